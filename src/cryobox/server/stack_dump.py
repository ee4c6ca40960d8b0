"""What a running server is doing, on a signal, written to its log: ``kill -USR1 PID``
every thread's stack (from a C handler: it answers even while the event loop is stuck),
``kill -USR2 PID`` every asyncio task's (answered by the loop, so only while it runs).

For a request that hangs: the first names the call a blocked loop or worker thread is
in, the second the await each request is parked on.
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import logging
import signal
import sys
import threading

log = logging.getLogger(__name__)


def on_usr1_dump_threads() -> None:
    """Every thread's stack to standard error on SIGUSR1 (the process goes on)."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def on_usr2_dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Every task of ``loop`` with its stack to the log on SIGUSR2: when it runs in the
    main thread, as the server's does (a signal reaches only that thread's loop; an app
    served by a test client runs in another)."""
    if threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGUSR2, dump_tasks)


def dump_tasks() -> None:
    """Log every task of the running loop, each with where it awaits."""
    tasks = asyncio.all_tasks()
    for task in tasks:
        stack = io.StringIO()
        task.print_stack(limit=30, file=stack)
        log.warning("task %s:\n%s", task.get_name(), stack.getvalue().rstrip())
    log.warning("%d tasks", len(tasks))
