"""An E2B process stream whose sandbox went away is cut mid-response, as E2B's edge cuts
it (cryobox.e2b.envd: EnvdRpc, StreamCut), and nothing else is: not a unary call, not a
stream whose frames merely say the same words. The SDKs' side of it, on real VMs:
tests/compat/test_e2b_sdk.py and test_e2b_js.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("e2b")
from e2b.envd.process import process_pb as pr
from e2b.envd.process.process_connect import ProcessASGIApplication

from cryobox.e2b import envd

WORDS = 'grep "ended before the stream completed" app.log'


def _rpc(process: envd.Process) -> envd.EnvdRpc:
    stub = SimpleNamespace(processes={("sbx1", 42): process})

    async def rpc_caller(ctx: Any) -> Any:
        return SimpleNamespace(sandbox_id="sbx1")

    async def alive(caller: Any) -> None:
        return None

    stub.rpc_caller = rpc_caller
    service = envd.ProcessService(stub)  # type: ignore[arg-type]
    service._alive = alive  # type: ignore[method-assign]
    rpc = envd.EnvdRpc.__new__(envd.EnvdRpc)
    rpc.process = ProcessASGIApplication(service)  # type: ignore[arg-type]
    return rpc


async def _call(rpc: envd.EnvdRpc, method: str, body: bytes, sent: list[dict[str, Any]]) -> None:
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # (the client stays)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = f"/e2b/process.Process/{method}"
    stream = method in ("Start", "Connect")
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "headers": [
            (b"content-type", b"application/connect+proto" if stream else b"application/proto")
        ],
        "query_string": b"",
        "scheme": "http",
        "client": ("127.0.0.1", 1),
    }
    await rpc(scope, receive, send)


def _envelope(message: Any) -> bytes:
    data = bytes(message.to_binary())
    return b"\x00" + len(data).to_bytes(4, "big") + data


def test_a_stream_whose_sandbox_went_away_is_cut_and_nothing_else_is() -> None:
    async def scenario() -> None:
        config = pr.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", WORDS])
        process = envd.Process("sbx1", config, None, pid=42)
        rpc = _rpc(process)

        sent: list[dict[str, Any]] = []
        await _call(
            rpc, "List", bytes(pr.ListRequest().to_binary()), sent
        )  # the words, in a unary answer
        assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
        assert WORDS.encode() in b"".join(m.get("body", b"") for m in sent)

        selector = pr.ProcessSelector(selector=envd.one("pid", 42))
        sent = []
        process.on_output("stdout", WORDS.encode())  # (no subscriber yet: dropped)
        call = asyncio.ensure_future(
            _call(rpc, "Connect", _envelope(pr.ConnectRequest(process=selector)), sent)
        )
        await asyncio.sleep(0.2)
        process.on_output("stdout", WORDS.encode())  # the same words, in the stream
        process.finish(None)  # killed with its sandbox: no exit status
        with pytest.raises(envd.StreamCut):
            await asyncio.wait_for(call, 10)
        bodies = [m for m in sent if m["type"] == "http.response.body"]
        assert bodies and all(m.get("more_body") for m in bodies)  # no last frame sent

        ended = envd.Process("sbx1", config, None, pid=42)
        rpc = _rpc(ended)
        sent = []
        call = asyncio.ensure_future(
            _call(rpc, "Connect", _envelope(pr.ConnectRequest(process=selector)), sent)
        )
        await asyncio.sleep(0.2)
        ended.finish(SimpleNamespace(exit_code=0, error=None, signal=None))  # type: ignore[arg-type]
        await asyncio.wait_for(call, 10)  # a stream that ends well ends whole
        assert not sent[-1].get("more_body")

    asyncio.run(scenario())


def test_an_answer_cut_short_by_another_host_is_cut_short_here_too() -> None:
    """A fleet host relaying another host's answer (server/relay.py) that the other
    host cut short (as above) cuts its own short: never ends it as if it were whole."""
    import httpx

    from cryobox.server.relay import stream_answer
    from cryobox.server.response_cut import ResponseCut

    class CutShort(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            yield b"first frame"
            raise httpx.RemoteProtocolError("incomplete chunked read")

    async def scenario() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def send(message: Any) -> None:
            sent.append(message)

        async def next_message() -> Any:
            await asyncio.sleep(3600)

        response = httpx.Response(200, stream=CutShort())
        with pytest.raises(ResponseCut):
            await stream_answer(response, send, next_message, asyncio.Event(), "host-b")
        return sent

    sent = asyncio.run(scenario())
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[-1]["body"] == b"first frame" and sent[-1]["more_body"]
