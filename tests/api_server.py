"""A real ``cryobox server`` process on a loopback port, for the HTTP tests (unit tests
run it over the fake VMM, integration tests over real VMs)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryobox.util import free_port

CLI = [sys.executable, "-m", "cryobox.cli.main"]


@dataclass
class ApiServer:
    """A real ``cryobox server`` process on a loopback port, and one tenant's key."""

    port: int
    database: Path
    env: dict[str, str]
    log: Path
    key: str = ""
    #: PostgreSQL shared with other servers, instead of the SQLite file ``database``.
    database_url: str | None = None
    #: The address it listens on and is reached at (another host's, in ``netns``).
    address: str = "127.0.0.1"
    #: The network namespace it runs in (``tests/fleet_net.py``); None: this one's.
    netns: str | None = None
    #: More ``cryobox server`` options (``--ssl-certfile ...``).
    options: list[str] = field(default_factory=list)
    #: ``https`` when ``options`` give it a certificate.
    scheme: str = "http"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}:{self.port}"

    def client_env(self, key: str | None = None) -> dict[str, str]:
        """The environment of a process that uses this server (the CLI, say)."""
        return {**self.env, "CRYOBOX_API_URL": self.url, "CRYOBOX_API_KEY": key or self.key}

    @property
    def database_options(self) -> list[str]:
        if self.database_url:
            return ["--database-url", self.database_url]
        return ["--database", str(self.database)]

    def tenant(self, name: str, *options: str) -> str:
        """Create a tenant with ``cryobox tenant create``; its key (the last line)."""
        done = subprocess.run(
            [*CLI, "tenant", "create", name, *self.database_options, *options],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
            check=True,
        )
        return done.stdout.strip().splitlines()[-1]

    def start(self) -> None:
        with open(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self.process = subprocess.Popen(
                [
                    *(["ip", "netns", "exec", self.netns] if self.netns else []),
                    *CLI,
                    "server",
                    "--host",
                    self.address,
                    "--port",
                    str(self.port),
                    *self.database_options,
                    "--tick",
                    "0.2",
                    "--storage-interval",
                    "1",
                    *self.options,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        RUNNING.append(self)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            try:
                with socket.create_connection((self.address, self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"cryobox server did not listen: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM, as a service manager stops it (the sandboxes stay)."""
        if self in RUNNING:
            RUNNING.remove(self)
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


#: The servers started and not stopped (whose stacks a failed test prints).
RUNNING: list[ApiServer] = []
#: The zygote's command line, which every supervisor forked from it keeps.
ZYGOTE = b"cryobox.sandbox.zygote"


def print_stacks(state: Path, lines: int = 400) -> None:
    """Print where each running server is, and each supervisor and zygote under
    ``state``: their threads' stacks (SIGUSR1, faulthandler) and a server's asyncio
    tasks (SIGUSR2), as their logs got them. For a test that failed waiting: a request
    or start that hangs says what it waits on."""
    logs = {server.log: server.log.stat().st_size for server in RUNNING if server.log.exists()}
    logs.update({log: log.stat().st_size for log in state.glob("**/supervisor-spare.log")})
    for server in RUNNING:
        if server.process is not None and server.process.poll() is None:
            for signum in (signal.SIGUSR1, signal.SIGUSR2):
                _signal_if_caught(server.process.pid, signum)
    for pid in processes_under(state, ZYGOTE):
        _signal_if_caught(pid, signal.SIGUSR1)
    time.sleep(2)  # the loop answers SIGUSR2 at its next turn
    for log, size in logs.items():
        with contextlib.suppress(OSError), open(log, "rb") as handle:
            handle.seek(size)
            said = handle.read().decode(errors="replace").splitlines()[-lines:]
            if said:
                print(f"\n===== {log} (stacks) =====\n" + "\n".join(said))


def _signal_if_caught(pid: int, signum: int) -> None:
    """Send ``signum`` only to a process that handles it now (``SigCgt``): to one still
    starting, or winding down, it would be the default action, an end."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        caught = int(next(line for line in status if line.startswith("SigCgt:")).split()[1], 16)
        if caught >> (signum - 1) & 1:
            os.kill(pid, signum)


def make_server(
    folder: Path,
    env: dict[str, str] | None = None,
    database_url: str | None = None,
    *,
    address: str = "127.0.0.1",
    netns: str | None = None,
) -> ApiServer:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # private, as cryobox's own
    server = ApiServer(
        port=free_port(),
        database=folder / "server.db",
        env={**os.environ, **(env or {})},
        log=folder / "server.log",
        database_url=database_url,
        address=address,
        netns=netns,
    )
    for name in ("CRYOBOX_API_URL", "CRYOBOX_API_KEY"):
        server.env.pop(name, None)
    return server


@contextlib.contextmanager
def fake_server(
    prefix: str, tenant: str, env: dict[str, str] | None = None, options: Sequence[str] = ()
) -> Iterator[ApiServer]:
    """A server over the fake VMM in a new state folder, with ``tenant``'s key (and more
    ``cryobox server`` ``options``); stopped, its sandboxes killed and its folder removed
    after."""
    state = Path(tempfile.mkdtemp(prefix=prefix))
    made = make_server(
        state / "server", {"CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(state), **(env or {})}
    )
    made.options = list(options)
    made.key = made.tenant(tenant)
    made.start()
    try:
        yield made
    finally:
        made.stop()
        remove_state(state)


def remove_state(state: Path) -> None:
    """Remove a test's state folder, the VMs its records name killed and its helpers
    ended first, then every cryobox process working in it waited for (SIGKILL after 5 s):
    one that ends later (a supervisor, an uploader) would make the folder again."""
    kill_vms(state)
    end_helpers(state)
    if not _all_ended(state, 5.0):
        for pid in processes_under(state, CRYOBOX_MODULES):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        _all_ended(state, 5.0)
    subprocess.run(["rm", "-rf", str(state)], check=False)


def kill_vms(state: Path) -> None:
    """SIGKILL every VM the records under a state folder name (their supervisors then
    end): what tests left running, the server's sandboxes outliving it included."""
    kill_vms_of(state.glob("**/sandboxes/*/state.json"))


#: What the command line of every process cryobox starts holds (``python -m cryobox.…``:
#: servers, supervisors and their zygote, helpers).
CRYOBOX_MODULES = b"-m\0cryobox."


def _all_ended(state: Path, seconds: float) -> bool:
    """Whether every cryobox process working under ``state`` ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while processes_under(state, CRYOBOX_MODULES):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


#: The helper processes a service starts, which may outlive it.
HELPERS = (b"cryobox.store.uploads", b"cryobox.service.refill", b"cryobox.store.lazy_ram")


def processes_under(root: Path, *programs: bytes) -> list[int]:
    """The pids of the processes whose command line names one of ``programs`` and whose
    state folder (CRYOBOX_STATE_DIR) is ``root`` or under it."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        if proc.name == str(os.getpid()):
            continue
        with contextlib.suppress(OSError, ValueError):
            if not any(program in (proc / "cmdline").read_bytes() for program in programs):
                continue
            for variable in (proc / "environ").read_bytes().split(b"\0"):
                name, _, value = variable.partition(b"=")
                if name == b"CRYOBOX_STATE_DIR" and Path(value.decode()).is_relative_to(root):
                    found.append(int(proc.name))
    return found


def end_helpers(root: Path) -> None:
    """SIGKILL the helpers (uploaders, refills, servers of arriving RAM) whose state
    folder is ``root`` or under it, and detach their FUSE files under it: a RAM still
    arriving when its test's folder goes would keep its server and mount for good."""
    for pid in processes_under(root, *HELPERS):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    detach_mounts_under(root)


def detach_mounts_under(root: Path) -> None:
    """Detach every FUSE file (any mount) under ``root``: a killed server's stays,
    dead, and keeps the folder from being removed."""
    from cryobox.snapshot import arriving

    for line in Path("/proc/self/mounts").read_text().splitlines():
        where = line.split()[1]
        if where.startswith(f"{root}/"):
            with contextlib.suppress(OSError):
                arriving.detach(Path(where))


def kill_vms_of(records: Iterable[Path]) -> None:
    """SIGKILL the VM each of these sandbox records (``state.json``) names, if it runs."""
    for record in records:
        with contextlib.suppress(OSError, ValueError):
            pid = json.loads(record.read_text()).get("qemu_pid")
            if pid and record.parent.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
