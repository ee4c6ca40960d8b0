"""One event loop on a background thread, where the sync SDK runs the async core.

Created on first use, a daemon thread, shared by every sync sandbox of the process:
no loop per object and nothing to clean up in ``__del__``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _get_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="cryobox-sdk", daemon=True).start()
            _loop = loop
        return _loop


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the SDK's loop and block until it is done (cancelled on interrupt)."""
    future = asyncio.run_coroutine_threadsafe(coro, _get_loop())
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise
