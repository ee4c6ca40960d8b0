"""Warm pools: sandboxes restored from a template ahead of time, claimed by ``create()``.

A restore costs about half a second here (QEMU's start, the device state, and the
guest's first answer while TCG translates its code again); a pooled sandbox has paid
all of it. ``create()`` from a pooled template claims a waiting member, gives it its
caller's settings and a fresh identity, and answers.

On disk (``STATE/pool/``):

- ``sizes.json``: members wanted per template (``cryobox pool set``); the default
  template wants one unless said otherwise; ``CRYOBOX_POOL_SIZE`` overrides the
  default template's size, and ``0`` there turns every pool off.
- ``TEMPLATE/SANDBOX_ID``: one file per member ready to be claimed, naming the
  template snapshot it was restored from. Members are ordinary sandboxes (their
  folders under ``sandboxes/``) that lists do not show (their spec's ``pool``).
- ``refill.lock``: held by the one refill process at work; ``wanted`` changes on each
  claim, so a refill about to exit sees a claim that came after its last look.

A claim is the removal of a member's file: ``unlink`` succeeds for exactly one
process, so a member is never handed out twice, across processes and hosts' threads.
The refill is a separate process (``python -m cryobox.service.refill``, its work in
:mod:`.pool_refill`), started after
a claim and niced where its priority can be restored on claim, so it never holds up
the caller and outlives a short script.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from cryobox import config
from cryobox.arguments import whole_number
from cryobox.models import NetworkJson
from cryobox.sandbox import priority
from cryobox.sandbox.launcher import relevant_env
from cryobox.util import lock_held, open_log, write_json_atomic

log = logging.getLogger("cryobox.pool")

#: Members wanted when nothing was configured.
DEFAULT_SIZES = {"default": 1}
#: Most members one template may keep.
MAX_SIZE = config.MAX_POOL_SIZE
#: Seconds a member may wait unclaimed before it ends (a refill replaces it).
MEMBER_LIFETIME = 24 * 3600.0
#: Seconds a refill waits before it starts a VM: a claimed sandbox's first commands come
#: right after its create() and would otherwise share the cores with a restore.
REFILL_DELAY = 1.0
#: Host memory (MiB) a refill leaves free beyond the member's RAM.
MEMORY_MARGIN_MIB = 1024


@dataclass(frozen=True)
class Member:
    """One waiting sandbox, as its pool file says."""

    sandbox_id: str
    template: str
    snapshot_id: str
    ready_at: float
    #: Its network policy's JSON form: a claim asks for the same.
    network: NetworkJson = "internet"
    #: :func:`env_digest` of the refill that made it: a claim asks for the same.
    env: str = ""


#: Variables that size or drive pools: the same member serves callers that differ here.
_POOL_VARIABLES = ("CRYOBOX_POOL_SIZE", "CRYOBOX_POOL_REFILL", "CRYOBOX_POOL_REFILL_DELAY")


def env_digest() -> str:
    """What of this process's environment a sandbox's start depends on (as the launcher's
    spare supervisor checks): a member made under other settings (network isolation, the
    accelerator, the store...) is not handed to this caller."""
    relevant = sorted((k, v) for k, v in relevant_env().items() if k not in _POOL_VARIABLES)
    return hashlib.sha256(json.dumps(relevant).encode()).hexdigest()[:16]


def root() -> Path:
    path = config.state_dir() / "pool"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def folder(template: str) -> Path:
    path = root() / template
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def sizes() -> dict[str, int]:
    """Members wanted per template."""
    try:
        configured = json.loads((root() / "sizes.json").read_text())
    except (OSError, ValueError):
        configured = {}
    wanted = {**DEFAULT_SIZES, **{str(k): int(v) for k, v in configured.items()}}
    override = os.environ.get("CRYOBOX_POOL_SIZE", "").strip()
    if override:
        size = whole_number("CRYOBOX_POOL_SIZE", _integer(override), 0, MAX_SIZE)
        if size == 0:
            return {}
        wanted["default"] = size
    return {name: size for name, size in wanted.items() if size > 0}


def _integer(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def set_size(template: str, size: int) -> None:
    """Keep ``size`` members of ``template`` waiting (0: none)."""
    whole_number("size", size, 0, MAX_SIZE)
    config.check_settings()  # a refill would fail on a bad setting, with nobody told
    path = root() / "sizes.json"
    try:
        configured = json.loads(path.read_text())
    except (OSError, ValueError):
        configured = {}
    configured[template] = size
    write_json_atomic(path, configured)


def members(template: str | None = None) -> list[Member]:
    """Members ready to be claimed, oldest first."""
    found = []
    templates = [template] if template else [p.name for p in root().iterdir() if p.is_dir()]
    for name in templates:
        for path in folder(name).iterdir():
            if path.name.startswith("."):
                continue
            with contextlib.suppress(OSError, ValueError, TypeError):
                found.append(Member(**json.loads(path.read_text())))
    return sorted(found, key=lambda m: m.ready_at)


def offer(member: Member) -> None:
    """Make a member claimable."""
    write_json_atomic(folder(member.template) / member.sandbox_id, asdict(member))


def withdraw(member: Member) -> bool:
    """Take a member out of the pool; True for the one process that did."""
    try:
        (folder(member.template) / member.sandbox_id).unlink()
    except FileNotFoundError:
        return False
    return True


def claims(template: str, snapshot_id: str, network: NetworkJson) -> Iterator[str]:
    """Ids of members restored from ``snapshot_id`` with the ``network`` policy under
    this process's settings, each withdrawn for the caller."""
    env = env_digest()
    for member in members(template):
        fits = member.snapshot_id == snapshot_id and member.network == network
        if fits and member.env == env and withdraw(member):
            yield member.sandbox_id


