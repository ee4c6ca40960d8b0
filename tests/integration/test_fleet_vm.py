"""Several ``cryobox server`` hosts on one PostgreSQL and one chunk store: a paused
sandbox wakes on another host when its own is gone, with every process alive; two
hosts racing to wake it end with exactly one running copy; a template saved on one
host is used from another; a drained host's sandbox wakes on another; a sandbox that
ran on the lost host reads as lost, and one that kept a history is recovered from its
stored checkpoint on another host."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

import tls_ca
from api_server import CLI, make_server
from cryobox import Sandbox
from cryobox.errors import HostUnavailable, SandboxDead
from postgres_server import may_move, recovery_at
from waiting import until

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm

COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/count.new; "
    "mv /root/count.new /root/count; sleep 0.2; done' >/dev/null 2>&1 &"
)


def test_a_paused_sandbox_wakes_on_another_host_once_its_host_is_gone(
    postgres: Any, tmp_path: Path
) -> None:
    """Hosts a, b and c share a database and a store. A sandbox paused on a (a counter
    running, a file written, a web server on a published port, a secret variable); a's
    server and VMs are killed with -9 and its state folder deleted; b and c are asked
    for it at the same moment. One of them takes it over: it runs there only, counting
    on from where it was, its file, variable and port served."""
    url = postgres.create_database("vm_wake_anywhere")
    root = Path(os.environ["CRYOBOX_STATE_DIR"])
    states = {name: root / f"fleet-{name}" for name in "abc"}
    fleet = {
        "CRYOBOX_STORE": str(tmp_path / "store"),
        "CRYOBOX_HOST_HEARTBEAT": "1",
        "CRYOBOX_HOST_GONE_AFTER": "4",
        "CRYOBOX_DOMAIN": "fleet.localhost",  # ports by host name on every host
    }
    servers = {
        name: make_server(
            tmp_path / name, {**fleet, "CRYOBOX_STATE_DIR": str(states[name])}, database_url=url
        )
        for name in "abc"
    }
    a = servers["a"]
    key = a.tenant("fleet")
    for server in servers.values():
        server.key = key
        server.start()
    sandbox_id = ""
    # The fleet's own CA: what each sandbox's header proxy trusts goes with it.
    fleet_ca = tls_ca.make(tmp_path / "ca", "203.0.113.9")[0].read_text()
    try:
        sbx = Sandbox.create(
            api_url=a.url,
            api_key=key,
            ports=[8000],
            envs={"NOTE": "it travels"},
            timeout=3600,
            ca_bundle=fleet_ca,
        )
        sandbox_id = sbx.id
        assert (states["a"] / "sandboxes" / sbx.id).exists()  # made where it was asked
        sbx.commands.run(COUNTER)
        assert (
            sbx.commands.run(
                "for i in $(seq 100); do [ -f /root/count ] && exit; sleep 0.1; done; exit 1"
            ).exit_code
            == 0
        )
        sbx.files.write("/srv/index.html", "served from the same machine")
        sbx.commands.run("cd /srv && nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
        assert fetch_until_up(f"http://127.0.0.1:{sbx.info().ports[8000]}/index.html")[0] == 200
        sbx.pause()
        running_on_a = Sandbox.create(api_url=a.url, api_key=key, timeout=3600)
        assert running_on_a.commands.run("echo up").stdout == "up\n"
        # One with a history: its newest automatic checkpoint is stored as it runs.
        with_history = Sandbox.create(
            api_url=a.url,
            api_key=key,
            timeout=3600,
            checkpoint_every=10,
            keep_checkpoints=3,
            ca_bundle=fleet_ca,
        )
        with_history.files.write("/root/kept", "written before the checkpoint")
        with_history.commands.run(COUNTER)
        identity = "cat /etc/machine-id /proc/sys/kernel/random/boot_id; hostname"
        itself = with_history.commands.run(identity).stdout
        assert with_history.id in itself
        # Stored, and recorded as such in its row (a's next monitor tick): from now on
        # another host may wake it.
        until(lambda: may_move(url, sbx.id), "a's pause is stored", timeout=600, every=0.5)
        until(
            lambda: recovery_at(url, with_history.id) > 0,
            "a checkpoint of the running one is stored",
            timeout=600,
            every=0.5,
        )

        # a is lost: its server and VMs killed, its state folder gone.
        a_id = (states["a"] / "host-id").read_text().strip()
        assert a.process is not None
        a.process.kill()
        a.process.wait()
        kill_processes_under(states["a"])
        shutil.rmtree(states["a"])
        until(lambda: "(gone)" in host_line(url, a_id), "a is seen as gone", timeout=60, every=0.5)

        # The sandbox that ran on a cannot move (nothing of it is stored): it says so.
        lost = Sandbox.connect(running_on_a.id, api_url=servers["b"].url, api_key=key)
        info = lost.info()
        assert (info.state, info.host, info.recoverable_from) == ("lost", a_id, None)
        assert a_id in (info.error or "") and "cannot be recovered" in (info.error or "")
        listed = {s.id: s.state for s in Sandbox.list(api_url=servers["c"].url, api_key=key)}
        assert listed[running_on_a.id] == "lost"
        with pytest.raises(HostUnavailable, match="has not been seen since"):
            lost.commands.run("true")

        # The one with a history is lost too, recoverable from its stored checkpoint: a
        # resume through any host starts it there from it, the same sandbox (its file,
        # its counter going on from the checkpoint's count); two hosts asked at once end
        # with one copy.
        recoverable = Sandbox.connect(with_history.id, api_url=servers["c"].url, api_key=key)
        info = recoverable.info()
        assert info.state == "lost" and info.recoverable_from and info.recoverable_at
        assert "resume it" in (info.error or "")
        with pytest.raises(HostUnavailable, match="resume it"):
            recoverable.commands.run("true")
        recovered: dict[str, Any] = {}

        def recover(name: str) -> None:
            try:
                recovered[name] = Sandbox.resume(
                    with_history.id, api_url=servers[name].url, api_key=key
                )
            except Exception as exc:  # kept for the assertion below
                recovered[name] = exc

        racers = [threading.Thread(target=recover, args=(n,)) for n in "bc"]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(600)
        copies = [n for n in "bc" if running_here(states[n], with_history.id)]
        assert len(copies) == 1, (copies, recovered)
        for outcome in recovered.values():  # the other was told to retry, or forwarded
            assert isinstance(outcome, Sandbox) or "retry" in str(outcome), recovered
        again = Sandbox.connect(with_history.id, api_url=servers["b"].url, api_key=key)
        assert again.info().state == "running"
        assert again.files.read("/root/kept") == b"written before the checkpoint"
        assert again.commands.run(identity).stdout == itself  # itself, not a fork of it
        counts_on(again)
        trusted = states[copies[0]] / "sandboxes" / with_history.id / "egress-trust.pem"
        assert trusted.read_text() == fleet_ca  # its proxy trusts what it was given
        assert info.recoverable_from in [s.id for s in again.history()]
        again.kill()

        woken: dict[str, Any] = {}

        def wake(name: str, server_url: str) -> None:
            try:
                woken[name] = Sandbox.connect(sandbox_id, api_url=server_url, api_key=key)
            except Exception as exc:  # kept for the assertion below
                woken[name] = exc

        racers = [threading.Thread(target=wake, args=(n, servers[n].url)) for n in "bc"]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(600)
        assert all(isinstance(w, Sandbox) for w in woken.values()), woken
        running = [name for name in "bc" if running_here(states[name], sandbox_id)]
        assert len(running) == 1, running  # one copy, on one host
        loser = "c" if running == ["b"] else "b"
        assert not (states[loser] / "sandboxes" / sandbox_id).exists()
        host_ids = {n: (states[n] / "host-id").read_text().strip() for n in "bc"}
        for moved in woken.values():  # both handles reach the one copy
            assert moved.info().state == "running"
            assert moved.info().host == host_ids[running[0]]

        moved = woken[loser]  # through the host that lost the race: forwarded
        counts_on(moved)
        trusted = states[running[0]] / "sandboxes" / sandbox_id / "egress-trust.pem"
        assert trusted.read_text() == fleet_ca  # its proxy trusts what it was given
        assert fleet_ca.strip() in moved.files.read_text("/etc/cryobox/ca-bundle.pem")
        assert moved.files.read("/srv/index.html") == b"served from the same machine"
        assert moved.commands.run("echo $NOTE").stdout == "it travels\n"
        public = moved.info().ports[8000]
        assert fetch_until_up(f"http://127.0.0.1:{public}/index.html") == (
            200,
            b"served from the same machine",
        )
        # By host name through the other host: passed on, Host header and all.
        by_name = httpx.get(
            f"{servers[loser].url}/index.html",
            headers={"Host": f"8000-{sandbox_id}.fleet.localhost"},
            timeout=60,
        )
        assert (by_name.status_code, by_name.text) == (200, "served from the same machine")

        # A template saved there is usable from the other host: pulled from the store.
        moved.files.write("/root/template-marker", "from the fleet")
        saved = moved.save_template("fleet-made")
        upload = states[running[0]] / "snapshots" / saved.id / "upload.json"
        until(
            lambda: upload.exists() and json.loads(upload.read_text())["state"] == "stored",
            "the template is stored",
            timeout=300,
            every=0.5,
        )
        other_url = servers[loser].url
        assert "fleet-made" in [t.name for t in Sandbox.templates(api_url=other_url, api_key=key)]
        # Snapshots and lineage of every host, from any host: a snapshot taken where the
        # sandbox runs is listed by the other host once stored, and starts sandboxes there.
        snap = moved.snapshot("fleet-snap")
        snap_upload = states[running[0]] / "snapshots" / snap.id / "upload.json"
        until(
            lambda: (
                snap_upload.exists() and json.loads(snap_upload.read_text())["state"] == "stored"
            ),
            "the snapshot is stored",
            timeout=300,
            every=0.5,
        )
        snaps = {s.id: s for s in Sandbox.snapshots(api_url=other_url, api_key=key)}
        assert snaps[snap.id].name == "fleet-snap" and snaps[snap.id].location == "store"
        nodes = {n.id: n for n in Sandbox.lineage(api_url=other_url, api_key=key)}
        assert nodes[snap.id].parent == sandbox_id and nodes[sandbox_id].kind == "sandbox"
        assert nodes[running_on_a.id].state == "lost"
        for source in ({"from_snapshot": "fleet-snap"}, {"template": "fleet-made"}):
            made = Sandbox.create(**source, api_url=other_url, api_key=key)  # type: ignore[arg-type]
            try:
                assert made.info().host == host_ids[loser]
                assert made.files.read("/root/template-marker") == b"from the fleet"
            finally:
                made.kill()

        # The host it runs on is drained: it pauses it into the store, and the next use
        # through the other host wakes it there, still counting; the drained host drops
        # its copy.
        drained, other = running[0], loser
        last = int(moved.files.read("/root/count"))
        assert "draining" in run_cli("host", "drain", host_ids[drained], "--database-url", url)
        until(lambda: moved.info().state == "paused", "the drain pauses it", timeout=300)
        until(lambda: may_move(url, sandbox_id), "its pause reaches the store", timeout=300)
        assert int(moved.files.read("/root/count")) >= last  # this call woke it
        assert moved.info().state == "running"
        assert moved.info().host == host_ids[other]
        until(
            lambda: int(moved.files.read("/root/count")) > last + 2,
            "the counter goes on after the drain",
            timeout=60,
        )
        until(
            lambda: not (states[drained] / "sandboxes" / sandbox_id).exists(),
            "the drained host drops its copy",
            timeout=60,
        )
        assert "active" in run_cli("host", "undrain", host_ids[drained], "--database-url", url)
        moved.kill()
        with pytest.raises(SandboxDead, match="killed"):  # through either host
            Sandbox.connect(sandbox_id, api_url=servers[loser].url, api_key=key)
    finally:
        for name in "bc":
            if sandbox_id:
                with contextlib.suppress(Exception):
                    httpx.delete(
                        f"{servers[name].url}/sandboxes/{sandbox_id}",
                        headers={"X-API-Key": key},
                        timeout=60,
                    )
        for server in servers.values():
            server.stop()
        for state in states.values():
            kill_processes_under(state)


def counts_on(sbx: Sandbox) -> None:
    """Wait until the sandbox's counter (:data:`COUNTER`) passes what it reads now."""
    first = int(sbx.files.read("/root/count"))
    until(lambda: int(sbx.files.read("/root/count")) > first, "the counter goes on", timeout=60)


