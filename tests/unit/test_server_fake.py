"""``cryobox server`` as a real process on a loopback port, over the fake VMM.

The HTTP layer's own rules, checked in seconds: keys, quotas, validation, schema
conformance (schemathesis), serialized concurrent calls, streams that free their
command when the client leaves, the database's migrations, the tenant commands. The
same server over real VMs is tested in ``tests/integration/test_server_vm.py``.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import response_schema_conformance

from api_server import CLI, ApiServer, kill_vms, make_server, remove_state
from cryobox import Sandbox, config
from cryobox.errors import (
    AuthenticationError,
    InvalidArgument,
    QuotaExceeded,
    SandboxDead,
    SandboxNotFound,
    StateError,
)
from cryobox.server.database import MIGRATIONS, SqliteDatabase
from cryobox.server.databases import open_database
from waiting import until


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(request: pytest.FixtureRequest) -> Iterator[ApiServer]:
    """The server on each database engine: its SQLite file, then a real PostgreSQL."""
    url = None
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres").create_database("fake_server")
    state = Path(tempfile.mkdtemp(prefix="cbx-srv-"))
    made = make_server(
        state / "server", {"CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(state)}, url
    )
    made.key = made.tenant("acme")
    made.start()
    yield made
    client = httpx.Client(base_url=made.url, headers={"X-API-Key": made.key})
    for info in client.get("/sandboxes", params={"all": "true"}).json():
        client.delete(f"/sandboxes/{info['id']}")
    made.stop()
    kill_vms(state)  # sandboxes other tenants or a race left: they outlive the server
    subprocess.run(["rm", "-rf", str(state)], check=False)


def client(server: ApiServer, key: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key or server.key}"}, timeout=60
    )


def sdk(server: ApiServer, key: str | None = None, **kwargs: Any) -> Sandbox:
    return Sandbox.create(api_url=server.url, api_key=key or server.key, **kwargs)


def test_every_call_needs_a_valid_key_in_either_header(server: ApiServer) -> None:
    anonymous = httpx.Client(base_url=server.url)
    assert anonymous.get("/health").json()["status"] == "ok"
    refused = anonymous.get("/sandboxes")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert "API key is required" in refused.json()["detail"]
    bad = anonymous.get("/sandboxes", headers={"X-API-Key": "cbx_not-a-key"})
    assert bad.status_code == 401 and "not valid" in bad.json()["detail"]
    assert anonymous.get("/sandboxes", headers={"X-API-Key": server.key}).status_code == 200
    assert client(server).get("/sandboxes").status_code == 200
    with pytest.raises(AuthenticationError, match="not valid"):
        Sandbox.list(api_url=server.url, api_key="cbx_wrong")


def test_bad_input_is_a_422_naming_the_field(server: ApiServer) -> None:
    http = client(server)
    for body, field in (
        ({"cpus": 0}, "cpus"),
        ({"timeout": "NaN"}, "timeout"),
        ({"ports": [70000]}, "ports"),
        ({"memory_mib": True, "nonsense": 1}, "nonsense"),
    ):
        answer = http.post("/sandboxes", json=body)
        assert answer.status_code == 422, body
        assert any(field in item["loc"] for item in answer.json()["detail"]), answer.json()
    with pytest.raises(InvalidArgument, match="cpus"):
        sdk(server, cpus=0)
    missing = http.post("/sandboxes", json={"template": "nope"})
    assert missing.status_code == 404 and "template 'nope' does not exist" in missing.text
    for path in ("/sandboxes/a%00b", "/sandboxes/a%00b/logs", "/snapshots/x%00y"):
        nul = http.get(path)  # PostgreSQL cannot even compare a NUL byte: never a 500
        assert nul.status_code in (400, 404), (path, nul.status_code, nul.text)


def test_quotas_are_answered_429_naming_the_limit(server: ApiServer) -> None:
    key = server.tenant("tiny", "--max-sandboxes", "1", "--max-vcpus", "2")
    first = sdk(server, key)
    try:
        with pytest.raises(QuotaExceeded, match="max_sandboxes is 1") as refused:
            sdk(server, key)
        assert refused.value.limit == "max_sandboxes"
        raw = client(server, key).post(f"/sandboxes/{first.id}/forks", json={"count": 1})
        assert raw.status_code == 429 and "max_sandboxes" in raw.json()["detail"]
        first.pause()  # a paused sandbox holds no compute
        second = sdk(server, key)
        with pytest.raises(QuotaExceeded, match="max_sandboxes"):
            Sandbox.resume(first.id, api_url=server.url, api_key=key)
        second.kill()
    finally:
        first.kill()
    # Past the quota and past what any host can take: the quota is the answer (it does
    # not depend on the hosts' free room), before placement looks.
    huge = client(server, key).post("/sandboxes", json={"cpus": 64, "memory_mib": 1 << 30})
    assert huge.status_code == 429 and "max_vcpus" in huge.json()["detail"], huge.text


def test_a_snapshot_started_at_another_shape_counts_that_shape(server: ApiServer) -> None:
    """A disk snapshot boots at any vCPUs and RAM, a memory snapshot grows to more: the
    quota counts what is asked for, not the snapshot's shape (which once let a tenant
    past its vCPU limit)."""
    key = server.tenant("shaped", "--max-vcpus", "4", "--max-memory-mib", "4096")
    source = sdk(server, key)
    try:
        source.snapshot("files", memory=False)
        source.snapshot("whole")
    finally:
        source.kill()
    with pytest.raises(QuotaExceeded, match="max_vcpus"):
        sdk(server, key, from_snapshot="whole", cpus=16)
    grown = sdk(server, key, from_snapshot="whole", cpus=3, memory_mib=1536)
    try:  # over HTTP as embedded: the saved machine given a vCPU and 512 MiB
        assert (grown.info().cpus, grown.info().memory_mib) == (3, 1536)
    finally:
        grown.kill()
    with pytest.raises(QuotaExceeded, match="max_vcpus"):
        sdk(server, key, from_snapshot="files", cpus=16)
    with pytest.raises(QuotaExceeded, match="max_memory_mib"):
        sdk(server, key, from_snapshot="files", memory_mib=16384)
    within = sdk(server, key, from_snapshot="files", cpus=3)
    try:
        assert within.info().cpus == 3
    finally:
        within.kill()


def test_the_sdk_works_over_http(server: ApiServer, tmp_path: Path) -> None:
    with sdk(server, ports=[8000]) as sbx:
        seen: list[str] = []
        result = sbx.commands.run("echo out; echo err >&2; exit 3", on_stdout=seen.append)
        assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
        assert seen == ["out\n"]
        handle = sbx.commands.run("cat", background=True, stdin=True)
        handle.send_stdin("fed\n", eof=True)
        assert handle.wait().stdout == "fed\n"
        # Every byte value, in 16 chunks (more than are sent before the first answer)
        # each unlike the others: a chunk written out of order would show.
        payload = b"".join(bytes([i]) * 100_000 + bytes(range(256)) for i in range(40))
        sbx.files.write("/tmp/blob", payload)
        assert sbx.files.read("/tmp/blob") == payload
        assert sbx.files.stat("/tmp/blob").size == len(payload)
        sbx.files.remove("/tmp/blob")  # (the fake VMM's guest is the host: its /tmp)
        checkpoint = sbx.checkpoint("before")
        sbx.rollback("before")
        assert [c.id for c in sbx.checkpoints()] == [checkpoint.id]
        info = sbx.info()
        assert info.vmm_pid is None and info.supervisor_pid is None  # no host pids leak
        assert set(info.ports) == {8000}


def test_concurrent_lifecycle_calls_on_one_sandbox_are_serialized(server: ApiServer) -> None:
    sbx = sdk(server)
    results: dict[str, Any] = {}

    def attempt(name: str, call: Any) -> None:
        try:
            results[name] = call()
        except Exception as exc:
            results[name] = exc

    threads = [
        threading.Thread(target=attempt, args=("fork-a", lambda: sbx.fork(2))),
        threading.Thread(target=attempt, args=("fork-b", lambda: sbx.fork(2))),
        threading.Thread(target=attempt, args=("checkpoint", sbx.checkpoint)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(not isinstance(r, Exception) for r in results.values()), results
    forks = results["fork-a"] + results["fork-b"]
    assert len({f.id for f in forks}) == 4
    for fork in forks:
        assert fork.commands.run("echo alive").stdout == "alive\n"
        fork.kill()
    # A kill while a fork is under way waits for it; the fork's sandboxes stay whole.
    attempt_thread = threading.Thread(target=attempt, args=("fork-c", lambda: sbx.fork(1)))
    attempt_thread.start()
    time.sleep(0.05)
    sbx.kill()
    attempt_thread.join()
    left = results["fork-c"]
    if isinstance(left, list):
        assert left[0].commands.run("echo alive").stdout == "alive\n"
        left[0].kill()
    else:  # the kill came first: the fork finds no sandbox (or a killed one)
        assert isinstance(left, SandboxNotFound | StateError | SandboxDead), left
    assert sbx.id not in {i.id for i in Sandbox.list(api_url=server.url, api_key=server.key)}


def _lock_waiters(lock: Path) -> int:
    """How many processes' threads wait for the ``flock`` on ``lock`` (``/proc/locks``)."""
    inode = f":{lock.stat().st_ino} "
    return sum("->" in line and inode in line for line in Path("/proc/locks").open())


