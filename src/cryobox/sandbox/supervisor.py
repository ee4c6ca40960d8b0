"""The supervisor: one process per sandbox that owns its QEMU for the sandbox's life.

Why a process of its own: QEMU's monitor and the guest agent's port each accept one
connection, yet several clients (an SDK program, ``cryobox exec`` in another shell)
use a sandbox at once, and someone must enforce its timeout while nobody is
connected. The supervisor holds both connections and serves any number of clients
on ``control.sock`` with the same frame protocol as the agent: guest operations
are forwarded, ``sandbox.*`` operations (status, timeout, ports, pause, checkpoint,
snapshot, rollback, kill) are its own. Snapshot work is in :mod:`.machine`.

It is the only writer of the sandbox's state record. QEMU is started with a parent
death signal, so a supervisor killed with SIGKILL takes its VM with it.

Run as ``python -m cryobox.sandbox.supervisor SANDBOX_DIR [--resume]``, or with no
folder: then it imports everything, waits for a folder on stdin and starts from
there (a spare kept warm by creators, so a restore does not wait for Python).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from cryobox.errors import ChannelError, CryoboxError, GuestError, error_detail
from cryobox.guest import protocol as p
from cryobox.qemu import qemu_version
from cryobox.sandbox.machine import Machine
from cryobox.sandbox.registry import SandboxDir, SandboxRecord
from cryobox.sandbox.state import SandboxState, require

log = logging.getLogger("cryobox.supervisor")


class ClientConnection:
    """One connected client of the control socket."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if not self.writer.is_closing():
            self.writer.write(p.encode(header, payload))


