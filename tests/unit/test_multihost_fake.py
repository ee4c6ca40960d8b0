"""Several ``cryobox server`` hosts on one real PostgreSQL, over the fake VMM.

Two real server processes, each with its own state folder (its own "host"), share a
real PostgreSQL database: tenants made once work on both, a sandbox started on one is
reached through the other (forwarded to the host it runs on), quotas count every
host, a host that is down is named instead of hanging, and each host follows only its
own sandboxes. The same forwarding over real VMs is in
``tests/integration/test_server_vm.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psycopg
import pytest

from api_server import CLI, ApiServer, end_helpers, kill_vms, make_server
from cryobox import Sandbox
from cryobox.errors import (
    InvalidArgument,
    NoHostAvailable,
    QuotaExceeded,
    SandboxNotFound,
    SnapshotNotFound,
)
from cryobox.server.database import MIGRATIONS
from cryobox.server.databases import open_database
from cryobox.server.moves import Mover
from cryobox.service.persist import Persistence
from cryobox.snapshot.store import LocalSnapshotStore
from cryobox.store import locks
from cryobox.store.chunkstore import ChunkStore
from cryobox.store.objects import open_objects
from postgres_server import may_move, recovery_at, tenant_id
from waiting import until


@pytest.fixture(scope="module")
def hosts(postgres: Any) -> Iterator[tuple[ApiServer, ApiServer]]:
    url = postgres.create_database("hosts")
    folder = Path(tempfile.mkdtemp(prefix="cbx-mh-"))
    made = []
    for name in ("a", "b"):
        state = folder / name
        made.append(
            make_server(
                state / "server",
                {"CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(state)},
                database_url=url,
            )
        )
    a, b = made
    a.key = b.key = a.tenant("shared")
    a.start()
    b.start()
    yield a, b
    for server in (a, b):
        http = httpx.Client(base_url=server.url, headers={"X-API-Key": a.key}, timeout=30)
        if server.process is not None and server.process.poll() is None:
            for info in http.get("/sandboxes", params={"all": "true"}).json():
                http.delete(f"/sandboxes/{info['id']}")
        server.stop()
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def http(server: ApiServer, key: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-Key": key or server.key}, timeout=60)


def state_folder(server: ApiServer) -> Path:
    return Path(server.env["CRYOBOX_STATE_DIR"])


def test_a_tenant_made_once_is_known_to_every_host(hosts: tuple[ApiServer, ApiServer]) -> None:
    a, _ = hosts
    for server in hosts:
        assert http(server).get("/sandboxes").status_code == 200
        assert http(server, "cbx_wrong").get("/sandboxes").status_code == 401
    listed = subprocess.run(
        [*CLI, "tenant", "ls", *a.database_options],
        capture_output=True,
        text=True,
        env=a.env,
        check=True,
    )
    assert "shared" in listed.stdout
    ids = {json.loads(line)["id"] for line in _hosts_rows(a)}
    assert len(ids) == 2  # each server recorded itself as its own host


def _hosts_rows(server: ApiServer) -> list[str]:
    db = open_database(url=server.database_url)
    try:
        return [json.dumps(dict(row)) for row in db.rows("SELECT * FROM hosts")]
    finally:
        db.close()


def test_a_sandbox_is_reached_through_any_host(hosts: tuple[ApiServer, ApiServer]) -> None:
    a, b = hosts
    sbx = Sandbox.create(api_url=a.url, api_key=a.key)
    try:
        assert (state_folder(a) / "sandboxes" / sbx.id).is_dir()  # it runs on a...
        assert not (state_folder(b) / "sandboxes" / sbx.id).exists()  # ...not on b
        via_b = Sandbox.connect(sbx.id, api_url=b.url, api_key=b.key)
        seen: list[str] = []
        result = via_b.commands.run("echo one; echo two", on_stdout=seen.append)
        assert result.stdout == "one\ntwo\n" and "".join(seen) == "one\ntwo\n"
        via_b.files.write("/tmp/from-b", b"written through b")
        assert sbx.files.read("/tmp/from-b") == b"written through b"
        via_b.files.remove("/tmp/from-b")  # (the fake VMM's guest is the host: its /tmp)
        assert sbx.id in [i.id for i in Sandbox.list(api_url=b.url, api_key=b.key)]
        time.sleep(1)  # b's monitor ticks (0.2 s) and must leave a's sandbox alone
        assert sbx.info().state == "running"
        other = b.tenant("intruder-mh")
        refused = http(b, other).get(f"/sandboxes/{sbx.id}")
        assert refused.status_code == 404 and sbx.id in refused.text  # as a missing id
        assert http(b, other).get(f"/sandboxes/{sbx.id}/logs").status_code == 404
        assert http(b).get(f"/sandboxes/{sbx.id}").json()["id"] == sbx.id
    finally:
        Sandbox.connect(sbx.id, api_url=b.url, api_key=b.key).kill()  # killed through b
    # Listed as killed a while, through either host; killed again, it is forgotten.
    ended = Sandbox.connect(sbx.id, api_url=a.url, api_key=a.key, resume=False)
    assert ended.info().state == "killed"
    assert sbx.id in [i.id for i in Sandbox.list(all=True, api_url=b.url, api_key=b.key)]
    assert sbx.id not in [i.id for i in Sandbox.list(api_url=b.url, api_key=b.key)]
    ended.kill()
    with pytest.raises(SandboxNotFound):
        Sandbox.connect(sbx.id, api_url=a.url, api_key=a.key)


def test_quotas_count_the_sandboxes_of_every_host(hosts: tuple[ApiServer, ApiServer]) -> None:
    a, b = hosts
    key = a.tenant("one-at-a-time", "--max-sandboxes", "1")
    first = Sandbox.create(api_url=a.url, api_key=key)
    try:
        with pytest.raises(QuotaExceeded, match="max_sandboxes is 1"):
            Sandbox.create(api_url=b.url, api_key=key)
    finally:
        first.kill()
    Sandbox.create(api_url=b.url, api_key=key).kill()  # the place is free again


def test_concurrent_creates_on_two_hosts_never_pass_the_quota(
    hosts: tuple[ApiServer, ApiServer],
) -> None:
    a, b = hosts
    key = a.tenant("racing", "--max-sandboxes", "2")
    results: list[Any] = []

    def create(server: ApiServer) -> None:
        try:
            results.append(Sandbox.create(api_url=server.url, api_key=key))
        except QuotaExceeded as exc:
            results.append(exc)

    threads = [threading.Thread(target=create, args=(s,)) for s in (a, b, a, b, a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    made = [r for r in results if isinstance(r, Sandbox)]
    try:
        assert len(made) == 2, results
        assert sum(isinstance(r, QuotaExceeded) for r in results) == 4
    finally:
        for sbx in made:
            sbx.kill()


def test_a_host_that_is_down_is_named_and_adopts_its_sandboxes_again(
    hosts: tuple[ApiServer, ApiServer],
) -> None:
    a, b = hosts
    sbx = Sandbox.create(api_url=b.url, api_key=b.key)
    missing = "sbx-000000000000"
    try:
        b.stop()
        answer = http(a).get(f"/sandboxes/{sbx.id}", timeout=30)
        assert answer.status_code == 503 and sbx.id in answer.json()["detail"]
        assert b.url not in answer.text  # where hosts are is not the caller's business
        # Anyone else learns nothing: the answers of a missing id, and of no key.
        other = a.tenant("outsider-mh")
        for sandbox_id in (sbx.id, missing):
            theirs = http(a, other).post(f"/sandboxes/{sandbox_id}/pause")
            assert theirs.status_code == 404 and theirs.json()["detail"] == (
                f"no sandbox with id {sandbox_id!r}"
            )
            anonymous = httpx.post(f"{a.url}/sandboxes/{sandbox_id}/commands", json={})
            assert anonymous.status_code == 401
        listed = http(a).get("/sandboxes")
        assert listed.status_code == 200 and sbx.id not in [i["id"] for i in listed.json()]
        b.start()
        assert http(a).get(f"/sandboxes/{sbx.id}").json()["state"] == "running"
        back = Sandbox.connect(sbx.id, api_url=a.url, api_key=a.key)
        assert back.commands.run("echo still here").stdout == "still here\n"
    finally:
        Sandbox.connect(sbx.id, api_url=a.url, api_key=a.key).kill()


def test_e2b_paths_are_forwarded_too(hosts: tuple[ApiServer, ApiServer]) -> None:
    a, b = hosts
    made = http(a).post("/e2b/sandboxes", json={"templateID": "default"})
    assert made.status_code == 201, made.text
    sandbox_id = made.json()["sandboxID"]
    try:
        seen = http(b).get(f"/e2b/sandboxes/{sandbox_id}")
        assert seen.status_code == 200 and seen.json()["sandboxID"] == sandbox_id
        listed = http(b).get("/e2b/v2/sandboxes").json()
        assert sandbox_id in [s["sandboxID"] for s in listed]
        # E2B's SDK, pointed at b: its in-sandbox calls name the sandbox by a header.
        e2b = pytest.importorskip("e2b")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("E2B_API_URL", f"{b.url}/e2b")
            patch.setenv("E2B_SANDBOX_URL", f"{b.url}/e2b")
            patch.setenv("E2B_API_KEY", b.key)
            sandbox = e2b.Sandbox.connect(sandbox_id)
            root = {"user": "root"}  # the fake VMM's guest has no E2B "user" account
            assert sandbox.commands.run("echo via b", **root).stdout == "via b\n"
            sandbox.files.write("/tmp/e2b-via-b", "written", **root)
            assert sandbox.files.read("/tmp/e2b-via-b", **root) == "written"
            sandbox.files.remove("/tmp/e2b-via-b", **root)
    finally:
        assert http(b).delete(f"/e2b/sandboxes/{sandbox_id}").status_code == 204


def test_hosts_starting_together_migrate_once(postgres: Any) -> None:
    url = postgres.create_database("racing_migrations")
    opened: list[Any] = []
    threads = [
        threading.Thread(target=lambda: opened.append(open_database(url=url))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(opened) == 4 and all(db.version == len(MIGRATIONS) for db in opened)
    with opened[0].transaction() as conn:
        conn.execute("UPDATE cryobox_schema SET version = ?", (len(MIGRATIONS) + 1,))
    for db in opened:
        db.close()
    with pytest.raises(InvalidArgument, match="newer than this cryobox knows"):
        open_database(url=url)


def test_first_store_keys_of_more_tenants_at_once_than_the_pool_holds_are_all_made(
    postgres: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server's thread pool is larger than its database pool (8): as many new tenants'
    first uploads at once each make their store key and share it through the database,
    none left waiting for a connection (each held one, and took a second inside it)."""
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "state"))
    db = open_database(url=postgres.create_database("first_keys"))
    hub = SimpleNamespace(db=db, service=SimpleNamespace(persist=Persistence(LocalSnapshotStore())))
    mover = Mover(hub)  # type: ignore[arg-type]
    tenants = {f"tn-first{i}" for i in range(12)}

    async def all_at_once() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(len(tenants)))
        await asyncio.gather(*(mover.key_ready(tenant) for tenant in tenants))

    try:
        asyncio.run(all_at_once())
        rows = db.rows("SELECT name FROM secrets WHERE name LIKE ?", ("%tn-first%",))
    finally:
        db.close()
    assert mover.keyed == tenants
    assert {str(row["name"]).rsplit(":", 1)[-1] for row in rows} >= tenants, rows


