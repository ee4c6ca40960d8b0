"""Process checkpoints: chosen processes of a sandbox saved by CRIU in the guest, and
restored into this sandbox or another started from the same template.

A checkpoint is a snapshot of purpose ``process`` in the host's snapshot store: CRIU's
image files of the tree, and ``files.tar`` when files are carried with it. So it is
verified like any snapshot before a restore, uploaded to the chunk store (deduplicated,
encrypted for the tenant), expired by the retention policy (as a memory snapshot) and
counted in the tenant's stored bytes.

What CRIU needs is checked before anything starts, and refused by name:

- the files the processes map (their executable, libraries) must be the very ones in the
  target (same size and mtime: a sandbox of the same image and template), and the guest
  kernel the same release;
- the regular files they have open must exist in the target (unless carried);
- their pids must be free there: CRIU gives each process its pid again.

What a restored process sees:

- its pipes to processes outside the tree (a command's output going to the caller, say)
  are replaced: its output goes to ``/var/log/cryobox/process-<checkpoint id>.log`` in the
  target, its input reads from ``/dev/null``;
- its TCP connections: ``tcp="established"`` restores them (CRIU's TCP repair) when the
  target is the sandbox it was taken in; otherwise they are closed (a read returns an
  error or end of file, as after a reset);
- listening sockets, open files (at their offsets), its working directory and memory as
  they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shlex
import time
from importlib import resources
from typing import Any

from cryobox import arguments
from cryobox.errors import (
    CryoboxError,
    InvalidArgument,
    ProcessCheckpointFailed,
    SnapshotIncompatible,
    StorageError,
)
from cryobox.guest.protocol import CHUNK
from cryobox.models import CommandRequest, ProcessCheckpointInfo, SnapshotPurpose
from cryobox.sandbox import registry
from cryobox.service.guest_ops import GuestOperations
from cryobox.service.persist import Persistence
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest, SnapshotKind
from cryobox.snapshot.store import SnapshotStore
from cryobox.store.keys import LOCAL_TENANT
from cryobox.util import new_id

#: The files carried with a checkpoint (``with_files``), in its snapshot folder beside
#: CRIU's images (kept under CRIU's own names: no archive to pack and unpack under
#: emulation, which cost more than the dump itself).
CARRIED = "files.tar"
#: What a CRIU image's name may be (a hostile guest names the files the host keeps).
IMAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,120}")
MAX_IMAGES = 10_000
#: Where the guest keeps a checkpoint's files while it is taken or restored.
GUEST_DIR = "/var/lib/cryobox/criu"
#: Where a restored process's output goes when its reader was outside the tree.
GUEST_LOG_DIR = "/var/log/cryobox"
TCP_MODES = ("close", "established")
#: A dump or restore of a large process under emulation takes a while.
CRIU_TIMEOUT = 900.0
#: The first fd a restore hands CRIU in place of an outside pipe's end.
FIRST_INHERITED_FD = 10


def _probe_source() -> str:
    return (resources.files("cryobox.service") / "process_probe.py").read_text()


def guest_log(checkpoint_id: str) -> str:
    """Where the restored processes' output goes in the target (see the module)."""
    return f"{GUEST_LOG_DIR}/process-{checkpoint_id}.log"


def _criu_errors(log: str) -> str:
    """CRIU's error lines from its log (the reason it gives), else the log's tail."""
    if "criu: not found" in log:
        return (
            "this sandbox's guest image has no CRIU (it predates process checkpoints): "
            "checkpoint processes of a sandbox started from a current image"
        )
    lines = [line for line in log.splitlines() if "Error" in line]
    return "\n".join((lines or log.splitlines())[-8:]).strip() or "no output"


