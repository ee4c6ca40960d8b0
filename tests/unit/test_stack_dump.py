"""``kill -USR1`` and ``kill -USR2`` make a running server, and the zygote and the
supervisors it forks, write where they are to their logs, and they go on serving: a
real ``cryobox server`` over the fake VMM."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from api_server import ZYGOTE, ApiServer, fake_server, processes_under
from waiting import until


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with fake_server("cbx-stk-", "stacks") as made:
        yield made


def test_signals_write_the_stacks_and_everything_serves_on(server: ApiServer) -> None:
    http = httpx.Client(base_url=server.url, headers={"X-API-Key": server.key}, timeout=60)
    first = http.post("/sandboxes", json={}).json()["id"]
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGUSR1)
    # Each thread's, the main thread's (uvicorn's loop, started by run.py) among them.
    until(lambda: "cryobox/server/run.py" in server.log.read_text(), "the threads' stacks")
    assert "most recent call first" in server.log.read_text()
    os.kill(server.process.pid, signal.SIGUSR2)
    until(lambda: "in _monitor" in server.log.read_text(), "the tasks' stacks")

    state = Path(server.env["CRYOBOX_STATE_DIR"])
    forked = processes_under(state, ZYGOTE)  # the zygote and the supervisor it forked
    assert len(forked) >= 2
    spare_log = state / "supervisor-spare.log"
    for pid in forked:
        os.kill(pid, signal.SIGUSR1)
    until(lambda: spare_log.read_text().count("in _become_supervisor") >= 1, "their stacks")
    until(lambda: spare_log.read_text().count("in serve\n") >= 1, "the zygote's stack")

    # Nothing ended: the server answers, the first sandbox runs, a new one starts.
    assert http.get(f"/sandboxes/{first}").json()["state"] == "running"
    second = http.post("/sandboxes", json={})
    assert second.status_code == 201, second.text
    assert set(processes_under(state, ZYGOTE)) >= set(forked)
