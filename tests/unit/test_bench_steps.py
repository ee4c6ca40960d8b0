"""The bench's reading of a supervisor's step timings and of a process's CPU time."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cryobox import config
from cryobox.bench import steps as bench_steps


def test_the_latest_line_of_a_kind_is_read_step_by_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path))
    folder = config.sandboxes_dir() / "sbx-0123456789ab"
    folder.mkdir(parents=True)
    (folder / "supervisor.log").write_text(
        "2026-11-30 15:48:19,129 cryobox.supervisor INFO pause 308 ms: stop 3, hash 216\n"
        "2026-11-30 15:48:19,812 cryobox.supervisor INFO resume 372 ms: vm start 107, "
        "device state 34, agent refreshed 232\n"
        "2026-11-30 15:48:20,904 cryobox.supervisor INFO resume 443 ms: vm start 151, "
        "device state 28, agent refreshed 263, of which in the agent 80.4\n"
        "2026-11-30 15:48:21,000 cryobox.supervisor INFO running\n"
    )
    assert bench_steps.step_timings("sbx-0123456789ab", "resume") == {
        "total": 443.0,
        "vm start": 151.0,
        "device state": 28.0,
        "agent refreshed": 263.0,
        "of which in the agent": 80.4,
    }
    assert bench_steps.step_timings("sbx-0123456789ab", "pause") == {
        "total": 308.0,
        "stop": 3.0,
        "hash": 216.0,
    }
    assert bench_steps.step_timings("sbx-0123456789ab", "claim") is None
    assert bench_steps.step_timings("sbx-ffffffffffff", "resume") is None


def test_cpu_seconds_count_this_process_and_nothing_for_a_gone_one() -> None:
    before = bench_steps.cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert bench_steps.cpu_seconds(os.getpid()) >= before + 0.1
    assert bench_steps.cpu_seconds(None) == 0.0
    assert bench_steps.cpu_seconds(2**22 + 1) == 0.0


def test_memory_parts_of_a_process() -> None:
    """This test process's own memory, split: its program and libraries are files, its
    heap is the rest; it has no guest RAM or translated code."""
    parts = bench_steps.memory_parts([os.getpid()])
    assert parts[bench_steps.PROGRAM] > 1
    assert parts[bench_steps.OTHER] > 1
    assert parts[bench_steps.GUEST_RAM] == 0
    assert bench_steps.memory_parts([2**22 + 7]) == dict.fromkeys(parts, 0.0)  # no such pid


def test_mappings_are_told_apart() -> None:
    part = bench_steps._part
    assert part("7f53-7f54 rw-p 00000000 00:00 0   /srv/snapshots/snap-1/memory") == (
        bench_steps.GUEST_RAM
    )
    assert part("7f53-7f54 rw-p 00000000 00:00 0   /srv/sbx-1/memory-3f2a") == bench_steps.GUEST_RAM
    assert part("7f53-7f54 rwxp 00000000 00:00 0 ") == bench_steps.TRANSLATED_CODE
    assert part("7f53-7f54 rw-p 00000000 00:00 0 ") == bench_steps.OTHER
    assert part("7f53-7f54 rw-p 00000000 00:00 0   [heap]") == bench_steps.OTHER
    assert part("5583-5584 r-xp 00000000 08:01 12  /usr/bin/qemu-system-x86_64") == (
        bench_steps.PROGRAM
    )
