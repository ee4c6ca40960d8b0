"""Moves of paused sandboxes between hosts (:mod:`cryobox.server.moves`): the sealed
departure, the claim and the fence racing across processes, and the store's keys shared
by the hosts of one database."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cryobox.server.database import SqliteDatabase
from cryobox.server.meter import Meter
from cryobox.server.moves import Departure, claim, fence, seal, unseal
from cryobox.server.tenants import Tenants

SPEC = {"id": "sbx-1", "envs": {"TOKEN": "s3cret"}, "cpus": 1}


def test_a_departure_opens_only_for_its_sandbox_and_unaltered() -> None:
    sealed = seal("fleet-secret", "sbx-1", Departure(SPEC, "pause-1", 900.0))
    assert "s3cret" not in sealed
    opened = unseal("fleet-secret", "sbx-1", sealed)
    assert opened == Departure(SPEC, "pause-1", 900.0)
    with pytest.raises(ValueError, match="sbx-2"):  # pasted onto another sandbox's row
        unseal("fleet-secret", "sbx-2", sealed)
    with pytest.raises(ValueError):  # another fleet's secret
        unseal("other-secret", "sbx-1", sealed)
    altered = sealed[:20] + ("A" if sealed[20] != "A" else "B") + sealed[21:]
    with pytest.raises(ValueError):
        unseal("fleet-secret", "sbx-1", altered)


def _paused_row(path: Path) -> SqliteDatabase:
    db = SqliteDatabase(path)
    tenant, _ = Tenants(db).create("fleet")
    Meter(db).track("sbx-1", tenant.id, 1, 1024, 600, "host-a")
    db.execute("UPDATE sandboxes SET last_state = 'paused', departure = 'D' WHERE id = 'sbx-1'")
    db.execute(
        "INSERT INTO ports (sandbox_id, guest_port, public_port, host_id) "
        "VALUES ('sbx-1', 8000, 40000, 'host-a')"
    )
    return db


RACER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from cryobox.server.database import SqliteDatabase
    from cryobox.server.moves import claim
    db = SqliteDatabase(Path(sys.argv[1]))
    go = Path(sys.argv[3])
    while not go.exists():
        time.sleep(0.001)
    print(claim(db, "sbx-1", sys.argv[2], "host-a", 0, "D"))
    """
)


def test_hosts_racing_to_claim_one_sandbox_from_separate_processes_one_wins(
    tmp_path: Path,
) -> None:
    db = _paused_row(tmp_path / "server.db")
    go = tmp_path / "go"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path / "server.db"), f"host-{n}", str(go)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(6)
    ]
    go.touch()
    said = [racer.communicate(timeout=60)[0].strip() for racer in racers]
    assert sorted(said) == ["False"] * 5 + ["True"]
    winner = f"host-{said.index('True')}"
    row = db.row("SELECT host_id, epoch FROM sandboxes WHERE id = 'sbx-1'")
    assert row is not None
    assert (row["host_id"], row["epoch"]) == (winner, 1)
    port = db.row("SELECT host_id FROM ports WHERE sandbox_id = 'sbx-1'")
    assert port is not None
    assert port["host_id"] == winner  # its ports follow it in the same transaction


def test_a_local_resume_and_a_move_fence_each_other(tmp_path: Path) -> None:
    db = _paused_row(tmp_path / "server.db")
    assert not claim(db, "sbx-1", "host-b", "host-a", 0, "other")  # not the departure read
    assert fence(db, "sbx-1", "host-a")  # its host resumes it: epoch 0 -> 1, departure taken
    assert not claim(db, "sbx-1", "host-b", "host-a", 0, "D")  # read before: too late
    assert not claim(db, "sbx-1", "host-b", "host-a", 1, "D")  # its departure is gone
    db.execute("UPDATE sandboxes SET departure = 'D2' WHERE id = 'sbx-1'")  # paused again
    assert claim(db, "sbx-1", "host-b", "host-a", 1, "D2")
    assert not fence(db, "sbx-1", "host-a")  # a comes back: it moved, never runs there
    assert fence(db, "sbx-1", "host-b")
    db.execute("UPDATE sandboxes SET last_state = 'running', departure = 'D3' WHERE id = 'sbx-1'")
    assert not claim(db, "sbx-1", "host-c", "host-b", 3, "D3")  # only a paused one moves
    assert fence(db, "sbx-unknown", "host-a")  # not the server's: nothing to fence


def test_a_tenants_store_key_made_on_one_host_opens_on_another_once_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryobox.errors import StoreError
    from cryobox.store import keys
    from cryobox.store.objects import open_objects

    objects = open_objects(str(tmp_path / "store"))
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "host-a"))
    made = keys.data_key(objects, "fleet")
    shared = keys.host_keks()
    assert list(shared) == ["fleet"]
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "host-b"))
    with pytest.raises(StoreError, match="has no key"):
        keys.data_key(objects, "fleet")
    assert keys.add_keks("fleet", shared["fleet"])
    assert not keys.add_keks("fleet", shared["fleet"])  # nothing new the second time
    assert keys.data_key(objects, "fleet") == made
    with pytest.raises(StoreError, match="32 bytes"):
        keys.add_keks("fleet", {"kek-bad": "c2hvcnQ="})
