"""Create, resume, find and stop sandboxes on this host.

Creating one validates the request, makes sure the guest image exists, writes the
sandbox's spec and hands it to a supervisor process (which outlives the caller), then
waits until the supervisor reports the guest agent ready or the start failed. A
caller interrupted while waiting stops the supervisor: nothing is orphaned.

Starting a Python supervisor costs about 0.2 s on these machines, more than a whole
restore, so a creating process keeps one spare supervisor started and imported,
waiting on a pipe for the folder it is to serve; each start takes the spare and
starts the next. A spare whose creator exits sees its pipe close and exits too.

Templates: ``base`` boots the image cold; any other name restores the template's
memory snapshot. ``default`` is built by this module on first use (boot the image,
save the machine), so every later create is a restore.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import (
    CapacityError,
    CryoboxError,
    InvalidArgument,
    QemuError,
    SandboxDead,
    SnapshotIncompatible,
    SnapshotNotFound,
    error_from_detail,
)
from cryobox.image import Image, ensure_image
from cryobox.image.build import Progress
from cryobox.qemu import detect_accelerator, qemu_binary
from cryobox.sandbox import registry
from cryobox.sandbox.registry import SandboxDir, SandboxRecord, SandboxSpec
from cryobox.sandbox.state import SandboxState, require
from cryobox.snapshot import manifest as mf
from cryobox.snapshot import store
from cryobox.util import new_id

BASE_TEMPLATE = "base"
DEFAULT_TEMPLATE = "default"
#: How long a creator waits for the supervisor to report the sandbox ready.
CREATE_TIMEOUT = 300.0
POLL_INTERVAL = 0.005

_spare: subprocess.Popen[bytes] | None = None
_spare_env: dict[str, str] = {}
_spare_lock = threading.Lock()


def validate(
    *, cpus: int, memory_mib: int, disk_gib: int, timeout: float, ports: Sequence[int]
) -> None:
    """Reject a request that cannot work, naming the argument.

    :raises InvalidArgument:
    """
    if not 1 <= cpus <= config.MAX_CPUS:
        raise InvalidArgument(f"cpus={cpus}: must be between 1 and {config.MAX_CPUS}")
    if not config.MIN_MEMORY_MIB <= memory_mib <= config.MAX_MEMORY_MIB:
        raise InvalidArgument(
            f"memory_mib={memory_mib}: must be between "
            f"{config.MIN_MEMORY_MIB} and {config.MAX_MEMORY_MIB}"
        )
    if not config.MIN_DISK_GIB <= disk_gib <= config.MAX_DISK_GIB:
        raise InvalidArgument(
            f"disk_gib={disk_gib}: must be between {config.MIN_DISK_GIB} and {config.MAX_DISK_GIB}"
        )
    if not timeout > 0:
        raise InvalidArgument(f"timeout={timeout}: must be a positive number of seconds")
    for port in ports:
        if not 1 <= port <= 65535:
            raise InvalidArgument(f"port {port}: must be between 1 and 65535")


async def create_sandbox(
    *,
    template: str = DEFAULT_TEMPLATE,
    from_snapshot: str | None = None,
    cpus: int | None = None,
    memory_mib: int | None = None,
    disk_gib: int | None = None,
    timeout: float = config.DEFAULT_TIMEOUT,
    ports: Sequence[int] = (),
    progress: Progress | None = None,
    forked_from: str | None = None,
    fork_index: int = 0,
) -> SandboxDir:
    """Start a new sandbox and return its folder once its guest agent answers.

    A template or snapshot fixes the machine's shape: ``cpus``, ``memory_mib`` and
    ``disk_gib`` may be left out, and must match it when given.

    :raises InvalidArgument: for a request that cannot work.
    :raises SnapshotError: when the template or snapshot is missing, refused or corrupt.
    :raises QemuError: when QEMU is missing, fails to start or the guest never answers.
    """
    validate(
        cpus=config.DEFAULT_CPUS if cpus is None else cpus,
        memory_mib=config.DEFAULT_MEMORY_MIB if memory_mib is None else memory_mib,
        disk_gib=config.DEFAULT_DISK_GIB if disk_gib is None else disk_gib,
        timeout=timeout,
        ports=ports,
    )
    qemu_binary()  # fail early and clearly when QEMU is not installed
    image = await asyncio.to_thread(ensure_image, progress)
    source: Path | None = None
    if from_snapshot is not None:
        source, _ = store.find(from_snapshot)
    elif template != BASE_TEMPLATE:
        source = await _template_snapshot(template, image, progress)
    shape = {"cpus": cpus, "memory_mib": memory_mib, "disk_gib": disk_gib}
    if source is not None:
        manifest = mf.load(source)
        for name, asked in shape.items():
            if asked is not None and asked != getattr(manifest, name):
                raise SnapshotIncompatible(manifest.id, name, getattr(manifest, name), asked)
            shape[name] = getattr(manifest, name)
    accelerator = await asyncio.to_thread(detect_accelerator, image.kernel, image.initrd)
    spec = SandboxSpec(
        id=new_id("sbx"),
        image_id=image.id,
        image_path=str(image.path),
        accelerator=accelerator,
        cpus=shape["cpus"] or config.DEFAULT_CPUS,
        memory_mib=shape["memory_mib"] or config.DEFAULT_MEMORY_MIB,
        disk_gib=shape["disk_gib"] or config.DEFAULT_DISK_GIB,
        timeout=timeout,
        ports=tuple(ports),
        template=template if from_snapshot is None else "",
        restore_from=str(source) if source else None,
        forked_from=forked_from,
        fork_index=fork_index,
    )
    folder = SandboxDir.for_id(spec.id)
    folder.write_spec(spec)
    folder.write_record(SandboxRecord(id=spec.id, state=SandboxState.CREATING), check=False)
    record = await _run_supervisor(folder, [str(folder.path)])
    if record.state is not SandboxState.RUNNING:
        raise _start_error(folder, record)
    return folder


async def resume_sandbox(sandbox_id: str) -> SandboxDir:
    """Continue a paused sandbox with every process where it was.

    :raises StateError: when it is not paused.
    :raises SnapshotError: when its saved state is refused (it stays paused).
    """
    folder = registry.find(sandbox_id)
    require(sandbox_id, folder.record().state, (SandboxState.PAUSED,), "resume")
    record = await _run_supervisor(folder, [str(folder.path), "--resume"])
    if record.state is not SandboxState.RUNNING:
        raise _start_error(folder, record)
    return folder


async def _run_supervisor(folder: SandboxDir, args: list[str]) -> SandboxRecord:
    supervisor = _take_spare()
    assert supervisor.stdin is not None
    try:
        supervisor.stdin.write((" ".join(args) + "\n").encode())
        supervisor.stdin.close()
    except BrokenPipeError as exc:
        raise QemuError("the sandbox supervisor exited before it was given a sandbox") from exc
    try:
        record = await _wait_started(folder, supervisor)
    except BaseException:
        _terminate(supervisor)
        raise
    if record.state is not SandboxState.RUNNING:
        _terminate(supervisor)  # it is exiting already: reap it, so nothing is left behind
        record = folder.record()
    return record


def _relevant_env() -> dict[str, str]:
    """The environment a supervisor's behaviour depends on."""
    return {k: v for k, v in os.environ.items() if k.startswith("CRYOBOX_") or k == "PATH"}


