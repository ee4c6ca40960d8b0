"""The HTTP API and the SDK's HTTP transport in one process: the app called through
``httpx.ASGITransport`` (no socket, no server process), over the fake VMM.

What crosses the API is checked here in seconds: records, command output, file bytes,
and errors that keep their type. The same calls over a real server process and real VMs
are in ``tests/integration/test_server_vm.py`` and the ladder.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import kill_vms
from cryobox.client import AsyncSandbox
from cryobox.client.http_transport import HttpTransport
from cryobox.e2b.extension import extension as e2b
from cryobox.errors import GuestFileNotFound, InvalidArgument, SandboxNotFound
from cryobox.models import CommandRequest, CreateRequest
from cryobox.sandbox.registry import SandboxDir
from cryobox.server.app import create_app
from cryobox.server.database import SqliteDatabase
from cryobox.server.hub import Hub
from cryobox.service import open_service
from cryobox.vmm.fake import FakeVmm
from cryobox.wire import SandboxUsage, UsageReport


@pytest.fixture
async def wired(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[Hub, httpx.AsyncClient, str]]:
    """The hub, an httpx client wired to its app in this process, one tenant's key."""
    state = Path(tempfile.mkdtemp(prefix="cbx-api-"))  # short: unix socket paths
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(state))
    monkeypatch.setenv("CRYOBOX_VMM", "fake")  # the supervisors this service starts
    hub = Hub(open_service(vmm=FakeVmm()), SqliteDatabase(state / "server.db"))
    _, key = hub.tenants.create("acme")
    await hub.start()  # what the app's lifespan does first (ASGITransport runs no lifespan)
    asgi = httpx.ASGITransport(app=create_app(hub, extensions=[e2b()]))
    client = httpx.AsyncClient(transport=asgi, base_url="http://cryobox.test")
    try:
        yield hub, client, key
    finally:
        await client.aclose()
        await hub.close()
        kill_vms(state)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def app(wired: tuple[Hub, httpx.AsyncClient, str]) -> tuple[httpx.AsyncClient, str]:
    """An httpx client wired to the app in this process, and one tenant's key."""
    return wired[1], wired[2]


@pytest.fixture
async def api(app: tuple[httpx.AsyncClient, str]) -> AsyncIterator[HttpTransport]:
    """The SDK's HTTP transport over that client."""
    client, key = app
    transport = HttpTransport("http://cryobox.test", key, client=client)
    try:
        yield transport
    finally:
        for info in await transport.list(all=True):
            with contextlib.suppress(Exception):
                await transport.kill(info.id)


async def test_a_sandbox_round_trip_through_the_api_in_process(
    api: HttpTransport, tmp_path: Path
) -> None:
    info = await api.create(CreateRequest(template="base", metadata={"run": "in-process"}))
    assert info.state == "running" and info.metadata == {"run": "in-process"}
    assert [s.id for s in await api.list()] == [info.id]
    sbx = AsyncSandbox(info, api)
    done = await sbx.commands.run("echo hello; echo oops >&2; exit 3")
    assert (done.exit_code, done.stdout, done.stderr) == (3, "hello\n", "oops\n")
    # The fake VMM's guest is this host: a folder of the test's own, not the host's /tmp
    # (whose hundreds of entries made an answer too long for one frame: found in CI).
    await sbx.files.write(f"{tmp_path}/blob", b"\x00\xffbytes")
    assert await sbx.files.read(f"{tmp_path}/blob") == b"\x00\xffbytes"
    assert "blob" in [entry.name for entry in await sbx.files.list(str(tmp_path))]
    node = {n.id: n for n in await api.lineage()}[info.id]  # typed records, both ends
    assert (node.kind, node.state, node.parent) == ("sandbox", "running", None)
    report = await api.usage()
    assert isinstance(report, UsageReport) and [s.id for s in report.sandboxes] == [info.id]
    assert report.cost_usd.total == report.cost_usd.compute + report.cost_usd.storage
    line = await api.usage(info.id)
    assert isinstance(line, SandboxUsage) and line.id == info.id and line.tenant_id
    await sbx.kill()
    assert (await api.get(info.id)).state == "killed"


async def test_errors_keep_their_type_through_the_api_in_process(api: HttpTransport) -> None:
    with pytest.raises(SandboxNotFound):
        await api.get("sbx-000000000000")
    with pytest.raises(InvalidArgument, match="cpus"):
        await api.create(CreateRequest(template="base", cpus=0))
    info = await api.create(CreateRequest(template="base"))
    with pytest.raises(GuestFileNotFound):
        await AsyncSandbox(info, api).files.read("/no/such/file")
    with pytest.raises(InvalidArgument):
        await api.start_command(info.id, CommandRequest(), lambda _stream, _data: None)


def test_a_create_request_goes_on_the_wire_as_plain_json() -> None:
    import json
    from types import MappingProxyType

    request = CreateRequest(
        ports=(8000,), network=["1.2.3.4"], envs=MappingProxyType({"A": "1"}), cpus=2
    )
    body = request.to_wire()
    assert json.loads(json.dumps(body)) == {
        "template": "default",  # always: a server's defaults may differ
        "timeout": 300.0,
        "ports": [8000],
        "network": ["1.2.3.4"],
        "envs": {"A": "1"},
        "cpus": 2,
    }


async def test_the_shared_wire_bodies_bound_and_close_each_field(
    app: tuple[httpx.AsyncClient, str],
) -> None:
    """The bodies the SDK sends (cryobox.wire) are the ones the server validates: a bad
    value or an unknown field is a 422 naming it, before any work starts."""
    client, key = app
    auth = {"Authorization": f"Bearer {key}"}
    cases = [
        ("/templates", {"name": "no spaces"}, "name"),
        ("/templates", {"name": "web", "cpus": 0}, "cpus"),
        ("/sandboxes/sbx-0/commands", {"cmd": "true", "bogus": 1}, "bogus"),
        ("/sandboxes/sbx-0/commands", {"cmd": []}, "cmd"),
        ("/sandboxes/sbx-0/forks", {"count": 101}, "count"),
        ("/sandboxes/sbx-0/timeout", {"seconds": 0}, "seconds"),
        ("/sandboxes/sbx-0/ports", {"guest_port": 70000}, "guest_port"),
    ]
    for path, body, field in cases:
        answer = await client.post(path, json=body, headers=auth)
        assert answer.status_code == 422, (path, body, answer.text)
        assert any(field in item["loc"] for item in answer.json()["detail"]), answer.json()


async def test_a_quota_check_reads_no_record_of_a_sandbox_that_ended(
    wired: tuple[Hub, httpx.AsyncClient, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sandbox's row stays for its metering. A quota check (one at a time for all
    tenants) once read the record of each, ended ones too: a tenant making and killing
    sandboxes in a loop slowed every tenant's creates."""
    hub, client, key = wired
    transport = HttpTransport("http://cryobox.test", key, client=client)
    ended = [await transport.create(CreateRequest(template="base")) for _ in range(3)]
    for info in ended:
        await transport.kill(info.id)
    live = await transport.create(CreateRequest(template="base"))
    try:
        tenant = hub.tenants.authenticate(key)
        assert tenant is not None
        read: list[str] = []
        record = SandboxDir.record

        def counted(folder: SandboxDir) -> Any:
            read.append(folder.id)
            return record(folder)

        monkeypatch.setattr(SandboxDir, "record", counted)
        with hub.db.transaction() as conn:
            use = hub._in_use(tenant, conn)
        assert use.sandboxes == 1, use
        assert read == [live.id]  # (before: the three ended ones were read too)
    finally:
        await transport.kill(live.id)
