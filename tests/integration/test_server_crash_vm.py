"""A server killed with -9 at any step of a create, a fork or a resume leaves no sandbox
that no tenant owns (issue 31): the spec records its tenant before its VM starts, and
the server gives it to that tenant when it starts again (real VMs and a real server)."""

from __future__ import annotations

import base64
import contextlib
import json
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import ApiServer, make_server, remove_state
from cryobox.sandbox import registry

pytestmark = pytest.mark.vm


@pytest.fixture
def server() -> Iterator[ApiServer]:
    folder = Path(tempfile.mkdtemp(prefix="cbx-crash-"))  # short: socket paths
    made = make_server(folder / "server")
    made.key = made.tenant("crashy", "--max-sandboxes", "3")
    yield made
    if made.process is not None and made.process.poll() is None:
        with httpx.Client(base_url=made.url, headers={"X-API-Key": made.key}) as client:
            for info in client.get("/sandboxes").json():
                client.delete(f"/sandboxes/{info['id']}")
    made.stop()
    remove_state(folder)


def _client(server: ApiServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-Key": server.key}, timeout=180)


def _start_crashing_at(server: ApiServer, step: str | None) -> None:
    server.stop()
    server.env.pop("CRYOBOX_TEST_CRASH_AT", None)
    if step:
        server.env["CRYOBOX_TEST_CRASH_AT"] = step
    server.start()


def _crash(server: ApiServer, method: str, path: str, body: dict[str, Any]) -> None:
    """Send the request that kills the server at its crash point; start it again."""
    with _client(server) as client, pytest.raises(httpx.HTTPError):
        client.request(method, path, json=body)
    assert server.process is not None
    assert server.process.wait(60) == -9
    _start_crashing_at(server, None)


def _run(client: httpx.Client, sandbox_id: str, cmd: str) -> str:
    """A command's stdout, from the NDJSON stream of events."""
    answer = client.post(f"/sandboxes/{sandbox_id}/commands", json={"cmd": cmd})
    assert answer.status_code == 200, answer.text
    events = [json.loads(line) for line in answer.text.splitlines()]
    return b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout").decode()


def _tenant_id(server: ApiServer) -> str:
    with sqlite3.connect(server.database) as db:
        return str(db.execute("SELECT id FROM tenants WHERE name = 'crashy'").fetchone()[0])


def _no_orphans(server: ApiServer, client: httpx.Client) -> list[dict[str, Any]]:
    """The tenant's live sandboxes, after checking that every live sandbox made for it on
    this host is among them."""
    listed = client.get("/sandboxes").json()
    mine = {
        spec.id
        for spec, record in registry.list_sandboxes()
        if spec.owner == _tenant_id(server) and not record.state.finished
    }
    assert mine <= {info["id"] for info in listed}, (mine, listed)
    return list(listed)


@pytest.mark.parametrize("step", ["server-started-vm", "server-owned"])
def test_a_create_cut_short_is_given_to_its_tenant(server: ApiServer, step: str) -> None:
    _start_crashing_at(server, step)
    _crash(server, "POST", "/sandboxes", {})
    with _client(server) as client:
        listed = _no_orphans(server, client)
        assert [info["state"] for info in listed] == ["running"]
        sandbox_id = listed[0]["id"]
        assert _run(client, sandbox_id, "echo adopted") == "adopted\n"
        # It holds its place in the quota (3): two more fit, a third does not.
        more = [client.post("/sandboxes", json={}) for _ in range(3)]
        assert [r.status_code for r in more] == [201, 201, 429], [r.text for r in more]
        assert client.delete(f"/sandboxes/{sandbox_id}").status_code == 204


def test_a_fork_cut_short_gives_every_copy_to_its_tenant(server: ApiServer) -> None:
    _start_crashing_at(server, None)
    with _client(server) as client:
        parent = client.post("/sandboxes", json={}).json()["id"]
    _start_crashing_at(server, "server-started-vm")
    _crash(server, "POST", f"/sandboxes/{parent}/forks", {"count": 2})
    with _client(server) as client:
        listed = _no_orphans(server, client)
        copies = [info for info in listed if info["id"] != parent]
        assert len(copies) == 2 and all(c["state"] == "running" for c in copies), listed
        assert all(c["forked_from"] == parent for c in copies)


def test_a_resume_cut_short_leaves_the_sandbox_its_tenants_and_running(
    server: ApiServer,
) -> None:
    _start_crashing_at(server, None)
    with _client(server) as client:
        sandbox_id = client.post("/sandboxes", json={}).json()["id"]
        assert client.post(f"/sandboxes/{sandbox_id}/pause").status_code == 204
    _start_crashing_at(server, "server-resumed")
    _crash(server, "POST", f"/sandboxes/{sandbox_id}/resume", {})
    with _client(server) as client:
        deadline = time.monotonic() + 30
        while (listed := _no_orphans(server, client))[0]["state"] != "running":
            assert time.monotonic() < deadline, listed
            time.sleep(0.5)
        assert _run(client, sandbox_id, "echo back") == "back\n"


def test_a_server_killed_at_random_during_creates_leaves_no_orphan(server: ApiServer) -> None:
    _start_crashing_at(server, None)
    for delay in (0.3, 1.0, 2.0):
        assert server.process is not None
        with _client(server) as client, contextlib.suppress(httpx.TimeoutException):
            client.post("/sandboxes", json={}, timeout=delay)
        server.process.kill()
        server.process.wait()
        _start_crashing_at(server, None)
        time.sleep(3)  # a supervisor that was still starting its VM finishes
        _start_crashing_at(server, None)  # and a restart reconciles it
        with _client(server) as client:
            _no_orphans(server, client)
