"""Checks of caller-given arguments by type and range, shared by every boundary that takes
them (the service, the supervisor's control protocol): one message shape, naming the
argument."""

from __future__ import annotations

import math
from typing import Any

from cryobox.errors import InvalidArgument


def whole_number(name: str, value: Any, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) within low..high.

    :raises InvalidArgument: naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name}={value!r}: must be a whole number")
    if not low <= value <= high:
        raise InvalidArgument(f"{name}={value}: must be between {low} and {high}")
    return value


def positive_seconds(name: str, value: Any) -> float:
    """``value`` as seconds if it is a positive, finite number (not a bool).

    :raises InvalidArgument: naming ``name``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgument(f"{name}={value!r}: must be a positive, finite number of seconds")
    return float(value)
