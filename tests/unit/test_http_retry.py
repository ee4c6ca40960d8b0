"""The SDK's HTTP transport sends a request again only when the server said it did
nothing and asked for a retry (503 with ``Retry-After``: the request raced a move of
its sandbox between hosts), for a bounded time; every other failure is raised at once.
One layer, against a fake server (the fleet's VM tests reach the real race)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from cryobox.client import http_transport
from cryobox.client.http_transport import HttpTransport
from cryobox.errors import HostUnavailable, error_detail

RACED = HostUnavailable(
    "sbx-1", "this request reached a host that does not run it; retry it", retry_after=1.0
)


def answering(*answers: httpx.Response) -> tuple[HttpTransport, list[httpx.Request]]:
    """A transport whose server gives ``answers`` in turn (the last one from then on)."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1]

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return HttpTransport("http://cryobox.test", "cbx_key", client=client), seen


def refused(retry_after: str | None) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    body = {"detail": str(RACED), "error": error_detail(RACED)}
    return httpx.Response(503, json=body, headers=headers)


def test_a_request_that_raced_a_move_is_sent_again_and_succeeds() -> None:
    transport, seen = answering(refused("1"), httpx.Response(204))
    asyncio.run(transport.kill("sbx-1"))
    assert [r.method for r in seen] == ["DELETE", "DELETE"]


def test_a_retry_that_keeps_failing_ends_in_the_servers_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http_transport, "RETRY_FOR", 2.5)
    transport, seen = answering(refused("1"))
    with pytest.raises(HostUnavailable, match="does not run it; retry it") as raised:
        asyncio.run(transport.kill("sbx-1"))
    assert raised.value.retry_after == 1.0 and raised.value.sandbox_id == "sbx-1"
    assert len(seen) == 3  # at 0, 1 and 2 s; a fourth would be past the 2.5 s


@pytest.mark.parametrize("retry_after", [None, "soon"])
def test_a_503_that_asks_for_no_retry_is_raised_at_once(retry_after: str | None) -> None:
    transport, seen = answering(refused(retry_after), httpx.Response(204))
    with pytest.raises(HostUnavailable):
        asyncio.run(transport.kill("sbx-1"))
    assert len(seen) == 1
