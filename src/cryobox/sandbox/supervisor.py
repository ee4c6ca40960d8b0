"""The supervisor: one process per sandbox that owns its VM for the sandbox's life.

Why a process of its own: the VM's monitor and the guest agent's port each accept one
connection, yet several clients (an SDK program, ``cryobox exec`` in another shell)
use a sandbox at once, and someone must enforce its timeout while nobody is
connected. The supervisor holds both connections and serves any number of clients
on ``control.sock`` (:mod:`.control`): guest operations are forwarded, its own
operations (status, timeout, ports, pause, snapshot, rollback, kill) are handled
here, snapshot work in :mod:`.machine`. Every request is answered, whatever happens.

It is the only writer of the sandbox's state record. The VM outlives it: a supervisor
killed with SIGKILL leaves its VM running, and the next use of the sandbox starts a new
supervisor that adopts it (``Machine.adopt``), as containers outlive containerd.

Forked from the service's zygote (:mod:`.zygote`, which imported everything once, so
a restore does not wait for Python), or started as ``python -m
cryobox.sandbox.supervisor --fd N``: it reads a :class:`~.control.StartRequest` on
its socket, reports progress and readiness or failure on it, then closes it.

The copies of one fork share a supervisor process (:func:`serve_group`): a Python
process per copy held 7.6 MiB of its own (pages its zygote shared, written again by
reference counts), 3% of a 256 MiB guest at 100 forks. Each copy keeps its own
:class:`Supervisor`, lock, control socket, log and record, so the process only pools
memory. A group that dies (killed with -9, a crash) leaves its VMs running, to be
adopted one by one like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import fcntl
import logging
import logging.handlers
import os
import resource
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from cryobox import config
from cryobox.errors import (
    AlreadySupervised,
    ChannelError,
    CryoboxError,
    GuestError,
    InvalidArgument,
    SandboxDead,
    StateError,
    StorageError,
    VmNotHeld,
    error_detail,
)
from cryobox.guest import protocol as p
from cryobox.guest.client import AgentClient
from cryobox.network.policy import NetworkPolicy
from cryobox.sandbox import priority
from cryobox.sandbox.backend import backend
from cryobox.sandbox.control import (
    Claim,
    ControlOp,
    ExposePort,
    Kill,
    NetworkSet,
    Pause,
    PortExposed,
    Rollback,
    SetNetwork,
    SetTimeout,
    StartRequest,
    Status,
    TakeSnapshot,
    TimeoutSet,
    Wake,
)
from cryobox.sandbox.ending import vm_ended
from cryobox.sandbox.machine import Machine
from cryobox.sandbox.records import PAUSING_TIMEOUTS
from cryobox.sandbox.registry import SandboxDir, SandboxRecord
from cryobox.sandbox.state import SandboxState, require
from cryobox.sandbox.volumes import VolumeEnds
from cryobox.snapshot import arriving
from cryobox.snapshot.manifest import Manifest, SnapshotPurpose
from cryobox.snapshot.store import LocalSnapshotStore, SnapshotStore
from cryobox.store import uploads
from cryobox.store.keys import LOCAL_TENANT
from cryobox.util import mem_available_mib, without_huge_pages
from cryobox.vmm import Vmm

log = logging.getLogger("cryobox.supervisor")
#: supervisor.log is rotated at this size (one old file kept): at most 2 MiB on disk.
LOG_MAX_BYTES = 1 << 20
#: console.log is rotated past this size, checked every few seconds: it holds at most
#: this plus what the guest prints between two checks, and one old file is kept.
CONSOLE_MAX_BYTES = 1 << 20
CONSOLE_CHECK_SECONDS = 2.0
SPACE_CHECK_SECONDS = 1.0
#: How often a sandbox whose RAM arrives from the store looks whether it arrived.
ARRIVAL_POLL = 0.5
#: How often a sandbox without a history looks again (a pool member may get one).
HISTORY_CHECK_SECONDS = 1.0
#: Output held for a client that does not read before the guest is told to wait.
OUTPUT_HIGH = 4 << 20
OUTPUT_LOW = 1 << 20
#: Held output past which a guest that ignores "pause" has its request ended.
OUTPUT_LIMIT = 64 << 20
#: While requests are in flight, the agent is pinged this often; one that does not
#: answer within AGENT_DEADLINE seconds (stopped, killed without restart, starved by a
#: fork bomb) fails them with a clear error instead of leaving them waiting forever.
AGENT_CHECK_SECONDS = 5.0
#: How long a start waits for the previous supervisor of its sandbox to be gone.
LOCK_WAIT_SECONDS = 15.0
#: How often it tries the lock meanwhile: a resume right after a pause waits for the
#: pausing supervisor's exit (tens of ms), and each try is one flock call.
LOCK_POLL_SECONDS = 0.005
AGENT_DEADLINE = 30.0
#: While a paused VM is held: how often the hold checks its end and the host's memory,
#: and the free memory (MiB) below which it lets the VM go early.
HOLD_CHECK_SECONDS = 1.0
HOLD_MEMORY_MARGIN_MIB = 1024
#: How long an ending supervisor waits for a wake under way (its agent's answer has 60).
WAKE_WAIT_SECONDS = 90.0


#: The copies of one fork a group supervisor serves at most; more start another group.
GROUP_MAX = 25
#: The sandbox whose log the current task writes to (set in :func:`_serve`).
_SANDBOX_LOG: contextvars.ContextVar[logging.Handler] = contextvars.ContextVar("sandbox_log")
#: Every sandbox this process serves, each told to stop on SIGTERM or SIGINT.
_SERVING: set[Supervisor] = set()


class _SandboxLogs(logging.Handler):
    """The process's one log handler: a record goes to the supervisor.log of the
    sandbox whose task wrote it (a thread of no sandbox's writes to ``fallback``, the
    one sandbox's log of a process that serves one, else to stderr)."""

    def __init__(self) -> None:
        super().__init__()
        self.fallback: logging.Handler = logging.StreamHandler()

    def emit(self, record: logging.LogRecord) -> None:
        _SANDBOX_LOG.get(self.fallback).handle(record)


_LOGS = _SandboxLogs()


def _log_to(folder: SandboxDir, *, only: bool) -> logging.Handler:
    """Route this task's log records to ``folder``'s supervisor.log (rotated); ``only``:
    the process serves no other sandbox."""
    handler = logging.handlers.RotatingFileHandler(
        folder.supervisor_log, maxBytes=LOG_MAX_BYTES, backupCount=1
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    _SANDBOX_LOG.set(handler)
    root = logging.getLogger()
    if _LOGS not in root.handlers:
        root.addHandler(_LOGS)
        root.setLevel(logging.INFO)
    if only:
        _LOGS.fallback = handler
    return handler


@dataclass
class _Process:
    """What this process does on SIGTERM or SIGINT: every sandbox it serves stops (as
    killed), starts that have not begun are refused, and a group takes no more."""

    stopping: bool = False
    on_stop: list[Callable[[], None]] = field(default_factory=list)


_PROCESS = _Process()


def _on_signal(signum: signal.Signals) -> None:
    _PROCESS.stopping = True
    for supervisor in list(_SERVING):
        supervisor.stop(SandboxState.KILLED, f"signal {signum.name}")
    for callback in _PROCESS.on_stop:
        callback()


def error_reply(rid: int | None, exc: BaseException, op: str) -> dict[str, Any]:
    """The one mapping from an exception to an error reply."""
    if isinstance(exc, GuestError):
        return p.error_header(rid, exc.kind, exc.message)
    if isinstance(exc, InvalidArgument):
        header = p.error_header(rid, p.INVALID, str(exc))
    elif isinstance(exc, ChannelError):
        header = p.error_header(rid, p.CHANNEL, str(exc))
    elif isinstance(exc, CryoboxError):
        header = p.error_header(rid, p.INTERNAL, str(exc))
    else:  # a bug: say what it was, and keep serving
        log.error("%s failed unexpectedly:\n%s", op, "".join(traceback.format_exception(exc)))
        return p.error_header(
            rid, p.INTERNAL, f"{op}: internal error in the supervisor: {type(exc).__name__}: {exc}"
        )
    return {**header, "detail": error_detail(exc)}


class ClientConnection:
    """One connected client of the control socket."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Write one frame; one that cannot be encoded (a guest's answer too large to
        relay, say) becomes an error for its request, so the client is never left
        waiting."""
        if self.writer.is_closing():
            return
        try:
            frame = p.encode(header, payload)
        except p.FrameError as exc:
            if "ok" not in header and "event" in header:
                return  # an event: dropped (its request still gets its answer)
            frame = p.encode(
                p.error_header(header.get("id"), p.BAD_FRAME, f"answer not relayed: {exc}")
            )
        self.writer.write(frame)

    @property
    def gone(self) -> bool:
        return self.writer.is_closing()

    def buffered(self) -> int:
        """Bytes written to this client and not yet taken by it."""
        transport = self.writer.transport
        return 0 if transport.is_closing() else transport.get_write_buffer_size()


class OutputFlow:
    """Backpressure from a slow client to the guest, per request.

    Output for a client that does not read piles up here; past ``OUTPUT_HIGH`` bytes
    the agent is told to pause that request (it stops reading the command's pipes, so
    the command itself waits on its full pipe), and once the client has taken all but
    ``OUTPUT_LOW`` bytes, to resume. Nothing is dropped, and the supervisor holds at
    most ``OUTPUT_HIGH`` plus what was already on its way per slow request. A guest
    that does not pause (a replaced agent) is cut off at ``OUTPUT_LIMIT``: its request
    ends with an error and its command is killed.
    """

    def __init__(self, agent: AgentClient, client: ClientConnection) -> None:
        self._agent = agent
        self._client = client
        self._paused: set[int] = set()
        #: Requests whose output passed OUTPUT_LIMIT: a guest that ignores "pause".
        self.overflowed: set[int] = set()

    def after_send(self, agent_rid: int | None) -> None:
        if agent_rid is None:
            return
        if self._client.buffered() > OUTPUT_LIMIT and agent_rid not in self.overflowed:
            # The guest went on sending after being told to pause: stop relaying, and
            # end the command (its answer becomes an error, see Supervisor._forward).
            self.overflowed.add(agent_rid)
            log.warning(
                "request %d: %d MiB held, the guest ignored flow control",
                agent_rid,
                OUTPUT_LIMIT >> 20,
            )
            kill = asyncio.ensure_future(
                self._agent.request(p.GuestOp.EXEC_KILL, {"exec_id": agent_rid}, timeout=30)
            )
            kill.add_done_callback(lambda t: t.cancelled() or t.exception())
            return
        if agent_rid in self._paused or self._client.buffered() <= OUTPUT_HIGH:
            return
        self._paused.add(agent_rid)
        task = asyncio.ensure_future(self._hold(agent_rid))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _hold(self, agent_rid: int) -> None:
        try:
            await self._agent.request(
                p.GuestOp.FLOW, {"target": agent_rid, "paused": True}, timeout=30
            )
            while self._client.buffered() > OUTPUT_LOW and not self._client.gone:
                await asyncio.sleep(0.02)
            await self._agent.request(
                p.GuestOp.FLOW, {"target": agent_rid, "paused": False}, timeout=30
            )
        finally:
            self._paused.discard(agent_rid)


Request = TypeVar("Request")


@dataclass(frozen=True)
class Handler(Generic[Request]):
    """How the supervisor answers one of its ops (a row of its dispatch table)."""

    #: Reads and checks the op's arguments (:class:`~cryobox.errors.InvalidArgument`).
    parse: Callable[[dict[str, Any]], Request]
    #: Does it; its reply (a record, a manifest, a small reply type, or None).
    run: Callable[[Request], Awaitable[Any]]
    #: The states the sandbox must be in (None: any; the handler checks what it needs).
    states: tuple[SandboxState, ...] | None
    #: Runs under the lifecycle lock: one pause, snapshot, rollback, claim or wake at a time.
    locked: bool = False
    #: A failure that leaves the VM ended ends the sandbox: paused after a pause (every
    #: file was written), dead after anything else.
    ends_with_vm: bool = False


def encode_reply(reply: Any) -> dict[str, Any]:
    """A handler's reply as the frame carries it."""
    if reply is None:
        return {}
    if isinstance(reply, SandboxRecord | Manifest):
        return reply.to_json()
    return dataclasses.asdict(reply)


class Supervisor:
    def __init__(
        self, folder: SandboxDir, vmm: Vmm, store: SnapshotStore, *, shared: bool = False
    ) -> None:
        self.folder = folder
        # ``shared``: this process serves other sandboxes too (a fork's group).
        self.machine = Machine(folder, self._save, vmm, store, shared_supervisor=shared)
        self._stop = asyncio.Event()
        self._stop_reason: tuple[SandboxState, str | None] = (SandboxState.KILLED, None)
        self._deadline_changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Lifecycle operations (pause, checkpoint, rollback...) run one at a time.
        self._lifecycle = asyncio.Lock()
        self._dispatch = self._handlers()
        self._exit_paused = False
        #: Paused with its VM kept (stopped) for a quick wake, until a wake has succeeded;
        #: the task that ends the hold; whether a KILL request (not a signal) ends it.
        self._holding = False
        self._hold_task: asyncio.Task[None] | None = None
        self._kill_asked = False
        #: The host ends of its volume mounts, for its life (they outlive its VMs).
        self.volumes = VolumeEnds(folder)

    @property
    def record(self) -> SandboxRecord:
        return self.machine.record

    def _save(self, record: SandboxRecord) -> None:
        self.folder.write_record(record)

    # -- life

    async def run(
        self,
        resume: bool,
        report: ClientConnection | None = None,
        *,
        adopt: bool = False,
        own_process: bool = True,
    ) -> int:
        """Start (or resume) the sandbox, serve it until it ends; 0 unless the start failed.

        ``report`` receives the start's outcome: the state record, or the error.
        ``own_process``: the process is a supervisor's (SIGTERM and SIGINT stop it);
        False for one served inside another program's event loop (a unit test's).
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT) if own_process else ():
            loop.add_signal_handler(sig, _on_signal, sig)
        _SERVING.add(self)
        try:
            return await self._run(resume, report, adopt=adopt)
        finally:
            _SERVING.discard(self)
            self.volumes.stop()

    async def _run(self, resume: bool, report: ClientConnection | None, *, adopt: bool) -> int:
        if self.machine.spec.pool:
            priority.lower()  # restored when it is claimed
        try:
            if adopt:
                await self.machine.adopt(os.getpid())
            elif resume:
                await self.machine.resume(os.getpid())
            else:
                await self.machine.start(os.getpid())
        except Exception as exc:
            if not adopt or not self._leave_as_is(exc):
                await self._failed_start(exc, resume)
            if report is not None:
                report.send(error_reply(0, exc, "start"))
            return 1
        try:
            self.volumes.start()
            assert self.machine.agent is not None
            await self.volumes.mount_in_guest(self.machine.agent)
        except Exception as exc:
            self.volumes.stop()
            await self._failed_start(exc, resume)
            if report is not None:
                report.send(error_reply(0, exc, "start"))
            return 1
        self.folder.control_socket.unlink(missing_ok=True)
        server = await asyncio.start_unix_server(
            self._serve_client, str(self.folder.control_socket)
        )
        os.chmod(self.folder.control_socket, 0o600)
        self.machine.update(state=SandboxState.RUNNING, error=None, failure=None)
        log.info("running")
        if report is not None:
            report.send({"id": 0, "ok": True, "result": self.record.to_json()})
        watchers = [
            asyncio.ensure_future(self._watch_vm()),
            asyncio.ensure_future(self._watch_deadline()),
            asyncio.ensure_future(self._watch_console()),
            asyncio.ensure_future(self._watch_agent()),
            asyncio.ensure_future(self._watch_space()),
            asyncio.ensure_future(self._keep_history()),
            asyncio.ensure_future(self._watch_arrival()),
        ]
        await self._stop.wait()
        for watcher in watchers:
            watcher.cancel()
        server.close()
        self.folder.control_socket.unlink(missing_ok=True)
        if self._holding:  # a wake under way finishes first (its steps are time-bounded)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lifecycle.acquire(), WAKE_WAIT_SECONDS)
                self._lifecycle.release()
        if self._holding and not self._kill_asked:  # still paused: the VM goes, the pause stays
            self._holding = False
            await self.machine.release()
        elif not self._exit_paused:
            state, reason = self._stop_reason
            await self._shutdown(state, reason)
        return 0

    async def end_after_bug(self, exc: Exception) -> None:
        """End this sandbox after an error nobody expected escaped it, in a process that
        serves others on: its VM is killed and its record says so (a process of its own
        would have ended instead, leaving its VM to be adopted)."""
        log.error("ended by an internal error:\n%s", "".join(traceback.format_exception(exc)))
        with contextlib.suppress(Exception):
            await self.machine.stop_vm()
        with contextlib.suppress(Exception):
            self.machine.update(
                state=SandboxState.DEAD,
                error=f"internal error in its supervisor: {type(exc).__name__}: {exc}",
                qemu_pid=None,
            )

    def _leave_as_is(self, exc: Exception) -> bool:
        """Whether a failed adoption left the sandbox as it should stay: paused again (a
        resume cut short before its guest ran), or served by another supervisor."""
        return self.record.state is SandboxState.PAUSED or isinstance(
            exc, StateError | AlreadySupervised
        )

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
            await self.machine.stop_vm()
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

    async def _watch_vm(self) -> None:
        while not self._stop.is_set():
            vm = self.machine.vm
            if vm is None:  # ended by an operation that failed past it (and said so)
                return
            code = await vm.wait()
            if vm is self.machine.vm and not self._lifecycle.locked():
                reason = vm_ended(
                    self.machine.vmm.name,
                    code,
                    vm.stderr_text(),
                    self.folder.console_log,
                    vm.guest_ending,
                )
                failed = self._arrival_failed()
                self.stop(SandboxState.DEAD, f"{failed} ({reason})" if failed else reason)
                return
            # Under a lifecycle operation: a rollback replaces the VM on purpose (the new
            # one is watched next), a pause ends it and says so. One that ended under an
            # operation that did neither (an automatic checkpoint when QEMU crashed) is
            # found dead on the next turn, once the operation let go.
            while self._lifecycle.locked():
                await asyncio.sleep(0.05)

    def _arrival_failed(self) -> CryoboxError | None:
        """Why the RAM this VM maps failed to arrive from the store, when it did (QEMU
        stops at the first page of it that never came)."""
        record = self.machine.record
        if not (record.memory_from and record.memory_arriving):
            return None
        folder = self.machine.store.folder(record.memory_from)
        return arriving.failure(folder, record.memory_arriving)

    async def _watch_arrival(self) -> None:
        """A sandbox started while its RAM still arrived from the store ends, saying why,
        if that arrival fails: its QEMU would stop at its next read of a page that never
        came, at any time. Done once the RAM is whole (or its own: a pause wrote it)."""
        while not self._stop.is_set():
            record = self.machine.record
            token = record.memory_arriving
            if not (record.memory_from and token):
                return
            folder = self.machine.store.folder(record.memory_from)
            if arriving.served_by(folder) != token:
                # Over: a failure is told before the note is let go of.
                failed = arriving.failure(folder, token)
                if failed is None:
                    self.machine.update(memory_arriving=None)
                    return
                log.error("ending: %s", failed)
                self.stop(SandboxState.DEAD, str(failed))
                return
            await asyncio.sleep(ARRIVAL_POLL)

    async def _watch_deadline(self) -> None:
        while True:
            if self._holding:  # paused: its time does not run (a wake sets a new deadline)
                self._deadline_changed.clear()
                await self._deadline_changed.wait()
                continue
            assert self.record.deadline is not None
            remaining = self.record.deadline - time.time()
            if remaining <= 0 and self.machine.spec.on_timeout in PAUSING_TIMEOUTS:
                # Shielded: a stop that cancels this watcher lets the pause finish (as a
                # caller's pause, which runs in its own task, does).
                await asyncio.shield(self._pause_for_timeout())
                if self._stop.is_set():
                    return
                continue
            if remaining <= 0:
                self.stop(SandboxState.KILLED, f"timed out after {self.machine.timeout:g} s")
                return
            self._deadline_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deadline_changed.wait(), remaining)

    async def _pause_for_timeout(self) -> None:
        """Pause as a caller's ``pause`` does (held, then saved), for a sandbox created
        with ``on_timeout="pause"`` (its disk only for ``"pause-disk"``); its pause goes to
        the chunk store as any other. One that fails (a full disk) kills it, as its
        timeout would have."""
        async with self._lifecycle:
            if self.record.state is not SandboxState.RUNNING or self._holding:
                return  # pausing or paused already (by a caller): nothing to do
            if (self.record.deadline or 0) > time.time():
                return  # its timeout was extended meanwhile
            memory = self.machine.spec.on_timeout == "pause"
            try:
                await self._pause(Pause(config.pause_hold() if memory else 0.0, memory))
            except Exception as exc:
                vm = self.machine.vm
                if vm is not None and vm.returncode is not None:
                    # Its VM ended after every file was written: completed later, as a
                    # caller's pause is (never a kill that would remove its disk).
                    log.error("pause on timeout failed after its VM ended: %r", exc)
                    self._exit_paused = True
                    self.stop(SandboxState.PAUSED, None)
                    return
                log.error("pause on timeout failed, killed instead: %r", exc)
                self.stop(SandboxState.KILLED, f"timed out after {self.machine.timeout:g} s")
                return
        log.info("paused: timed out after %g s", self.machine.timeout)
        try:
            uploads.schedule(self.folder.paused, self.machine.spec.owner or LOCAL_TENANT)
        except OSError as exc:  # stored by the next upload run, or kept here
            log.error("the timeout's pause was not scheduled for upload: %r", exc)

    async def _watch_agent(self) -> None:
        """Fail requests in flight when the guest agent stops answering."""
        while True:
            await asyncio.sleep(AGENT_CHECK_SECONDS)
            agent = self.machine.agent
            if agent is None or agent.in_flight == 0 or self._lifecycle.locked() or self._holding:
                continue
            known = agent.peer_pid
            try:
                await agent.request(p.GuestOp.PING, timeout=AGENT_DEADLINE)
            except GuestError:
                pass  # it answered
            except ChannelError:
                restarted = agent.peer_pid != known  # its requests were failed already
                if agent is self.machine.agent and not self._lifecycle.locked() and not restarted:
                    log.warning(
                        "guest agent silent for %.0f s: failing its requests", AGENT_DEADLINE
                    )
                    agent.fail_pending(
                        f"the guest agent did not answer for {AGENT_DEADLINE:.0f} s (stopped, "
                        "starved by a fork bomb, or out of memory?)"
                    )

    async def _watch_space(self) -> None:
        """Reserve the RAM file's blocks as soon as the free space runs short."""
        while True:
            await asyncio.sleep(SPACE_CHECK_SECONDS)
            if self._lifecycle.locked() or self._holding:
                continue
            try:
                await self.machine.keep_ram_safe()
            except (StorageError, OSError) as exc:
                log.error("cannot reserve the RAM file's blocks: %s", exc)

    async def _keep_history(self) -> None:
        """A sandbox created with ``checkpoint_every`` checkpoints itself that often
        while it runs (measured from the start of the previous one, or of this
        supervisor: a resumed sandbox waits a whole period), and its oldest automatic
        checkpoints beyond ``keep_checkpoints`` go. One that fails (a full disk) is
        logged and tried again a period later: the sandbox runs on."""
        started = time.monotonic()
        while True:
            every = self.machine.spec.checkpoint_every  # a pool member gets one on claim
            if not every:
                await asyncio.sleep(HISTORY_CHECK_SECONDS)
                started = time.monotonic()
                continue
            await asyncio.sleep(max(0.0, started + every - time.monotonic()))
            started = time.monotonic()
            async with self._lifecycle:
                if self.record.state is not SandboxState.RUNNING or self._holding:
                    continue  # pausing or paused: the period starts again on its resume
                try:
                    manifest = await self.machine.capture(
                        purpose=SnapshotPurpose.CHECKPOINT, name=None, memory=True, automatic=True
                    )
                    expired = await asyncio.to_thread(self.machine.expire_history)
                except Exception as exc:  # never the end of the history (nor of the VM)
                    log.warning("automatic checkpoint failed (tried again in %g s): %r", every, exc)
                    continue
            log.info("automatic checkpoint %s; expired: %s", manifest.id, expired or "none")

    async def _watch_console(self) -> None:
        """Keep console.log under its cap: past it, the log moves to console.log.1 and
        starts again (QEMU appends, so it writes on at the new end)."""
        path = self.folder.console_log
        while True:
            await asyncio.sleep(CONSOLE_CHECK_SECONDS)
            with contextlib.suppress(OSError):
                if path.stat().st_size > CONSOLE_MAX_BYTES:
                    shutil.copyfile(path, path.with_name(path.name + ".1"))
                    os.truncate(path, 0)

    async def _shutdown(
        self, state: SandboxState, reason: str | None, failure: dict[str, Any] | None = None
    ) -> None:
        if self.machine.agent is not None:  # a command cut short says why
            self.machine.agent.fail_pending(f"the sandbox ended: {reason or state.value}")
            await asyncio.sleep(0)  # their error replies are on their way to the clients
        await self.machine.stop_vm()
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
        except asyncio.CancelledError:
            # The supervisor is ending. Returning (not raising) keeps Python 3.11's
            # start_server callback from logging the cancellation as an error.
            pass
        finally:
            writer.close()

    async def _handle(self, client: ClientConnection, frame: p.Frame) -> None:
        """Answer one request: a result, or an error reply whatever went wrong."""
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
            if op in ControlOp.__members__.values():
                result = await self._control(ControlOp(op), args)
            else:
                result = await self._forward(client, rid, op, args, frame.payload)
        except Exception as exc:
            client.send(error_reply(rid, exc, op))
        else:
            try:
                header, payload = p.answer(rid, result)
            except p.FrameError as exc:
                client.send(p.error_header(rid, p.TOO_LARGE, f"{op}: {exc}"))
            else:
                client.send(header, payload)

    async def _forward(
        self, client: ClientConnection, rid: int, op: str, args: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        # Wait out a lifecycle operation: the agent is being replaced or is frozen.
        async with self._lifecycle:
            agent = self.machine.agent
        if self._holding:  # paused, its VM held: a handle's call resumes it (StateError)
            paused, running = SandboxState.PAUSED.value, SandboxState.RUNNING.value
            raise StateError(self.folder.id, paused, [running], "use")
        if agent is None:
            raise ChannelError("the guest agent is not connected")

        flow = OutputFlow(agent, client)

        def relay(header: dict[str, Any], event_payload: bytes) -> None:
            agent_rid = header.get("id")
            if agent_rid in flow.overflowed:
                return
            client.send({**header, "id": rid}, event_payload)
            if event_payload:
                flow.after_send(agent_rid if isinstance(agent_rid, int) else None)

        result = await agent.request(op, args, payload, on_event=relay)
        if flow.overflowed:
            raise ChannelError(
                f"{op}: more than {OUTPUT_LIMIT >> 20} MiB of output waited for this client "
                "and the guest did not pause: the command was killed"
            )
        return result

    def _handlers(self) -> dict[ControlOp, Handler[Any]]:
        """The dispatch table: how each of the supervisor's own ops is answered."""
        running = (SandboxState.RUNNING,)
        return {
            ControlOp.STATUS: Handler(Status.parse, self._status, None),
            ControlOp.KILL: Handler(Kill.parse, self._kill, None),
            ControlOp.WAKE: Handler(Wake.parse, self._wake, None, locked=True),
            ControlOp.SET_TIMEOUT: Handler(SetTimeout.parse, self._set_timeout, running),
            ControlOp.EXPOSE_PORT: Handler(ExposePort.parse, self._expose_port, running),
            ControlOp.SET_NETWORK: Handler(SetNetwork.parse, self._set_network, running, True),
            ControlOp.CLAIM: Handler(Claim.parse, self._claim, running, True, True),
            ControlOp.PAUSE: Handler(Pause.parse, self._pause, running, True, True),
            ControlOp.SNAPSHOT: Handler(TakeSnapshot.parse, self._snapshot, running, True, True),
            ControlOp.ROLLBACK: Handler(Rollback.parse, self._rollback, running, True, True),
        }

    async def _control(self, op: ControlOp, args: dict[str, Any]) -> dict[str, Any]:
        """Answer one of the supervisor's own ops through its handler; the reply's JSON."""
        handler = self._dispatch.get(op)
        if handler is None:
            raise InvalidArgument(f"{op} is not a request a running supervisor takes")
        request = handler.parse(args)
        if not handler.locked:
            self._guard(op, handler)
            return encode_reply(await handler.run(request))
        async with self._lifecycle:
            self._guard(op, handler)
            try:
                return encode_reply(await handler.run(request))
            except Exception as exc:
                vm = self.machine.vm
                if handler.ends_with_vm and vm is not None and vm.returncode is not None:
                    if op is ControlOp.PAUSE:  # every file was written: completed later
                        self._exit_paused = True
                        self.stop(SandboxState.PAUSED, None)
                    else:  # it failed past the VM
                        self.stop(SandboxState.DEAD, f"{op} failed after its VM ended: {exc}")
                raise

    def _guard(self, op: ControlOp, handler: Handler[Any]) -> None:
        """The handler's state guard: the states it needs, as the record says (a held
        VM's record says paused)."""
        if handler.states is not None:
            require(self.record.id, self.record.state, handler.states, op.action)

    async def _status(self, _request: Status) -> SandboxRecord:
        return self.record

    async def _kill(self, _request: Kill) -> None:
        # Whatever stop was asked before (a hold's end, say), this one is the reason.
        self._kill_asked = True
        self._stop_reason = (SandboxState.KILLED, "killed by request")
        self._stop.set()

    async def _set_timeout(self, request: SetTimeout) -> TimeoutSet:
        self.machine.update(deadline=time.time() + request.seconds, timeout=request.seconds)
        self._deadline_changed.set()
        return TimeoutSet(self.record.deadline)

    async def _expose_port(self, request: ExposePort) -> PortExposed:
        return PortExposed(await self.machine.expose_port(request.guest_port))

    async def _set_network(self, request: SetNetwork) -> NetworkSet:
        policy = NetworkPolicy.from_json(request.network)
        await self.machine.set_network(policy)
        return NetworkSet(policy.to_json())

    async def _claim(self, _request: Claim) -> SandboxRecord:
        await self.machine.claim()
        self._deadline_changed.set()
        return self.record

    async def _pause(self, request: Pause) -> None:
        if not request.memory:  # nothing to hold: the machine boots again on its resume
            await self.machine.pause_disk()
            self._exit_paused = True
            self.stop(SandboxState.PAUSED, None)
            return
        await self.machine.pause(hold=request.hold)
        if request.hold:
            self._holding = True
            self._hold_task = asyncio.ensure_future(self._hold(request.hold))
        else:
            self._exit_paused = True
            self.stop(SandboxState.PAUSED, None)

    async def _snapshot(self, request: TakeSnapshot) -> Manifest:
        return await self.machine.capture(
            purpose=request.purpose, name=request.name, memory=request.memory
        )

    async def _rollback(self, request: Rollback) -> None:
        await self.machine.rollback(request.snapshot_id)

    # -- a paused VM held

    async def _hold(self, seconds: float) -> None:
        """Let the held VM go after ``seconds``, or sooner if the host runs short of
        memory (or this check fails: a VM is never held for want of a check)."""
        until = time.monotonic() + seconds
        try:
            while time.monotonic() < until:
                if mem_available_mib() < HOLD_MEMORY_MARGIN_MIB:
                    log.warning("host memory is short: the held VM goes early")
                    break
                await asyncio.sleep(min(HOLD_CHECK_SECONDS, until - time.monotonic()))
        except Exception:
            log.exception("the hold's check failed: the held VM goes")
        async with self._lifecycle:
            if self._holding:
                self.stop(SandboxState.PAUSED, None)

    async def _wake(self, _request: Wake) -> SandboxRecord:
        """Continue the held VM (the caller holds the lifecycle lock); its state record.

        A failure before its CPUs went on leaves it paused and lets the VM go (a resume
        from the saved pause follows). ``_holding`` stays set until the wake succeeds, so
        a signal meanwhile waits for it (run)."""
        if not self._holding or self._stop.is_set():
            if self.record.state is not SandboxState.PAUSED:
                raise StateError(self.record.id, self.record.state.value, ["paused"], "wake")
            raise VmNotHeld(self.record.id)
        if self._hold_task is not None:
            self._hold_task.cancel()
        try:
            await self.machine.wake(os.getpid())
        except BaseException as exc:
            if self.record.state is SandboxState.PAUSED:  # given back: the VM goes
                self.stop(SandboxState.PAUSED, None)
            else:  # its CPUs may have run on the files: nothing left to trust
                self._holding = False
                self.stop(SandboxState.DEAD, f"its wake failed as its CPUs went on: {exc}")
            raise
        self._holding = False
        self.machine.update(state=SandboxState.RUNNING, error=None, failure=None)
        self._deadline_changed.set()
        log.info("woken")
        return self.record


async def serve_group(group: socket.socket) -> int:
    """Serve the sandboxes whose sockets arrive on ``group`` (one each, SCM_RIGHTS), each
    as :func:`_serve` does, side by side; return once no more can come (the service
    closed ``group``, or SIGTERM/SIGINT ended them all) and every one has ended. 0, or 1
    when one of them failed."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(ValueError, OSError):  # 25 sandboxes' sockets and files
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    serving: set[asyncio.Task[int]] = set()
    failed = False
    done = asyncio.Event()

    def ended(task: asyncio.Task[int]) -> None:
        nonlocal failed
        serving.discard(task)
        failed = failed or task.cancelled() or task.exception() is not None or task.result() != 0
        if not task.cancelled() and task.exception() is not None:  # its socket is closed
            log.error("a start in this group failed: %r", task.exception())

    def stop_receiving() -> None:
        if not done.is_set():
            loop.remove_reader(group.fileno())
            done.set()

    def arrived() -> None:
        try:
            message, fds, _, _ = socket.recv_fds(group, 1, 4)
        except BlockingIOError:
            return
        except OSError:
            message, fds = b"", []
        for fd in fds:  # one arriving as the process stops is refused by _start_and_run
            task = asyncio.ensure_future(_serve(socket.socket(fileno=fd), shared=True))
            serving.add(task)
            task.add_done_callback(ended)
        if not message:
            stop_receiving()  # the service closed it: no more sandboxes

    group.setblocking(False)
    _PROCESS.on_stop.append(stop_receiving)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig)
    loop.add_reader(group.fileno(), arrived)
    try:
        await done.wait()
    finally:
        group.close()
    while serving:
        await asyncio.wait(set(serving))
    return 1 if failed else 0


async def _serve(sock: socket.socket, *, shared: bool = False) -> int:
    """Read the start request from the service, then run the sandbox (``shared``: beside
    others of this process's) on the VMM the request names and the local snapshot
    store. The socket is closed on every way out, so the service never waits on a start
    nobody serves."""
    return await serve(sock, shared=shared)


async def serve(
    sock: socket.socket,
    *,
    shared: bool = False,
    vmm: Vmm | None = None,
    store: SnapshotStore | None = None,
) -> int:
    """:func:`_serve` with the VMM and store given (an in-process supervisor's: the
    service's own, see :class:`cryobox.sandbox.in_process.InProcessLauncher`)."""
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    try:
        return await _start_and_run(reader, writer, shared, vmm, store)
    finally:
        writer.close()


async def _start_and_run(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    shared: bool,
    vmm: Vmm | None,
    store: SnapshotStore | None,
) -> int:
    decoder = p.Decoder()
    request: StartRequest | None = None
    while request is None:
        data = await reader.read(p.MAX_HEADER)
        if not data:
            return 0  # the service went away without handing us a sandbox
        for item in decoder.feed(data):
            if isinstance(item, p.Frame) and item.header.get("op") == ControlOp.START:
                request = StartRequest.parse(item.header.get("args") or {})
                break
    folder = SandboxDir(Path(request.folder))
    report = ClientConnection(writer)
    if _PROCESS.stopping:
        report.send(error_reply(0, SandboxDead(folder.id, "its supervisor is stopping"), "start"))
        await writer.drain()
        return 1
    # Two processes may find the same orphaned VM at once: the first adopter holds this
    # lock for its life, a second one finds it taken and leaves.
    # One supervisor per sandbox: it holds this lock for its life. An adopter gives up at
    # once if another holds it (someone adopted first); a resume waits for the supervisor
    # that paused to be gone. Each re-reads the state once it holds the lock (Machine).
    lock = os.open(folder.supervisor_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + (0 if request.adopt else LOCK_WAIT_SECONDS)
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    # (an adopter lost the race: the sandbox is another's, not dead)
                    busy: CryoboxError = (
                        AlreadySupervised(folder.id)
                        if request.adopt
                        else SandboxDead(folder.id, "another supervisor serves it")
                    )
                    report.send(error_reply(0, busy, "start"))
                    await writer.drain()
                    return 1
                await asyncio.sleep(LOCK_POLL_SECONDS)
        handler = _log_to(folder, only=not shared)
        try:
            try:
                supervisor = Supervisor(
                    folder,
                    vmm or backend(request.backend),  # the service's choice
                    store or LocalSnapshotStore(),
                    shared=shared,
                )
            except Exception as exc:
                if isinstance(exc, OSError):
                    exc = StorageError("starting the supervisor", str(folder.path), str(exc))
                report.send(error_reply(0, exc, "start"))
                await writer.drain()
                return 1
            try:
                return await supervisor.run(
                    request.resume, report, adopt=request.adopt, own_process=vmm is None
                )
            except Exception as exc:
                if not shared:
                    raise  # the process ends: its sandbox is adopted or found dead
                await supervisor.end_after_bug(exc)  # its siblings are served on
                return 1
        finally:
            if shared:  # its log goes with it; the process serves others on
                handler.close()
    finally:
        if shared:
            os.close(lock)


def prepare(program: str) -> socket.socket:
    """What a supervisor process (or the zygote that forks them) does before it serves:
    the socket ``--fd N`` names, the VMM's version cached, a private umask, no huge
    pages for the VMs."""
    args = sys.argv[1:]
    if len(args) != 2 or args[0] != "--fd":
        sys.exit(f"usage: python -m cryobox.sandbox.{program} --fd N (started by the service)")
    with contextlib.suppress(CryoboxError):
        backend().check_installed()
    os.umask(0o077)  # every file this process or its VM writes: 0600, folders 0700
    without_huge_pages()
    return socket.socket(fileno=int(args[1]))


def main() -> None:
    sys.exit(asyncio.run(_serve(prepare("supervisor"))))


if __name__ == "__main__":
    main()
