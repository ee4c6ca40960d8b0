"""A fleet on a network of its own (``tests/fleet_net.py``): three ``cryobox server``
hosts, each in a network namespace at its own address, on one PostgreSQL and one
SeaweedFS reached over that network. One host is cut off (its link down: its server
and VMs run on, alone) while a client goes on using its sandboxes through another
host; when its link comes back, it stops its copies of every sandbox that moved."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import make_server
from cryobox import Sandbox
from fleet_net import GATEWAY, FleetNet
from postgres_server import may_move, recovery_at
from waiting import until

from .test_fleet_vm import COUNTER, counts_on, host_line, kill_processes_under, running_here

pytestmark = pytest.mark.vm


def test_a_host_cut_off_loses_its_sandboxes_to_the_others_and_drops_its_copies_when_back(
    postgres: Any, s3_server: Any, tmp_path: Path
) -> None:
    """On host c: a paused sandbox (its pause stored), a running one with a history (its
    checkpoint stored), a running one without. c's link goes down. Through a, once c
    reads as gone: the paused one wakes on a or b (counter going on, file intact), the
    one with a history is recovered there from its checkpoint, the other reads as lost,
    while c's own VMs still run (a real partition, not a dead host). c's link comes
    back: c stops its copies of the two that moved (one running copy of each in the
    fleet), a request through c reaches them where they run now, and the one that
    never moved is c's and running again."""
    url = postgres.create_database("vm_partition")
    root = Path(os.environ["CRYOBOX_STATE_DIR"])
    states = {name: root / f"partition-{name}" for name in "abc"}
    with FleetNet("abc") as net:
        # Through the network: the database and the store from the hosts' side.
        database = url.replace(
            f"127.0.0.1:{postgres.port}", f"{GATEWAY}:{net.relay(postgres.port)}"
        )
        fleet = {
            **s3_server.env(f"partition-{os.getpid()}"),
            "AWS_ENDPOINT_URL": f"http://{GATEWAY}:{net.relay(s3_server.port)}",
            "CRYOBOX_HOST_HEARTBEAT": "1",
            "CRYOBOX_HOST_GONE_AFTER": "4",
        }
        servers = {
            name: make_server(
                tmp_path / name,
                {**fleet, "CRYOBOX_STATE_DIR": str(states[name])},
                database_url=database,
                address=net.address(name),
                netns=net.namespace(name),
            )
            for name in "abc"
        }
        key = servers["a"].tenant("partition")
        made: list[str] = []
        try:
            for server in servers.values():
                server.key = key
                server.start()
            c = servers["c"]
            paused = Sandbox.create(api_url=c.url, api_key=key, timeout=3600)
            kept = Sandbox.create(api_url=c.url, api_key=key, timeout=3600, checkpoint_every=10)
            plain = Sandbox.create(api_url=c.url, api_key=key, timeout=3600)
            made += [paused.id, kept.id, plain.id]
            for sbx in (paused, kept):
                sbx.files.write("/root/kept", f"the file of {sbx.id}")
                sbx.commands.run(COUNTER)
                started = "for i in $(seq 100); do [ -f /root/count ] && exit; sleep 0.1; done"
                assert sbx.commands.run(f"{started}; exit 1").exit_code == 0
            paused.pause()
            until(lambda: may_move(url, paused.id), "c's pause is stored", timeout=600)
            until(lambda: recovery_at(url, kept.id) > 0, "c's checkpoint is stored", timeout=600)
            c_id = (states["c"] / "host-id").read_text().strip()

            net.cut("c")
            until(lambda: "(gone)" in host_line(url, c_id), "c is seen as gone", timeout=120)
            with pytest.raises(httpx.HTTPError):  # nobody reaches it: a real partition
                httpx.get(f"{c.url}/health", timeout=3)
            assert running_here(states["c"], kept.id)  # its VMs run on, cut off

            a = servers["a"]
            woken = Sandbox.connect(paused.id, api_url=a.url, api_key=key)
            assert woken.files.read("/root/kept") == f"the file of {paused.id}".encode()
            counts_on(woken)
            assert woken.info().host != c_id
            lost = Sandbox.connect(kept.id, api_url=a.url, api_key=key).info()
            assert lost.state == "lost" and lost.recoverable_from
            recovered = Sandbox.resume(kept.id, api_url=a.url, api_key=key)
            assert recovered.files.read("/root/kept") == f"the file of {kept.id}".encode()
            counts_on(recovered)
            stuck = Sandbox.connect(plain.id, api_url=servers["b"].url, api_key=key).info()
            assert stuck.state == "lost" and stuck.recoverable_from is None
            assert running_here(states["c"], kept.id)  # two copies, one unreachable

            net.heal("c")
            until(
                lambda: (
                    not running_here(states["c"], kept.id)
                    and not (states["c"] / "sandboxes" / paused.id).exists()
                ),
                "c, back, stops its copies of the sandboxes that moved",
                timeout=300,
                every=1,
            )
            for sandbox_id in (paused.id, kept.id):
                copies = [n for n in "abc" if running_here(states[n], sandbox_id)]
                assert len(copies) == 1 and copies != ["c"], (sandbox_id, copies)
                through_c = Sandbox.connect(sandbox_id, api_url=c.url, api_key=key)
                assert through_c.files.read("/root/kept") == f"the file of {sandbox_id}".encode()
            until(
                lambda: (
                    Sandbox.connect(plain.id, api_url=a.url, api_key=key).info().state == "running"
                ),
                "the one that never moved is c's again",
                timeout=120,
            )
            assert running_here(states["c"], plain.id)
        finally:
            for sandbox_id in made:
                for server in servers.values():
                    with contextlib.suppress(httpx.HTTPError):
                        httpx.delete(
                            f"{server.url}/sandboxes/{sandbox_id}",
                            headers={"X-API-Key": key},
                            timeout=30,
                        )
                        break
            for server in servers.values():
                with contextlib.suppress(Exception):  # (whatever happens, the VMs go below)
                    server.stop()
            for state in states.values():
                kill_processes_under(state)
