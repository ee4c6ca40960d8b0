"""The pause hold's setting and request: bad values are named, never half-used."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from cryobox import config
from cryobox.errors import InvalidArgument
from cryobox.sandbox.control import ControlOp, Pause
from cryobox.sandbox.registry import SandboxDir, SandboxRecord
from cryobox.sandbox.state import SandboxState


def test_the_hold_comes_from_the_environment_and_bad_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CRYOBOX_PAUSE_HOLD", raising=False)
    assert config.pause_hold() == config.PAUSE_HOLD == 60.0
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "0")
    assert config.pause_hold() == 0.0
    monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", "2.5")
    assert config.pause_hold() == 2.5
    for bad in ("-1", "soon", "nan", "inf", "86401"):
        monkeypatch.setenv("CRYOBOX_PAUSE_HOLD", bad)
        with pytest.raises(InvalidArgument, match="CRYOBOX_PAUSE_HOLD"):
            config.pause_hold()
        with pytest.raises(InvalidArgument, match="CRYOBOX_PAUSE_HOLD"):
            config.check_settings()  # what a resume or create checks first


def test_a_pause_request_carries_its_hold_and_refuses_anything_else() -> None:
    assert Pause.parse({}).hold == 0.0
    assert Pause.parse(Pause(30).to_args()).hold == 30.0
    assert Pause.parse({"hold": config.MAX_PAUSE_HOLD}).hold == config.MAX_PAUSE_HOLD
    for bad in (-1, True, "60", math.nan, math.inf, None, config.MAX_PAUSE_HOLD + 1):
        with pytest.raises(InvalidArgument, match=ControlOp.PAUSE.value):
            Pause.parse({"hold": bad})
    assert Pause.parse({}).memory is True  # a whole machine unless asked otherwise
    assert Pause.parse(Pause(0, memory=False).to_args()).memory is False
    for bad in (0, "false", None):
        with pytest.raises(InvalidArgument, match="memory"):
            Pause.parse({"memory": bad})


def test_a_stale_pause_folder_never_stands_for_a_sandbox_whose_files_are_not_in_it(
    tmp_path: Path,
) -> None:
    """A running sandbox whose supervisor and VM are gone is paused only if its disk
    layer went into ``paused/``: a pause folder left from before (a pull, a wake that
    could not remove it) would be an older machine."""
    folder = SandboxDir(tmp_path / "sbx-1")
    folder.path.mkdir()
    (folder.paused).mkdir()
    (folder.paused / "manifest.json").write_text(json.dumps({"id": "pause-old"}))
    long_ago = time.time() - 3600
    running = SandboxRecord(id="sbx-1", state=SandboxState.RUNNING, disk="disk-1.qcow2")

    folder.write_record(running)
    _age(folder, long_ago)
    (folder.path / "disk-1.qcow2").write_bytes(b"the live disk")
    assert folder.record().state is SandboxState.DEAD  # its disk never moved: not paused

    (folder.path / "disk-1.qcow2").rename(folder.paused / "disk.qcow2")
    folder.write_record(running)
    _age(folder, long_ago)
    found = folder.record()
    assert found.state is SandboxState.PAUSED and found.pause_id == "pause-old"


def _age(folder: SandboxDir, when: float) -> None:
    """Make the record look written at ``when`` (a supervisor that died long ago)."""
    raw = json.loads(folder.state_file.read_text())
    raw["updated_at"] = when
    folder.state_file.write_text(json.dumps(raw))


def test_reading_a_record_changes_nothing_and_reconcile_finishes_the_pause(
    tmp_path: Path,
) -> None:
    """A supervisor killed after its pause was written whole but before its renames:
    a read says what the sandbox is (paused) without moving a file; ``reconcile`` (the
    service's, a starting supervisor's) does the renames and records it."""
    folder = SandboxDir(tmp_path / "sbx-2")
    folder.path.mkdir()
    folder.pause.temp.mkdir()
    listed = {"id": "pause-new", "files": {"disk.qcow2": {}, "devices.state": {}}}
    (folder.pause.temp / "manifest.json").write_text(json.dumps(listed))
    (folder.pause.temp / "devices.state").write_bytes(b"devices")
    (folder.path / "disk-1.qcow2").write_bytes(b"the live disk")
    folder.write_record(SandboxRecord(id="sbx-2", state=SandboxState.RUNNING, disk="disk-1.qcow2"))
    _age(folder, time.time() - 3600)
    before = sorted(p.relative_to(folder.path) for p in folder.path.rglob("*"))
    raw = folder.state_file.read_text()

    seen = folder.record()
    assert seen.state is SandboxState.PAUSED and seen.pause_id == "pause-new"
    assert sorted(p.relative_to(folder.path) for p in folder.path.rglob("*")) == before
    assert folder.state_file.read_text() == raw  # not written either

    settled = folder.reconcile()
    assert settled.state is SandboxState.PAUSED and settled.pause_id == "pause-new"
    assert (folder.paused / "disk.qcow2").read_bytes() == b"the live disk"
    assert not (folder.path / "disk-1.qcow2").exists() and not folder.pause.temp.exists()
    assert json.loads(folder.state_file.read_text())["state"] == "paused"
    again = folder.record()
    assert (again.state, again.pause_id) == (SandboxState.PAUSED, "pause-new")


def test_a_pause_missing_a_file_it_lists_never_stands(tmp_path: Path) -> None:
    """A pause written into ``paused.tmp`` that lists a file no longer anywhere cannot be
    completed: the sandbox reads (and stays) dead, never paused on a pause that would
    be refused at every resume."""
    folder = SandboxDir(tmp_path / "sbx-3")
    folder.path.mkdir()
    folder.pause.temp.mkdir()
    listed = {"id": "pause-broken", "files": {"disk.qcow2": {}, "devices.state": {}}}
    (folder.pause.temp / "manifest.json").write_text(json.dumps(listed))
    (folder.path / "disk-1.qcow2").write_bytes(b"the live disk")  # devices.state: lost
    folder.write_record(SandboxRecord(id="sbx-3", state=SandboxState.RUNNING, disk="disk-1.qcow2"))
    _age(folder, time.time() - 3600)
    assert folder.record().state is SandboxState.DEAD
    assert folder.reconcile().state is SandboxState.DEAD
    assert json.loads(folder.state_file.read_text())["state"] == "running"  # not rewritten
    assert (folder.path / "disk-1.qcow2").exists()  # nothing moved for a pause that cannot be
