"""Why a VM ended by itself, in words: read from the end of its serial console.

QEMU exits with code 0 both when the guest powers itself off and when its kernel
panics (``panic=-1`` reboots at once, and ``-no-reboot`` turns the reboot into an
exit), so its exit code and its stderr say nothing; the guest kernel's last lines do.
"""

from __future__ import annotations

import contextlib
import re
import signal
from pathlib import Path

#: How much of the console's end is read.
TAIL_BYTES = 64 << 10

_PANIC = re.compile(r"^Kernel panic - not syncing: ?(.*)")
_ENDINGS = (
    ("reboot: Power down", "the guest powered itself off"),
    ("reboot: Restarting system", "the guest rebooted itself (a reboot ends a sandbox)"),
    ("reboot: System halted", "the guest halted itself"),
)


def console_tail(path: Path) -> str:
    """The last :data:`TAIL_BYTES` of a console log, as text ('' when there is none)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            handle.seek(max(0, size - TAIL_BYTES))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def guest_ending(console: str) -> str | None:
    """What the guest's console says ended it, or None when it says nothing of it."""
    lines = [line.strip() for line in console.replace("\r", "").splitlines()]
    for line in reversed(lines):
        # The kernel prefixes its lines with a time stamp: "[   12.3] reboot: ...".
        text = re.sub(r"^\[\s*\d+\.\d+\]\s*", "", line)
        panic = _PANIC.search(text)
        if panic:
            return f"the guest kernel panicked: {panic.group(1).strip() or text}"
        for marker, meaning in _ENDINGS:
            if text.startswith(marker):
                return meaning
    return None


def vm_ended(
    vmm: str, code: int | None, stderr: str, console_log: Path, reported: str | None = None
) -> str:
    """The reason a sandbox whose VM ended by itself is dead, never blank: a panic's
    message from the guest's console; else what the VMM ``reported`` of the guest's
    end (it powered off or rebooted: the VMM was then stopped on purpose, so its exit
    code says nothing); else what the console says; else the VMM's code and last words."""
    console = guest_ending(console_tail(console_log))
    qemu = f"{vmm.upper()} exited with code {code}"
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):  # a number no signal has
            qemu = f"{vmm.upper()} was killed by {signal.Signals(-code).name}"
        if code == -signal.SIGSEGV:  # QEMU 7.2 does so when a restored guest powers off
            qemu += " (it crashed; a restored guest that powers itself off ends so)"
    stderr = stderr.strip()[-2000:]
    if console and console.startswith("the guest kernel panicked"):
        return console
    if reported:
        return reported
    if console:
        return f"{console} ({qemu}{': ' + stderr if stderr else ''})"
    return f"{qemu}: {stderr}" if stderr else f"{qemu}, and the guest's console says nothing of why"