def _spawn_spare() -> subprocess.Popen[bytes]:
    global _spare_env
    _spare_env = _relevant_env()
    log = open(config.state_dir() / "supervisor-spare.log", "ab")  # noqa: SIM115
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "cryobox.sandbox.supervisor"],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )


def discard_spare() -> None:
    """Let the warm spare go (it exits when its pipe closes)."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    _release(spare)


def _release(spare: subprocess.Popen[bytes] | None) -> None:
    if spare is not None and spare.stdin is not None:
        spare.stdin.close()
        spare.wait()


def _take_spare() -> subprocess.Popen[bytes]:
    """The warm spare supervisor if it is alive and was started with the environment as it
    is now (it read CRYOBOX_* at start), else a new one; then starts the next spare."""
    global _spare
    stale = None
    with _spare_lock:
        spare, _spare = _spare, None
        if spare is not None and (spare.poll() is not None or _spare_env != _relevant_env()):
            stale, spare = spare, None
        if spare is None:
            spare = _spawn_spare()
        _spare = _spawn_spare()
    _release(stale)
    return spare


async def _wait_started(folder: SandboxDir, supervisor: subprocess.Popen[bytes]) -> SandboxRecord:
    """Wait until the sandbox runs, or its supervisor gave up (and said why in the record)."""
    deadline = time.monotonic() + CREATE_TIMEOUT
    while True:
        record = folder.record()
        if record.state is SandboxState.RUNNING or record.state.finished:
            return record
        if supervisor.poll() is not None:
            return folder.record()
        if time.monotonic() > deadline:
            raise QemuError(
                f"sandbox {folder.id} did not become ready within {CREATE_TIMEOUT:.0f} s"
            )
        await asyncio.sleep(POLL_INTERVAL)


def _start_error(folder: SandboxDir, record: SandboxRecord) -> Exception:
    """The exception the supervisor hit, rebuilt from the state record."""
    message = f"sandbox {folder.id} failed to start: {record.error}"
    rebuilt = error_from_detail(record.failure or {}, message)
    return rebuilt or SandboxDead(folder.id, record.error or "its supervisor exited while starting")


def _terminate(supervisor: subprocess.Popen[bytes]) -> None:
    """Stop a supervisor (and with it its QEMU): politely, then by force."""
    with contextlib.suppress(ProcessLookupError):
        supervisor.send_signal(signal.SIGTERM)
    try:
        supervisor.wait(10)
    except subprocess.TimeoutExpired:
        supervisor.kill()
        supervisor.wait()


def kill_sandbox_files(folder: SandboxDir) -> None:
    """Stop whatever still runs for a sandbox and remove its folder."""
    record = folder.record()
    if registry.supervisor_alive(record):
        assert record.supervisor_pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.supervisor_pid, signal.SIGKILL)
    if record.qemu_pid and registry.process_alive(record.qemu_pid, folder.id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.qemu_pid, signal.SIGKILL)
    shutil.rmtree(folder.path, ignore_errors=True)


# --------------------------------------------------------------------------- templates


async def _template_snapshot(name: str, image: Image, progress: Progress | None) -> Path:
    """The snapshot folder a template starts from; builds ``default`` when missing or stale."""
    entry = store.template(name)
    if entry is not None and entry.get("image_id") == image.id:
        with contextlib.suppress(SnapshotNotFound):
            folder: Path = store.find(str(entry["snapshot"]))[0]
            return folder
    if name != DEFAULT_TEMPLATE:
        if entry is None:
            known = [t["name"] for t in store.list_templates()]
            raise InvalidArgument(
                f"template {name!r} does not exist (known: "
                f"{', '.join([BASE_TEMPLATE, DEFAULT_TEMPLATE, *known])})"
            )
        raise SnapshotIncompatible(
            str(entry.get("snapshot")), "image_id", entry.get("image_id"), image.id
        )
    if progress:
        progress("building the default template (one cold boot, then every create restores)")
    return await build_template(DEFAULT_TEMPLATE, [])


async def build_template(
    name: str,
    setup: Sequence[str],
    *,
    cpus: int = config.DEFAULT_CPUS,
    memory_mib: int = config.DEFAULT_MEMORY_MIB,
    disk_gib: int = config.DEFAULT_DISK_GIB,
) -> Path:
    """Boot the image, run ``setup`` commands, save the machine as template ``name``.

    :raises InvalidArgument: for a bad name, or a setup command that fails (its output).
    """
    if not name or "/" in name or name.startswith(".") or name == BASE_TEMPLATE:
        raise InvalidArgument(f"template name {name!r} is not allowed")
    from cryobox.guest.client import AgentClient

    folder = await create_sandbox(
        template=BASE_TEMPLATE, cpus=cpus, memory_mib=memory_mib, disk_gib=disk_gib, timeout=3600
    )
    client = await AgentClient.connect(folder.control_socket)
    try:
        for command in setup:
            output: list[bytes] = []

            def collect(_header: dict[str, Any], data: bytes, into: list[bytes] = output) -> None:
                into.append(data)

            result = await client.request("exec", {"shell": command}, on_event=collect)
            if result["exit_code"] != 0:
                text = b"".join(output).decode(errors="replace")[-2000:]
                raise InvalidArgument(
                    f"template {name}: setup command {command!r} exited with "
                    f"{result['exit_code']}:\n{text}"
                )
        saved = await client.request(
            "sandbox.snapshot", {"purpose": "template", "name": f"template:{name}"}
        )
    finally:
        with contextlib.suppress(Exception):
            await client.request("sandbox.kill")
        await client.close()
        await wait_finished(folder)
        shutil.rmtree(folder.path, ignore_errors=True)
    previous = store.template(name)
    store.set_template(
        name,
        saved["id"],
        {"image_id": saved["image_id"], "setup": list(setup), "created_at": time.time()},
    )
    if previous and previous.get("snapshot") != saved["id"]:
        with contextlib.suppress(CryoboxError):  # kept while something builds on it
            store.delete(str(previous["snapshot"]))
    return store.snapshots_dir() / str(saved["id"])


async def wait_finished(folder: SandboxDir, timeout: float = 15.0) -> None:
    """Return once the sandbox's record says killed or dead (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while not folder.record().state.finished and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- fork

