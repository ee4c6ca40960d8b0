"""Which point of a sandbox's history a rewind goes back to."""

from __future__ import annotations

from datetime import UTC, datetime

from cryobox.errors import InvalidArgument, SnapshotNotFound
from cryobox.models import SnapshotInfo


def point_in_history(
    history: list[SnapshotInfo], to: SnapshotInfo | str | datetime | float, now: float
) -> SnapshotInfo:
    """The checkpoint of ``history`` (oldest first) that ``to`` names: a checkpoint, its
    id, name (the newest of that name) or a unique start of its id; or, for an instant
    (a ``datetime``, or seconds before ``now``), the newest taken at or before it.

    A ``datetime`` holds whole microseconds, so each checkpoint's time is made one, as
    ``datetime`` makes it, before they are compared: ``datetime.fromtimestamp(
    c.created_at)`` names ``c`` itself, even where making it rounded a fraction of a
    microsecond down (a float's own product by a million rounds otherwise, now and then).

    :raises SnapshotNotFound: when no checkpoint of the history has that id or name.
    :raises InvalidArgument: for a ``to`` of another type, a negative number of
        seconds, or an instant older than every checkpoint (naming the oldest).
    """
    if isinstance(to, SnapshotInfo):
        to = to.id
    if isinstance(to, str):
        named = [c for c in history if to in (c.id, c.name)]
        if not named and len(to) >= 4:
            named = [c for c in history if c.id.startswith(to) or c.id.startswith(f"snap-{to}")]
            if len(named) > 1:
                raise InvalidArgument(f"{to!r} starts the ids of several checkpoints: give more")
        if not named:
            raise SnapshotNotFound(to)
        return max(named, key=lambda c: c.created_at)
    if isinstance(to, datetime):
        try:
            limit = to.astimezone(UTC)  # a naive datetime is this host's local time
        except (OverflowError, ValueError):  # within a day of datetime's first or last
            limit = (
                datetime.max.replace(tzinfo=UTC)
                if to.year > 1
                else datetime.min.replace(tzinfo=UTC)
            )
        earlier = [c for c in history if datetime.fromtimestamp(c.created_at, UTC) <= limit]
    elif isinstance(to, int | float) and not isinstance(to, bool):
        if to < 0:
            raise InvalidArgument(f"to={to!r}: seconds ago cannot be negative")
        earlier = [c for c in history if c.created_at <= now - to]
    else:
        raise InvalidArgument(
            f"to={to!r}: must be a checkpoint, its id or name, a datetime or seconds ago"
        )
    if earlier:
        return max(earlier, key=lambda c: c.created_at)
    if not history:
        raise InvalidArgument("this sandbox has no checkpoint to rewind to")
    oldest = min(history, key=lambda c: c.created_at)
    raise InvalidArgument(
        f"no checkpoint is that old: the oldest, {oldest.id}, is from "
        f"{now - oldest.created_at:.0f} s ago ({datetime.fromtimestamp(oldest.created_at)})"
    )
