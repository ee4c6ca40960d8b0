"""A response cut short on purpose: an application raises :class:`ResponseCut` once it
has started a response it must not finish (E2B's process stream whose sandbox went
away: E2B's edge drops such a connection, and the SDKs act on that), and the server
drops the connection without the error report an unexpected exception gets."""

from __future__ import annotations

import logging


class ResponseCut(Exception):
    """Raised in place of a response's last part: the connection is dropped."""


class QuietCuts(logging.Filter):
    """Leaves out the server's report of a :class:`ResponseCut` (it is no fault)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ResponseCut))