class Processes:
    """Process checkpoints of this host's sandboxes (see the module)."""

    def __init__(self, store: SnapshotStore, persist: Persistence, guest: GuestOperations):
        self.store = store
        self.persist = persist
        self.guest = guest

    async def _run(
        self, sandbox_id: str, argv: list[str], timeout: float = 300.0
    ) -> tuple[int, str]:
        """Run ``argv`` as root in the guest: its exit code and its output (both streams)."""
        output = bytearray()
        session = await self.guest.start_command(
            sandbox_id,
            CommandRequest(argv=tuple(argv), user="root", timeout=timeout),
            lambda _stream, data: output.extend(data),
        )
        status = await session.wait()
        return status.exit_code, output.decode(errors="replace")

    async def _probe(self, sandbox_id: str, *args: str) -> dict[str, Any]:
        code, output = await self._run(sandbox_id, ["python3", "-c", _probe_source(), *args])
        try:
            answer = json.loads(output.strip().splitlines()[-1]) if code == 0 else None
        except (ValueError, IndexError):
            answer = None
        if not isinstance(answer, dict):
            raise ProcessCheckpointFailed(
                "inspection", sandbox_id, f"the guest's probe failed ({code}): {output[-500:]}"
            )
        return answer

    def info(self, manifest: Manifest) -> ProcessCheckpointInfo:
        upload = self.persist.upload_state(manifest.id)
        return ProcessCheckpointInfo.from_manifest(
            manifest.to_json(), location=str(upload.get("state", "local"))
        )

    # ------------------------------------------------------------------ checkpoint

    async def checkpoint(
        self,
        sandbox_id: str,
        pid: int,
        name: str | None = None,
        *,
        leave_running: bool = True,
        tcp: str = "close",
        with_files: tuple[str, ...] = (),
        tenant: str = LOCAL_TENANT,
    ) -> ProcessCheckpointInfo:
        """Save process ``pid`` and the processes below it (see the module).

        :raises InvalidArgument: a bad pid (missing, the guest's own), tcp mode or path.
        :raises ProcessCheckpointFailed: CRIU's reason, when it cannot dump the tree.
        :raises StorageError: when the host cannot hold the copy.
        """
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 2:
            raise InvalidArgument(f"pid={pid!r}: a process id of the guest (2 or more)")
        if tcp not in TCP_MODES:
            raise InvalidArgument(f"tcp={tcp!r}: one of {', '.join(TCP_MODES)}")
        if name is not None:
            arguments.snapshot_name("name", name)
        for path in with_files:
            if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
                raise InvalidArgument(f"with_files: {path!r} is not an absolute guest path")
        spec = registry.find(sandbox_id).spec()
        described = await self._probe(sandbox_id, "describe", str(pid))
        if "error" in described:
            raise InvalidArgument(f"no process {pid} in sandbox {sandbox_id}")
        comms = described["comms"]
        guest_own = [p for p, comm in comms.items() if comm.startswith("cryobox-")]
        if guest_own:
            raise InvalidArgument(
                f"pid {pid}'s tree holds the sandbox's own {comms[guest_own[0]]} "
                f"(pid {guest_own[0]}): checkpoint a process it started"
            )
        checkpoint_id = new_id("snap")
        guest = f"{GUEST_DIR}/{checkpoint_id}"
        await self._dump(sandbox_id, pid, guest, leave_running=leave_running, tcp=tcp)
        try:
            if with_files:
                relative = [path.lstrip("/") for path in with_files]
                code, output = await self._run(
                    sandbox_id, ["tar", "-C", "/", "-cpf", f"{guest}/{CARRIED}", "--", *relative]
                )
                if code != 0:
                    raise InvalidArgument(f"with_files: cannot carry them: {output[-500:]}")
            images = await self._images(sandbox_id, f"{guest}/images", spec.memory_mib)
            sources = {name: f"{guest}/images/{name}" for name in images}
            if with_files:
                sources[CARRIED] = f"{guest}/{CARRIED}"
            manifest = await self._keep(
                sandbox_id,
                sources,
                Manifest(
                    id=checkpoint_id,
                    kind=SnapshotKind.DISK,
                    purpose=SnapshotPurpose.PROCESS,
                    name=name,
                    created_at=time.time(),
                    source_sandbox=sandbox_id,
                    parent=None,
                    image_id=spec.image_id,
                    cpus=0,
                    memory_mib=0,
                    disk_gib=0,
                    disk_chain=(),
                    ports=(),
                    ram_in_stream=False,
                    process={
                        **described,
                        "pid": pid,
                        "tcp": tcp,
                        "leave_running": leave_running,
                        "with_files": list(with_files),
                        "template": spec.template,
                        "images": images,
                    },
                ),
            )
        finally:
            with contextlib.suppress(CryoboxError):
                await self._run(sandbox_id, ["rm", "-rf", guest])
        self.persist.of(tenant).after_capture(manifest)
        return self.info(manifest)

    async def _dump(
        self, sandbox_id: str, pid: int, guest: str, *, leave_running: bool, tcp: str
    ) -> None:
        options = ["--shell-job", "--file-locks", "-v2"]
        if leave_running:
            options.append("--leave-running")
        if tcp == "established":
            options += ["--tcp-established", "--network-lock", "nftables"]
        else:
            options.append("--tcp-close")
        script = (
            f"mkdir -p {guest}/images && cd {guest} && "
            f"criu dump -t {pid} -D images -o ../dump.log {' '.join(options)}; code=$?; "
            "if [ $code -ne 0 ]; then cat dump.log; exit $code; fi"
        )
        code, output = await self._run(sandbox_id, ["sh", "-c", script], CRIU_TIMEOUT)
        if code != 0:
            with contextlib.suppress(CryoboxError):
                await self._run(sandbox_id, ["rm", "-rf", guest])
            raise ProcessCheckpointFailed("checkpoint", sandbox_id, _criu_errors(output))

    async def _images(self, sandbox_id: str, folder: str, memory_mib: int) -> list[str]:
        """The names of CRIU's image files in the guest's ``folder``, checked: plain
        names, not too many, and together no larger than the guest's RAM could make them
        (the guest is not trusted to say what the host keeps)."""
        entries = await self.guest.list_dir(sandbox_id, folder)
        names = sorted(e.name for e in entries)
        bad = [n for n in names if not IMAGE_NAME.fullmatch(n) or n == CARRIED]
        total = sum(e.size for e in entries)
        if bad or len(names) > MAX_IMAGES or any(e.type != "file" for e in entries):
            raise ProcessCheckpointFailed(
                "checkpoint", sandbox_id, f"unexpected files among CRIU's images: {bad[:3]}"
            )
        if total > (memory_mib << 20) * 2:
            raise ProcessCheckpointFailed(
                "checkpoint",
                sandbox_id,
                f"CRIU's images hold {total} bytes, more than the guest's RAM could make",
            )
        return names

    async def _keep(self, sandbox_id: str, sources: dict[str, str], manifest: Manifest) -> Manifest:
        """Copy the guest's files (name in the snapshot -> guest path) into a new snapshot
        folder and commit it."""
        temp = await asyncio.to_thread(self.store.begin, manifest.id)
        try:
            for name, path in sources.items():
                fd = os.open(temp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    async for data in self.guest.read_file(sandbox_id, path):
                        await asyncio.to_thread(os.write, fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            described = await asyncio.to_thread(mf.describe_files, temp, list(sources))
            manifest = Manifest.from_json({**manifest.to_json(), "files": described})
            await asyncio.to_thread(self.store.commit, temp, manifest)
        except OSError as exc:
            self.store.abandon(temp)
            raise StorageError("saving a process checkpoint", str(temp), str(exc)) from exc
        except BaseException:
            self.store.abandon(temp)
            raise
        return manifest

    # ------------------------------------------------------------------ restore

    async def restore(self, ref: str, sandbox_id: str, *, tenant: str = LOCAL_TENANT) -> int:
        """Restore the checkpoint ``ref`` into the running sandbox ``sandbox_id``; the pid
        of its root process (the one it had: CRIU keeps pids).

        :raises SnapshotNotFound: :raises SnapshotVerificationFailed: a file altered.
        :raises SnapshotIncompatible: another guest kernel, or files it maps that differ.
        :raises InvalidArgument: open files missing in the target, or its pids in use.
        :raises ProcessCheckpointFailed: CRIU's reason; the target runs on.
        """
        manifest = await self.persist.of(tenant).local_or_pulled(ref)
        if manifest.purpose is not SnapshotPurpose.PROCESS:
            raise InvalidArgument(
                f"snapshot {ref!r} is a {manifest.purpose.value}, not a process checkpoint"
            )
        folder = self.store.folder(manifest.id)
        await asyncio.to_thread(mf.verify, folder, manifest)
        saved = manifest.process
        found = await self._probe(sandbox_id, "check", json.dumps(saved))
        self._refuse_what_differs(manifest, sandbox_id, found)
        guest = f"{GUEST_DIR}/{manifest.id}"
        top = max(int(pid) for pid in saved["pids"])
        if int(found["last_pid"]) < top:
            # What the restore starts in the guest must not take the tree's pids: the
            # guest's next pids are moved past them first.
            await self._run(sandbox_id, ["sh", "-c", f"echo {top} > /proc/sys/kernel/ns_last_pid"])
        try:
            for name in manifest.files:
                with open(folder / name, "rb") as handle:
                    chunks = iter(functools.partial(handle.read, CHUNK), b"")
                    path = f"{guest}/{name}" if name == CARRIED else f"{guest}/images/{name}"
                    await self.guest.write_file(sandbox_id, path, chunks, 0o600)
            return await self._restore(manifest, sandbox_id, guest)
        finally:
            with contextlib.suppress(CryoboxError):
                await self._run(sandbox_id, ["rm", "-rf", guest])

    def _refuse_what_differs(
        self, manifest: Manifest, sandbox_id: str, found: dict[str, Any]
    ) -> None:
        saved = manifest.process
        if found["kernel"] != saved["kernel"]:
            raise SnapshotIncompatible(
                manifest.id,
                "the guest kernel",
                saved["kernel"],
                found["kernel"],
                "CRIU restores a process only on the kernel it ran on",
            )
        if found["maps_changed"]:
            first = found["maps_changed"][0]
            here = "missing" if first["here"] is None else f"{first['here']} bytes"
            target_image = registry.find(sandbox_id).spec().image_id
            image = (
                f"the checkpoint was taken on image {manifest.image_id}, "
                f"{sandbox_id} runs image {target_image}"
                if target_image != manifest.image_id
                else f"{sandbox_id} has other files than the image the process ran on"
            )
            raise SnapshotIncompatible(
                manifest.id,
                f"{first['path']} (mapped by the process)",
                f"{first['saved']} bytes",
                here,
                f"{image}; {len(found['maps_changed'])} mapped file(s) differ: a process "
                "checkpoint restores into a sandbox of the same image and template",
            )
        if found["missing"]:
            raise InvalidArgument(
                f"process checkpoint {manifest.id} needs what {sandbox_id} lacks: "
                f"{', '.join(found['missing'])} (open in the process, or its working "
                "folder; make them, or carry them with with_files=[...])"
            )
        if found["pids_in_use"]:
            first = found["pids_in_use"][0]
            raise InvalidArgument(
                f"pid {first['pid']} is in use in {sandbox_id} by {first['comm']!r}: CRIU "
                "restores each process with its pid (end that process, or restore into "
                "another sandbox)"
            )

    async def _restore(self, manifest: Manifest, sandbox_id: str, guest: str) -> int:
        saved = manifest.process
        same_sandbox = manifest.source_sandbox == sandbox_id
        options = ["--shell-job", "--file-locks", "--restore-detached", "-v2"]
        if saved.get("tcp") == "established" and same_sandbox:
            options += ["--tcp-established", "--network-lock", "nftables"]
        else:
            options.append("--tcp-close")
        opens = [f"mkdir -p {GUEST_LOG_DIR}"]
        for number, outside in enumerate(saved.get("outside_pipes", ())):
            fd = FIRST_INHERITED_FD + number
            if outside["end"] == "out":
                opens.append(f"exec {fd}>>{guest_log(manifest.id)}")
            else:
                opens.append(f"exec {fd}</dev/null")
            options += ["--inherit-fd", shlex.quote(f"fd[{fd}]:{outside['pipe']}")]
        carried = f"tar -C / -xpf {CARRIED} && " if CARRIED in manifest.files else ""
        script = (
            f"cd {guest} && {carried}"
            f"{' && '.join(opens)} && "
            f"criu restore -D images -o ../restore.log --pidfile ../pid {' '.join(options)}; "
            "code=$?; if [ $code -ne 0 ]; then cat restore.log; exit $code; fi; cat pid"
        )
        code, output = await self._run(sandbox_id, ["bash", "-c", script], CRIU_TIMEOUT)
        if code != 0:
            raise ProcessCheckpointFailed("restore", sandbox_id, _criu_errors(output))
        try:
            return int(output.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ProcessCheckpointFailed(
                "restore", sandbox_id, f"CRIU gave no pid: {output[-300:]}"
            ) from exc

    # ------------------------------------------------------------------ catalog

    async def list(self, ids: set[str] | None = None) -> list[ProcessCheckpointInfo]:
        """This host's process checkpoints (only ``ids``, when given), oldest first."""
        return [
            self.info(m)
            for m in self.store.all()
            if m.purpose is SnapshotPurpose.PROCESS and (ids is None or m.id in ids)
        ]

    def find(self, ref: str) -> Manifest:
        """:raises SnapshotNotFound: :raises InvalidArgument: when ``ref`` is not one."""
        manifest = self.store.get(ref)
        if manifest.purpose is not SnapshotPurpose.PROCESS:
            raise InvalidArgument(
                f"{ref!r} is a {manifest.purpose.value}, not a process checkpoint"
            )
        return manifest