def test_calls_waiting_in_worker_threads_hold_up_no_other_call(server: ApiServer) -> None:
    """Ten calls that wait in the server's worker threads at once (deletes of a snapshot
    whose lock is held, as a long fold holds it) neither queue behind each other nor
    hold up the calls after them: a 2-core host's default of six threads would."""
    sbx = sdk(server)
    saved = sbx.snapshot("held")
    sbx.kill()
    lock = Path(server.env["CRYOBOX_STATE_DIR"]) / "locks" / f"ram-{saved.id}.lock"
    lock.parent.mkdir(mode=0o700, exist_ok=True)  # (made at the first lock taken)
    with open(lock, "a+b") as held, ThreadPoolExecutor(10) as callers:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            deletes = [
                callers.submit(client(server).delete, f"/snapshots/{saved.id}") for _ in range(10)
            ]
            until(lambda: _lock_waiters(lock) == 10, "ten deletes waiting in threads", 30)
            assert client(server).get("/snapshots", timeout=15).status_code == 200
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        answers = [d.result().status_code for d in deletes]
    assert set(answers) <= {200, 404} and 200 in answers, answers
    assert saved.id not in {s["id"] for s in client(server).get("/snapshots").json()}


def test_a_client_that_leaves_a_command_stream_kills_the_command(server: ApiServer) -> None:
    with sdk(server) as sbx:
        http = client(server)
        with http.stream(
            "POST", f"/sandboxes/{sbx.id}/commands", json={"cmd": "sleep 600"}
        ) as stream:
            lines = stream.iter_lines()  # held: a dropped iterator closes the stream
            started = json.loads(next(lines))
            assert started["type"] == "started" and started["pid"] > 0
            assert sbx.commands.run(f"kill -0 {started['pid']}").exit_code == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sbx.commands.run(f"kill -0 {started['pid']}").exit_code != 0:
                break
            time.sleep(0.2)
        assert sbx.commands.run(f"kill -0 {started['pid']}").exit_code != 0
        stdin = http.post(f"/sandboxes/{sbx.id}/commands/{started['command_id']}/stdin")
        assert stdin.status_code == 400 and "no running command" in stdin.text


