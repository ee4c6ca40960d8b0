"""Reaching a web server in a guest through its forwarded port, for the VM tests."""

from __future__ import annotations

import time
import urllib.request


def fetch_until_up(url: str, within: float = 60.0) -> tuple[int, bytes]:
    """Status and body of a GET, retried while the server in the guest starts.

    :raises OSError: the last failure, once ``within`` seconds have passed.
    """
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                body: bytes = response.read()
                return int(response.status), body
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
