"""``cryobox shell`` and ``exec -t``: a command on a pseudo-terminal in the guest, driven
from this terminal.

When input is passed on (``shell``, ``exec -it``), this terminal is put in raw mode for
the session, so every key (Ctrl-C, Ctrl-D, arrows) goes to the guest's terminal as
typed, where its line discipline turns Ctrl-C into SIGINT for what runs there. Without
it (``exec -t``), Ctrl-C here kills the command there. A resize of this window is passed
on (SIGWINCH). When our stdin is not a terminal (piped), it is typed in as it comes and
its end is a Ctrl-D.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import termios
import threading
import tty
from collections.abc import Iterator, Sequence
from typing import Any

from cryobox.client import PtyHandle, Sandbox
from cryobox.errors import CommandNotFound, CryoboxError

from .output import say_error

#: The end of typed input, as a terminal says it.
CTRL_D = b"\x04"


def terminal_size() -> tuple[int, int]:
    """(columns, rows) of our terminal, 80x24 when there is none."""
    size = shutil.get_terminal_size((80, 24))
    return max(size.columns, 1), max(size.lines, 1)


def stdin_fd() -> int:
    """Our stdin's descriptor, or -1 when there is none."""
    try:
        return sys.stdin.fileno() if sys.stdin is not None else -1
    except (OSError, ValueError):
        return -1


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Our terminal in raw mode for the block (when stdin is one), restored after."""
    if fd < 0 or not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd, termios.TCSANOW)  # keeps what was typed ahead (TCSAFLUSH drops it)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_on_terminal(
    sbx: Sandbox,
    cmd: str | Sequence[str],
    *,
    forward_input: bool,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    timeout: float | None = None,
) -> int:
    """Run ``cmd`` on a guest terminal the size of ours; its exit code."""
    output = sys.stdout.buffer

    def show(data: bytes) -> None:
        output.write(data)
        output.flush()

    cols, rows = terminal_size()
    try:
        handle = sbx.pty.create(
            cols, rows, on_data=show, cmd=cmd, env=env, cwd=cwd, user=user, timeout=timeout
        )
    except CommandNotFound as exc:  # as a shell says it, and as `exec` without -t does
        say_error(exc)
        return 127
    fd = stdin_fd()
    previous = signal.signal(signal.SIGWINCH, lambda *_: _resize_soon(handle))
    try:
        with raw_mode(fd if forward_input else -1):
            if forward_input:
                threading.Thread(target=_type_in, args=(handle, fd), daemon=True).start()
            result = handle.wait()
    except KeyboardInterrupt:  # only without raw mode: Ctrl-C here stops the command there
        with contextlib.suppress(CryoboxError):
            handle.kill()
        return 130
    finally:
        signal.signal(signal.SIGWINCH, previous)
    return result.exit_code


def _resize_soon(handle: PtyHandle) -> None:
    """Pass our new size on, from a thread: a signal handler must not wait on the SDK."""

    def resize() -> None:
        with contextlib.suppress(CryoboxError):
            handle.resize(*terminal_size())

    threading.Thread(target=resize, daemon=True).start()


def _type_in(handle: PtyHandle, fd: int) -> None:
    """Our stdin typed at the guest's terminal, then Ctrl-D at its end; stops quietly once
    the command no longer takes input."""
    read: Any = (lambda: os.read(fd, 4096)) if fd >= 0 else (lambda: b"")
    last = b"\n"
    try:
        for chunk in iter(read, b""):
            handle.send_input(chunk)
            last = chunk
        # A Ctrl-D ends the input at the start of a line; after a partial line the first
        # only hands that line over.
        handle.send_input(CTRL_D if last.endswith((b"\n", CTRL_D)) else CTRL_D * 2)
    except (CryoboxError, OSError):
        pass