def test_idle_sandboxes_pause_and_the_next_call_wakes_them(server: ApiServer) -> None:
    with sdk(server, idle_timeout=1) as sbx:
        sbx.commands.run("echo $$ > /tmp/shell-pid")
        deadline = time.monotonic() + 20
        while sbx.info().state != "paused" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sbx.info().state == "paused"
        assert sbx.files.read("/tmp/shell-pid")  # the call wakes it
        assert sbx.info().state == "running"
        sbx.files.remove("/tmp/shell-pid")  # (the fake VMM's guest is the host: its /tmp)


def test_events_stream_state_changes(server: ApiServer) -> None:
    sbx = sdk(server)
    seen: list[dict[str, Any]] = []

    def listen() -> None:
        with (
            client(server).stream("GET", f"/sandboxes/{sbx.id}/events", timeout=30) as stream,
        ):
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["type"] == "killed":
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    time.sleep(0.5)
    sbx.pause()
    Sandbox.resume(sbx.id, api_url=server.url, api_key=server.key)
    sbx.checkpoint()
    sbx.kill()
    listener.join(30)
    types = [event["type"] for event in seen]
    assert types == ["paused", "resumed", "snapshot stored", "killed"], seen


def test_usage_counts_compute_only_while_running(server: ApiServer) -> None:
    key = server.tenant("metered")
    http = client(server, key)
    sbx = sdk(server, key)
    time.sleep(1.5)
    sbx.pause()
    paused_at = http.get("/usage").json()
    assert paused_at["vcpu_seconds"] >= 1.5 * 2 and paused_at["gib_seconds"] >= 1.5
    time.sleep(1.5)
    later = http.get("/usage").json()
    assert later["vcpu_seconds"] == pytest.approx(paused_at["vcpu_seconds"], abs=0.5)
    assert later["stored_gb_months"] > 0 and later["cost_usd"]["storage"] > 0
    mine = http.get("/usage", params={"sandbox_id": sbx.id}).json()
    assert mine["id"] == sbx.id and mine["vcpu_seconds"] > 0
    sbx.kill()


