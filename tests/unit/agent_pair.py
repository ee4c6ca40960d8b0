"""The real guest agent served on the host over a socketpair, for the unit tests: the
Python agent in this process, or the compiled front (``cryobox-agent``, built from
guest/front.c as the image build does) with the Python agent behind it."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from cryobox.guest import agent as guest_agent
from cryobox.image import build

#: Stream buffer of the host end: room for a whole frame of the largest payload.
STREAM_LIMIT = 2 << 20
#: The Python agent behind the front, without the guest's system setup (this is a host).
HELPER = (sys.executable, "-c", "from cryobox.guest.agent import serve; serve(3)")


async def serve_agent() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Start an agent on this loop; return the host's end of its channel as streams."""
    ours, theirs = socket.socketpair()
    agent = guest_agent.Agent()
    agent.channel = guest_agent.Channel(
        os.dup(theirs.fileno()), asyncio.get_running_loop(), agent.on_frame
    )
    theirs.close()
    return await asyncio.open_unix_connection(sock=ours, limit=STREAM_LIMIT)


#: Where both agents look for a template's command defaults in these tests (the guest's
#: /etc/cryobox/defaults.json): absent unless a test writes it.
COMMAND_DEFAULTS = Path(tempfile.mkdtemp(prefix="cryobox-defaults-test-")) / "defaults.json"
os.environ["CRYOBOX_COMMAND_DEFAULTS"] = str(COMMAND_DEFAULTS)
atexit.register(shutil.rmtree, COMMAND_DEFAULTS.parent, ignore_errors=True)


@functools.cache
def front_binary() -> Path:
    """The front, compiled once per test session."""
    folder = Path(tempfile.mkdtemp(prefix="cryobox-front-test-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    binary = folder / "cryobox-agent"
    build.compile_front(binary)
    return binary


@dataclass
class Front:
    """A running front: its process, and the host's end of its port."""

    process: subprocess.Popen[bytes]
    sock: socket.socket

    def helper_pid(self) -> int:
        """The pid of the Python agent the front started."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return int(children.read_text().split()[0])

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)
        self.sock.close()


def start_front(helper: tuple[str, ...] = HELPER) -> Front:
    """Start the front with a socket pair as its port; it opens it once the Python agent
    behind it (``helper``) said hello."""
    ours, theirs = socket.socketpair()
    src = str(Path(guest_agent.__file__).parents[2])
    env = {**os.environ, "CRYOBOX_AGENT_PORT_FD": str(theirs.fileno()), "PYTHONPATH": src}
    process = subprocess.Popen([str(front_binary()), *helper], env=env, pass_fds=[theirs.fileno()])
    theirs.close()
    return Front(process, ours)


@contextlib.asynccontextmanager
async def served_front(
    helper: tuple[str, ...] = HELPER,
) -> AsyncIterator[tuple[Front, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A front for one test, as streams on this loop; killed (its Python agent with it)
    at the end."""
    front = start_front(helper)
    try:
        reader, writer = await asyncio.open_unix_connection(
            sock=front.sock.dup(), limit=STREAM_LIMIT
        )
        try:
            yield front, reader, writer
        finally:
            writer.close()
    finally:
        front.stop()
