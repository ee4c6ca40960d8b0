"""A store that takes connections and never answers (a network fault between the host
and S3): housekeeping in it is tried briefly, and never on the server's event loop,
so every other request is served meanwhile. A real ``cryobox server`` over the fake
VMM."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from api_server import fake_server
from cryobox import Sandbox
from silent_store import SilentStore
from waiting import until


def test_the_server_answers_others_while_a_resume_waits_on_the_store() -> None:
    """A resume forgets the sandbox's stored pause once its VM runs again. While that
    waits on the store, the server answers other requests (it used to wait on the event
    loop: every request of every tenant stopped for up to 5 minutes)."""
    with (
        SilentStore() as store,
        fake_server("cbx-silent-", "silent", store.settings()) as server,
        ThreadPoolExecutor(1) as background,
    ):
        sbx = Sandbox.create(api_url=server.url, api_key=server.key)
        sbx.pause()
        resuming = background.submit(Sandbox.resume, sbx.id, api_url=server.url, api_key=server.key)

        def forgetting() -> list[str]:
            return [r for r in store.waiting() if r.startswith("DELETE") and sbx.id in r]

        until(forgetting, "the resume's request to forget the stored pause", 120)
        answer = httpx.get(f"{server.url}/health", timeout=60)
        assert answer.status_code == 200
        # Answered while the resume still waited on the store: the event loop was free.
        assert forgetting()
        resumed = resuming.result(timeout=120)
        assert resumed.commands.run("echo on").stdout == "on\n"
        assert not forgetting()  # (given up on: the sandbox runs on)
        resumed.kill()