def test_the_api_meets_its_own_openapi_schema(server: ApiServer) -> None:
    """schemathesis generates requests for every operation of /openapi.json: no 5xx, and
    every answer in the schema it declares (a tenant of its own, quota 2 sandboxes).
    The tenant's event stream is left out: it answers 200 and never ends."""
    key = server.tenant("fuzz", "--max-sandboxes", "2")
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    failures: list[str] = []
    operations = calls = 0
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result
        operation = result.ok()
        if operation.path == "/events":
            continue  # the tenant's event stream never ends: tested on its own above
        operations += 1

        @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            nonlocal calls
            calls += 1
            try:
                case.call_and_validate(
                    headers={"X-API-Key": key},
                    checks=[not_a_server_error, response_schema_conformance],
                    timeout=60,
                )
            except Exception as exc:
                failures.append(f"{case.method} {case.formatted_path}: {exc}"[:800])

        check()
    assert operations > 25 and calls > 5 * operations
    assert not failures, "\n".join(failures[:8])


def test_tenant_commands(server: ApiServer) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, "tenant", *args, *server.database_options],
            capture_output=True,
            text=True,
            env=server.env,
            timeout=60,
            check=False,
        )

    made = run("create", "rotating")
    old = made.stdout.strip().splitlines()[-1]
    assert made.returncode == 0 and old.startswith("cbx_")
    assert "rotating" in run("ls").stdout
    assert run("create", "rotating").returncode == 1  # the name is taken
    assert run("create", "Bad Name").returncode == 1
    sbx = sdk(server, old)
    refused = run("rm", "rotating")
    assert refused.returncode == 1 and sbx.id in refused.stderr
    kept = sbx.snapshot("kept")
    sbx.kill()
    refused = run("rm", "rotating")  # nor while it owns saved state
    assert refused.returncode == 1 and kept.id in refused.stderr
    Sandbox.delete_snapshot("kept", api_url=server.url, api_key=old)
    sbx = sdk(server, old)
    new = run("key-rotate", "rotating").stdout.strip().splitlines()[-1]
    with pytest.raises(AuthenticationError):
        Sandbox.list(api_url=server.url, api_key=old)
    Sandbox.connect(sbx.id, api_url=server.url, api_key=new).kill()
    assert run("rm", "rotating").returncode == 0
    with pytest.raises(AuthenticationError):
        Sandbox.list(api_url=server.url, api_key=new)
    db = open_database(server.database, server.database_url)
    rows = db.rows("SELECT * FROM api_keys")
    db.close()
    assert rows and all(new not in str(dict(r)) and old not in str(dict(r)) for r in rows)


def test_the_database_migrates_forward_and_refuses_a_newer_one(tmp_path: Path) -> None:
    path = tmp_path / "server.db"
    first = SqliteDatabase(path)
    assert first.version == len(MIGRATIONS)
    first.execute(
        "INSERT INTO tenants (id, name, created_at, max_sandboxes, max_vcpus, max_memory_mib, "
        "max_stored_bytes) VALUES ('tn-1', 'kept', 0, 1, 1, 1, 1)",
    )
    first.close()
    assert SqliteDatabase(path).row("SELECT name FROM tenants")["name"] == "kept"  # type: ignore[index]
    with sqlite3.connect(path) as raw:
        raw.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    with pytest.raises(InvalidArgument, match="newer than this cryobox knows"):
        SqliteDatabase(path)


