"""The warm pool's bookkeeping: sizes, and claims that only one process can win."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cryobox.errors import InvalidArgument
from cryobox.service import pool


@pytest.fixture(autouse=True)
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    monkeypatch.delenv("CRYOBOX_POOL_SIZE", raising=False)


def test_default_template_keeps_one_unless_told() -> None:
    assert pool.sizes() == {"default": 1}
    pool.set_size("web", 3)
    pool.set_size("default", 0)
    assert pool.sizes() == {"web": 3}


def test_the_environment_sets_the_default_size_or_turns_every_pool_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool.set_size("web", 2)
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "4")
    assert pool.sizes() == {"default": 4, "web": 2}
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "0")
    assert pool.sizes() == {}
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "many")
    with pytest.raises(InvalidArgument, match="CRYOBOX_POOL_SIZE"):
        pool.sizes()


def test_sizes_are_bounded() -> None:
    with pytest.raises(InvalidArgument, match="size"):
        pool.set_size("default", pool.MAX_SIZE + 1)
    with pytest.raises(InvalidArgument, match="size"):
        pool.set_size("default", -1)


def member(sandbox_id: str, snapshot: str, ready_at: float, **changes: str) -> pool.Member:
    fields = {"network": "internet", "env": pool.env_digest(), **changes}
    return pool.Member(sandbox_id, "default", snapshot, ready_at, **fields)


def test_claims_take_members_of_the_same_snapshot_network_and_settings_oldest_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool.offer(member("sbx-new", "snap-a", 30.0))
    pool.offer(member("sbx-old", "snap-a", 10.0))
    pool.offer(member("sbx-stale", "snap-old", 5.0))
    pool.offer(member("sbx-closed", "snap-a", 1.0, network="none"))
    monkeypatch.setenv("CRYOBOX_NETWORK_ISOLATION", "off")
    pool.offer(member("sbx-open", "snap-a", 2.0))  # made without network isolation
    monkeypatch.delenv("CRYOBOX_NETWORK_ISOLATION")
    monkeypatch.setenv("CRYOBOX_POOL_SIZE", "3")  # the pool's own settings do not count
    assert list(pool.claims("default", "snap-a", "internet")) == ["sbx-old", "sbx-new"]
    assert [m.sandbox_id for m in pool.members()] == ["sbx-closed", "sbx-open", "sbx-stale"]


def test_a_member_is_withdrawn_by_exactly_one_of_many_claimers() -> None:
    for index in range(20):
        pool.offer(member(f"sbx-{index:02d}", "snap-a", float(index)))
    won: list[str] = []
    start = threading.Barrier(8)

    def claimer() -> None:
        start.wait()
        for sandbox_id in pool.claims("default", "snap-a", "internet"):
            won.append(sandbox_id)

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(won) == [f"sbx-{index:02d}" for index in range(20)]
    assert pool.members() == []
