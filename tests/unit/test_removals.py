"""The removals put off (:mod:`cryobox.service.removals`): one file for every process
of a host, changed under a lock. Processes recording at once lose none of each
other's entries, and one killed with -9 at any moment leaves a file that reads and
no temporary file."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryobox.service import removals

#: Records NAME-0, NAME-1, ... one settle each, printing each once it is recorded; with
#: FORGET, forgets each even one right after (a removal made).
WRITER = """
import sys
from cryobox.service import removals
name, count, forget = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "forget"
where = removals.Where("s3://bucket", "tenant", "settings")
for i in range(count):
    removals.settle({where: {f"{name}-{i}"}}, {})
    if forget and i % 2 == 0:
        removals.settle({}, {where: {f"{name}-{i}"}})
    print(f"{name}-{i}", flush=True)
"""


def test_processes_recording_at_once_lose_nothing_and_a_kill_9_spoils_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    # A write cut short earlier (a kill inside one leaves its temporary file).
    (tmp_path / f".{removals.FILE}.k1ll3d.tmp").write_text('[{"id": "half')

    def writer(name: str, count: int, forget: bool) -> subprocess.Popen[str]:
        command = [sys.executable, "-c", WRITER, name, str(count), "forget" if forget else "-"]
        return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)

    victims = [writer(f"victim{n}", 1_000_000, False) for n in range(2)]
    racers = [writer(f"racer{n}", 30, True) for n in range(3)]
    printed: set[str] = set()
    for victim in victims:  # (under way: its first entry recorded)
        assert victim.stdout is not None
        printed.add(victim.stdout.readline().strip())
    time.sleep(random.uniform(0.2, 1.0))
    for victim in victims:  # killed with -9 wherever it is: reading, writing, renaming
        victim.kill()
        printed |= set(victim.communicate(timeout=60)[0].split())
    for racer in racers:
        out, _ = racer.communicate(timeout=120)
        assert racer.returncode == 0
        printed |= set(out.split())
    # One settle more, as the next collection's: it clears what a victim left mid-write.
    removals.settle({}, {})
    entries = json.loads((tmp_path / removals.FILE).read_text())  # (it reads)
    recorded = {entry["id"] for entry in entries}
    racer_ids = {f"racer{n}-{i}" for n in range(3) for i in range(30)}
    assert racer_ids & recorded == {r for r in racer_ids if int(r.rsplit("-", 1)[1]) % 2}
    assert {p for p in printed if p.startswith("victim")} <= recorded  # none lost
    assert not list(tmp_path.glob(f".{removals.FILE}.*.tmp"))


def test_a_removal_recorded_again_after_a_collection_read_it_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collection reads the removals, works for seconds, then settles those it found
    done (a snapshot here again, say). One recorded again meanwhile (a new delete of
    that snapshot) is a new removal: it stays. Before, the settle took it off."""
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    where = removals.Where("s3://bucket", "tenant", "settings")
    removals.settle({where: {"snap-a", "snap-b"}}, {})
    read_at = time.time()
    time.sleep(0.01)
    removals.settle({where: {"snap-a"}}, {})  # (recorded again by a delete)
    removals.settle({}, {where: {"snap-a", "snap-b"}}, read_at=read_at)
    assert removals.recorded(where) == {"snap-a"}
    removals.settle({}, {where: {"snap-a"}})  # (a settle of its own record: no read time)
    assert removals.recorded(where) == set()


def test_a_drop_forgets_a_snapshots_removals_of_every_store_and_a_strict_record_fails_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    here, there = (removals.Where(f"s3://{b}", "tenant", "settings") for b in ("one", "two"))
    removals.settle({here: {"snap-a", "snap-b"}, there: {"snap-a"}}, {})
    removals.drop({"snap-a"})
    assert removals.recorded(here) == {"snap-b"} and removals.recorded(there) == set()
    removals.settle({here: {"snap-d"}}, {})

    def full(path: Path, value: object, *, durable: bool = True) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(removals, "write_json_atomic", full)
    removals.settle({here: {"snap-c"}}, {})  # (logged: a collection goes on)
    with pytest.raises(OSError, match="No space left"):
        removals.settle({here: {"snap-c"}}, {}, strict=True)
    with pytest.raises(OSError, match="No space left"):
        removals.drop({"snap-b"})
    assert removals.recorded(here) == {"snap-b", "snap-d"}


def test_a_file_that_cannot_be_read_is_not_written_over_and_a_new_removal_starts_its_day(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    where = removals.Where("s3://bucket", "tenant", "settings")
    removals.settle({where: {"snap-a"}}, {})
    entries = json.loads((tmp_path / removals.FILE).read_text())
    entries[0]["since"] -= removals.GIVE_UP_AFTER - 5  # (waiting for almost a day)
    (tmp_path / removals.FILE).write_text(json.dumps(entries))
    # A delete of the same snapshot, here again, records a new removal: not given up
    # with the old one's day.
    removals.settle({where: {"snap-a"}}, {}, strict=True)
    since = json.loads((tmp_path / removals.FILE).read_text())[0]["since"]
    assert time.time() - since < 60
    real = Path.read_text

    def failing(path: Path, *args: object, **kwargs: object) -> str:
        if path.name == removals.FILE:
            raise OSError(5, "Input/output error")
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    with monkeypatch.context() as fault:
        fault.setattr(Path, "read_text", failing)
        removals.settle({where: {"snap-b"}}, {})  # (logged, nothing written)
        with pytest.raises(OSError, match="Input/output"):
            removals.settle({where: {"snap-b"}}, {}, strict=True)
        assert removals.due("settings") == {}  # (nothing due that cannot be read)
    assert removals.recorded(where) == {"snap-a"}