# ------------------------------------------------------------------ the refill process


def wanted_token() -> str:
    with contextlib.suppress(OSError):
        return (root() / "wanted").read_text()
    return ""


def wanted_sizes() -> dict[str, int]:
    """The sizes the latest request saw (its environment may differ from the refill's:
    the refill serves the latest request), else this process's own."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        asked = json.loads(wanted_token())["sizes"]
        return {str(name): int(size) for name, size in asked.items()}
    return sizes()


_started: list[subprocess.Popen[bytes]] = []


def announce() -> None:
    """Say the sizes this process wants: a refill at work sees the change and looks again
    with them, and so does one still starting (it reads them once it holds the lock).
    Written in place (a rename costs ~10 ms here): a torn read only makes a refill look
    once more, with its own sizes."""
    request = {"token": secrets.token_hex(8), "sizes": sizes()}
    fd = os.open(root() / "wanted", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # whatever the caller's umask, or an older file's mode
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(request))


def request_refill() -> None:
    """Start a refill process unless one is at work (which then sees this request)."""
    announce()
    if not sizes() or _refill_running():
        return
    _started[:] = [p for p in _started if p.poll() is None]  # reap those that ended
    log_file = open_log(root() / "refill.log")
    try:
        _started.append(
            subprocess.Popen(
                priority.lowered_argv([sys.executable, "-m", "cryobox.service.refill"]),
                env={**os.environ, priority.REFILL_ENV: "1"},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                start_new_session=True,
            )
        )
    finally:
        os.close(log_file)


def _refill_running() -> bool:
    return lock_held(root() / "refill.lock")


def lock_within(fd: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def refill_pid() -> int | None:
    """The pid of the refill process at work, if one is."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((root() / "refill.pid").read_text())
        if _refill_running():
            return pid
    return None


def stop_refill() -> None:
    """End a refill at work (it ends the member it was starting before it exits)."""
    pid = refill_pid()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 15)
        deadline = time.monotonic() + 30
        while _refill_running() and time.monotonic() < deadline:
            time.sleep(0.05)


class WarmPools(Protocol):
    """What the service asks of the warm pools: which templates have one, a member to
    claim, the members to end, and a refill. :class:`HostPools` is this host's (the
    functions above, on disk); a test may give the service its own."""

    def sizes(self) -> dict[str, int]: ...

    def claims(self, template: str, snapshot_id: str, network: NetworkJson) -> Iterator[str]: ...

    def members(self, template: str | None = None) -> list[Member]: ...

    def withdraw(self, member: Member) -> bool: ...

    def request_refill(self) -> None: ...

    def stop_refill(self) -> None: ...


class HostPools:
    """This host's warm pools (``STATE/pool/``), refilled by a process of their own."""

    def sizes(self) -> dict[str, int]:
        return sizes()

    def claims(self, template: str, snapshot_id: str, network: NetworkJson) -> Iterator[str]:
        return claims(template, snapshot_id, network)

    def members(self, template: str | None = None) -> list[Member]:
        return members(template)

    def withdraw(self, member: Member) -> bool:
        return withdraw(member)

    def request_refill(self) -> None:
        request_refill()

    def stop_refill(self) -> None:
        stop_refill()