def test_async_sdk_over_http(server: ApiServer) -> None:
    from cryobox import AsyncSandbox

    async def main() -> list[str]:
        sbx = await AsyncSandbox.create(api_url=server.url, api_key=server.key)
        try:
            results = await asyncio.gather(*(sbx.commands.run(f"echo {i}") for i in range(5)))
            return [r.stdout for r in results]
        finally:
            await sbx.kill()

    assert asyncio.run(main()) == [f"{i}\n" for i in range(5)]


def test_templates_are_each_tenants_own(server: ApiServer) -> None:
    maker, other = server.key, server.tenant("other-builder")
    built = Sandbox.build_template(
        "web", ["echo served > /root/page"], api_url=server.url, api_key=maker
    )
    theirs = client(server, other)
    assert [t.name for t in Sandbox.templates(api_url=server.url, api_key=maker)].count("web") == 1
    assert "web" not in theirs.get("/templates").text
    assert theirs.post("/sandboxes", json={"template": "web"}).status_code == 404
    assert theirs.delete("/templates/web").status_code == 404
    assert theirs.get(f"/snapshots/{built.id}").status_code == 404
    with sdk(server, maker, template="web") as sbx:
        assert sbx.files.read_text("/root/page") == "served\n"
    Sandbox.build_template("web", [], api_url=server.url, api_key=other)  # a name of its own
    Sandbox.delete_template("web", api_url=server.url, api_key=other)
    Sandbox.delete_template("web", api_url=server.url, api_key=maker)
    assert "web" not in client(server).get("/templates").text


def test_a_sandbox_forwards_a_bounded_number_of_ports(server: ApiServer) -> None:
    """Each forwarded port is a listening socket on the host: a tenant asking for every
    port of its sandboxes would use up the host's descriptors for every tenant."""
    api = client(server)
    sandbox_id = api.post("/sandboxes", json={}).json()["id"]
    try:
        opened = {}
        for guest_port in range(1000, 1000 + config.MAX_FORWARDED_PORTS):
            answer = api.post(f"/sandboxes/{sandbox_id}/ports", json={"guest_port": guest_port})
            assert answer.status_code == 200, answer.text
            opened[guest_port] = answer.json()["host_port"]
        refused = api.post(f"/sandboxes/{sandbox_id}/ports", json={"guest_port": 2000})
        assert refused.status_code == 400
        assert f"{config.MAX_FORWARDED_PORTS} ports forwarded" in refused.json()["detail"]
        again = api.post(f"/sandboxes/{sandbox_id}/ports", json={"guest_port": 1000})
        assert again.json()["host_port"] == opened[1000]  # one forwarded already is kept
        assert (
            len(api.get(f"/sandboxes/{sandbox_id}").json()["ports"]) == config.MAX_FORWARDED_PORTS
        )
    finally:
        api.delete(f"/sandboxes/{sandbox_id}")


