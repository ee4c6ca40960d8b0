"""CPU priority of a warm pool's members while they wait, and back to normal on claim.

A refill restores a sandbox nobody waits for yet, so it must not slow down the ones in
use: on these 2-core machines a restore running beside a just-claimed sandbox made that
sandbox's first command 6x slower (0.55 s instead of 0.09 s).

Linux schedules each session's processes as one group ("autogroup") when
``kernel.sched_autogroup_enabled`` is 1, the default: niceness then only orders the
threads inside a session, and sessions share the CPU by their group's niceness, set in
``/proc/self/autogroup``. A supervisor runs in a session of its own with its QEMU, so it
sets its group's niceness: any process may raise it, and set it back to 0 (only a
negative value needs privilege). Without autogroups, the threads' own niceness counts;
lowering it again needs CAP_SYS_NICE, so it is only changed where it can be undone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger("cryobox.supervisor")

#: Niceness of a waiting member's session (19: runs on what other sessions leave).
WAITING = 19
AUTOGROUP = Path("/proc/self/autogroup")


def autogroups() -> bool:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    return False


def may_renice() -> bool:
    """Whether threads' niceness can be lowered again (root; CAP_SYS_NICE is not probed)."""
    return os.geteuid() == 0


#: Set in a refill process: the supervisors it starts begin at the lowest priority.
REFILL_ENV = "CRYOBOX_POOL_REFILL"


def lowered_argv(argv: list[str]) -> list[str]:
    """``argv`` started at the lowest priority from its first instruction (its Python
    start and imports included): a shell sets its session's group niceness, then
    becomes the program (same process, same session)."""
    if not autogroups():
        return argv
    return ["/bin/sh", "-c", f'echo {WAITING} > {AUTOGROUP} 2>/dev/null; exec "$@"', "sh", *argv]


def lower() -> None:
    """Run this process, and what it starts from now on, at the lowest priority."""
    if autogroups():
        _set_group_niceness(WAITING)
    elif may_renice():
        os.nice(WAITING - os.nice(0))


def restore(pids: tuple[int, ...]) -> None:
    """Normal priority again for this session, and every thread of ``pids``."""
    if autogroups() and not _set_group_niceness(0):
        log.warning("this sandbox's CPU priority is still low: %s", _group())
    if not may_renice():
        return
    for pid in pids:
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in threads:
            with contextlib.suppress(ProcessLookupError):
                if os.getpriority(os.PRIO_PROCESS, tid) != 0:
                    os.setpriority(os.PRIO_PROCESS, tid, 0)


def _group() -> str:
    with contextlib.suppress(OSError):
        return AUTOGROUP.read_text().strip()
    return ""


def _set_group_niceness(niceness: int) -> bool:
    """Set this session's group niceness; whether it took. The kernel takes one change
    per 100 ms from an unprivileged process, host wide (EAGAIN otherwise): retried for a
    second."""
    for _ in range(20):
        with contextlib.suppress(OSError):
            AUTOGROUP.write_text(str(niceness))
        if _group().endswith(f" nice {niceness}"):
            return True
        time.sleep(0.05)
    return False
