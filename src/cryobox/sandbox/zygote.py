"""The supervisor zygote: one process, started and imported once, that forks a
supervisor for each sandbox.

Starting a supervisor as a new Python costs about 0.25 s of CPU (the interpreter and
the imports) and 15 MiB of memory of its own; a fork of a process that has done both
costs a few milliseconds, and its pages stay shared until written. Each supervisor is
still a process of its own, in a session of its own, so one that crashes takes only
its sandbox with it (crash isolation as before).

The service talks to the zygote on a socket pair: a request is one byte (``L`` for a
warm pool's member, started at the lowest priority; ``N`` otherwise; ``G`` for a
supervisor that serves a group of sandboxes, the copies of one fork, see
:func:`cryobox.sandbox.supervisor.serve_group`) carrying the supervisor's end of a new
socket pair (SCM_RIGHTS; for ``G`` the group's socket, on which each sandbox's own
socket arrives in turn); the answer is the new
supervisor's pid, one line, carrying a pidfd for it, opened before the zygote can
reap it (so no reuse of its pid can make the service signal another process). The
zygote reaps supervisors that exit (SIGCHLD). A zygote whose service exits sees its
socket close and exits too; the supervisors it forked live on.

Started as ``python -m cryobox.sandbox.zygote --fd N``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
import threading

LOWERED, NORMAL, GROUP = b"L", b"N", b"G"


def _become_supervisor(control: socket.socket, fd: int, kind: bytes) -> None:
    """In the forked child: a supervisor in a session of its own, serving ``fd`` (one
    sandbox's socket, or a group's)."""
    import asyncio

    from cryobox.sandbox import priority, supervisor

    code = 1
    try:
        control.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        os.setsid()  # its own session (and scheduling group), as a spawned one had
        if kind == LOWERED:
            priority.lower()
        serve = supervisor.serve_group if kind == GROUP else supervisor._serve
        code = asyncio.run(serve(socket.socket(fileno=fd)))
    except BaseException:  # a supervisor never returns into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(control: socket.socket) -> None:
    """Fork a supervisor for each request until the service closes the socket."""
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 1, 1)
        except InterruptedError:
            continue
        if not message or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return
        if threading.active_count() != 1:  # a fork beside threads may inherit a held lock
            print("cryobox zygote: threads are running; refusing to fork", file=sys.stderr)
            os.close(fds[0])
            return
        # SIGCHLD held until the pidfd is open: a child that exits at once is not
        # reaped (and its pid freed) before then.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            pid = os.fork()
            if pid == 0:
                _become_supervisor(control, fds[0], message)
            os.close(fds[0])
            pidfd = os.pidfd_open(pid)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        try:
            socket.send_fds(control, [f"{pid}\n".encode()], [pidfd])
        except OSError:  # the service is gone: the supervisor serves its request anyway
            return
        finally:
            os.close(pidfd)


def _reap(signum: int, frame: object) -> None:
    """Collect the exit of every supervisor that ended (they are this process's)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    # First: ``kill -USR1`` writes the stack of this process, or of any supervisor forked
    # from it, to supervisor-spare.log (its standard error): what a start that hangs
    # waits on. (A process without the handler would end on it: see ``SigCgt``.)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from cryobox.sandbox import supervisor  # everything a supervisor needs, imported once

    # Before the reaper: preparing asks QEMU its version (a child of ours), and every
    # supervisor forked from here then knows it.
    control = supervisor.prepare("zygote")
    signal.signal(signal.SIGCHLD, _reap)
    del supervisor
    gc.collect()
    gc.freeze()  # what is imported stays shared with every fork (no collector writes)
    serve(control)


if __name__ == "__main__":
    main()
