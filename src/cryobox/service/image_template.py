"""A template built from a container image takes on the image's configuration.

As a container runtime would run it: the image's environment, user and working folder
become every command's defaults in the template's sandboxes (the guest's
:data:`~cryobox.guest.protocol.COMMAND_DEFAULTS`, as a Dockerfile's ENV, USER and
WORKDIR do), and its entrypoint and command are started once, before the machine is
saved, so that every sandbox created from the template has them running.

Only what cryobox carries into the image is used to do it (its static busybox in
``/.cryobox``): an image without a shell (distroless) works too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex

from cryobox.errors import InvalidArgument
from cryobox.guest import protocol as p
from cryobox.image.oci import ImageConfig
from cryobox.image.runtime import GUEST_DIR
from cryobox.models import CommandRequest, Progress
from cryobox.service.commands import collector
from cryobox.service.guest_ops import GuestOperations

BUSYBOX = f"{GUEST_DIR}/bin/busybox"
#: util-linux's setsid, carried: it finds the command on the image's PATH (busybox's own
#: would run its built-in ``sh``, ``env`` or ``nc`` instead of the image's).
SETSID = f"{GUEST_DIR}/bin/setsid"
#: Where the started command's output goes in the guest (as a Dockerfile's CMD's).
COMMAND_LOG = "/var/log/cryobox-cmd.log"
#: Seconds the started command must stay up before the machine is saved.
SETTLE = 1.0


async def apply(
    guest: GuestOperations, sandbox_id: str, config: ImageConfig, say: Progress
) -> ImageConfig:
    """Make ``config``'s environment, user and folder the sandbox's command defaults;
    ``config`` with its user as the guest's account name (for :func:`start`)."""
    defaults: dict[str, object] = {"env": config.env}
    if config.user:
        config = dataclasses.replace(config, user=await _user_name(guest, sandbox_id, config.user))
        defaults["user"] = config.user
    if config.workdir:
        defaults["workdir"] = config.workdir
        code, output = await run(
            guest, sandbox_id, [BUSYBOX, "mkdir", "-p", "--", config.workdir], "root"
        )
        if code != 0:
            raise InvalidArgument(f"the image's WorkingDir {config.workdir}: {output.strip()}")
    text = json.dumps(defaults).encode()
    await guest.write_file(sandbox_id, p.COMMAND_DEFAULTS, [text], 0o644)
    say("the image's environment, user and folder are every command's defaults")
    return config


async def start(
    guest: GuestOperations, sandbox_id: str, config: ImageConfig, say: Progress
) -> None:
    """Start the image's entrypoint and command, detached, and check it stays up
    (``config`` as :func:`apply` returned it).

    :raises InvalidArgument: with its output, when it ends at once.
    """
    if not config.command:
        return
    shown = shlex.join(config.command)
    say(f"starting {shown[:70]}")
    prepare = f"mkdir -p /var/log && : > {COMMAND_LOG} && chmod 644 {COMMAND_LOG}"
    if config.user:
        prepare += f" && {BUSYBOX} chown {shlex.quote(config.user)} {COMMAND_LOG}"
    await run(guest, sandbox_id, [BUSYBOX, "sh", "-c", prepare], "root")
    detach = f'{SETSID} "$@" >{COMMAND_LOG} 2>&1 </dev/null & echo $!'
    argv = [BUSYBOX, "sh", "-c", detach, "sh", *config.command]
    code, output = await run(guest, sandbox_id, argv)
    pid = output.strip()
    await asyncio.sleep(SETTLE)
    alive, _ = await run(guest, sandbox_id, [BUSYBOX, "kill", "-0", pid], "root")
    if code != 0 or not pid.isdigit() or alive != 0:
        _, log = await run(guest, sandbox_id, [BUSYBOX, "tail", "-c", "2000", COMMAND_LOG], "root")
        raise InvalidArgument(f"the image's command {shown} ended at once:\n{log}")


async def run(
    guest: GuestOperations, sandbox_id: str, argv: list[str], user: str | None = None
) -> tuple[int, str]:
    """Run ``argv`` in the sandbox (as ``user``, else the defaults' user): its exit
    code and output (stdout and stderr)."""
    output = bytearray()
    session = await guest.start_command(
        sandbox_id, CommandRequest(argv=tuple(argv), user=user, timeout=120), collector(output)
    )
    result = await session.wait()
    return result.exit_code, output.decode(errors="replace")


async def _user_name(guest: GuestOperations, sandbox_id: str, user: str) -> str:
    """The account name of the image's ``User`` (``name``, ``uid``, either with
    ``:group``): cryobox runs commands as named users of the guest's /etc/passwd.

    :raises InvalidArgument: when the image has no such account.
    """
    name = user.partition(":")[0]
    code, passwd = await run(guest, sandbox_id, [BUSYBOX, "cat", "/etc/passwd"], "root")
    for line in passwd.splitlines() if code == 0 else ():
        fields = line.split(":")
        if len(fields) >= 3 and name in (fields[0], fields[2]):
            return fields[0]
    raise InvalidArgument(
        f"the image's user {user!r} has no entry in its /etc/passwd "
        "(cryobox runs commands as the guest's named users)"
    )


__all__ = ["apply", "run", "start"]
