"""One QEMU process and its QMP monitor (through the QEMU project's ``qemu.qmp``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qemu.qmp import ConnectError, ExecuteError, QMPClient

from cryobox.errors import NetworkError, QemuError, QemuNotInstalled
from cryobox.network.namespace import Link, attach, change, isolate_this_process, open_namespace
from cryobox.network.policy import NetworkPolicy
from cryobox.qemu.command import (
    ROOT_DRIVE,
    build_command,
    cpu_device,
    hostfwd,
    memory_device,
    memory_object,
)
from cryobox.vmm.base import MachineSpec, PortForward

if TYPE_CHECKING:
    from cryobox.network.header_proxy import HeaderProxy

BINARY = "qemu-system-x86_64"
#: Seconds a VM being killed waits for its network's setup to end (each step is a
#: program that takes milliseconds).
ATTACH_TIMEOUT = 10.0
#: Seconds ``qemu-system-x86_64 --version`` may take (it answers in milliseconds).
VERSION_TIMEOUT = 10.0


#: glibc's malloc settings for QEMU: one arena for all its threads, and blocks of 128 KiB
#: and more always mapped apart and given back when freed. By default glibc raises both
#: thresholds each time a mapped block is freed, so the TLB tables TCG resizes stay in the
#: heap once freed. Measured on 10 forks of a 1 GiB guest: QEMU's heap and buffers 12.6
#: MiB per VM against 13.1 (2026-12-01, one run each).
MALLOC_SETTINGS = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": "131072",
    "MALLOC_TRIM_THRESHOLD_": "131072",
}


def qemu_binary() -> str:
    """The QEMU system emulator's path.

    :raises QemuNotInstalled: when it is not on PATH.
    """
    path = os.environ.get("CRYOBOX_QEMU") or shutil.which(BINARY)
    if not path or not os.access(path, os.X_OK):
        raise QemuNotInstalled(
            f"{os.environ.get('CRYOBOX_QEMU') or BINARY} not found: install Debian's "
            "qemu-system-x86 (`make setup` does)"
        )
    return path


def qemu_version(binary: str | None = None) -> str:
    """QEMU's version string, such as ``7.2.19``.

    Asked of the binary once per version of its file (path, inode, size, mtime): a
    supervisor checks it before every restore and resume, and starting QEMU only to
    print it cost 16-20 ms there. The zygote asks before it forks, so its supervisors
    find it known; an upgraded QEMU is a new file, asked again.
    """
    binary = binary or qemu_binary()
    st = os.stat(binary)
    return _version_of(binary, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.cache
def _version_of(binary: str, inode: int, size: int, mtime_ns: int) -> str:
    try:
        out = subprocess.run(
            [binary, "--version"],
            capture_output=True,
            text=True,
            check=False,
            timeout=VERSION_TIMEOUT,
        ).stdout
    except subprocess.TimeoutExpired as exc:
        raise QemuError(f"{binary} --version did not answer within {VERSION_TIMEOUT} s") from exc
    words = out.split()
    return (
        words[3] if len(words) > 3 and words[:3] == ["QEMU", "emulator", "version"] else out.strip()
    )


#: QEMUs run as uids from here on (2^24 of them, none in /etc/passwd) when cryobox is
#: root: each VM its own uid and gid, so that a guest escaping into one QEMU cannot even
#: signal another.
VM_UID_BASE = 0x5C000000


def vm_user(name: str) -> str | None:
    """``uid:gid`` for QEMU's ``-runas``, derived from the machine's name (a sandbox id):
    None when cryobox is not root (QEMU then runs as the caller, already unprivileged)."""
    if os.geteuid() != 0:
        return None
    uid = VM_UID_BASE + int.from_bytes(hashlib.sha256(name.encode()).digest()[:3], "big")
    return f"{uid}:{uid}"


#: The capabilities QEMU keeps in its bounding set: those its ``-runas`` uses to become
#: its own unprivileged user. It never regains any other, even as root.
KEPT_CAPABILITIES = (6, 7)  # CAP_SETGID, CAP_SETUID
PR_CAPBSET_DROP = 24
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def drop_capabilities() -> None:
    """Empty this process's capability bounding set but for :data:`KEPT_CAPABILITIES`
    (as root; a no-op otherwise): what QEMU may ever hold, before it execs."""
    if os.geteuid() != 0:
        return
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        last = 40
    for cap in range(last + 1):
        if cap not in KEPT_CAPABILITIES and _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(err)}")


def _isolated_child() -> None:
    isolate_this_process()
    drop_capabilities()


class _Adopted:
    """A QEMU that another supervisor started (and died): waited on through a pidfd,
    since only a parent can reap it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._fd = os.pidfd_open(pid)
        self._ended: asyncio.Future[None] | None = None

    async def wait(self) -> int:
        if self.returncode is None:
            loop = asyncio.get_running_loop()
            if self._ended is None:
                ended = self._ended = loop.create_future()

                def exited() -> None:
                    if not ended.done():
                        ended.set_result(None)

                loop.add_reader(self._fd, exited)
            await asyncio.shield(self._ended)
            if self.returncode is None:
                loop.remove_reader(self._fd)
                os.close(self._fd)
                self.returncode = -1  # not our child: its exit code is not ours to read
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:  # by pidfd: never another process that got the pid
            signal.pidfd_send_signal(self._fd, signal.SIGKILL)


