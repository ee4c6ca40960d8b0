"""``cryobox server`` over real VMs: tenants cannot see each other, idle sandboxes pause
and wake on the next call or connection, and sandboxes outlive a server restart.

(The SDK's own checks also run over HTTP: ``test_sandbox_vm.py``'s shared sandbox is
made both ways.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import CLI, ApiServer, make_server
from cryobox import Sandbox, Volume
from cryobox.errors import NoHostAvailable, SandboxNotFound
from cryobox.sandbox import registry
from cryobox.snapshot import manifest as mf
from waiting import until

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm

#: A valid body for every operation that takes one, so that only the key is wrong.
BODIES: dict[tuple[str, str], Any] = {
    ("post", "/sandboxes/{sandbox_id}/timeout"): {"seconds": 600},
    ("post", "/sandboxes/{sandbox_id}/checkpoints"): {"name": "theirs"},
    ("post", "/sandboxes/{sandbox_id}/rollback"): {"checkpoint": "PLACEHOLDER"},
    ("post", "/sandboxes/{sandbox_id}/snapshots"): {"name": "theirs"},
    ("post", "/sandboxes/{sandbox_id}/forks"): {"count": 1},
    ("post", "/sandboxes/{sandbox_id}/template"): {"name": "theirs"},
    ("post", "/sandboxes/{sandbox_id}/ports"): {"guest_port": 9999},
    ("post", "/sandboxes/{sandbox_id}/commands"): {"cmd": "touch /root/intruder"},
    ("post", "/sandboxes/{sandbox_id}/commands/{command_id}/kill"): {"signal": 9},
    ("post", "/sandboxes/{sandbox_id}/commands/{command_id}/resize"): {"cols": 80, "rows": 24},
    ("post", "/sandboxes/{sandbox_id}/files/mkdir"): {"path": "/root/intruder"},
    ("post", "/volumes/{name}/snapshots"): {"name": "theirs"},
    ("post", "/sandboxes/{sandbox_id}/processes/checkpoints"): {"pid": 2},
    ("post", "/sandboxes/{sandbox_id}/processes/restore"): {"checkpoint": "PLACEHOLDER"},
    ("put", "/sandboxes/{sandbox_id}/network"): {"network": "none"},
}


def http(server: ApiServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=120)


def test_another_tenants_key_is_answered_404_on_every_endpoint(api_server: ApiServer) -> None:
    owner = http(api_server, api_server.key)
    intruder = http(api_server, api_server.tenant("intruder"))
    sbx = Sandbox.create(api_url=api_server.url, api_key=api_server.key)
    # The owner's volume of the name the walk uses: the intruder must not reach it either.
    Volume.create("mine", size_gib=1, api_url=api_server.url, api_key=api_server.key)
    try:
        sbx.files.write("/root/mine.txt", "owner's")
        checkpoint = sbx.checkpoint("mine")
        saved = sbx.snapshot("mine-snap")
        with owner.stream(
            "POST", f"/sandboxes/{sbx.id}/commands", json={"cmd": "sleep 300"}
        ) as command:
            lines = command.iter_lines()  # held: a dropped iterator closes the stream
            started = json.loads(next(lines))
            ids = {
                "sandbox_id": sbx.id,
                "ref": saved.id,
                "command_id": started["command_id"],
                "name": "mine",
            }
            tried = _walk_as_intruder(owner, intruder, ids, checkpoint.id)
            assert tried >= 20
            assert sbx.info().network == "internet"  # the intruder's "none" changed nothing
            for listing in (
                "/sandboxes?all=true",
                "/snapshots",
                "/lineage",
                "/process-checkpoints",
            ):
                assert sbx.id not in intruder.get(listing).text
                assert saved.id not in intruder.get(listing).text
            # No template was made of the owner's sandbox for anyone.
            assert "theirs" not in intruder.get("/templates").text
            assert "theirs" not in owner.get("/templates").text
            # The owner's sandbox is untouched: running, its file, its command.
            assert owner.get(f"/sandboxes/{sbx.id}").json()["state"] == "running"
            assert sbx.files.read_text("/root/mine.txt") == "owner's"
            assert not sbx.files.exists("/root/intruder")
            assert sbx.commands.run(f"kill -0 {started['pid']}").exit_code == 0
            assert [c.id for c in sbx.checkpoints()] == [checkpoint.id]
    finally:
        sbx.kill()
        Sandbox.delete_snapshot("mine-snap", api_url=api_server.url, api_key=api_server.key)
        Volume.delete("mine", api_url=api_server.url, api_key=api_server.key)


def _walk_as_intruder(
    owner: httpx.Client, intruder: httpx.Client, ids: dict[str, str], checkpoint: str
) -> int:
    """Call every operation with a path parameter on the owner's ids with the intruder's
    key; each must be a 404. How many were tried."""
    tried = 0
    for path, methods in owner.get("/openapi.json").json()["paths"].items():
        if "{" not in path or path.startswith("/templates"):
            continue  # lists are checked by the caller; templates in the fake-VMM tests
        for method in methods:
            url = re.sub(r"\{(\w+)\}", lambda m: ids[m.group(1)], path)
            body = BODIES.get((method, path))
            if body and "checkpoint" in body:
                body = {"checkpoint": checkpoint}
            params = {"path": "/root/mine.txt"} if "/files" in path else None
            answer = intruder.request(method.upper(), url, json=body, params=params)
            assert answer.status_code == 404, (method, path, answer.text)
            tried += 1
    return tried


def test_an_idle_sandbox_pauses_and_a_connection_to_its_port_wakes_it(
    api_server: ApiServer,
) -> None:
    sbx = Sandbox.create(
        ports=[8000], idle_timeout=3, api_url=api_server.url, api_key=api_server.key
    )
    events: list[dict[str, Any]] = []

    def listen() -> None:
        with http(api_server, api_server.key).stream(
            "GET", f"/sandboxes/{sbx.id}/events", timeout=120
        ) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if events[-1]["type"] == "resumed":
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        sbx.files.write("/root/index.html", "awake")
        sbx.commands.run(
            "cd /root && setsid python3 -m http.server 8000 >/dev/null 2>&1 < /dev/null &"
        )
        url = f"http://127.0.0.1:{sbx.ports[8000]}/index.html"
        assert fetch_until_up(url)[1] == b"awake"
        deadline = time.monotonic() + 60
        while sbx.info().state != "paused" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert sbx.info().state == "paused"
        paused_folder = registry.find(sbx.id)
        assert not registry.process_alive(paused_folder.record().qemu_pid or 0, sbx.id)
        usage = http(api_server, api_server.key).get("/usage", params={"sandbox_id": sbx.id})
        assert usage.json()["vcpu_seconds"] > 0
        # The published port is the server's: the connection waits for the wake.
        with httpx.Client(timeout=60) as plain:
            answer = plain.get(url)
        assert answer.status_code == 200 and answer.text == "awake"
        assert sbx.info().state == "running"
        listener.join(30)
        reasons = [(e["type"], e.get("reason")) for e in events]
        assert ("paused", "idle") in reasons and ("resumed", "woken") in reasons, events
    finally:
        sbx.kill()


def test_sandboxes_outlive_a_server_restart(tmp_path: Path) -> None:
    server = make_server(tmp_path / "restarted")
    server.key = server.tenant("restarts")
    server.start()
    sbx = Sandbox.create(ports=[8000], api_url=server.url, api_key=server.key)
    try:
        sbx.files.write("/root/index.html", "still here")
        sbx.commands.run(
            "cd /root && setsid python3 -m http.server 8000 >/dev/null 2>&1 < /dev/null &"
        )
        public = sbx.ports[8000]
        assert fetch_until_up(f"http://127.0.0.1:{public}/index.html")[1] == b"still here"
        server.stop()
        record = registry.find(sbx.id).record()
        assert record.state.value == "running"
        assert registry.process_alive(record.qemu_pid or 0, sbx.id)
        assert registry.supervisor_alive(record)
        server.start()
        again = Sandbox.connect(sbx.id, api_url=server.url, api_key=server.key)
        assert again.info().state == "running" and again.ports[8000] == public
        assert again.commands.run("cat /root/index.html").stdout == "still here"
        assert fetch_until_up(f"http://127.0.0.1:{public}/index.html")[1] == b"still here"
    finally:
        Sandbox.connect(sbx.id, api_url=server.url, api_key=server.key).kill()
        server.stop()


def test_a_tenants_snapshots_are_stored_under_its_own_key(api_server: ApiServer) -> None:
    from cryobox import config as cryobox_config
    from cryobox.errors import SnapshotNotFound
    from cryobox.store.chunkstore import ChunkStore

    sbx = Sandbox.create(api_url=api_server.url, api_key=api_server.key)
    try:
        saved = sbx.snapshot("tenant-stored")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            mine = Sandbox.snapshots(api_url=api_server.url, api_key=api_server.key)
            if [s.location for s in mine if s.id == saved.id] == ["stored"]:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the tenant's snapshot was not stored")
        store_root = cryobox_config.state_dir() / "store" / "snapshots"
        (where,) = store_root.glob(f"*/{saved.id}.json")
        tenant = where.parent.name
        assert tenant != "local"
        assert ChunkStore(tenant).find(saved.id).manifest["name"] == "tenant-stored"
        with pytest.raises(SnapshotNotFound):  # not in the embedded (local) tenant's store
            ChunkStore("local").find(saved.id)
        # Killed while paused, its stored pause goes, and the checkpoint stored below it
        # (its disk builds on that checkpoint's after a rollback): nothing of it stays.
        checkpoint = sbx.checkpoint()
        sbx.rollback(checkpoint)
        sbx.pause()
        marked = cryobox_config.state_dir() / "sandboxes" / sbx.id / "paused" / "upload.json"
        until(
            lambda: marked.exists() and json.loads(marked.read_text())["state"] == "stored",
            "the pause to be stored",
            timeout=300,
        )
        assert checkpoint.id in mf.builds_on(ChunkStore(tenant).pause_of(sbx.id).manifest)
        sbx.kill()
        with pytest.raises(SnapshotNotFound):
            ChunkStore(tenant).pause_of(sbx.id)
        with pytest.raises(SnapshotNotFound):
            ChunkStore(tenant).find(checkpoint.id)
    finally:
        sbx.kill()
        Sandbox.delete_snapshot("tenant-stored", api_url=api_server.url, api_key=api_server.key)
    assert not list(store_root.glob(f"*/{saved.id}.json"))  # deleted from the store too


def test_two_hosts_on_one_postgresql_serve_each_others_sandboxes(
    postgres: Any, tmp_path: Path
) -> None:
    """Host a runs the VM; every call below goes through host b, which forwards it."""
    url = postgres.create_database("vm_hosts")
    a = make_server(tmp_path / "a", database_url=url)
    b_state = Path(os.environ["CRYOBOX_STATE_DIR"]) / "host-b"
    b = make_server(tmp_path / "b", {"CRYOBOX_STATE_DIR": str(b_state)}, database_url=url)
    a.key = b.key = a.tenant("two-hosts")
    a.start()
    b.start()
    sbx = Sandbox.create(api_url=a.url, api_key=a.key)
    try:
        via_b = Sandbox.connect(sbx.id, api_url=b.url, api_key=b.key)
        via_b.commands.run(COUNTER)  # detached: it outlives this call's stream
        # Under TCG the loop's first write can take a while: wait for it before pausing.
        assert (
            via_b.commands.run(
                "for i in $(seq 100); do [ -f /root/count ] && exit; sleep 0.1; done; exit 1"
            ).exit_code
            == 0
        )
        via_b.files.write("/root/from-b.txt", "through b")
        assert sbx.files.read("/root/from-b.txt") == b"through b"
        assert not (b_state / "sandboxes" / sbx.id).exists()  # the VM is a's
        via_b.pause()
        assert sbx.info().state == "paused"
        via_b = Sandbox.resume(sbx.id, api_url=b.url, api_key=b.key)
        first = int(via_b.files.read("/root/count"))
        deadline = time.monotonic() + 30
        while int(via_b.files.read("/root/count")) <= first and time.monotonic() < deadline:
            time.sleep(0.3)
        assert int(via_b.files.read("/root/count")) > first  # the same loop, still counting
        via_b.kill()
        assert Sandbox.list(api_url=a.url, api_key=a.key) == []
    finally:
        with contextlib.suppress(SandboxNotFound):  # (killed already: forgotten now)
            Sandbox.connect(sbx.id, api_url=a.url, api_key=a.key, resume=False).kill()
        a.stop()
        b.stop()


def test_creates_are_placed_by_host_state_labels_and_room(postgres: Any, tmp_path: Path) -> None:
    """Two hosts on one PostgreSQL: a pool host and one labelled for tenant acme. A create
    reaching either lands where the tenant belongs; a draining host takes none; when no
    host can, the create is refused naming each host and why; `cryobox host ls` shows
    them all."""
    url = postgres.create_database("vm_placement")
    pool = make_server(tmp_path / "pool", database_url=url)
    acme_state = Path(os.environ["CRYOBOX_STATE_DIR"]) / "host-acme"
    acme = make_server(
        tmp_path / "acme",
        {"CRYOBOX_STATE_DIR": str(acme_state), "CRYOBOX_HOST_LABELS": "acme"},
        database_url=url,
    )
    shared_key = pool.tenant("shared")
    acme_key = pool.tenant("acme", "--hosts", "acme")
    pool.start()
    acme.start()
    made: list[Sandbox] = []
    try:
        pool_id = (Path(os.environ["CRYOBOX_STATE_DIR"]) / "host-id").read_text().strip()
        acme_id = (acme_state / "host-id").read_text().strip()
        # The pool tenant's create reaches acme's host and is made on the pool's.
        shared = Sandbox.create(api_url=acme.url, api_key=shared_key)
        made.append(shared)
        assert shared.info().host == pool_id
        assert shared.commands.run("echo placed").stdout == "placed\n"
        # Acme's reaches the pool host and is made on its own.
        owned = Sandbox.create(api_url=pool.url, api_key=acme_key)
        made.append(owned)
        assert owned.info().host == acme_id
        assert (acme_state / "sandboxes" / owned.id).exists()

        listed = run_cli("host", "ls", "--database-url", url)
        line = next(row for row in listed.splitlines() if row.startswith(acme_id))
        assert "active" in line and "acme" in line and "\t1\t" in line  # its sandbox
        assert "draining" in run_cli("host", "drain", acme_id, "--database-url", url)
        with pytest.raises(NoHostAvailable) as refused:
            Sandbox.create(api_url=pool.url, api_key=acme_key)
        said = str(refused.value)
        assert f"{acme_id}: draining" in said and f"{pool_id}: not labelled 'acme'" in said
        # No way around it: a shape written as text, a volume, E2B's route with a second
        # key header; each refused before anything starts (found by a review).
        for path, body, headers in (
            ("/sandboxes", {"cpus": "2"}, {"Authorization": f"Bearer {acme_key}"}),
            ("/sandboxes", {"volumes": {"/v": "x"}}, {"Authorization": f"Bearer {acme_key}"}),
            (
                "/e2b/sandboxes",
                {"templateID": "base"},
                {"X-API-Key": acme_key, "Authorization": "Bearer cbx_not-a-key"},
            ),
        ):
            answer = httpx.post(pool.url + path, json=body, headers=headers, timeout=60)
            assert answer.status_code == 503, (path, answer.text)
            assert "labelled 'acme'" in answer.text  # named: no host of acme's can take it
        assert "draining" in run_cli("host", "ls", "--database-url", url)
        assert owned.commands.run("echo still").stdout == "still\n"  # it runs on
        run_cli("host", "activate", acme_id, "--database-url", url)
        again = Sandbox.create(api_url=acme.url, api_key=acme_key)
        made.append(again)
        assert again.info().host == acme_id
    finally:
        for sandbox in made:
            with contextlib.suppress(SandboxNotFound):
                sandbox.kill()
        pool.stop()
        acme.stop()


def run_cli(*args: str) -> str:
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /root/count.new; "
    "mv /root/count.new /root/count; sleep 0.2; done' >/dev/null 2>&1 &"
)
