"""Create, find and stop sandboxes on this host.

Creating one validates the request, makes sure the guest image exists, writes the
sandbox's spec and starts its supervisor as a process of its own (it outlives the
caller), then waits until the supervisor reports the guest agent ready or the VM
failed. A caller interrupted while waiting stops the supervisor: nothing orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from cryobox import config
from cryobox.errors import InvalidArgument, QemuError, SandboxDead
from cryobox.image import ensure_image
from cryobox.image.build import Progress
from cryobox.qemu import detect_accelerator, qemu_binary
from cryobox.sandbox import registry
from cryobox.sandbox.registry import SandboxDir, SandboxRecord, SandboxSpec
from cryobox.sandbox.state import SandboxState
from cryobox.util import new_id

TEMPLATES = ("base",)
#: How long a creator waits for the supervisor to report the sandbox ready.
CREATE_TIMEOUT = 300.0
POLL_INTERVAL = 0.01


def validate(
    *,
    template: str,
    cpus: int,
    memory_mib: int,
    disk_gib: int,
    timeout: float,
    ports: Sequence[int],
) -> None:
    """Reject a request that cannot work, naming the argument.

    :raises InvalidArgument:
    """
    if template not in TEMPLATES:
        raise InvalidArgument(
            f"template {template!r} does not exist (known: {', '.join(TEMPLATES)})"
        )
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
    template: str = "base",
    cpus: int = config.DEFAULT_CPUS,
    memory_mib: int = config.DEFAULT_MEMORY_MIB,
    disk_gib: int = config.DEFAULT_DISK_GIB,
    timeout: float = config.DEFAULT_TIMEOUT,
    ports: Sequence[int] = (),
    progress: Progress | None = None,
) -> SandboxDir:
    """Boot a new sandbox and return its folder once its guest agent answers.

    :raises InvalidArgument: for a request that cannot work.
    :raises QemuError: when QEMU is missing, fails to start or the guest never answers.
    :raises ImageError: when the guest image cannot be built.
    """
    validate(
        template=template,
        cpus=cpus,
        memory_mib=memory_mib,
        disk_gib=disk_gib,
        timeout=timeout,
        ports=ports,
    )
    qemu_binary()  # fail early and clearly when QEMU is not installed
    image = await asyncio.to_thread(ensure_image, progress)
    accelerator = await asyncio.to_thread(detect_accelerator, image.kernel, image.initrd)
    spec = SandboxSpec(
        id=new_id("sbx"),
        image_id=image.id,
        image_path=str(image.path),
        accelerator=accelerator,
        cpus=cpus,
        memory_mib=memory_mib,
        disk_gib=disk_gib,
        timeout=timeout,
        ports=tuple(ports),
        template=template,
    )
    folder = SandboxDir.for_id(spec.id)
    folder.write_spec(spec)
    folder.write_record(SandboxRecord(id=spec.id, state=SandboxState.CREATING), check=False)
    with open(folder.supervisor_log, "ab") as log:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "cryobox.sandbox.supervisor", str(folder.path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        record = await _wait_started(folder, supervisor)
    except BaseException:
        _terminate(supervisor)
        raise
    if record.state is not SandboxState.RUNNING:
        _terminate(supervisor)  # it is exiting already: reap it, so nothing is left behind
        raise _creation_error(folder, folder.record())
    return folder


async def _wait_started(folder: SandboxDir, supervisor: subprocess.Popen[bytes]) -> SandboxRecord:
    deadline = time.monotonic() + CREATE_TIMEOUT
    while True:
        record = folder.record()
        if record.state is not SandboxState.CREATING:
            return record
        if supervisor.poll() is not None:
            return folder.record()
        if time.monotonic() > deadline:
            raise QemuError(
                f"sandbox {folder.id} did not become ready within {CREATE_TIMEOUT:.0f} s"
            )
        await asyncio.sleep(POLL_INTERVAL)


def _creation_error(folder: SandboxDir, record: SandboxRecord) -> Exception:
    failure = record.failure or {}
    if failure.get("type") == "qemu":
        return QemuError(
            f"sandbox {folder.id} failed to start: {record.error}",
            command=failure.get("command") or (),
            exitcode=failure.get("exitcode"),
            stderr=failure.get("stderr") or "",
        )
    return SandboxDead(folder.id, record.error or "its supervisor exited during boot")


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
    for pid in (record.supervisor_pid, record.qemu_pid):
        if pid and registry.process_alive(pid, folder.id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder.path, ignore_errors=True)