#: What QEMU's SHUTDOWN event says when the guest itself ended its run.
GUEST_ENDINGS = {
    "guest-shutdown": "the guest powered itself off",
    "guest-reset": "the guest rebooted itself (a reboot ends a sandbox)",
    "guest-panic": "the guest kernel panicked",
}


class QemuProcess:
    """A running QEMU with a connected QMP client.

    QEMU's stderr goes to a file so that a crash can be reported with its last words,
    and QEMU is killed by the kernel if its parent dies (no orphaned VMs).
    """

    def __init__(self, spec: MachineSpec, stderr_path: Path, binary: str | None = None) -> None:
        self.spec = spec
        self.stderr_path = stderr_path
        self.command = build_command(binary or qemu_binary(), spec, vm_user(spec.name))
        self._process: asyncio.subprocess.Process | _Adopted | None = None
        self._qmp: QMPClient | None = None
        #: Set when the guest itself ended its run (see _watch_guest_ending).
        self.guest_ending: str | None = None
        self._ending_watch: asyncio.Task[None] | None = None
        self.link: Link | None = None
        #: The namespace's way out being made (see start).
        self._attaching: asyncio.Future[Link | None] | None = None
        #: Sets the policy's headers on the guest's requests, while it sets any.
        self._headers: HeaderProxy | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None, "QEMU is not started"
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def error(self, message: str) -> QemuError:
        """A QemuError carrying the command line, exit code and stderr."""
        return QemuError(
            message, command=self.command, exitcode=self.returncode, stderr=self.stderr_text()
        )

    async def start(
        self, timeout: float = 30.0, on_spawn: Callable[[int], None] | None = None
    ) -> None:
        """Start QEMU and connect to its monitor.

        :raises QemuError: when QEMU exits or its monitor does not appear in time.
        """
        self.spec.monitor_socket.unlink(missing_ok=True)
        with open(self.stderr_path, "wb") as stderr:
            self._process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=subprocess.DEVNULL,
                stdout=stderr,
                stderr=stderr,
                # No parent-death signal: a supervisor killed with -9 leaves its VM
                # running for a new supervisor to adopt (see adopt()).
                preexec_fn=_isolated_child if self.spec.isolated else drop_capabilities,
                env={**os.environ, **MALLOC_SETTINGS},
            )
        try:
            if on_spawn is not None:
                on_spawn(self._process.pid)
            if self.spec.isolated:
                # Made while QEMU starts and its monitor connects (each takes tens of ms
                # here). A cold boot waits for it below; a restore's state loads only once
                # it is made (load_state), and its guest runs only after that. Until the
                # route, its last step, nothing in the namespace gets out.
                self._attaching = asyncio.ensure_future(self._attach(self._process.pid))
            await asyncio.wait_for(self._connect_qmp(), timeout)
            if not self.spec.incoming:  # a cold boot's guest is running already
                await self.network_ready()
        except TimeoutError:
            await self.kill()
            raise self.error(f"QEMU's monitor did not come up within {timeout:.0f} s") from None
        except BaseException:
            await self.kill()
            raise

    async def _attach(self, pid: int) -> Link | None:
        await self._serve_headers(pid, self.spec.network)
        return await attach(pid, self.spec.network)

    async def _serve_headers(self, pid: int, policy: NetworkPolicy) -> None:
        """Start the header proxy in the namespace if ``policy`` sets headers and none
        runs; then it sets those (one running keeps running when they go: its
        namespace's rules send it nothing)."""
        if self._headers is None and policy.headers:
            # Imported here: TLS and HTTP parsing cost every start nothing unless used.
            from cryobox.network.header_proxy import HeaderProxy

            proxy = HeaderProxy(open_namespace(pid), trust=self.spec.egress_trust)
            try:
                await proxy.start()
            except BaseException as exc:
                await proxy.close()  # (it holds the namespace open)
                if isinstance(exc, OSError):
                    raise NetworkError(f"the header proxy cannot start: {exc}") from exc
                raise
            self._headers = proxy
        if self._headers is not None:
            self._headers.rules = policy.headers

    async def _stop_headers(self) -> None:
        if self._headers is not None:
            proxy, self._headers = self._headers, None
            await proxy.close()

    async def network_ready(self) -> None:
        """Wait until the guest's way out (its namespace's link and filters) is made.

        :raises NetworkError: when it cannot be (or QemuError: QEMU ended meanwhile).
        """
        if self._attaching is None:
            return
        try:
            self.link = await asyncio.shield(self._attaching)
        except NetworkError:
            assert self._process is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._process.wait(), 0.5)
            if self._process.returncode is not None:  # the real cause: QEMU ended
                raise self.error("QEMU exited while starting") from None
            raise

    async def adopt(self, pid: int, timeout: float = 30.0) -> None:
        """Take over a running QEMU whose supervisor died: connect to its monitor.

        :raises QemuError: when it exits or its monitor does not answer in time.
        """
        try:
            self._process = _Adopted(pid)
        except OSError as exc:
            raise self.error(f"cannot adopt QEMU {pid}: {exc.strerror}") from exc
        try:
            await asyncio.wait_for(self._connect_qmp(), timeout)
        except TimeoutError:
            raise self.error(
                f"QEMU {pid}'s monitor did not answer within {timeout:.0f} s"
            ) from None
        # The proxy went with the supervisor that died; the namespace still sends to it.
        if self.spec.isolated:
            await self._serve_headers(pid, self.spec.network)

    async def _connect_qmp(self) -> None:
        assert self._process is not None
        while True:
            if self._process.returncode is not None:
                raise self.error("QEMU exited while starting")
            if self.spec.monitor_socket.exists():
                client = QMPClient(self.spec.name)
                try:
                    await client.connect(str(self.spec.monitor_socket))
                except (OSError, ConnectError):
                    pass  # the socket exists before QEMU listens on it: try again
                else:
                    self._qmp = client
                    self._ending_watch = asyncio.ensure_future(self._watch_guest_ending(client))
                    return
            waiter = asyncio.ensure_future(self._process.wait())
            await asyncio.wait([waiter], timeout=0.005)
            if not waiter.done():
                waiter.cancel()

    async def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        """Run a QMP command.

        :raises QemuError: when QEMU refuses it or the monitor is gone.
        """
        if self._qmp is None:
            raise self.error(f"QMP {command}: not connected")
        try:
            return await self._qmp.execute(command, arguments)
        except ExecuteError as exc:
            raise QemuError(f"QMP {command} failed: {exc}", command=self.command) from exc
        except Exception as exc:
            raise self.error(f"QMP {command}: monitor connection failed ({exc!r})") from exc

    async def human_monitor(self, command_line: str) -> str:
        """An HMP command (some, like ``hostfwd_add``, have no QMP twin)."""
        out = await self.execute("human-monitor-command", {"command-line": command_line})
        return str(out)

    async def run_state(self) -> str:
        status = await self.execute("query-status")
        return str(status.get("status", "")) if isinstance(status, dict) else ""

    async def stop_cpus(self) -> None:
        await self.execute("stop")

    async def continue_cpus(self) -> None:
        await self.execute("cont")

    async def resize_disk(self, size_bytes: int) -> None:
        # virtio-blk tells the guest (a configuration change interrupt).
        await self.execute("block_resize", {"node-name": ROOT_DRIVE, "size": size_bytes})

    async def add_cpu(self, index: int) -> None:
        # ACPI tells the guest; it brings the vCPU online when asked (``sys.online``).
        await self.execute("device_add", cpu_device(self.spec.accelerator, index))

    async def add_memory(self, slot: int, mib: int) -> int:
        await self.execute("object-add", memory_object(slot, mib))
        module = memory_device(slot)
        await self.execute("device_add", module)
        for listed in await self.execute("query-memory-devices") or ():
            data = listed.get("data") or {}
            if data.get("id") == module["id"]:
                return int(data["addr"])
        raise self.error(f"memory module {module['id']} is not listed once added")

    async def add_port_forward(self, forward: PortForward) -> None:
        answer = await self.human_monitor(
            f"hostfwd_add net0 {hostfwd(forward, self.spec.isolated)}"
        )
        if answer.strip():
            raise QemuError(f"hostfwd_add refused: {answer.strip()}", command=self.command)

    async def set_network(self, policy: NetworkPolicy) -> None:
        if not self.spec.isolated or self._process is None:
            raise NetworkError(
                "this sandbox's network is not isolated (CRYOBOX_NETWORK_ISOLATION=off): "
                "no policy can be put in force"
            )
        await self.network_ready()
        kept = self._headers.rules if self._headers is not None else ()
        await self._serve_headers(self._process.pid, policy)
        try:
            self.link = await change(self._process.pid, self.link, policy)
        except BaseException:
            if self._headers is not None:
                self._headers.rules = kept
            raise

    # -- snapshots: the device state travels by migration, RAM stays in its file

    async def _migration_setup(self) -> None:
        # RAM mapped shared from a file is skipped by the stream (the file is the RAM);
        # RAM mapped privately is written into it. Both sides must agree on this.
        await self.execute(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": True}]},
        )
        # No announce after a restore: QEMU would have the guest send gratuitous ARPs and
        # a link notification (virtio-net's guest announce), for a switch user-mode
        # networking does not have: about 15 KiB of guest kernel code for each fork's
        # new QEMU to translate on the way to its first answer.
        await self.execute(
            "migrate-set-parameters", {"max-bandwidth": 32 << 30, "announce-rounds": 0}
        )

    async def save_state(self, path: Path, timeout: float = 600.0) -> None:
        """Write the stopped machine's device state (and any private RAM) to ``path``.

        :raises QemuError: when the migration fails or does not finish in time.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        await self._migrate_through(path, flags, "migrate", timeout)

    async def load_state(self, path: Path, timeout: float = 600.0) -> None:
        """Feed a saved device state to a QEMU started with ``incoming``; it stays stopped."""
        # Its network first: once the state is in (which writes guest RAM: the RAM file
        # is no longer the pause's), a supervisor that dies leaves a VM its successor
        # continues, and that VM must have its way out, and its filters, already.
        await self.network_ready()
        await self._migrate_through(path, os.O_RDONLY, "migrate-incoming", timeout)

    async def _migrate_through(self, path: Path, flags: int, command: str, timeout: float) -> None:
        """Run migration ``command`` through ``path``, opened here and handed to QEMU."""
        await self._migration_setup()
        fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        try:
            await self._pass_fd(fd, "state")
            await self.execute(command, {"uri": "fd:state"})
            await self._wait_migration(timeout)
        finally:
            os.close(fd)

    async def _pass_fd(self, fd: int, name: str) -> None:
        """Hand QEMU an open file (it may neither open our files nor spawn ``cat``)."""
        if self._qmp is None:
            raise self.error("QMP getfd: not connected")
        self._qmp.send_fd_scm(fd)
        await self.execute("getfd", {"fdname": name})

    async def _wait_migration(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            info = await self.execute("query-migrate")
            status = info.get("status") if isinstance(info, dict) else None
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                raise self.error(f"migration {status}: {info.get('error-desc', 'no detail')}")
            if self.returncode is not None:
                raise self.error("QEMU exited during migration")
            if loop.time() > deadline:
                raise self.error(f"migration did not complete within {timeout:.0f} s")
            await asyncio.sleep(0.002)

    async def _watch_guest_ending(self, client: QMPClient) -> None:
        """When the guest powers itself off, reboots or panics, say so and end QEMU.

        QEMU runs with ``-action shutdown=pause``: left to power off by itself, QEMU 7.2
        under TCG crashed (SIGSEGV) on the way out, and its exit said nothing of why.
        Paused instead, it reports the guest's reason here, and is then killed."""
        with client.listener(("SHUTDOWN",)) as listener:
            # One that ended while no supervisor listened (between a kill -9 and its
            # adoption) waits paused in "shutdown": its event went to nobody.
            with contextlib.suppress(Exception):
                status = await client.execute("query-status")
                if isinstance(status, dict) and status.get("status") == "shutdown":
                    self._guest_ended("the guest shut itself down while unwatched")
                    return
            async for event in listener:
                data = event.get("data")
                reason = data.get("reason", "") if isinstance(data, dict) else ""
                if reason in GUEST_ENDINGS:
                    self._guest_ended(GUEST_ENDINGS[reason])
                    return

    def _guest_ended(self, why: str) -> None:
        self.guest_ending = why
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()

    async def wait(self) -> int:
        assert self._process is not None
        return await self._process.wait()

    async def quit(self, timeout: float = 5.0) -> None:
        """Ask QEMU to quit; kill it if it does not within ``timeout``."""
        await self._stop_attaching()
        await self._stop_headers()
        if self._process is None or self._process.returncode is not None:
            await self._close_qmp()
            return
        with contextlib.suppress(QemuError):
            await asyncio.wait_for(self.execute("quit"), timeout)
        try:
            await asyncio.wait_for(self._process.wait(), timeout)
        except TimeoutError:
            await self.kill()
        await self._close_qmp()

    async def kill(self) -> None:
        """SIGKILL QEMU and reap it."""
        # An attach still under way ends first: its steps name the namespace by QEMU's
        # pid, which must not be free for another process to take while they run.
        try:
            await self._stop_attaching()
            await self._stop_headers()
        finally:  # cancelled meanwhile, QEMU is still killed
            if self._process is not None and self._process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._process.kill()
                await self._process.wait()
            await self._close_qmp()

    async def _stop_attaching(self) -> None:
        """Wait for an unfinished attach to end, not cancelled (a cancelled step would
        leave its program running); what it made goes with the namespace."""
        if self._attaching is not None:
            attaching, self._attaching = self._attaching, None
            # A failure was reported where it mattered: reading it here (or when a slow
            # one ends) keeps asyncio from logging it as never retrieved.
            attaching.add_done_callback(lambda done: done.cancelled() or done.exception())
            await asyncio.wait([attaching], timeout=ATTACH_TIMEOUT)

    async def _close_qmp(self) -> None:
        if self._ending_watch is not None:
            self._ending_watch.cancel()
            self._ending_watch = None
        if self._qmp is not None:
            client, self._qmp = self._qmp, None
            with contextlib.suppress(Exception):
                await client.disconnect()