def running_here(state: Path, sandbox_id: str) -> bool:
    """Whether the host of state folder ``state`` runs the sandbox."""
    record = state / "sandboxes" / sandbox_id / "state.json"
    return record.exists() and json.loads(record.read_text())["state"] == "running"


def run_cli(*args: str) -> str:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def host_line(url: str, host: str) -> str:
    """Host ``host``'s line in ``cryobox host ls``."""
    listed = run_cli("host", "ls", "--database-url", url)
    return next((row for row in listed.splitlines() if row.startswith(host)), "")


def kill_processes_under(state: Path) -> None:
    """SIGKILL every process whose command line names ``state`` (VMs, supervisors,
    uploaders of that host)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if (
                str(state).encode() in (proc / "cmdline").read_bytes()
                or str(state).encode() in (proc / "environ").read_bytes()
            ):
                os.kill(int(proc.name), 9)


def test_forks_that_do_not_fit_their_parents_host_are_made_on_another(
    postgres: Any, tmp_path: Path
) -> None:
    """Host small may run 2 vCPUs: a 2-vCPU sandbox fills it. Its 2 forks asked through
    small are made on host big from a snapshot of it that goes through the store: each
    copy has the parent's file and variable, its counter going on, and an identity of
    its own; the parent runs on, on small."""
    url = postgres.create_database("vm_fork_away")
    root = Path(os.environ["CRYOBOX_STATE_DIR"])
    states = {name: root / f"forks-{name}" for name in ("small", "big")}
    fleet = {"CRYOBOX_STORE": str(tmp_path / "store"), "CRYOBOX_HOST_HEARTBEAT": "1"}
    servers = {
        name: make_server(
            tmp_path / name,
            {
                **fleet,
                "CRYOBOX_STATE_DIR": str(states[name]),
                "CRYOBOX_HOST_VCPUS": "2" if name == "small" else "0",
            },
            database_url=url,
        )
        for name in states
    }
    key = servers["small"].tenant("fork-away")
    for server in servers.values():
        server.key = key
        server.start()
    try:
        small = servers["small"]
        fleet_ca = tls_ca.make(tmp_path / "ca", "203.0.113.9")[0].read_text()
        parent = Sandbox.create(
            api_url=small.url, api_key=key, cpus=2, envs={"NOTE": "same"}, ca_bundle=fleet_ca
        )
        parent.files.write("/root/who", "the parent's")
        parent.commands.run(COUNTER)
        until(lambda: parent.files.exists("/root/count"), "the counter starts", timeout=60)
        forks = parent.fork(2)
        big_id = (states["big"] / "host-id").read_text().strip()
        assert [f.info().host for f in forks] == [big_id, big_id]
        seen = set()
        for copy in forks:
            assert copy.files.read("/root/who") == b"the parent's"
            assert copy.commands.run("echo $NOTE").stdout == "same\n"
            counts_on(copy)
            seen.add(copy.commands.run("cat /proc/sys/kernel/random/boot_id").stdout)
            # Its proxy trusts what the parent's does, as a fork made on its host would.
            trusted = states["big"] / "sandboxes" / copy.id / "egress-trust.pem"
            assert trusted.read_text() == fleet_ca
        seen.add(parent.commands.run("cat /proc/sys/kernel/random/boot_id").stdout)
        assert len(seen) == 3  # three machines, each its own
        assert parent.info().state == "running" and parent.info().host != big_id
        for copy in forks:
            copy.kill()
        parent.kill()
    finally:
        for server in servers.values():
            server.stop()
        for state in states.values():
            kill_processes_under(state)
