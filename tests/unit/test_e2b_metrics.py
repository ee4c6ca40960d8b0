"""E2B's get_metrics: what a guest prints becomes a sample, or nothing."""

from __future__ import annotations

import pytest

from cryobox.e2b.metrics import Samples, parse

GOOD = "1000 800 1200 900\n2\n1000000 600000 200000 \n500000 4000000\n"


def test_a_guests_readings_become_a_sample() -> None:
    sample = parse(GOOD, 100.0)
    assert sample.cpu_count == 2 and sample.cpu_used_pct == 50.0  # 100 of 200 ticks busy
    assert (sample.mem_total, sample.mem_used, sample.mem_cache) == (
        1024_000_000,
        409_600_000,
        204_800_000,
    )
    assert (sample.disk_used, sample.disk_total) == (500000, 4000000)
    assert sample.to_e2b()["timestamp"] == "1970-01-01T00:01:40Z"


@pytest.mark.parametrize(
    "printed",
    [
        "",
        "garbage",
        "1 2 3\n2\n",
        "1000 800 900 1000\n2\n1 1 1\n1 2\n",
        GOOD.replace("\n2\n", "\n0\n"),
    ],
)
def test_what_a_guest_prints_otherwise_is_refused(printed: str) -> None:
    with pytest.raises(ValueError):
        parse(printed, 0.0)


def test_samples_are_kept_per_sandbox_and_filtered_by_time() -> None:
    kept = Samples()
    for at in (10.0, 20.0, 30.0):
        kept.add("sbx-1", parse(GOOD, at))
    assert [s.at for s in kept.between("sbx-1", 15, 30)] == [20.0, 30.0]
    assert kept.between("sbx-2", None, None) == []
    kept.forget("sbx-1")
    assert kept.between("sbx-1", None, None) == []
