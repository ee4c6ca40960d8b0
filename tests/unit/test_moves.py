"""Moves of paused sandboxes between hosts (:mod:`cryobox.server.moves`): the sealed
departure, the claim and the fence racing across processes, and the store's keys shared
by the hosts of one database."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cryobox.sandbox.records import SandboxRecord, SandboxSpec
from cryobox.sandbox.registry import SandboxDir
from cryobox.sandbox.state import SandboxState
from cryobox.server.database import SqliteDatabase
from cryobox.server.hosts import STALE_AFTER
from cryobox.server.meter import Meter
from cryobox.server.moves import (
    Departure,
    _key,
    _trusted_by,
    bury,
    claim,
    claim_recovery,
    fence,
    seal,
    tombstoned,
    unseal,
)
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


def test_the_cas_a_sandbox_was_given_travel_sealed_and_land_in_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extra CAs its header proxy trusts go with a moved or recovered sandbox,
    inside the seal; a departure sealed before they did opens with none."""
    pem = "-----BEGIN CERTIFICATE-----\nMIIB-the-fleets-own-CA\n-----END CERTIFICATE-----\n"
    sealed = seal("fleet-secret", "sbx-1", Departure(SPEC, "pause-1", None, pem))
    assert "the-fleets-own-CA" not in sealed
    assert unseal("fleet-secret", "sbx-1", sealed).trust == pem
    older = base64.b64decode(seal("fleet-secret", "sbx-1", Departure(SPEC, "pause-1", None)))
    plain = json.loads(AESGCM(_key("fleet-secret")).decrypt(older[:12], older[12:], b"sbx-1"))
    plain.pop("trust")  # as a host of the previous release sealed it
    nonce = os.urandom(12)
    body = AESGCM(_key("fleet-secret")).encrypt(nonce, json.dumps(plain).encode(), b"sbx-1")
    assert unseal("fleet-secret", "sbx-1", base64.b64encode(nonce + body).decode()).trust == ""
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    spec = SandboxSpec.from_json(
        {
            **SPEC,
            "image_id": "i",
            "accelerator": "tcg",
            "memory_mib": 1024,
            "disk_gib": 4,
            "timeout": 60.0,
            "template": "base",
            "created_at": 0.0,
        }
    )
    record = SandboxRecord(id="sbx-1", state=SandboxState.PAUSED, pause_id="pause-1")
    landed = SandboxDir.arrive(spec, record, pem.encode())
    assert landed.egress_trust.read_text() == pem
    assert _trusted_by(landed) == pem  # what its next departure seals
    again = SandboxDir.arrive(spec, record)  # given none: none is left from before
    assert not again.egress_trust.exists() and _trusted_by(again) == ""


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


def _host(db: SqliteDatabase, host: str, seen_at: float) -> None:
    db.execute(
        "INSERT INTO hosts (id, url, store, started_at, seen_at) VALUES (?, '', '', 0, ?) "
        "ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at",
        (host, seen_at),
    )


def test_a_sandbox_is_recovered_or_buried_only_while_its_host_is_silent(tmp_path: Path) -> None:
    """A host whose heartbeat is late but renewed before the claim is slow, not lost:
    the claim read when it looked lost matches nothing (else two copies would run);
    one stopped by its operator (seen_at 0) is not lost either."""
    db = _paused_row(tmp_path / "server.db")
    db.execute("UPDATE sandboxes SET last_state = 'running', recovery = 'R' WHERE id = 'sbx-1'")
    _host(db, "host-a", time.time())  # it answered again just before the claim
    assert not claim_recovery(db, "sbx-1", "host-b", "host-a", 0, "R")
    assert not bury(db, "sbx-1", "host-b", "host-a", 0)
    _host(db, "host-a", 0.0)  # stopped by its operator: its sandboxes run on
    assert not claim_recovery(db, "sbx-1", "host-b", "host-a", 0, "R")
    _host(db, "host-a", time.time() - STALE_AFTER - 1)  # silent: lost
    assert claim_recovery(db, "sbx-1", "host-b", "host-a", 0, "R")
    row = db.row("SELECT host_id, epoch, last_state FROM sandboxes WHERE id = 'sbx-1'")
    assert row is not None and (row["host_id"], row["epoch"]) == ("host-b", 1)
    assert tombstoned(db, "host-a") == {"sbx-1"}  # back, a stops its copy


def test_every_host_a_sandbox_left_keeps_a_tombstone_until_it_comes_back(tmp_path: Path) -> None:
    """A paused sandbox moves a -> b, then b is lost and it is recovered on a: a's
    tombstone goes (it is a's own again), b gets one; killed while a is lost, a's
    comes back and the bill stops at the kill."""
    db = _paused_row(tmp_path / "server.db")
    assert claim(db, "sbx-1", "host-b", "host-a", 0, "D")
    assert tombstoned(db, "host-a") == {"sbx-1"} and tombstoned(db, "host-b") == set()
    db.execute(
        "UPDATE sandboxes SET last_state = 'running', recovery = 'R', running_since = 1 "
        "WHERE id = 'sbx-1'"
    )
    _host(db, "host-b", time.time() - STALE_AFTER - 1)
    assert claim_recovery(db, "sbx-1", "host-a", "host-b", 1, "R")
    assert tombstoned(db, "host-a") == set() and tombstoned(db, "host-b") == {"sbx-1"}
    _host(db, "host-a", time.time() - STALE_AFTER - 1)
    assert not bury(db, "sbx-1", "host-c", "host-a", 1)  # an epoch read before: too late
    assert bury(db, "sbx-1", "host-c", "host-a", 2)
    row = db.row("SELECT host_id, last_state, running_since FROM sandboxes WHERE id = 'sbx-1'")
    assert row is not None
    assert (row["host_id"], row["last_state"], row["running_since"]) == ("host-c", "killed", None)
    assert tombstoned(db, "host-a") == {"sbx-1"} and tombstoned(db, "host-b") == {"sbx-1"}
    assert db.row("SELECT 1 FROM ports WHERE sandbox_id = 'sbx-1'") is None


def test_tombstones_of_schema_11_survive_the_upgrade(tmp_path: Path) -> None:
    import sqlite3

    from cryobox.server.database import MIGRATIONS

    raw = sqlite3.connect(tmp_path / "server.db")
    for script in MIGRATIONS[:11]:
        raw.executescript(script)
    raw.execute("INSERT INTO tombstones VALUES ('sbx-1', 'host-a', 5.0)")
    raw.execute("PRAGMA user_version=11")
    raw.commit()
    raw.close()
    db = SqliteDatabase(tmp_path / "server.db")
    assert db.version == len(MIGRATIONS)
    assert tombstoned(db, "host-a") == {"sbx-1"}


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
