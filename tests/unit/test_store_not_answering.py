"""A store that takes connections and never answers (a network fault between the host
and S3): housekeeping in it is tried briefly, and never on the server's event loop,
so every other request is served meanwhile, and the server's monitor goes on. A real
``cryobox server`` over the fake VMM."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from api_server import ApiServer, fake_server
from cryobox import Sandbox
from silent_store import SilentStore
from waiting import until


@pytest.fixture(scope="module")
def silent() -> Iterator[tuple[ApiServer, SilentStore]]:
    """A server whose store never answers, and that store."""
    store = SilentStore()
    # (the store goes first at the end: what the server still asks it then fails at once)
    with fake_server("cbx-silent-", "silent", store.settings()) as server, store:
        yield server, store


def test_the_server_answers_others_while_a_resume_waits_on_the_store(
    silent: tuple[ApiServer, SilentStore],
) -> None:
    """A resume forgets the sandbox's stored pause once its VM runs again. While that
    waits on the store, the server answers other requests (it used to wait on the event
    loop: every request of every tenant stopped for up to 5 minutes)."""
    server, store = silent
    with ThreadPoolExecutor(1) as background:
        sbx = Sandbox.create(api_url=server.url, api_key=server.key)
        sbx.pause()
        resuming = background.submit(Sandbox.resume, sbx.id, api_url=server.url, api_key=server.key)

        def forgetting(lines: list[str]) -> list[str]:
            return [r for r in lines if r.startswith("DELETE") and sbx.id in r]

        until(lambda: forgetting(store.waiting()), "the resume's request to the store", 120)
        answer = httpx.get(f"{server.url}/health", timeout=60)
        assert answer.status_code == 200
        given_up_then = len(forgetting(store.given_up()))
        resumed = resuming.result(timeout=120)
        assert resumed.commands.run("echo on").stdout == "on\n"
        # Answered while the resume still waited on the store (it gave up more of its
        # tries after): the event loop was free.
        until(lambda: len(forgetting(store.given_up())) > given_up_then, "a try given up after")
        resumed.kill()


def test_an_idle_sandbox_is_paused_while_the_store_does_not_answer(
    silent: tuple[ApiServer, SilentStore],
) -> None:
    """The monitor measures each tenant's saved state in the store every minute (and as
    it starts), and pauses idle sandboxes: the measure is tried briefly, and the last
    one known is counted while the store does not answer. (It used to wait 5 minutes a
    tenant, and no idle sandbox was paused meanwhile.)"""
    server, store = silent
    sbx = Sandbox.create(api_url=server.url, api_key=server.key, idle_timeout=1)
    until(lambda: sbx.info().state == "paused", "the idle sandbox paused", 90, every=0.5)
    assert any("/keys/" in line for line in store.given_up())  # (it asked the store)
    sbx.kill()


def test_the_monitor_goes_on_while_a_collection_waits_on_the_store() -> None:
    """The server's collection (retention, then the chunks nothing names) waits on the
    store with the S3 client's patience: a minute per read, five tries. It runs beside
    the monitor's tick, which went on (idle pauses, metering) only after it."""
    store = SilentStore()
    with (
        fake_server(
            "cbx-collect-", "collect", store.settings(), ["--collect-interval", "1"]
        ) as server,
        store,
    ):
        # A request older than the brief client's two 5 s reads: the collection's.
        until(lambda: store.longest_wait() > 15, "the collection waiting on the store", 60)
        sbx = Sandbox.create(api_url=server.url, api_key=server.key, idle_timeout=1)
        until(lambda: sbx.info().state == "paused", "the idle sandbox paused", 60, every=0.5)
        sbx.kill()
