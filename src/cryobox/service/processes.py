"""Process checkpoints: chosen processes of a sandbox saved by CRIU in the guest, and
restored into this sandbox or another started from the same template.

A checkpoint is a snapshot of purpose ``process`` in the host's snapshot store: CRIU's
image files of the tree, and ``files.tar`` when files are carried with it. So it is
verified like any snapshot before a restore, uploaded to the chunk store (deduplicated,
encrypted for the tenant), expired by the retention policy (as a memory snapshot) and
counted in the tenant's stored bytes.

What the checkpoint records of the tree (its pids, open files, mapped files, pipes) is
read by CRIU's post-dump action while the tree is still frozen: the very state saved.

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
import json
import os
import re
import shlex
import time
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

from cryobox import arguments
from cryobox.errors import (
    CryoboxError,
    InvalidArgument,
    ProcessCheckpointFailed,
    SnapshotIncompatible,
    StorageError,
)
from cryobox.guest.protocol import CHUNK, DEFAULT_PATH
from cryobox.models import CommandRequest, ProcessCheckpointInfo, SnapshotPurpose
from cryobox.sandbox import registry
from cryobox.service.guest_ops import GuestOperations
from cryobox.service.persist import Persistence
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest, SnapshotKind
from cryobox.snapshot.store import SnapshotStore, looks_like_id, new_snapshot
from cryobox.store.keys import LOCAL_TENANT
from cryobox.util import new_id

#: The files carried with a checkpoint (``with_files``), in its snapshot folder beside
#: CRIU's images (kept under CRIU's own names: no archive to pack and unpack under
#: emulation, which cost more than the dump itself).
CARRIED = "files.tar"
#: The probe's description of the tree as CRIU froze it (beside the images, in the guest).
FROZEN = "frozen.json"
#: What a CRIU image's name may be (a hostile guest names the files the host keeps),
#: and the prefix it is kept under (never one of the snapshot folder's own names).
IMAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,120}")
IMAGE_PREFIX = "criu-"
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
#: What the host keeps of a guest command's output (its end), and waits past its timeout.
MAX_OUTPUT = 1 << 20
HOST_GRACE = 30.0
#: Internal commands run with these, never the sandbox's own variables (PYTHONPATH,
#: LD_PRELOAD...), and by absolute path.
PLAIN_ENV = {"PATH": DEFAULT_PATH, "PYTHONPATH": "", "LD_PRELOAD": "", "LANG": "C.UTF-8"}
GUEST_PYTHON = "/usr/bin/python3"
CRIU = "/usr/sbin/criu"
#: Bounds on what the guest's probe may say (it is stored in the manifest).
MAX_PIDS = 4096
MAX_MAPS = 4096
MAX_TEXT = 4096
MAX_WITH_FILES = 256
PIPE_KEY = re.compile(r"pipe:\[[0-9]{1,20}\]")


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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _check_paths(paths: tuple[str, ...]) -> None:
    """``with_files``: absolute guest paths, not too many nor too long.

    :raises InvalidArgument: naming the first that is not.
    """
    if len(paths) > MAX_WITH_FILES:
        raise InvalidArgument(f"with_files: at most {MAX_WITH_FILES} paths")
    for path in paths:
        if (
            not isinstance(path, str)
            or not path.startswith("/")
            or path.strip("/") == ""
            or "\0" in path
            or len(path) > MAX_TEXT
        ):
            raise InvalidArgument(f"with_files: {path!r} is not a guest path below /")


def _text(value: object, most: int = MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not text")
    return value[:most]


def _number(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ValueError(f"{value!r} is not a count")
    return value


def _description(answer: dict[str, Any], pid: int) -> dict[str, Any] | None:
    """What the guest's probe said of ``pid``'s tree, checked and bounded field by field
    (it goes into the manifest, which every listing reads); None: no such process.

    :raises ProcessCheckpointFailed: when the answer is not what the probe says.
    """
    if "error" in answer:
        return None
    try:
        pids = [_number(p) for p in answer["pids"]][:MAX_PIDS]
        if not pids or pids[0] != pid:
            raise ValueError("the tree does not start at the pid asked for")
        if min(pids) < 2:  # (the host signals them: never 0, the group, nor 1, init)
            raise ValueError(f"pid {min(pids)} in the tree")
        maps = {
            _text(path): [_number(size), _number(mtime)]
            for path, (size, mtime) in list(dict(answer["maps"]).items())[:MAX_MAPS]
        }
        pipes = []
        for outside in list(answer["outside_pipes"])[:MAX_PIDS]:
            key, end = _text(outside["pipe"]), outside["end"]
            if not PIPE_KEY.fullmatch(key) or end not in ("in", "out"):
                raise ValueError(f"bad pipe {outside!r}")
            pipes.append({"pipe": key, "end": end})
        return {
            "pids": pids,
            "comms": {str(_number(int(p))): _text(c, 64) for p, c in dict(answer["comms"]).items()},
            "command": _text(answer["command"]),
            "cwd": _text(answer["cwd"]),
            "rss_bytes": _number(answer["rss_bytes"]),
            "open_files": [_text(f) for f in list(answer["open_files"])[:MAX_MAPS]],
            "maps": maps,
            "outside_pipes": pipes,
            "sockets": _number(answer["sockets"]),
            "kernel": _text(answer["kernel"], 200),
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProcessCheckpointFailed(
            "inspection", "the guest", f"the probe's answer is malformed: {exc}"
        ) from exc


def _answer(sandbox_id: str, code: int, output: str) -> dict[str, Any]:
    """The probe's JSON answer (its last line of output).

    :raises ProcessCheckpointFailed: when it failed or said something else.
    """
    try:
        answer = json.loads(output.strip().splitlines()[-1]) if code == 0 else None
    except (ValueError, IndexError, RecursionError):
        answer = None
    if not isinstance(answer, dict):
        raise ProcessCheckpointFailed(
            "inspection", sandbox_id, f"the guest's probe failed ({code}): {output[-500:]}"
        )
    return answer


def _refuse_the_guests_own(described: dict[str, Any], pid: int) -> None:
    """:raises InvalidArgument: when ``pid``'s tree holds the sandbox's own agent."""
    comms = described["comms"]
    guest_own = [p for p, comm in comms.items() if comm.startswith("cryobox-")]
    if guest_own:
        raise InvalidArgument(
            f"pid {pid}'s tree holds the sandbox's own {comms[guest_own[0]]} "
            f"(pid {guest_own[0]}): checkpoint a process it started"
        )


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    """A file's bytes in the agent protocol's chunks, read off the event loop."""
    with open(path, "rb") as handle:
        while data := await asyncio.to_thread(handle.read, CHUNK * 16):
            for start in range(0, len(data), CHUNK):
                yield data[start : start + CHUNK]


def _found(answer: dict[str, Any]) -> dict[str, Any]:
    """The target's probe answer (see :func:`.process_probe.check`), checked.

    :raises ProcessCheckpointFailed: when it is not what the probe says.
    """
    try:
        return {
            "kernel": _text(answer["kernel"], 200),
            "maps_changed": [
                {
                    "path": _text(c["path"]),
                    "saved": _number(c["saved"]),
                    "here": None if c["here"] is None else _number(c["here"]),
                }
                for c in list(answer["maps_changed"])[:MAX_MAPS]
            ],
            "missing": [_text(path) for path in list(answer["missing"])[:MAX_MAPS]],
            "pids_in_use": [
                {"pid": _number(u["pid"]), "comm": _text(u["comm"], 64)}
                for u in list(answer["pids_in_use"])[:MAX_PIDS]
            ],
            "last_pid": _number(answer["last_pid"]),
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProcessCheckpointFailed(
            "restore", "the guest", f"the probe's answer is malformed: {exc}"
        ) from exc


class Processes:
    """Process checkpoints of this host's sandboxes (see the module)."""

    def __init__(self, store: SnapshotStore, persist: Persistence, guest: GuestOperations):
        self.store = store
        self.persist = persist
        self.guest = guest

    async def _run(
        self, sandbox_id: str, argv: list[str], timeout: float = 300.0
    ) -> tuple[int, str]:
        """Run ``argv`` as root in the guest, with a plain environment (not the
        sandbox's variables): its exit code and the end of its output (both streams, at
        most MAX_OUTPUT bytes: a hostile guest may print without end).

        :raises ProcessCheckpointFailed: when it runs past ``timeout`` by the host's clock.
        """
        output = bytearray()

        def keep(_stream: str, data: bytes) -> None:
            output.extend(data)
            if len(output) > MAX_OUTPUT:
                del output[: len(output) - MAX_OUTPUT]

        request = CommandRequest(argv=tuple(argv), user="root", timeout=timeout, env=PLAIN_ENV)
        session = await self.guest.start_command(sandbox_id, request, keep)
        try:
            status = await asyncio.wait_for(session.wait(), timeout + HOST_GRACE)
        except TimeoutError:
            with contextlib.suppress(CryoboxError):
                await session.kill()
            raise ProcessCheckpointFailed(
                "inspection", sandbox_id, f"{argv[0]} did not end within {timeout:.0f} s"
            ) from None
        return status.exit_code, output.decode(errors="replace")

    async def _probe(self, sandbox_id: str, *args: str) -> dict[str, Any]:
        code, output = await self._run(
            sandbox_id, [GUEST_PYTHON, "-I", "-c", _probe_source(), *args]
        )
        return _answer(sandbox_id, code, output)

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
        """Save process ``pid`` and the processes below it (see the module). With
        ``leave_running=False`` CRIU leaves them stopped, and they end only once the
        checkpoint is committed: on any failure they go on running.

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
            if looks_like_id(name):
                raise InvalidArgument(f"name={name!r} looks like a snapshot id: choose another")
        _check_paths(with_files)
        spec = registry.find(sandbox_id).spec()
        described = _description(await self._probe(sandbox_id, "describe", str(pid)), pid)
        if described is None:
            raise InvalidArgument(f"no process {pid} in sandbox {sandbox_id}")
        _refuse_the_guests_own(described, pid)
        checkpoint_id = new_id("snap")
        guest = f"{GUEST_DIR}/{checkpoint_id}"
        pids = [str(p) for p in described["pids"]]
        try:
            await self._run(sandbox_id, ["mkdir", "-p", f"{guest}/images"])
            if with_files:  # first: a path that cannot be carried fails before the dump
                relative = [path.lstrip("/") for path in with_files]
                code, output = await self._run(
                    sandbox_id,
                    ["tar", "-C", "/", "-cpf", f"{guest}/{CARRIED}", "--", *relative],
                )
                if code != 0:
                    raise InvalidArgument(f"with_files: cannot carry them: {output[-500:]}")
            await self._dump(sandbox_id, pid, guest, leave_running=leave_running, tcp=tcp)
            try:
                # The tree as CRIU froze and saved it: a busy process opens files, and
                # starts children, between the first look and the dump.
                code, output = await self._run(sandbox_id, ["cat", f"{guest}/{FROZEN}"])
                frozen = _description(_answer(sandbox_id, code, output), pid)
                if frozen is None:
                    raise ProcessCheckpointFailed(
                        "checkpoint", sandbox_id, f"the frozen tree of {pid} was not found"
                    )
                _refuse_the_guests_own(frozen, pid)
                described, pids = frozen, [str(p) for p in frozen["pids"]]
                images = await self._images(sandbox_id, f"{guest}/images", spec.memory_mib)
                sources = {
                    f"{IMAGE_PREFIX}{image}": (f"{guest}/images/{image}", size)
                    for image, size in images.items()
                }
                if with_files:
                    sources[CARRIED] = (f"{guest}/{CARRIED}", spec.disk_gib << 30)
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
                        },
                    ),
                )
            except BaseException:
                if not leave_running:  # stopped by CRIU, not saved: they go on
                    with contextlib.suppress(CryoboxError):  # (the tree as it is now, too)
                        now = _description(await self._probe(sandbox_id, "describe", str(pid)), pid)
                        pids += [str(p) for p in (now or {}).get("pids", ())]
                    with contextlib.suppress(CryoboxError):
                        await self._run(sandbox_id, ["kill", "-CONT", "--", *set(pids)])
                raise
            if not leave_running:
                await self._run(sandbox_id, ["kill", "-KILL", "--", *pids])
        finally:
            with contextlib.suppress(CryoboxError):
                await self._run(sandbox_id, ["rm", "-rf", guest])
        self.persist.of(tenant).after_capture(manifest)
        return self.info(manifest)

    async def _dump(
        self, sandbox_id: str, pid: int, guest: str, *, leave_running: bool, tcp: str
    ) -> None:
        # CRIU runs the post-dump action while the tree is still frozen, as it was saved.
        await self.guest.write_file(
            sandbox_id, f"{guest}/probe.py", [_probe_source().encode()], 0o600
        )
        action = (
            '#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
            f"exec {GUEST_PYTHON} -I {guest}/probe.py describe {pid} > {guest}/{FROZEN}\n"
        )
        await self.guest.write_file(sandbox_id, f"{guest}/action.sh", [action.encode()], 0o700)
        options = ["--shell-job", "--file-locks", "-v2", "--action-script", f"{guest}/action.sh"]
        options.append("--leave-running" if leave_running else "--leave-stopped")
        if tcp == "established":
            options += ["--tcp-established", "--network-lock", "nftables"]
        else:
            options.append("--tcp-close")
        script = (
            f"mkdir -p {guest}/images && cd {guest} && "
            f"{CRIU} dump -t {pid} -D images -o ../dump.log {' '.join(options)}; code=$?; "
            "if [ $code -ne 0 ]; then cat dump.log; exit $code; fi"
        )
        code, output = await self._run(sandbox_id, ["sh", "-c", script], CRIU_TIMEOUT)
        if code != 0:
            if not leave_running:  # a dump that failed late may have left them stopped
                with contextlib.suppress(CryoboxError):
                    await self._run(sandbox_id, ["kill", "-CONT", "--", str(pid)])
            raise ProcessCheckpointFailed("checkpoint", sandbox_id, _criu_errors(output))

    async def _images(self, sandbox_id: str, folder: str, memory_mib: int) -> dict[str, int]:
        """CRIU's image files in the guest's ``folder`` and their sizes, checked: plain
        names, not too many, and together no larger than the guest's RAM could make them
        (the guest is not trusted to say what the host keeps)."""
        entries = await self.guest.list_dir(sandbox_id, folder)
        bad = [e.name for e in entries if not IMAGE_NAME.fullmatch(e.name) or e.type != "file"]
        if bad or len(entries) > MAX_IMAGES:
            raise ProcessCheckpointFailed(
                "checkpoint", sandbox_id, f"unexpected files among CRIU's images: {bad[:3]}"
            )
        total = sum(e.size for e in entries)
        if total > (memory_mib << 20) * 2:
            raise ProcessCheckpointFailed(
                "checkpoint",
                sandbox_id,
                f"CRIU's images hold {total} bytes, more than the guest's RAM could make",
            )
        return {e.name: e.size for e in sorted(entries, key=lambda e: e.name)}

    async def _keep(
        self, sandbox_id: str, sources: dict[str, tuple[str, int]], manifest: Manifest
    ) -> Manifest:
        """Copy the guest's files (name in the snapshot -> guest path, most bytes) into a
        new snapshot folder and commit it; a file that grows past its bound is refused
        (the guest may keep writing to it, or swap in a device that never ends)."""

        def failed(exc: OSError, temp: Path) -> StorageError:
            return StorageError("saving a process checkpoint", str(temp), str(exc))

        with new_snapshot(self.store, manifest.id, failed) as temp:
            for name, (path, most) in sources.items():
                fd = os.open(temp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    written = 0
                    async for data in self.guest.read_file(sandbox_id, path):
                        written += len(data)
                        if written > most:
                            raise ProcessCheckpointFailed(
                                "checkpoint", sandbox_id, f"{path} grew past {most} bytes"
                            )
                        await asyncio.to_thread(_write_all, fd, data)
                    await asyncio.to_thread(os.fsync, fd)
                finally:
                    os.close(fd)
            described = await asyncio.to_thread(mf.describe_files, temp, list(sources))
            manifest = Manifest.from_json({**manifest.to_json(), "files": described})
            await asyncio.to_thread(self.store.commit, temp, manifest)
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
        guest = f"{GUEST_DIR}/{new_id('restore')}"  # one folder per restore
        try:
            # What the check needs travels as a file (a big tree's would not fit argv).
            wanted = {k: saved.get(k) for k in ("maps", "open_files", "cwd", "pids")}
            wanted["with_files"] = saved.get("with_files", [])
            await self.guest.write_file(
                sandbox_id, f"{guest}/check.json", [json.dumps(wanted).encode()], 0o600
            )
            found = _found(await self._probe(sandbox_id, "check", f"{guest}/check.json"))
            self._refuse_what_differs(manifest, sandbox_id, found)
            top = max(int(pid) for pid in saved["pids"])
            if found["last_pid"] < top:
                # What the restore starts in the guest must not take the tree's pids:
                # the guest's next pids are moved past them first.
                await self._run(
                    sandbox_id, ["sh", "-c", f"echo {top} > /proc/sys/kernel/ns_last_pid"]
                )
            for name in manifest.files:
                path = (
                    f"{guest}/{CARRIED}"
                    if name == CARRIED
                    else f"{guest}/images/{name.removeprefix(IMAGE_PREFIX)}"
                )
                await self.guest.write_file(sandbox_id, path, _chunks(folder / name), 0o600)
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
        carried = ""
        if CARRIED in manifest.files:  # only the paths asked for, whatever the archive holds
            members = " ".join(shlex.quote(p.lstrip("/")) for p in saved.get("with_files", ()))
            carried = f"tar -C / -xpf {CARRIED} -- {members} && "
        script = (
            f"cd {guest} && {carried}"
            f"{' && '.join(opens)} && "
            f"{CRIU} restore -D images -o ../restore.log --pidfile ../pid {' '.join(options)}; "
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
