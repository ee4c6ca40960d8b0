"""Lifecycle rules, the on-disk registry and argument validation: no VM needed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cryobox import Sandbox
from cryobox.errors import InvalidArgument, QemuNotInstalled, SandboxNotFound, StateError
from cryobox.models import CreateRequest
from cryobox.sandbox import registry
from cryobox.sandbox.registry import SandboxDir, SandboxRecord, process_start
from cryobox.sandbox.state import SandboxState, check_transition, require
from cryobox.service.service import validate
from specs import small_spec


def test_state_error_names_the_state_and_what_was_needed() -> None:
    with pytest.raises(StateError) as info:
        require("sbx-1", SandboxState.KILLED, (SandboxState.RUNNING,), "run a command in")
    assert info.value.state == "killed" and info.value.required == ("running",)
    assert "cannot run a command in sandbox sbx-1: it is killed, needs to be running" in str(
        info.value
    )


def test_finished_states_are_final() -> None:
    check_transition("s", SandboxState.CREATING, SandboxState.RUNNING)
    for final in (SandboxState.KILLED, SandboxState.DEAD):
        with pytest.raises(StateError):
            check_transition("s", final, SandboxState.RUNNING)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"cpus": 0}, "cpus=0"),
        ({"memory_mib": 16}, "memory_mib=16"),
        ({"disk_gib": 1}, "disk_gib=1"),
        ({"timeout": 0}, "timeout=0"),
        ({"ports": [70000]}, "port 70000"),
        ({"cpus": True}, "cpus=True"),
        ({"cpus": 2.5}, "cpus=2.5"),
        ({"timeout": float("inf")}, "timeout=inf"),
        ({"timeout": float("nan")}, "timeout=nan"),
    ],
)
def test_bad_create_arguments_are_named(kwargs: dict[str, object], named: str) -> None:
    args: dict[str, object] = dict(cpus=2, memory_mib=512, disk_gib=4, timeout=60.0, ports=[])
    args.update(kwargs)
    with pytest.raises(InvalidArgument, match=named):
        validate(CreateRequest(**args))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=named):
        Sandbox.create("base", **kwargs)  # type: ignore[arg-type]


def test_unknown_template_is_named() -> None:
    with pytest.raises(InvalidArgument, match="template 'nope' does not exist"):
        Sandbox.create("nope")


def test_create_without_qemu_fails_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRYOBOX_QEMU", "/nonexistent/qemu")
    before = [spec.id for spec, _ in registry.list_sandboxes()]
    with pytest.raises(QemuNotInstalled):
        Sandbox.create()
    assert [spec.id for spec, _ in registry.list_sandboxes()] == before


def test_unknown_sandbox_id() -> None:
    for bad in ("sbx-000000000000", "../etc", ""):
        with pytest.raises(SandboxNotFound):
            Sandbox.connect(bad)


def test_record_of_a_vanished_supervisor_reads_dead(tmp_path: object) -> None:
    folder = SandboxDir.for_id("sbx-deadbeef0001")
    folder.write_spec(small_spec(folder.id))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", folder.id])
    try:
        folder.write_record(
            SandboxRecord(
                id=folder.id,
                state=SandboxState.RUNNING,
                supervisor_pid=child.pid,
                supervisor_started=process_start(child.pid),
            )
        )
        assert folder.record().state is SandboxState.RUNNING
    finally:
        child.kill()
        child.wait()
    record = folder.record()
    assert record.state is SandboxState.DEAD and "supervisor" in (record.error or "")
    # pid reuse guard: a live process that started at another time is not the supervisor
    folder.write_record(
        SandboxRecord(
            id=folder.id,
            state=SandboxState.RUNNING,
            supervisor_pid=os.getpid(),
            supervisor_started=1,
        )
    )
    assert folder.record().state is SandboxState.DEAD
    Sandbox.connect(folder.id, resume=False).kill()  # (connect() raises: it is dead)
    assert not folder.path.exists()


def test_record_writes_are_atomic_and_checked() -> None:
    folder = SandboxDir.for_id("sbx-deadbeef0002")
    folder.path.mkdir(parents=True)
    folder.write_record(SandboxRecord(id=folder.id, state=SandboxState.KILLED))
    with pytest.raises(StateError):
        folder.write_record(SandboxRecord(id=folder.id, state=SandboxState.RUNNING))
    assert [p.name for p in folder.path.iterdir()] == ["state.json"]
    assert time.time() - folder.record().updated_at < 60
