"""The supervisor's host ports: bound at port 0 where none is kept (no other process can
take one between its choice and the bind), and one host port reaches one guest port."""

from __future__ import annotations

import asyncio
import errno
import os
import socket

import pytest

from cryobox.network.forward import PortForwarder


def test_ports_are_chosen_as_bound_and_a_taken_one_is_refused() -> None:
    async def scenario() -> None:
        forwarder = PortForwarder(os.getpid())  # this process's namespace: binding only
        try:
            first = await forwarder.forward(0, 8000)
            second = await forwarder.forward(0, 9000)
            assert 0 not in (first, second) and first != second
            with socket.create_connection(("127.0.0.1", first), timeout=5):
                pass  # listening
            assert await forwarder.forward(first, 8000) == first  # asked again: the same
            with pytest.raises(OSError) as other_guest_port:
                await forwarder.forward(first, 9000)
            assert other_guest_port.value.errno == errno.EADDRINUSE
            with socket.socket() as squatter:
                squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                squatter.bind(("127.0.0.1", 0))
                squatter.listen()
                with pytest.raises(OSError) as taken:
                    await forwarder.forward(squatter.getsockname()[1], 7000)
                assert taken.value.errno == errno.EADDRINUSE
        finally:
            await forwarder.close()

    asyncio.run(scenario())


def test_a_connection_in_flight_keeps_its_namespace_when_the_forwarder_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() (a pause, say) while a connection is being made inside: the connecting
    thread still holds a namespace fd of its own, and gives it back when done."""
    import threading

    from cryobox.network import forward

    entered, go = threading.Event(), threading.Event()
    seen: list[str] = []

    def slow_connect(namespace: int, port: int) -> socket.socket:
        entered.set()
        go.wait(10)
        seen.append(os.readlink(f"/proc/self/fd/{namespace}"))  # raises if it was closed
        left, right = socket.socketpair()
        right.close()
        return left

    monkeypatch.setattr(forward, "connect_inside", slow_connect)

    async def scenario() -> None:
        forwarder = PortForwarder(os.getpid())
        port = await forwarder.forward(0, 8000)
        fds = len(os.listdir("/proc/self/fd"))
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        await asyncio.to_thread(entered.wait, 10)
        await forwarder.close()
        go.set()
        for _ in range(100):  # the thread ends on its own, its fd closed
            if not any(t.name == "netns-connect" for t in threading.enumerate()):
                break
            await asyncio.sleep(0.02)
        client.close()
        assert seen and seen[0].startswith("net:[")
        assert len(os.listdir("/proc/self/fd")) <= fds

    asyncio.run(scenario())
