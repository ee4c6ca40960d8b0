"""The supervisor: one process per sandbox that owns its QEMU for the sandbox's life.

Why a process of its own: QEMU's monitor and the guest agent's port each accept one
connection, yet several clients (an SDK program, ``cryobox exec`` in another shell)
use a sandbox at once, and someone must enforce its timeout while nobody is
connected. The supervisor holds both connections and serves any number of clients
on ``control.sock`` with the same frame protocol as the agent: guest operations
are forwarded, ``sandbox.*`` operations are its own.

It is the only writer of the sandbox's state record. QEMU is started with a parent
death signal, so a supervisor killed with SIGKILL takes its VM with it.

Run as ``python -m cryobox.sandbox.supervisor SANDBOX_DIR``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from cryobox.errors import ChannelError, CryoboxError, GuestError, QemuError
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient
from cryobox.image import Image
from cryobox.qemu import MachineSpec, PortForward, QemuProcess
from cryobox.sandbox.registry import SandboxDir, SandboxRecord, SandboxSpec
from cryobox.sandbox.state import SandboxState
from cryobox.util import free_port

log = logging.getLogger("cryobox.supervisor")

#: Seconds a cold boot may take to reach the agent (TCG on a busy host is slow).
BOOT_TIMEOUT = 240.0


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
        self.spec: SandboxSpec = folder.spec()
        self.record = SandboxRecord(
            id=self.spec.id,
            state=SandboxState.CREATING,
            supervisor_pid=os.getpid(),
            deadline=time.time() + self.spec.timeout,
        )
        self.qemu: QemuProcess | None = None
        self.agent: AgentClient | None = None
        self._stop = asyncio.Event()
        self._stop_reason: tuple[SandboxState, str | None] = (SandboxState.KILLED, None)
        self._deadline_changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- records

    def _save(self, **changes: Any) -> None:
        self.record = replace(self.record, **changes)
        self.folder.write_record(self.record)

    # -- life

    async def run(self) -> int:
        self._save()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, SandboxState.KILLED, f"signal {sig.name}")
        try:
            await self._boot()
        except CryoboxError as exc:
            log.error("boot failed: %s", exc)
            await self._shutdown(SandboxState.DEAD, str(exc), failure=_failure(exc))
            return 1
        server = await asyncio.start_unix_server(
            self._serve_client, str(self.folder.control_socket)
        )
        self._save(state=SandboxState.RUNNING, qemu_pid=self.qemu.pid if self.qemu else None)
        log.info("running")
        watchers = [
            asyncio.ensure_future(self._watch_qemu()),
            asyncio.ensure_future(self._watch_deadline()),
        ]
        await self._stop.wait()
        for watcher in watchers:
            watcher.cancel()
        server.close()
        state, reason = self._stop_reason
        await self._shutdown(state, reason)
        return 0

    def stop(self, state: SandboxState, reason: str | None) -> None:
        if not self._stop.is_set():
            self._stop_reason = (state, reason)
            self._stop.set()

    async def _boot(self) -> None:
        image = Image.load(Path(self.spec.image_path))
        await _run(
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            str(image.rootfs),
            str(self.folder.disk),
            f"{self.spec.disk_gib}G",
        )
        forwards = tuple(PortForward(guest, free_port()) for guest in self.spec.ports)
        machine = MachineSpec(
            name=f"cryobox-{self.spec.id}",
            cpus=self.spec.cpus,
            memory_mib=self.spec.memory_mib,
            accelerator=self.spec.accelerator,
            kernel=image.kernel,
            initrd=image.initrd,
            disk=self.folder.disk,
            memory_file=self.folder.memory_file,
            qmp_socket=self.folder.qmp_socket,
            agent_socket=self.folder.agent_socket,
            console_log=self.folder.console_log,
            ports=forwards,
            kernel_args=(f"cryobox.time_ns={time.time_ns()}", f"cryobox.hostname={self.spec.id}"),
        )
        self.qemu = QemuProcess(machine, self.folder.qemu_stderr)
        await self.qemu.start()
        self._save(qemu_pid=self.qemu.pid, ports={f.guest_port: f.host_port for f in forwards})
        self.agent = await self._connect_agent(BOOT_TIMEOUT)

    async def _connect_agent(self, timeout: float) -> AgentClient:
        """Connect to the guest agent and wait until it answers a ping."""
        assert self.qemu is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        agent = await AgentClient.connect(self.folder.agent_socket)
        while True:
            if self.qemu.returncode is not None:
                await agent.close()
                raise self.qemu.error(
                    "QEMU exited before the guest agent answered; console:\n"
                    + _tail(self.folder.console_log)
                )
            try:
                await agent.request("ping", timeout=1.0)
                return agent
            except ChannelError:
                if loop.time() > deadline:
                    await agent.close()
                    await self.qemu.kill()
                    raise self.qemu.error(
                        f"the guest agent did not answer within {timeout:.0f} s; console:\n"
                        + _tail(self.folder.console_log)
                    ) from None

    async def _watch_qemu(self) -> None:
        assert self.qemu is not None
        code = await self.qemu.wait()
        self.stop(
            SandboxState.DEAD,
            f"QEMU exited with code {code}: " + self.qemu.stderr_text().strip()[-2000:],
        )

    async def _watch_deadline(self) -> None:
        while True:
            assert self.record.deadline is not None
            remaining = self.record.deadline - time.time()
            if remaining <= 0:
                self.stop(SandboxState.KILLED, f"timed out after {self.spec.timeout:.0f} s")
                return
            self._deadline_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deadline_changed.wait(), remaining)

    async def _shutdown(
        self, state: SandboxState, reason: str | None, failure: dict[str, Any] | None = None
    ) -> None:
        if self.agent is not None:
            await self.agent.close()
        if self.qemu is not None:
            await self.qemu.kill()
        for path in (
            self.folder.disk,
            self.folder.memory_file,
            self.folder.qmp_socket,
            self.folder.agent_socket,
            self.folder.control_socket,
        ):
            path.unlink(missing_ok=True)
        self._save(state=state, error=reason, failure=failure)
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
            client.send(p.error_header(rid, p.INTERNAL, str(exc)))
        else:
            client.send({"id": rid, "ok": True, "result": result})

    async def _forward(
        self, client: ClientConnection, rid: int, op: str, args: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        if self.agent is None:
            raise ChannelError("the guest agent is not connected")

        def relay(header: dict[str, Any], event_payload: bytes) -> None:
            client.send({**header, "id": rid}, event_payload)

        return await self.agent.request(op, args, payload, on_event=relay)

    async def _sandbox_op(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "sandbox.status":
            return self.record.to_json()
        if op == "sandbox.set_timeout":
            seconds = float(args["seconds"])
            if seconds <= 0:
                raise ValueError("seconds must be positive")
            self._save(deadline=time.time() + seconds)
            self._deadline_changed.set()
            return {"deadline": self.record.deadline}
        if op == "sandbox.kill":
            self.stop(SandboxState.KILLED, "killed by request")
            return {}
        if op == "sandbox.expose_port":
            return {"host_port": await self._expose_port(int(args["guest_port"]))}
        raise GuestError(op, p.UNKNOWN_OP, f"unknown op {op!r}")

    async def _expose_port(self, guest_port: int) -> int:
        if not 1 <= guest_port <= 65535:
            raise ValueError(f"guest port {guest_port} is not in 1..65535")
        if guest_port in self.record.ports:
            return self.record.ports[guest_port]
        assert self.qemu is not None
        forward = PortForward(guest_port, free_port())
        answer = await self.qemu.human_monitor(f"hostfwd_add net0 {forward.hostfwd()}")
        if answer.strip():
            raise QemuError(f"hostfwd_add refused: {answer.strip()}")
        self._save(ports={**self.record.ports, guest_port: forward.host_port})
        return forward.host_port


def _failure(exc: CryoboxError) -> dict[str, Any]:
    """The structured part of an error, so the creating process can raise the same error."""
    if isinstance(exc, QemuError):
        return {
            "type": "qemu",
            "command": exc.command,
            "exitcode": exc.exitcode,
            "stderr": exc.stderr,
        }
    return {"type": type(exc).__name__}


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no console output)"


async def _run(*argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise QemuError(
            f"{argv[0]} failed",
            command=argv,
            exitcode=proc.returncode,
            stderr=out.decode(errors="replace"),
        )


def main() -> None:
    folder = SandboxDir(Path(sys.argv[1]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(Supervisor(folder).run()))


if __name__ == "__main__":
    main()
