"""A rewindable history's arguments: which checkpoint a rewind picks, the bounds of
``checkpoint_every`` and ``keep_checkpoints``, and the CLI's ways of saying when."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta, timezone

import pytest

from cryobox.cli.main import taken, when
from cryobox.client.history import point_in_history
from cryobox.errors import InvalidArgument, SnapshotNotFound
from cryobox.models import CreateRequest, SnapshotInfo
from cryobox.service.service import history, validate

NOW = 1_800_000_000.0


def point(snapshot_id: str, ago: float, name: str | None = None) -> SnapshotInfo:
    return SnapshotInfo(
        id=snapshot_id,
        name=name,
        kind="memory",
        purpose="checkpoint",
        created_at=NOW - ago,
        source_sandbox="sbx-1",
        parent=None,
        memory_mib=1024,
        cpus=2,
        size_bytes=0,
        automatic=name is None,
    )


HISTORY = [
    point("snap-a1a1a1a1a1a1", 300),
    point("snap-b2b2b2b2b2b2", 200, "clean"),
    point("snap-c3c3c3c3c3c3", 100),
]


@pytest.mark.parametrize(
    ("to", "expected"),
    [
        (0, "snap-c3c3c3c3c3c3"),  # now: the newest
        (100, "snap-c3c3c3c3c3c3"),  # exactly when it was taken
        (150, "snap-b2b2b2b2b2b2"),  # between two: the one before
        (299.5, "snap-a1a1a1a1a1a1"),
        (datetime.fromtimestamp(NOW - 250), "snap-a1a1a1a1a1a1"),
        ("clean", "snap-b2b2b2b2b2b2"),  # by name
        ("snap-c3c3c3c3c3c3", "snap-c3c3c3c3c3c3"),
        ("b2b2", "snap-b2b2b2b2b2b2"),  # a start of the id, without "snap-" too
        (HISTORY[0], "snap-a1a1a1a1a1a1"),
    ],
)
def test_a_rewind_goes_to_the_newest_checkpoint_at_or_before_the_instant(
    to: object, expected: str
) -> None:
    assert point_in_history(HISTORY, to, NOW).id == expected  # type: ignore[arg-type]


def test_a_rewind_further_back_than_the_history_names_its_oldest_point() -> None:
    with pytest.raises(InvalidArgument, match="the oldest, snap-a1a1a1a1a1a1, is from 300 s ago"):
        point_in_history(HISTORY, 301, NOW)
    with pytest.raises(InvalidArgument, match="no checkpoint to rewind to"):
        point_in_history([], 10, NOW)


@pytest.mark.parametrize("to", [-5, True, None, ["snap-a1a1a1a1a1a1"]])
def test_a_rewind_to_something_that_is_no_instant_is_refused(to: object) -> None:
    with pytest.raises(InvalidArgument, match="to="):
        point_in_history(HISTORY, to, NOW)  # type: ignore[arg-type]


def test_a_rewind_to_a_checkpoints_own_time_goes_to_that_checkpoint() -> None:
    """A datetime made from a checkpoint's time, whose making rounded a fraction of a
    microsecond down (it once picked the checkpoint before it), and the time `history`
    lists for it, to the second, as typed to `cryobox rewind`."""
    taken = 1_800_000_100.1234564  # datetime makes .123456 of it
    history = [*HISTORY, dataclasses.replace(HISTORY[0], id="snap-d4d4d4d4d4d4", created_at=taken)]
    assert datetime.fromtimestamp(taken).timestamp() < taken  # what made it go wrong
    assert point_in_history(history, datetime.fromtimestamp(taken), NOW).id == "snap-d4d4d4d4d4d4"
    typed = when(datetime.fromtimestamp(taken).isoformat(sep=" ", timespec="seconds"))
    assert isinstance(typed, datetime)
    assert point_in_history(history, typed, NOW).id == "snap-d4d4d4d4d4d4"
    assert point_in_history(history, typed - timedelta(seconds=1), NOW).id == HISTORY[-1].id


def test_every_checkpoints_own_time_made_a_datetime_names_it() -> None:
    """Over many times (a multiplication by a million of the float rounded one in
    sixteen the other way from datetime: the soak's rewinds went to the point before)."""
    rng = random.Random(7)
    for _ in range(20_000):
        taken = NOW + rng.random() * 1000
        mine = dataclasses.replace(HISTORY[0], id="snap-e5e5e5e5e5e5", created_at=taken)
        history = [*HISTORY, mine]
        for made in (datetime.fromtimestamp(taken), datetime.fromtimestamp(taken, UTC)):
            assert point_in_history(history, made, NOW + 2000).id == mine.id, (taken, made)


def test_the_time_history_lists_for_a_checkpoint_typed_back_names_it() -> None:
    """Two checkpoints a few hundred milliseconds apart in one second too."""
    rng = random.Random(11)
    for _ in range(2_000):
        first = NOW + rng.random() * 1000
        pair = [
            dataclasses.replace(HISTORY[0], id="snap-f6f6f6f6f6f6", created_at=first),
            dataclasses.replace(HISTORY[0], id="snap-a7a7a7a7a7a7", created_at=first + 0.25),
        ]
        for point in pair:
            typed = when(taken(point.created_at))
            assert isinstance(typed, datetime) and typed.tzinfo is not None
            assert point_in_history([*HISTORY, *pair], typed, NOW + 2000).id == point.id


def test_a_rewind_to_the_ends_of_time_is_the_newest_or_none() -> None:
    """Within a day of datetime's last or first instant, no UTC time exists for it."""
    late = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5)))
    assert point_in_history(HISTORY, late, NOW).id == HISTORY[-1].id
    early = datetime(1, 1, 1, 0, 0, 1, tzinfo=timezone(timedelta(hours=5)))
    with pytest.raises(InvalidArgument, match="no checkpoint is that old"):
        point_in_history(HISTORY, early, NOW)