class Supervisor:
    def __init__(self, folder: SandboxDir) -> None:
        self.folder = folder
        self.machine = Machine(folder, self._save)
        self._stop = asyncio.Event()
        self._stop_reason: tuple[SandboxState, str | None] = (SandboxState.KILLED, None)
        self._deadline_changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Lifecycle operations (pause, checkpoint, rollback...) run one at a time.
        self._lifecycle = asyncio.Lock()
        self._exit_paused = False

    @property
    def record(self) -> SandboxRecord:
        return self.machine.record

    def _save(self, record: SandboxRecord) -> None:
        self.folder.write_record(record)

    # -- life

    async def run(self, resume: bool) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, SandboxState.KILLED, f"signal {sig.name}")
        try:
            if resume:
                await self.machine.resume(os.getpid())
            else:
                await self.machine.start(os.getpid())
        except Exception as exc:
            await self._failed_start(exc, resume)
            return 1
        self.folder.control_socket.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(
            self._serve_client, str(self.folder.control_socket)
        )
        self.machine.update(state=SandboxState.RUNNING, error=None, failure=None)
        log.info("running")
        watchers = [
            asyncio.ensure_future(self._watch_qemu()),
            asyncio.ensure_future(self._watch_deadline()),
        ]
        await self._stop.wait()
        for watcher in watchers:
            watcher.cancel()
        server.close()
        self.folder.control_socket.unlink(missing_ok=True)
        if not self._exit_paused:
            state, reason = self._stop_reason
            await self._shutdown(state, reason)
        return 0

    async def _failed_start(self, exc: Exception, resume: bool) -> None:
        """End a start that failed, saying why. A failed resume stays paused: its saved
        state was put back intact and can be resumed again (or killed)."""
        if isinstance(exc, CryoboxError):
            log.error("start failed: %s", exc)
            reason, detail = str(exc), error_detail(exc)
        else:  # a bug: still end cleanly and say what happened
            log.exception("start failed unexpectedly")
            reason, detail = f"internal error while starting: {exc!r}", None
        if resume:
            await self.machine.stop_qemu()
            self.machine.update(
                state=SandboxState.PAUSED,
                supervisor_pid=None,
                qemu_pid=None,
                error=reason,
                failure=detail,
            )
        else:
            await self._shutdown(SandboxState.DEAD, reason, detail)

    def stop(self, state: SandboxState, reason: str | None) -> None:
        if not self._stop.is_set():
            self._stop_reason = (state, reason)
            self._stop.set()

    async def _watch_qemu(self) -> None:
        while True:
            qemu = self.machine.qemu
            assert qemu is not None
            code = await qemu.wait()
            if qemu is self.machine.qemu and not self._lifecycle.locked():
                self.stop(
                    SandboxState.DEAD,
                    f"QEMU exited with code {code}: " + qemu.stderr_text().strip()[-2000:],
                )
                return
            # A rollback replaced QEMU on purpose: watch the new one.
            while self._lifecycle.locked() or self.machine.qemu is qemu:
                await asyncio.sleep(0.05)

    async def _watch_deadline(self) -> None:
        while True:
            assert self.record.deadline is not None
            remaining = self.record.deadline - time.time()
            if remaining <= 0:
                self.stop(SandboxState.KILLED, f"timed out after {self.machine.spec.timeout:.0f} s")
                return
            self._deadline_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deadline_changed.wait(), remaining)

    async def _shutdown(
        self, state: SandboxState, reason: str | None, failure: dict[str, Any] | None = None
    ) -> None:
        await self.machine.stop_qemu()
        self.machine.remove_runtime_files()
        self.machine.update(state=state, error=reason, failure=failure, qemu_pid=None)
        log.info("%s: %s", state.value, reason)

    # -- clients

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        client = ClientConnection(writer)
        decoder = p.Decoder()
        try:
            while data := await reader.read(256 * 1024):
                for item in decoder.feed(data):
                    if isinstance(item, p.FrameError):
                        client.send(p.error_header(None, p.BAD_FRAME, str(item)))
                        continue
                    task = asyncio.ensure_future(self._handle(client, item))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, client: ClientConnection, frame: p.Frame) -> None:
        rid, op = frame.id, frame.header.get("op")
        args = frame.header.get("args") or {}
        if rid is None or not isinstance(op, str) or not isinstance(args, dict):
            client.send(
                p.error_header(
                    rid, p.BAD_FRAME, "a request needs an integer id, an op and object args"
                )
            )
            return
        try:
            if op.startswith("sandbox."):
                result = await self._sandbox_op(op, args)
            else:
                result = await self._forward(client, rid, op, args, frame.payload)
        except GuestError as exc:
            client.send(p.error_header(rid, exc.kind, exc.message))
        except ChannelError as exc:
            client.send(p.error_header(rid, p.CHANNEL, str(exc)))
        except (KeyError, TypeError, ValueError) as exc:
            client.send(p.error_header(rid, p.INVALID, f"{op}: bad arguments ({exc!r})"))
        except CryoboxError as exc:
            client.send({**p.error_header(rid, p.INTERNAL, str(exc)), "detail": error_detail(exc)})
        else:
            client.send({"id": rid, "ok": True, "result": result})

    async def _forward(
        self, client: ClientConnection, rid: int, op: str, args: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        # Wait out a lifecycle operation: the agent is being replaced or is frozen.
        async with self._lifecycle:
            agent = self.machine.agent
        if agent is None:
            raise ChannelError("the guest agent is not connected")

        def relay(header: dict[str, Any], event_payload: bytes) -> None:
            client.send({**header, "id": rid}, event_payload)

        return await agent.request(op, args, payload, on_event=relay)

    async def _sandbox_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "sandbox.status":
            return self.record.to_json()
        if op == "sandbox.set_timeout":
            seconds = float(args["seconds"])
            if seconds <= 0:
                raise ValueError("seconds must be positive")
            self.machine.update(deadline=time.time() + seconds)
            self._deadline_changed.set()
            return {"deadline": self.record.deadline}
        if op == "sandbox.kill":
            self.stop(SandboxState.KILLED, "killed by request")
            return {}
        if op == "sandbox.expose_port":
            return {"host_port": await self.machine.expose_port(int(args["guest_port"]))}
        async with self._lifecycle:
            require(self.record.id, self.record.state, (SandboxState.RUNNING,), op.split(".")[1])
            if op == "sandbox.pause":
                await self.machine.pause()
                self._exit_paused = True
                self.stop(SandboxState.PAUSED, None)
                return {}
            if op == "sandbox.snapshot":
                manifest = await self.machine.capture(
                    purpose=str(args.get("purpose", "snapshot")),
                    name=args.get("name"),
                    memory=bool(args.get("memory", True)),
                )
                return manifest.to_json()
            if op == "sandbox.rollback":
                await self.machine.rollback(str(args["snapshot"]))
                return {}
        raise GuestError(op, p.UNKNOWN_OP, f"unknown op {op!r}")


def main() -> None:
    args = sys.argv[1:]
    if not args:
        # A warm spare: everything is imported and QEMU's version known; wait for a folder.
        with contextlib.suppress(CryoboxError):
            qemu_version()
        line = sys.stdin.readline().strip()
        if not line:
            return
        args = line.split()
    folder = SandboxDir(Path(args[0]))
    resume = "--resume" in args[1:]
    handler = logging.FileHandler(folder.supervisor_log)
    logging.basicConfig(
        level=logging.INFO,
        handlers=[handler],
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    sys.exit(asyncio.run(Supervisor(folder).run(resume)))


if __name__ == "__main__":
    main()
