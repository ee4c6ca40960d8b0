"""Build a template from a Dockerfile, on top of the SDK (so it runs embedded or against
a ``cryobox server`` alike).

A build sandbox starts from the Dockerfile's base (``FROM cryobox``: the image booted;
``FROM <template>``: that template restored) or from the newest cached step, runs the
remaining steps (:mod:`.dockerfile`), and takes a disk snapshot after each one, named
by the step's cache key: a rebuild boots from the last step whose key is unchanged and
runs only what follows it. Docker's layers are files only, and so are these (a RUN's
processes end with it). At the end the build writes the command defaults (ENV, USER,
WORKDIR) into the guest, starts CMD/ENTRYPOINT, and saves the running machine as the
template (:meth:`AsyncSandbox.save_template`): every sandbox created from it has that
process running and those defaults. The build sandbox is killed whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import shlex
import stat
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from cryobox.errors import CryoboxError, InvalidArgument
from cryobox.guest import protocol as p
from cryobox.models import Progress, SnapshotInfo

from .dockerfile import (
    OWN_IMAGE,
    Plan,
    Step,
    copied_digest,
    defaults_json,
    files_digest,
    plan,
    read_copied,
)

if TYPE_CHECKING:
    from .async_sandbox import AsyncSandbox

#: Where a template's CMD writes its output in the guest.
COMMAND_LOG = "/var/log/cryobox-cmd.log"
#: Cached steps are disk snapshots named this and their key.
CACHE_PREFIX = "dockerfile-"
#: Seconds a started CMD must stay up before the template is saved.
COMMAND_SETTLE = 1.0


def cache_name(origin: str, key: str) -> str:
    """A cached step's snapshot name: its key, made unique to the base it builds on."""
    return CACHE_PREFIX + hashlib.sha256(f"{origin}\0{key}".encode()).hexdigest()[:32]


def _archive(step: Step, context: Path) -> Path:
    """A tar file on the host holding the step's files at their guest paths, owned by
    root (``--chown`` is applied in the guest), made from the bytes read once here and
    checked against what the Dockerfile was read with (its cache key).

    :raises InvalidArgument: when a file changed since, or now leads out of the context.
    """
    handle, name = tempfile.mkstemp(prefix="cryobox-copy-", suffix=".tar")
    os.close(handle)
    copied: list[tuple[str, int, bytes | None]] = []
    try:
        with tarfile.open(name, "w") as tar:
            for host, guest in step.files:
                mode, data = read_copied(host, context)
                member = tarfile.TarInfo(guest.lstrip("/"))
                member.mode = stat.S_IMODE(mode)
                member.uname = member.gname = "root"
                if data is None:
                    member.type = tarfile.DIRTYPE
                    tar.addfile(member)
                else:
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
                copied.append((guest, mode, data))
        # The digest of the very bytes archived, not of a second read.
        if copied_digest(copied) != step.digest:
            raise InvalidArgument(
                f"Dockerfile line {step.line}: {step.text}: its files changed during the build"
            )
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


async def _shell(sandbox: AsyncSandbox, step: Step, command: str) -> None:
    """Run ``command`` as root for ``step``; a failure names the step."""
    result = await sandbox.commands.run(["/bin/sh", "-c", command], user="root", cwd="/")
    if result.exit_code != 0:
        raise InvalidArgument(
            f"Dockerfile line {step.line}: {step.text}: {result.stderr.strip()[-2000:]}"
        )


async def _run(sandbox: AsyncSandbox, step: Step, say: Progress) -> None:
    output = bytearray()

    def latest(text: str) -> None:
        output.extend(text.encode())
        lines = [line for line in text.splitlines() if line.strip()]
        if lines:
            say(f"  {lines[-1].strip()[:80]}")

    result = await sandbox.commands.run(
        step.shell if step.shell is not None else list(step.argv),
        env=dict(step.settings.env),
        cwd=step.settings.workdir,
        user=step.settings.user,
        on_stdout=latest,
        on_stderr=latest,
    )
    if result.exit_code != 0:
        raise InvalidArgument(
            f"Dockerfile line {step.line}: {step.text} exited with {result.exit_code}:\n"
            + output.decode(errors="replace")[-2000:]
        )