def test_a_rewind_to_a_checkpoint_not_in_the_history_is_not_found() -> None:
    with pytest.raises(SnapshotNotFound):
        point_in_history(HISTORY, "snap-zz99", NOW)


@pytest.mark.parametrize(
    ("every", "keep", "kept"),
    [
        (0, None, (0.0, 0)),
        (5, None, (5.0, 10)),
        (60, 30, (60.0, 30)),
        (86400, 1000, (86400.0, 1000)),
    ],
)
def test_a_history_is_kept_as_asked_with_ten_checkpoints_by_default(
    every: float, keep: int | None, kept: tuple[float, int]
) -> None:
    assert history(every, keep) == kept


@pytest.mark.parametrize(
    ("every", "keep", "named"),
    [
        (1, None, "checkpoint_every=1"),  # too often
        (86401, None, "checkpoint_every=86401"),
        (-5, None, "checkpoint_every=-5"),
        ("60", None, "checkpoint_every='60'"),
        (60, 0, "keep_checkpoints"),
        (60, 1001, "keep_checkpoints"),
        (0, 5, "keep_checkpoints: needs checkpoint_every"),
    ],
)
def test_a_history_out_of_bounds_is_refused_naming_the_value(
    every: object, keep: object, named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        history(every, keep)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("90", 90.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1.5h", 5400.0),
        # an instant covers its last unit: `history` lists times to the second
        ("2026-12-02T10:00:00", datetime(2026, 12, 2, 10, 0, 0, 999999)),
        ("2026-12-02 10:00", datetime(2026, 12, 2, 10, 0, 59, 999999)),
        ("2026-12-02", datetime(2026, 12, 2, 23, 59, 59, 999999)),
        ("2026-12-02T10:00:00.25", datetime(2026, 12, 2, 10, 0, 0, 259999)),
        ("2026-12-02 10:00:00.302", datetime(2026, 12, 2, 10, 0, 0, 302999)),  # as listed
        ("2026-12-02 10:00:00.123456", datetime(2026, 12, 2, 10, 0, 0, 123456)),
        # any separator fromisoformat takes, compact and week forms, spaces around
        ("2026-12-02t10:00:00", datetime(2026, 12, 2, 10, 0, 0, 999999)),
        ("2026-12-02_10:00", datetime(2026, 12, 2, 10, 0, 59, 999999)),
        ("20261202T100000", datetime(2026, 12, 2, 10, 0, 0, 999999)),
        ("20261202T10", datetime(2026, 12, 2, 10, 59, 59, 999999)),
        ("2026-W49-3T10:00", datetime(2026, 12, 2, 10, 0, 59, 999999)),
        (" 2026-12-02 ", datetime(2026, 12, 2, 23, 59, 59, 999999)),
        ("9999-12-31", datetime(9999, 12, 31)),
        ("clean", "clean"),
        ("snap-4f2a", "snap-4f2a"),
    ],
)
def test_the_cli_reads_seconds_ago_an_instant_or_a_checkpoint(typed: str, meant: object) -> None:
    assert when(typed) == meant


@pytest.mark.parametrize(
    ("asked", "template"),
    [
        ({}, "default"),
        ({"cpus": 2, "memory_mib": 1024, "disk_gib": 4}, "default"),  # the defaults
        ({"memory_mib": 2048}, "default-2c-2048m-4g"),
        ({"cpus": 4, "disk_gib": 8}, "default-4c-1024m-8g"),
        ({"template": "base", "memory_mib": 2048}, "base"),
        ({"template": "app", "cpus": 4}, "app"),  # a named template keeps its shape
        ({"from_snapshot": "snap-1", "cpus": 4}, "default"),
    ],
)
def test_any_shape_starts_from_a_default_template_of_that_shape(
    asked: dict[str, object], template: str
) -> None:
    from cryobox.models import CreateRequest
    from cryobox.service.service import default_shape, shaped_template

    chosen = shaped_template(CreateRequest(**asked))  # type: ignore[arg-type]
    assert chosen == template
    if chosen.startswith("default-"):
        shape = default_shape(chosen)
        assert shape is not None
        for name in ("cpus", "memory_mib", "disk_gib"):
            if asked.get(name) is not None:
                assert shape[name] == asked[name]
    assert default_shape("app") is None and default_shape("default-x") is None


def test_what_a_timeout_does_is_checked_at_the_door() -> None:
    for fine in ("kill", "pause", "pause-disk"):
        validate(CreateRequest(on_timeout=fine))
    with pytest.raises(InvalidArgument, match="on_timeout='sleep'"):
        validate(CreateRequest(on_timeout="sleep"))  # type: ignore[arg-type]