MAX_FORKS = 100
#: Host memory a fork needs beyond the frozen RAM all forks share: QEMU itself (about
#: 140 MB RSS measured under TCG) plus an eighth of its RAM for pages it writes.
FORK_OVERHEAD_MIB = 160
#: Forks started at once: each start is mostly CPU (a supervisor, QEMU, the guest's JIT).
FORK_CONCURRENCY = 4


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


async def fork_sandbox(
    parent_id: str, count: int, timeout: float | None = None
) -> list[SandboxDir]:
    """N new running sandboxes continuing from this instant of a running one.

    The parent is saved once (it goes on running, on its own RAM file), then N sandboxes
    restore that snapshot with its RAM mapped privately: shared pages stay shared.

    :raises InvalidArgument: when ``count`` is not within 1..100.
    :raises CapacityError: when the host cannot hold ``count`` more; nothing is started.
    :raises StateError: when the parent is not running.
    """
    if not 1 <= count <= MAX_FORKS:
        raise InvalidArgument(f"count={count}: a fork makes 1 to {MAX_FORKS} sandboxes")
    folder = registry.find(parent_id)
    require(parent_id, folder.record().state, (SandboxState.RUNNING,), "fork")
    spec = folder.spec()
    needed = count * (FORK_OVERHEAD_MIB + spec.memory_mib // 8)
    available = mem_available_mib()
    if needed > available:
        raise CapacityError(
            f"cannot fork {count} copies of {parent_id}", needed_mib=needed, available_mib=available
        )
    from cryobox.guest.client import AgentClient

    client = await AgentClient.connect(folder.control_socket)
    try:
        saved = await client.request(
            "sandbox.snapshot", {"purpose": "fork", "name": f"fork-of-{parent_id}"}
        )
    finally:
        await client.close()
    gate = asyncio.Semaphore(FORK_CONCURRENCY)

    async def one(index: int) -> SandboxDir:
        async with gate:
            return await create_sandbox(
                from_snapshot=str(saved["id"]),
                timeout=timeout or spec.timeout,
                forked_from=parent_id,
                fork_index=index,
            )

    results = await asyncio.gather(*(one(i) for i in range(1, count + 1)), return_exceptions=True)
    started = [r for r in results if isinstance(r, SandboxDir)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for fork in started:  # all or nothing: no fork is left behind unreturned
            kill_sandbox_files(fork)
        collect_fork_snapshot(str(saved["id"]))
        raise failed[0]
    return started


def collect_fork_snapshot(snapshot_id: str | None) -> None:
    """Delete a fork's snapshot once no live sandbox builds on it."""
    if not snapshot_id:
        return
    with contextlib.suppress(CryoboxError):
        _, manifest = store.find(snapshot_id)
        if manifest.purpose != "fork":
            return
        disks = [
            d for _, r in registry.list_sandboxes() if not r.state.finished for d in r.disk_chain
        ]
        store.delete(snapshot_id, sandbox_disks=disks)


def lineage() -> list[dict[str, Any]]:
    """Every sandbox and snapshot on this host as nodes naming their parent.

    A sandbox's parent is the snapshot it was restored from (none for a cold boot); a
    snapshot's parent is the sandbox it was taken of.
    """
    nodes: list[dict[str, Any]] = []
    for spec, record in registry.list_sandboxes():
        nodes.append(
            {
                "id": spec.id,
                "kind": "sandbox",
                "parent": record.origin,
                "state": record.state.value,
                "forked_from": spec.forked_from,
                "label": spec.template or "",
            }
        )
    for _, manifest in store.all_snapshots():
        nodes.append(
            {
                "id": manifest.id,
                "kind": "snapshot",
                "parent": manifest.source_sandbox,
                "state": manifest.kind,
                "forked_from": None,
                "label": manifest.purpose + (f" {manifest.name}" if manifest.name else ""),
            }
        )
    return nodes
