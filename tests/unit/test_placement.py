"""Placement of a new sandbox among hosts: live, active, labelled for the tenant, with
room; the host reached first, else the most free RAM; a refusal names every host."""

from __future__ import annotations

from pathlib import Path

import pytest

from cryobox.errors import InvalidArgument, NoHostAvailable
from cryobox.server.database import SqliteDatabase
from cryobox.server.hosts import STALE_AFTER, Host, Hosts, set_state
from cryobox.server.meter import Meter
from cryobox.server.placement import HostLoad, choose, loads
from cryobox.server.tenants import Tenants

NOW = 1_000_000.0
GIB = 1 << 30


def host(
    name: str,
    *,
    state: str = "active",
    labels: tuple[str, ...] = (),
    vcpus: int = 8,
    memory_mib: int = 8192,
    disk_gib: int = 50,
    available_mib: int = 4096,
    seen: float = NOW,
) -> Host:
    return Host(
        id=name,
        url=f"http://{name}",
        store="s",
        started_at=NOW - 100,
        seen_at=seen,
        state=state,
        labels=labels,
        max_vcpus=vcpus,
        max_memory_mib=memory_mib,
        disk_free_bytes=disk_gib * GIB,
        mem_available_mib=available_mib,
    )


def pick(loads: list[HostLoad], me: str = "a", label: str = "", memory: int = 1024) -> str:
    return choose(loads, me=me, vcpus=2, memory_mib=memory, label=label, now=NOW).id


def test_the_host_reached_keeps_what_it_can_take_else_the_most_ram_available() -> None:
    a, b, c = host("a"), host("b", available_mib=9000), host("c", available_mib=5000)
    assert pick([HostLoad(a), HostLoad(b), HostLoad(c)]) == "a"  # local first
    full_a = HostLoad(a, vcpus=8, memory_mib=1024, sandboxes=4)  # no vCPU left
    assert pick([full_a, HostLoad(b), HostLoad(c)]) == "b"
    assert pick([full_a, HostLoad(host("b", available_mib=200)), HostLoad(c)]) == "c"
    # No limits set (0): only the RAM available and the disk count.
    free = HostLoad(host("a", vcpus=0, memory_mib=0), vcpus=64, memory_mib=65536)
    assert pick([free]) == "a"


def test_draining_stale_and_full_hosts_are_never_chosen() -> None:
    loads = [
        HostLoad(host("a", state="draining")),
        HostLoad(host("b", seen=NOW - STALE_AFTER - 1)),
        HostLoad(host("c"), memory_mib=7500),
        HostLoad(host("d", disk_gib=0)),
        HostLoad(host("e", available_mib=100)),
        HostLoad(host("f")),
    ]
    assert pick(loads) == "f"
    with pytest.raises(NoHostAvailable) as refused:
        pick(loads[:5])
    said = str(refused.value)
    for reason in (
        "a: draining",
        "b: not seen for",
        "c: not enough of its memory free",
        "d: not enough disk free",
        "e: not enough RAM available",
    ):
        assert reason in said
    # (told to a tenant: the load of a host others share is not, as figures)
    assert "7500" not in said and "8192" not in said and " 100 MiB" not in said
    with pytest.raises(NoHostAvailable, match="no host is registered"):
        pick([])


def test_a_silo_tenant_goes_to_its_hosts_and_the_pool_never_does() -> None:
    loads = [HostLoad(host("a")), HostLoad(host("b", labels=("acme",)))]
    assert pick(loads, label="acme") == "b"  # reached a, placed on acme's host
    assert pick(loads) == "a"
    assert pick(loads, me="b") == "a"  # the pool never lands on a dedicated host
    with pytest.raises(NoHostAvailable, match="a: not labelled 'acme'"):
        pick(loads[:1], label="acme")
    with pytest.raises(NoHostAvailable, match="b: dedicated to other tenants") as refused:
        pick(loads[1:])
    assert "acme" not in str(refused.value)  # another tenant's label, often its name


def test_each_host_records_its_limits_labels_and_what_it_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `cryobox host ls` and placement read: each host's limits and labels as it
    registered them, its running sandboxes (not paused ones) and creates under way; a
    drain is kept across the host's restart; bad labels and states are refused."""
    db = SqliteDatabase(tmp_path / "server.db")
    monkeypatch.setenv("CRYOBOX_HOST_VCPUS", "6")
    monkeypatch.setenv("CRYOBOX_HOST_MEMORY_MIB", "4096")
    monkeypatch.setenv("CRYOBOX_HOST_LABELS", "gpu, acme")
    Hosts(db, "h-a", "http://a", "s").register()
    monkeypatch.delenv("CRYOBOX_HOST_LABELS")
    Hosts(db, "h-b", "http://b", "s").register()
    tenant, _ = Tenants(db).create("t", hosts="acme")
    assert Tenants(db).get("t").hosts == "acme"
    meter = Meter(db)
    meter.track("sbx-1", tenant.id, 2, 1024, 600, "h-a")
    meter.track("sbx-2", tenant.id, 1, 512, 600, "h-a")
    meter.track("sbx-3", tenant.id, 4, 2048, 600, "h-b")
    meter.observe("sbx-3", "paused")  # a paused sandbox holds no vCPU
    db.execute(
        "INSERT INTO reservations VALUES (?, ?, ?, ?, ?, ?, ?)",
        ("r1", tenant.id, "h-b", 1, 2, 256, NOW),
    )
    found = {load.host.id: load for load in loads(db, NOW - 10)}
    a, b = found["h-a"], found["h-b"]
    assert (a.host.labels, a.host.max_vcpus, a.host.max_memory_mib) == (("acme", "gpu"), 6, 4096)
    assert (a.vcpus, a.memory_mib, a.sandboxes) == (3, 1536, 2)
    assert (b.host.labels, b.vcpus, b.memory_mib, b.sandboxes) == ((), 2, 256, 1)
    assert b.host.disk_free_bytes > 0 and b.host.mem_available_mib > 0
    assert b.host.max_vcpus == 6  # the env of its registration
    assert set_state(db, "h-a", "draining").state == "draining"
    Hosts(db, "h-a", "http://a", "s").register()  # restarted: still draining
    assert Hosts(db, "", "", "").get("h-a").state == "draining"  # type: ignore[union-attr]
    with pytest.raises(InvalidArgument, match="no host 'h-x'"):
        set_state(db, "h-x", "draining")
    with pytest.raises(InvalidArgument, match="host state 'off'"):
        set_state(db, "h-a", "off")
    with pytest.raises(InvalidArgument, match="--hosts 'Bad Label'"):
        Tenants(db).create("u", hosts="Bad Label")