def test_requests_by_host_name_leave_the_owner_ports_of_its_own() -> None:
    """Anyone who knows a sandbox's id may ask for any of its ports by host name: they
    open at most 48 of its 64, so its owner can still forward ports of its own."""
    state = Path(tempfile.mkdtemp(prefix="cbx-traffic-"))
    made = make_server(state / "server", {"CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(state)})
    made.env["CRYOBOX_DOMAIN"] = f"localhost:{made.port}"
    made.key = made.tenant("traffic")
    made.start()
    try:
        api = client(made)
        sandbox_id = api.post("/sandboxes", json={}).json()["id"]
        anonymous = httpx.Client(base_url=made.url, timeout=60)
        for guest_port in range(2000, 2060):
            host = f"{guest_port}-{sandbox_id}.localhost:{made.port}"
            assert anonymous.get("/", headers={"Host": host}).status_code == 502  # (no server)
        record = json.loads((state / "sandboxes" / sandbox_id / "state.json").read_text())
        assert len(record["ports"]) == config.MAX_FORWARDED_PORTS - 16  # forwarded, unpublished
        for guest_port in range(3000, 3016):
            answer = api.post(f"/sandboxes/{sandbox_id}/ports", json={"guest_port": guest_port})
            assert answer.status_code == 200, answer.text
        refused = api.post(f"/sandboxes/{sandbox_id}/ports", json={"guest_port": 4000})
        assert refused.status_code == 400
        api.delete(f"/sandboxes/{sandbox_id}")
    finally:
        made.stop()
        remove_state(state)


def test_a_template_gone_meanwhile_is_named_as_its_tenant_named_it_and_no_other(
    server: ApiServer,
) -> None:
    """A create of a template that a delete at the same time removed from the host (its
    row and its entry, the tenant's ownership not yet) was told "does not exist (known:
    ...)" with every template of the host: every tenant's id and template names."""
    maker, neighbour = server.key, server.tenant("template-neighbour")
    Sandbox.build_template("payroll-etl", [], api_url=server.url, api_key=neighbour)
    Sandbox.build_template("mine", [], api_url=server.url, api_key=maker)
    templates = Path(server.env["CRYOBOX_STATE_DIR"]) / "templates"
    (entry,) = templates.glob("tn-*.mine.json")
    db = open_database(server.database, server.database_url)
    try:
        db.execute("DELETE FROM templates WHERE name = ?", (entry.name.removesuffix(".json"),))
    finally:
        db.close()
    entry.unlink()
    answer = client(server).post("/sandboxes", json={"template": "mine"})
    assert answer.status_code == 404, answer.text
    detail = answer.json()["detail"]
    assert detail == "template 'mine' does not exist"
    Sandbox.delete_template("mine", api_url=server.url, api_key=maker)
    Sandbox.delete_template("payroll-etl", api_url=server.url, api_key=neighbour)


def test_a_volume_deleted_and_made_again_at_once_is_always_the_tenants(
    server: ApiServer,
) -> None:
    """A delete of a name and a create of it at the same time: the delete disowned the
    name after the create had made the volume, which then belonged to nobody (not
    listed, not deletable, outside the quota, its name taken for good)."""
    api = client(server)
    volumes = Path(server.env["CRYOBOX_STATE_DIR"]) / "volumes"
    body = {"name": "raced", "size_gib": 1}
    assert api.post("/volumes", json=body).status_code == 201
    with ThreadPoolExecutor(2) as pool:
        for _ in range(15):
            deleted = pool.submit(api.delete, "/volumes/raced")
            made = pool.submit(api.post, "/volumes", json=body)
            deleted.result(), made.result()
            here = [p.name for p in volumes.iterdir() if p.name.endswith(".raced")]
            listed = [v["name"] for v in api.get("/volumes").json()]
            assert ("raced" in listed) == bool(here), (listed, here)
            if not here:
                assert (
                    api.post("/volumes", json={"name": "raced", "size_gib": 1}).status_code == 201
                )
    assert api.delete("/volumes/raced").status_code == 204


def test_oversized_bodies_are_refused_before_any_key_is_checked(server: ApiServer) -> None:
    anonymous = httpx.Client(base_url=server.url, timeout=60)
    huge = b"x" * (2 * 1024 * 1024)
    for path in ("/sandboxes", "/e2b/sandboxes"):
        answer = anonymous.post(path, content=huge, headers={"content-type": "application/json"})
        assert answer.status_code == 413 and "larger than" in answer.json()["message"]
    assert client(server).post("/sandboxes", json={"cpus": 0}).status_code == 422  # small: read


def test_e2b_file_uploads_refuse_bad_gzip_and_name_the_problem(server: ApiServer) -> None:
    http = httpx.Client(base_url=server.url, headers={"X-API-KEY": server.key}, timeout=60)
    made = http.post("/e2b/sandboxes", json={"templateID": "base"})
    assert made.status_code == 201, made.text
    sandbox = made.json()
    envd = {
        "E2b-Sandbox-Id": sandbox["sandboxID"],
        "X-Access-Token": sandbox["envdAccessToken"],
    }
    try:
        bad = http.post(
            "/e2b/files",
            params={"path": "/tmp/cbx-gzip-test", "username": "root"},  # no "user" on a host
            content=b"not gzip at all",
            headers={
                **envd,
                "content-type": "application/octet-stream",
                "content-encoding": "gzip",
            },
        )
        assert bad.status_code == 400 and "gzip" in bad.json()["message"]
        stranger = http.get("/e2b/health", headers={**envd, "X-Access-Token": "wrong"})
        assert stranger.status_code == 502 and "was not found" in stranger.json()["message"]
        assert http.get("/e2b/health", headers=envd).status_code == 204
    finally:
        assert http.delete(f"/e2b/sandboxes/{sandbox['sandboxID']}").status_code == 204


def test_a_killed_sandbox_is_listed_a_while_through_the_server_then_forgotten() -> None:
    state = Path(tempfile.mkdtemp(prefix="cbx-srv-"))
    env = {"CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(state), "CRYOBOX_FINISHED_KEEP": "3"}
    made = make_server(state / "server", env)
    made.key = made.tenant("keeper")
    made.start()
    try:
        sbx = sdk(made)
        sbx.kill()
        remote: dict[str, Any] = {"api_url": made.url, "api_key": made.key}
        listed = {i.id: i.state for i in Sandbox.list(all=True, **remote)}
        assert listed == {sbx.id: "killed"} and Sandbox.list(**remote) == []
        assert Sandbox.connect(sbx.id, resume=False, **remote).info().state == "killed"
        deadline = time.monotonic() + 30
        while Sandbox.list(all=True, **remote) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert Sandbox.list(all=True, **remote) == []  # forgotten once the while passed
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(sbx.id, resume=False, **remote)
        assert not (state / "sandboxes" / sbx.id).exists()
    finally:
        made.stop()
        kill_vms(state)
        subprocess.run(["rm", "-rf", str(state)], check=False)


def test_the_console_page_and_what_it_uses_keep_their_doors_shut(server: ApiServer) -> None:
    """The console's page, the tenant's event stream, usage per day and the terminal's
    WebSocket: the page is public, everything it uses needs the tenant's key."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    anonymous = httpx.Client(base_url=server.url)
    page = anonymous.get("/")
    assert page.status_code == 200 and "<title>cryobox</title>" in page.text
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert "textContent" in anonymous.get("/console/app.js").text
    for path in ("/events", "/usage/days"):
        assert anonymous.get(path).status_code == 401, path
    http = client(server)
    sbx = sdk(server)
    try:
        # Every sandbox's changes on one stream, each naming its sandbox.
        seen: list[dict[str, Any]] = []
        subscribed = threading.Event()

        def follow() -> None:
            with http.stream("GET", "/events", timeout=30) as stream:
                for line in stream.iter_lines():
                    if line == ": subscribed":
                        subscribed.set()
                    if line.startswith("data: "):
                        seen.append(json.loads(line[6:]))
                        return

        reader = threading.Thread(target=follow)
        reader.start()
        assert subscribed.wait(30)
        sbx.pause()
        reader.join(30)
        assert seen and seen[0]["sandbox_id"] == sbx.id and seen[0]["type"] == "paused"
        Sandbox.resume(sbx.id, api_url=server.url, api_key=server.key)
        time.sleep(0.6)  # a few of the server's ticks, metered
        days = http.get("/usage/days", params={"days": 7}).json()
        assert set(days["prices"]) == {"vcpu_hour", "gib_hour", "gb_month"}
        today = days["days"][-1]
        now = time.time()  # at midnight UTC the ticks may have gone to the day before
        assert today["day"] in {time.strftime("%Y-%m-%d", time.gmtime(t)) for t in (now, now - 60)}
        assert today["vcpu_seconds"] > 0 and today["cost_usd"]["total"] > 0
        assert http.get("/usage/days", params={"days": 0}).status_code == 422

        # The terminal: the key in the first message, or the door stays shut.
        url = f"ws://127.0.0.1:{server.port}/sandboxes/{sbx.id}/terminal"
        for hello, code in (("not json", 4400), ({"key": "cbx_wrong"}, 4401)):
            with connect(url) as socket:
                socket.send(hello if isinstance(hello, str) else json.dumps(hello))
                with pytest.raises(ConnectionClosed) as closed:
                    socket.recv(10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == code
        other = server.tenant(f"other-{time.time_ns()}")
        with connect(url) as socket:
            socket.send(json.dumps({"key": other}))
            with pytest.raises(ConnectionClosed) as closed:
                socket.recv(10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
        with connect(url) as socket:
            socket.send(json.dumps({"key": server.key, "cols": 100, "rows": 30}))
            socket.send(json.dumps({"input": "stty size; echo hi-$((2+3)); exit 3\n"}))
            output = b""
            while True:
                frame = socket.recv(30)
                if isinstance(frame, str):
                    assert json.loads(frame) == {"exit": 3}
                    break
                output += frame
            assert b"30 100" in output and b"hi-5" in output
    finally:
        sbx.kill()