async def _copy(sandbox: AsyncSandbox, step: Step, context: Path) -> None:
    """Unpack the step's files (or its archive) into the guest as root, then give them
    to ``--chown``'s user and group (names or numbers; an unknown name is refused)."""
    inbox = f"/tmp/.cryobox-build-{os.urandom(6).hex()}"
    if step.chown:
        await _shell(sandbox, step, _owner_check(step.chown))
    if step.archive is not None:
        if files_digest([(step.archive, step.target)], context) != step.digest:
            raise InvalidArgument(
                f"Dockerfile line {step.line}: {step.text}: the archive changed during the build"
            )
        local = step.archive
    else:
        local = _archive(step, context)
    try:
        await sandbox.files.upload(local, inbox)
    finally:
        if step.archive is None:
            local.unlink(missing_ok=True)
    owner = shlex.quote(step.chown or "")
    if step.archive is not None:
        target = shlex.quote(step.target)
        give = f" && chown -R -- {owner} {target}" if step.chown else ""
        command = f"mkdir -p -- {target} && tar -x -f {inbox} -C {target}{give}"
    else:
        paths = " ".join(shlex.quote(guest) for _host, guest in step.files)
        give = f" && chown -h -- {owner} {paths}" if step.chown else ""
        command = f"tar -x -p --same-owner -f {inbox} -C /{give}"
    try:
        await _shell(sandbox, step, command)
    finally:
        with contextlib.suppress(CryoboxError):
            await sandbox.commands.run(["rm", "-f", inbox], user="root")


def _owner_check(chown: str) -> str:
    """A shell test that ``--chown``'s user and group exist in the guest (a number is
    taken as it is, as Docker does)."""
    user, _, group = chown.partition(":")
    checks = []
    if not user.isdigit():
        checks.append(
            f"getent passwd {shlex.quote(user)} >/dev/null || "
            f"{{ echo 'no user {user} in the guest' >&2; exit 1; }}"
        )
    if group and not group.isdigit():
        checks.append(
            f"getent group {shlex.quote(group)} >/dev/null || "
            f"{{ echo 'no group {group} in the guest' >&2; exit 1; }}"
        )
    return " && ".join(checks) or "true"


async def _step(sandbox: AsyncSandbox, step: Step, say: Progress, context: Path) -> None:
    if step.kind == "run":
        await _run(sandbox, step, say)
    elif step.kind == "copy":
        await _copy(sandbox, step, context)
    else:
        await _shell(sandbox, step, f"mkdir -p {shlex.quote(step.target)}")


async def _inherited(sandbox: AsyncSandbox) -> dict[str, object]:
    """The command defaults the build's base already had (a template built from a
    Dockerfile), or none."""
    if not await sandbox.files.exists(p.COMMAND_DEFAULTS):
        return {}
    try:
        found = json.loads(await sandbox.files.read(p.COMMAND_DEFAULTS))
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