def test_an_unreachable_database_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_DATABASE_WAIT", "2")  # (15 s by default)
    started = time.monotonic()
    with pytest.raises(
        InvalidArgument, match=r"cannot reach the database .* within 2 s"
    ) as refused:
        open_database(url="postgresql://someone:secret@127.0.0.1:1/nowhere")
    assert "secret" not in str(refused.value)  # the password is never shown
    assert time.monotonic() - started < 30
    monkeypatch.setenv("CRYOBOX_DATABASE_WAIT", "soon")
    with pytest.raises(InvalidArgument, match=r"CRYOBOX_DATABASE_WAIT='soon' is not a number"):
        open_database(url="postgresql://someone:secret@127.0.0.1:1/nowhere")
    monkeypatch.setenv("CRYOBOX_DATABASE_WAIT", "2")
    with pytest.raises(InvalidArgument, match="use postgresql://"):
        open_database(url="mysql://x@y/z")
    done = subprocess.run(
        [*CLI, "tenant", "ls", "--database-url", "postgresql://u:pw@127.0.0.1:1/db"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "cannot reach the database" in done.stderr
    assert "pw@" not in done.stderr


def test_a_forged_forwarding_header_is_ignored_and_the_true_one_never_acts_elsewhere(
    hosts: tuple[ApiServer, ApiServer],
) -> None:
    a, b = hosts
    sbx = Sandbox.create(api_url=a.url, api_key=a.key)
    try:
        forged = http(b).get(f"/sandboxes/{sbx.id}", headers={"X-Cryobox-Forwarded": "1"})
        assert forged.status_code == 200 and forged.json()["id"] == sbx.id  # forwarded anyway
        db = open_database(url=a.database_url)
        row = db.row("SELECT value FROM secrets WHERE name = 'forward'")
        assert row is not None
        secret = row["value"]
        held = db.row("SELECT host_id FROM sandboxes WHERE id = ?", (sbx.id,))
        db.close()
        # Even the hosts' own marker only makes b answer for itself: it refuses to act.
        marked = http(b).delete(f"/sandboxes/{sbx.id}", headers={"X-Cryobox-Forwarded": secret})
        assert marked.status_code == 503 and "does not run it" in marked.json()["detail"]
        assert marked.headers["retry-after"] == "1"  # (the SDK sends it again)
        assert sbx.info().state == "running"
        db = open_database(url=a.database_url)
        assert db.row("SELECT host_id FROM sandboxes WHERE id = ?", (sbx.id,)) == held
        db.close()
        with_body = http(b).request("GET", f"/sandboxes/{sbx.id}", content=b"{}")
        assert with_body.status_code == 200  # a GET with a body is passed on, not a 500
    finally:
        sbx.kill()


def test_a_second_server_on_the_same_state_folder_is_refused(
    hosts: tuple[ApiServer, ApiServer],
) -> None:
    a, _ = hosts
    twin = make_server(
        state_folder(a) / "twin",
        {**a.env, "CRYOBOX_STATE_DIR": str(state_folder(a))},
        database_url=a.database_url,
    )
    done = subprocess.run(
        [*CLI, "server", "--port", str(twin.port), *twin.database_options],
        capture_output=True,
        text=True,
        env=twin.env,
        timeout=60,
    )
    assert done.returncode == 1
    assert "already served at" in done.stderr and a.url in done.stderr


@pytest.fixture
def fleet_dir() -> Iterator[Path]:
    """A short folder for a fleet's state folders: under pytest's ``tmp_path`` their
    sandboxes' sockets pass the 107 bytes a unix socket path may have once pytest numbers
    its folders far enough (:func:`cryobox.config.socket_room`)."""
    folder = Path(tempfile.mkdtemp(prefix="cbx-fleet-"))
    yield folder
    end_helpers(folder)  # (a fork's RAM may still arrive through the store)
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def lossy_pair(
    postgres: Any,
    folder: Path,
    name: str,
    vcpus: Mapping[str, int] | None = None,
    env: Mapping[str, Mapping[str, str]] | None = None,
) -> Iterator[tuple[ApiServer, ApiServer]]:
    """Hosts a and b on a database of their own and one chunk store, declared lost 3 s
    after their last heartbeat (``vcpus``: a host's limit, ``env`` more variables, by
    host name); both started, one tenant's key each. Every sandbox is killed and both
    servers stopped afterwards."""
    fleet = {
        "CRYOBOX_VMM": "fake",
        "CRYOBOX_HOST_HEARTBEAT": "1",
        "CRYOBOX_HOST_GONE_AFTER": "3",
        "CRYOBOX_STORE": str(folder / "store"),
    }
    url = postgres.create_database(name)
    a, b = (
        make_server(
            folder / host / "server",
            {
                **fleet,
                "CRYOBOX_STATE_DIR": str(folder / host),
                "CRYOBOX_HOST_VCPUS": str((vcpus or {}).get(host, 0)),
                **(env or {}).get(host, {}),
            },
            database_url=url,
        )
        for host in "ab"
    )
    a.key = b.key = a.tenant(name.replace("_", "-"))
    a.start()
    b.start()
    try:
        yield a, b
    finally:
        for server in (a, b):
            if server.process is not None and server.process.poll() is None:
                for listed in http(server).get("/sandboxes", params={"all": "true"}).json():
                    http(server).delete(f"/sandboxes/{listed['id']}")
            server.stop()
        for host in "ab":
            kill_vms(folder / host)


def wait_for_state(server: ApiServer, sandbox_id: str, state: str, what: str) -> dict[str, Any]:
    """The sandbox's info through ``server`` once it reads ``state`` (at most 120 s)."""
    deadline = time.monotonic() + 120
    while (info := http(server).get(f"/sandboxes/{sandbox_id}").json()).get("state") != state:
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return dict(info)


def lose(server: ApiServer, state: Path) -> None:
    """The host of ``server`` (state folder ``state``) is lost: its server and its VMs
    killed with -9."""
    assert server.process is not None
    server.process.kill()
    server.process.wait()
    kill_vms(state)


def recoverable_on_lost_b(a: ApiServer, b: ApiServer, folder: Path) -> tuple[str, Sandbox]:
    """A sandbox with a history on b, once its checkpoint is recorded as its recovery
    point; then b is lost (:func:`lose`). The fleet's database URL, and the sandbox."""
    url = a.database_url
    assert url is not None
    sbx = Sandbox.create(api_url=b.url, api_key=b.key, checkpoint_every=5)
    deadline = time.monotonic() + 120
    while not recovery_at(url, sbx.id):
        assert time.monotonic() < deadline, "no checkpoint of it is ever stored"
        time.sleep(0.5)
    lose(b, folder / "b")
    return url, sbx


def test_a_sandbox_killed_while_its_host_is_lost_never_runs_there_again(
    postgres: Any, fleet_dir: Path
) -> None:
    """Host b stops answering (its server killed with -9, its sandboxes running on); once
    a sees it lost, one of its sandboxes is killed through a: it reads as killed from a
    at once. When b comes back, it stops its copy of that one (never adopts it again),
    and its other sandbox, not killed, is its own as before."""
    with lossy_pair(postgres, fleet_dir, "hosts_tombstones") as (a, b):
        doomed, kept = (Sandbox.create(api_url=b.url, api_key=b.key) for _ in range(2))
        assert b.process is not None
        b.process.kill()
        b.process.wait()
        wait_for_state(a, doomed.id, "lost", "b is never seen as lost")
        lost = http(a).get(f"/sandboxes/{kept.id}").json()
        assert lost["state"] == "lost" and lost["recoverable_from"] is None
        assert "cannot be recovered" in lost["error"]
        refused = http(a).post(f"/sandboxes/{kept.id}/resume")
        assert refused.status_code == 503 and "cannot be recovered" in refused.text

        assert http(a).delete(f"/sandboxes/{doomed.id}").status_code == 204
        killed = http(a).get(f"/sandboxes/{doomed.id}").json()
        assert killed["state"] == "killed" and "was lost" in killed["error"]
        copy = fleet_dir / "b" / "sandboxes" / doomed.id
        assert json.loads((copy / "state.json").read_text())["state"] == "running"  # still
        # Killed again, it is forgotten (its row and ownership gone): b, back, has only
        # the tombstone to go by, and must neither adopt its copy nor let it run.
        assert http(a).delete(f"/sandboxes/{doomed.id}").status_code == 204
        assert http(a).get(f"/sandboxes/{doomed.id}").status_code == 404

        b.start()  # back: its copy of the killed one stops; the other is its own again
        deadline = time.monotonic() + 60
        while copy.exists():
            assert time.monotonic() < deadline, "b keeps its copy of the killed sandbox"
            time.sleep(0.5)
        assert http(b).get(f"/sandboxes/{doomed.id}").status_code == 404
        assert http(a).get(f"/sandboxes/{kept.id}").json()["state"] == "running"
        back = Sandbox.connect(kept.id, api_url=a.url, api_key=a.key)
        assert back.commands.run("echo still here").stdout == "still here\n"
        listed = {i["id"]: i["state"] for i in http(a).get("/sandboxes?all=true").json()}
        assert listed == {kept.id: "running"}
        # Told once: b's tombstone is gone, and a restart of b changes nothing.

        assert a.database_url is not None
        with psycopg.connect(a.database_url) as conn:
            assert conn.execute("SELECT count(*) FROM tombstones").fetchone() == (0,)
        b.stop()
        b.start()
        assert http(a).get(f"/sandboxes/{kept.id}").json()["state"] == "running"


def test_a_recovery_cut_short_by_a_crash_finishes_when_the_server_starts_again(
    postgres: Any, fleet_dir: Path
) -> None:
    """A sandbox with a history on host b; b is lost (its server and sandboxes killed
    with -9). A resume through a claims it, and a's server dies right then (before the
    sandbox starts there): started again, a finishes the recovery instead of forgetting
    the sandbox. (The same recovery over real VMs, with its processes and files, is in
    ``tests/integration/test_fleet_vm.py``.)"""
    with lossy_pair(postgres, fleet_dir, "hosts_recovery_crash") as (a, b):
        _, sbx = recoverable_on_lost_b(a, b, fleet_dir)
        info = wait_for_state(a, sbx.id, "lost", "b is never seen as lost")
        assert info["recoverable_from"] and "resume it" in info["error"]

        a.stop()
        a.env["CRYOBOX_TEST_CRASH_AT"] = "server-recovery-claimed"
        a.start()
        with pytest.raises(httpx.TransportError):  # the server dies mid-request
            http(a).post(f"/sandboxes/{sbx.id}/resume")
        assert a.process is not None
        assert a.process.wait(30) == -9
        del a.env["CRYOBOX_TEST_CRASH_AT"]
        a.start()
        wait_for_state(a, sbx.id, "running", "the recovery is never finished")
        back = Sandbox.connect(sbx.id, api_url=a.url, api_key=a.key)
        assert back.commands.run("echo recovered").stdout == "recovered\n"
        assert (fleet_dir / "a" / "sandboxes" / sbx.id).exists()


def test_a_former_recovery_point_is_folded_once_it_leaves_the_store(
    postgres: Any, fleet_dir: Path
) -> None:
    """A sandbox with a history on b: its newest checkpoint is uploaded and recorded as
    its recovery point, left whole while in the store (its copy there is whole). Once a
    newer one replaces it and it leaves the store, it is folded at the sandbox's next
    checkpoint, as the one before each checkpoint is: its RAM laid over a newer one's
    (it used to stay whole until the history dropped it)."""
    with lossy_pair(postgres, fleet_dir, "hosts_recovery_folded") as (_, b):
        sbx = Sandbox.create(api_url=b.url, api_key=b.key, checkpoint_every=5)
        snapshots = fleet_dir / "b" / "snapshots"
        stored: set[str] = set()  # its points seen in the store (each a recovery point)

        def folded_former_points() -> list[str]:
            """Points of the sandbox seen stored, now out of the store and folded."""
            found = []
            for folder in snapshots.iterdir():
                with contextlib.suppress(OSError, ValueError):
                    manifest = json.loads((folder / "manifest.json").read_text())
                    if manifest.get("source_sandbox") != sbx.id:
                        continue
                    mark = json.loads((folder / "upload.json").read_text())
                    if mark.get("state") == "stored":
                        stored.add(folder.name)
                    elif folder.name in stored and manifest.get("memory_base"):
                        found.append(folder.name)
            return found

        deadline = time.monotonic() + 180
        while not folded_former_points():
            assert time.monotonic() < deadline, "no former recovery point is ever folded"
            time.sleep(0.2)
        point = folded_former_points()[0]
        mark = json.loads((snapshots / point / "upload.json").read_text())
        assert mark["state"] == "local" and mark["unstored"] is True  # as the mover left it
        # Only its delta is kept: the whole RAM goes just after the fold's manifest is
        # written (its commit), so a look between the two still finds it.
        until(lambda: not (snapshots / point / "memory").exists(), "the folded RAM gone", 10)
        assert (snapshots / point / "memory.delta").exists()
        sbx.rewind(point)  # and it comes back as it was saved
        assert sbx.commands.run("echo back").stdout == "back\n"


def test_a_former_recovery_point_put_off_while_an_upload_ran_leaves_the_store_after_a_restart(
    postgres: Any, fleet_dir: Path
) -> None:
    """A sandbox with a history on b, while an upload runs (its lease held here): each
    newer recovery point replaces the one before, whose removal from the store is put
    off. The first one's local copy expires meanwhile (``keep_checkpoints=2``); b's
    server restarts, then the upload ends, and the first point leaves the store. (The
    removals put off were kept in the server's memory: lost with a restart, such a point
    stayed in the store for good.)"""

    with lossy_pair(postgres, fleet_dir, "hosts_unstore_restart") as (_, b):
        assert b.database_url is not None
        tenant = tenant_id(b.database_url, "hosts-unstore-restart")
        records = fleet_dir / "store" / "snapshots" / tenant
        snapshots = fleet_dir / "b" / "snapshots"
        seen: list[str] = []  # the sandbox's automatic checkpoints, in the order seen here

        def look() -> tuple[set[str], set[str]]:
            """Its points here, and its points in the store."""
            here = set()
            taken = []
            for folder in snapshots.iterdir():  # (one may go meanwhile: the history's)
                with contextlib.suppress(OSError, ValueError):
                    manifest = json.loads((folder / "manifest.json").read_text())
                    if manifest.get("source_sandbox") == sbx.id and manifest.get("automatic"):
                        here.add(folder.name)
                        taken.append((float(manifest["created_at"]), folder.name))
            seen.extend(name for _, name in sorted(taken) if name not in seen)
            stored = {p.stem for p in records.glob("snap-*.json")} & set(seen)
            return here, stored

        with locks.held(open_objects(str(fleet_dir / "store")), tenant, "upload"):
            sbx = Sandbox.create(
                api_url=b.url, api_key=b.key, checkpoint_every=5, keep_checkpoints=2
            )
            deadline = time.monotonic() + 180
            while True:  # the first point stored, gone here, and two newer ones stored
                here, stored = look()
                first = next((point for point in seen if point in stored), None)
                if first is not None and first not in here and len(stored - {first}) >= 2:
                    break
                assert time.monotonic() < deadline, (seen, here, stored)
                time.sleep(0.3)
            b.stop()
        b.start()
        until(lambda: first not in look()[1], "the first recovery point to leave", timeout=60)
        assert sbx.commands.run("echo on").stdout == "on\n"


def test_forks_that_do_not_fit_their_parents_host_are_made_on_another_through_the_store(
    postgres: Any, fleet_dir: Path
) -> None:
    """Host b may run 2 vCPUs, a 4. A 2-vCPU sandbox on b fills b: its 2 forks asked
    through b are made on a, from a snapshot of it pushed to the store (the parent runs
    on, on b); one more fork fits neither host and is refused, naming both. Over real
    VMs, with the copies' files and processes: ``tests/integration/test_fleet_vm.py``."""
    with lossy_pair(postgres, fleet_dir, "hosts_fork_away", vcpus={"a": 4, "b": 2}) as (_, b):
        parent = Sandbox.create(
            api_url=b.url, api_key=b.key, cpus=2, envs={"NOTE": "kept"}, timeout=300
        )
        parent.set_timeout(1800)  # (the copies live as long as it was last told to)
        a_id = (fleet_dir / "a" / "host-id").read_text().strip()
        forks = parent.fork(2)
        assert [f.info().host for f in forks] == [a_id, a_id]
        for copy in forks:
            deadline = copy.info().deadline
            assert deadline is not None and 1700 < deadline - time.time() <= 1800
        assert {f.id for f in forks} == {
            p.name for p in (fleet_dir / "a" / "sandboxes").iterdir() if p.name != parent.id
        }
        for copy in forks:
            assert copy.commands.run("echo $NOTE").stdout == "kept\n"
        assert parent.info().state == "running" and parent.info().host != a_id
        origin = forks[0].info().origin
        assert origin is not None
        snapshots = {s.id: s for s in Sandbox.snapshots(api_url=b.url, api_key=b.key)}
        assert snapshots[origin].source_sandbox == parent.id
        with pytest.raises(NoHostAvailable, match="fit neither this host") as refused:
            parent.fork(1)
        assert "not enough of its vCPUs free" in str(refused.value) and a_id in str(refused.value)


def test_a_snapshot_stored_under_a_key_this_host_does_not_hold_yet_starts_here(
    postgres: Any, fleet_dir: Path
) -> None:
    """Host b stores a snapshot under the tenant's key; a start from it through host a
    before a holds that key (the hosts share keys at their heartbeat: b made it a
    moment ago) takes the key then and starts. It was refused as not found: the key a
    lacked was taken for a store that did not answer (the fork-away test above saw it
    once, under load)."""
    with lossy_pair(postgres, fleet_dir, "hosts_key_late") as (a, b):
        assert a.database_url is not None
        tenant = tenant_id(a.database_url, "hosts-key-late")
        saved = Sandbox.create(api_url=b.url, api_key=b.key).snapshot("saved")

        def stored() -> bool:
            listed = Sandbox.snapshots(api_url=b.url, api_key=b.key)
            return any(s.id == saved.id and s.location == "stored" for s in listed)

        until(stored, "the snapshot stored", 60)
        held = fleet_dir / "a" / "keys" / "store" / f"{tenant}.json"
        until(held.exists, "a to take the tenant's key at its heartbeat", 30)
        held.unlink()  # (as before a's next heartbeat)
        copy = Sandbox.create(from_snapshot=saved.id, api_url=a.url, api_key=a.key)
        assert copy.info().host == (fleet_dir / "a" / "host-id").read_text().strip()
        assert copy.commands.run("echo here").stdout == "here\n"
        assert held.exists()


def test_a_paused_sandbox_moved_to_another_host_and_killed_there_leaves_no_stored_pause(
    postgres: Any, fleet_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paused on b (its pause stored), b is gone quiet (its server stopped: a host
    restarting); a kill through a takes it over and kills it there. Its stored pause
    goes with it: the copy a holds was never uploaded from a (no upload mark), so the
    pause is found in the tenant's store by its owner."""
    with lossy_pair(postgres, fleet_dir, "hosts_moved_killed") as (a, b):
        url = a.database_url
        assert url is not None
        sbx = Sandbox.create(api_url=b.url, api_key=b.key)
        sbx.pause()
        until(lambda: may_move(url, sbx.id), "b's pause to be stored", timeout=60)
        tenant = tenant_id(url, "hosts-moved-killed")
        monkeypatch.setenv("CRYOBOX_STATE_DIR", str(fleet_dir / "b"))  # (its keys, to read)
        stored = ChunkStore(tenant, open_objects(str(fleet_dir / "store")))
        assert stored.pause_of(sbx.id).id
        b.stop()
        wait_for_state(a, sbx.id, "paused", "a never answers for it")  # (b is seen gone)
        assert http(a).delete(f"/sandboxes/{sbx.id}").status_code == 204
        assert (fleet_dir / "a" / "sandboxes" / sbx.id).exists()  # (killed there)
        with pytest.raises(SnapshotNotFound):
            stored.pause_of(sbx.id)


def test_a_recovery_is_placed_as_a_create_is(postgres: Any, fleet_dir: Path) -> None:
    """b is lost with a sandbox whose checkpoint is stored; a is draining: a resume
    through a is refused naming why (nothing is claimed: it stays lost and
    recoverable); a undrained, the same resume recovers it there."""
    with lossy_pair(postgres, fleet_dir, "hosts_recovery_placed") as (a, b):
        url, sbx = recoverable_on_lost_b(a, b, fleet_dir)
        wait_for_state(a, sbx.id, "lost", "b is never seen as lost")
        a_id = (fleet_dir / "a" / "host-id").read_text().strip()
        drain = [*CLI, "host", "drain", a_id, "--database-url", url]
        subprocess.run(drain, check=True, capture_output=True, timeout=60)
        refused = http(a).post(f"/sandboxes/{sbx.id}/resume")
        assert refused.status_code == 503 and "draining" in refused.text, refused.text
        info = http(a).get(f"/sandboxes/{sbx.id}").json()
        assert info["state"] == "lost" and info["recoverable_from"]
        undrain = [*CLI, "host", "undrain", a_id, "--database-url", url]
        subprocess.run(undrain, check=True, capture_output=True, timeout=60)
        assert http(a).post(f"/sandboxes/{sbx.id}/resume").status_code == 200
        back = Sandbox.connect(sbx.id, api_url=a.url, api_key=a.key)
        assert back.info().host == a_id
        assert back.commands.run("echo placed").stdout == "placed\n"


def test_a_host_that_cannot_continue_a_saved_machine_is_never_tried(
    postgres: Any, fleet_dir: Path
) -> None:
    """a runs another VMM version than b (as after an upgrade of QEMU on one host).
    A sandbox paused on b, its pause stored; b is lost. Through a, it does not wake:
    placement names the version (a is never tried: nothing of it lands there), where a
    restore on a would have refused it only after pulling it. `host ls` shows each
    host's VMM. A running sandbox with a history on b is not recovered on a either."""
    versions = {"a": {"CRYOBOX_FAKE_VERSION": "2"}, "b": {"CRYOBOX_FAKE_VERSION": "1"}}
    with lossy_pair(postgres, fleet_dir, "hosts_platform", env=versions) as (a, b):
        url = a.database_url
        assert url is not None
        paused = Sandbox.create(api_url=b.url, api_key=b.key)
        paused.pause()
        kept = Sandbox.create(api_url=b.url, api_key=b.key, checkpoint_every=5)
        deadline = time.monotonic() + 120
        while not (may_move(url, paused.id) and recovery_at(url, kept.id)):
            assert time.monotonic() < deadline, "b's pause and checkpoint are never stored"
            time.sleep(0.5)
        listed = subprocess.run(
            [*CLI, "host", "ls", "--database-url", url], capture_output=True, text=True
        ).stdout
        assert "fake 2 fake" in listed and "fake 1 fake" in listed
        lose(b, fleet_dir / "b")
        wait_for_state(a, kept.id, "lost", "b is never seen as lost")
        refused = http(a).get(f"/sandboxes/{paused.id}")
        assert refused.status_code == 503, refused.text
        assert "version is '2', the saved machine's '1'" in refused.text
        recovery = http(a).post(f"/sandboxes/{kept.id}/resume")
        assert recovery.status_code == 503 and "version" in recovery.text, recovery.text
        assert not (fleet_dir / "a" / "sandboxes" / paused.id).exists()
        assert not (fleet_dir / "a" / "sandboxes" / kept.id).exists()
