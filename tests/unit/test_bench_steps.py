"""The bench's reading of a supervisor's step timings and of a process's CPU time."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cryobox import bench_steps, config


def test_the_latest_line_of_a_kind_is_read_step_by_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    folder = config.sandboxes_dir() / "sbx-0123456789ab"
    folder.mkdir(parents=True)
    (folder / "supervisor.log").write_text(
        "2026-11-30 15:48:19,129 cryobox.supervisor INFO pause 308 ms: stop 3, hash 216\n"
        "2026-11-30 15:48:19,812 cryobox.supervisor INFO resume 372 ms: vm start 107, "
        "device state 34, agent refreshed 232\n"
        "2026-11-30 15:48:20,904 cryobox.supervisor INFO resume 443 ms: vm start 151, "
        "device state 28, agent refreshed 263\n"
        "2026-11-30 15:48:21,000 cryobox.supervisor INFO running\n"
    )
    assert bench_steps.step_timings("sbx-0123456789ab", "resume") == {
        "total": 443.0,
        "vm start": 151.0,
        "device state": 28.0,
        "agent refreshed": 263.0,
    }
    assert bench_steps.step_timings("sbx-0123456789ab", "pause") == {
        "total": 308.0,
        "stop": 3.0,
        "hash": 216.0,
    }
    assert bench_steps.step_timings("sbx-0123456789ab", "claim") is None
    assert bench_steps.step_timings("sbx-ffffffffffff", "resume") is None


def test_cpu_seconds_count_this_process_and_nothing_for_a_gone_one() -> None:
    before = bench_steps.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert bench_steps.cpu_seconds(os.getpid()) >= before + 0.1
    assert bench_steps.cpu_seconds(None) == 0.0
    assert bench_steps.cpu_seconds(2**22 + 1) == 0.0