async def _finish(sandbox: AsyncSandbox, read: Plan, say: Progress) -> None:
    """Write the command defaults, then start CMD/ENTRYPOINT and check it stays up."""
    defaults = defaults_json(read, await _inherited(sandbox))
    folder = str(PurePosixPath(p.COMMAND_DEFAULTS).parent)
    await sandbox.commands.run(["mkdir", "-p", folder], user="root")
    await sandbox.files.write(p.COMMAND_DEFAULTS, defaults)
    settled = json.loads(defaults)
    workdir = settled.get("workdir")
    if workdir:
        await sandbox.commands.run(["mkdir", "-p", workdir], user="root")
    if not read.command:
        return
    say(f"starting {shlex.join(read.command)[:70]}")
    user = settled.get("user") or "root"
    prepare = f"install -m 644 -o {shlex.quote(user)} /dev/null {COMMAND_LOG}"
    await sandbox.commands.run(["/bin/sh", "-c", prepare], user="root")
    started = await sandbox.commands.run(
        f"setsid {shlex.join(read.command)} >{COMMAND_LOG} 2>&1 </dev/null & echo $!"
    )
    pid = started.stdout.strip()
    await asyncio.sleep(COMMAND_SETTLE)
    alive = await sandbox.commands.run(["kill", "-0", pid], user="root")
    if started.exit_code != 0 or not pid.isdigit() or alive.exit_code != 0:
        log = await sandbox.files.read_text(COMMAND_LOG)
        raise InvalidArgument(
            f"Dockerfile: the command {shlex.join(read.command)} ended at once:\n{log[-2000:]}"
        )


async def build_from_dockerfile(
    name: str,
    dockerfile: Path,
    context: Path,
    build_args: Mapping[str, str],
    *,
    cpus: int,
    memory_mib: int,
    disk_gib: int,
    progress: Progress | None,
    api_url: str | None,
    api_key: str | None,
    sandboxes: type[AsyncSandbox],
) -> SnapshotInfo:
    """Build template ``name`` from ``dockerfile`` with files from ``context``, with
    ``sandboxes`` (the SDK's class, passed in: it calls this module).

    :raises InvalidArgument: for a Dockerfile cryobox cannot build (naming the line), a
        missing base template, or a step that fails (with its output).
    """
    say = progress or (lambda _line: None)
    try:
        text = dockerfile.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"dockerfile={str(dockerfile)!r}: cannot be read ({exc})") from None
    if not context.is_dir():
        raise InvalidArgument(f"context={str(context)!r}: not a folder")
    read = plan(text, context, build_args)
    for unused in read.unused_args:
        say(f"build argument {unused} is not declared by an ARG: ignored")
    if read.base == OWN_IMAGE:
        origin = f"{OWN_IMAGE}:{cpus}:{memory_mib}:{disk_gib}"
    else:
        templates = {t.name: t for t in await sandboxes.templates(api_url=api_url, api_key=api_key)}
        if read.base not in templates:
            raise InvalidArgument(f"Dockerfile: FROM {read.base}: no such template")
        origin = f"template:{templates[read.base].snapshot_id}"
    keys = [cache_name(origin, step.key) for step in read.steps]
    names = {s.name for s in await sandboxes.snapshots(api_url=api_url, api_key=api_key) if s.name}
    reused = max((number for number, key in enumerate(keys, 1) if key in names), default=0)
    total = len(read.steps)
    if reused:
        say(f"steps 1-{reused} of {total}: cached")
        sandbox = await sandboxes.create(
            from_snapshot=keys[reused - 1], timeout=3600, api_url=api_url, api_key=api_key
        )
    elif read.base == OWN_IMAGE:
        say("booting the image")
        sandbox = await sandboxes.create(
            "base",
            cpus=cpus,
            memory_mib=memory_mib,
            disk_gib=disk_gib,
            timeout=3600,
            api_url=api_url,
            api_key=api_key,
        )
    else:
        sandbox = await sandboxes.create(read.base, timeout=3600, api_url=api_url, api_key=api_key)
    try:
        for number in range(reused + 1, total + 1):
            step = read.steps[number - 1]
            say(f"step {number}/{total}: {step.text[:70]}")
            await _step(sandbox, step, say, read.context)
            await sandbox.snapshot(keys[number - 1], memory=False, overwrite=True)
        await _finish(sandbox, read, say)
        say("saving the machine")
        return await sandbox.save_template(name, ports=read.ports)
    finally:
        with contextlib.suppress(CryoboxError):
            await asyncio.shield(sandbox.kill())


__all__ = ["build_from_dockerfile", "cache_name"]
