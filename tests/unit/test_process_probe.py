"""The guest's process probe (cryobox.service.process_probe), run on this host's own
processes: what a process checkpoint records and what a restore checks."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryobox.errors import InvalidArgument, ProcessCheckpointFailed, SnapshotIncompatible
from cryobox.service import process_probe
from cryobox.service.processes import Processes, _description
from cryobox.snapshot.manifest import Manifest
from waiting import until

CHILD = """
import subprocess, sys, time
held = open(sys.argv[1])
subprocess.Popen(["sleep", "60"])
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    held = tmp_path / "held.txt"
    held.write_text("x")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(held)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    # Popen returns once the exec has begun; the kernel names the child after it.
    until(
        lambda: "sleep" in process_probe.describe(child.pid)["comms"].values(),
        "the child to be named sleep",
        timeout=10,
    )
    yield child, held
    for pid in process_probe.tree(child.pid)[::-1]:
        os.kill(pid, 9)
    child.wait()


def test_describe_names_the_tree_its_files_and_its_pipes_to_outside(
    tree: tuple[subprocess.Popen[str], Path],
) -> None:
    child, held = tree
    described = process_probe.describe(child.pid)
    assert described["pids"][0] == child.pid and len(described["pids"]) == 2
    assert set(described["comms"].values()) >= {"sleep"}
    assert str(held) in described["open_files"]
    assert sys.executable in described["command"]
    assert os.path.realpath(sys.executable) in described["maps"]
    # Its stdout is a pipe this test reads: outside the tree, the "out" end.
    assert {"end": "out"} in [{"end": p["end"]} for p in described["outside_pipes"]]
    assert described["rss_bytes"] > 0 and described["kernel"] == os.uname().release
    assert process_probe.describe(2**22 + 1) == {"error": f"no process {2**22 + 1}"}


def test_check_names_what_differs_in_the_target(
    tree: tuple[subprocess.Popen[str], Path],
) -> None:
    child, held = tree
    saved = process_probe.describe(child.pid)
    same = process_probe.check(saved)
    assert same["maps_changed"] == [] and same["missing"] == []
    assert [p["pid"] for p in same["pids_in_use"]] == saved["pids"]  # still running here
    library = next(iter(saved["maps"]))
    altered = {
        **saved,
        "maps": {**saved["maps"], library: [saved["maps"][library][0] + 1, 0]},
        "open_files": [*saved["open_files"], "/nonexistent/file"],
    }
    found = process_probe.check(altered)
    assert [c["path"] for c in found["maps_changed"]] == [library]
    assert found["missing"] == ["/nonexistent/file"]
    carried = process_probe.check({**altered, "with_files": ["/nonexistent/file"]})
    assert carried["missing"] == []
    held.unlink()  # (the process still has it open; only its name is gone)
    assert str(held) in process_probe.check(saved)["missing"]


def test_a_restore_onto_another_kernel_or_a_taken_pid_is_refused_in_words() -> None:
    saved = {"kernel": "6.1.0-57-amd64", "pids": [140], "maps": {}, "open_files": []}
    manifest = Manifest.from_json(
        {
            "id": "snap-0123456789ab",
            "kind": "disk",
            "purpose": "process",
            "name": None,
            "created_at": 0.0,
            "source_sandbox": "sbx-0123456789ab",
            "parent": None,
            "image_id": "img",
            "cpus": 0,
            "memory_mib": 0,
            "disk_gib": 0,
            "disk_chain": [],
            "ports": [],
            "ram_in_stream": False,
            "process": saved,
        }
    )
    processes = Processes.__new__(Processes)
    found = {"kernel": "6.12.0-1-amd64", "maps_changed": [], "missing": [], "pids_in_use": []}
    with pytest.raises(SnapshotIncompatible, match=r"6\.1\.0-57-amd64.*6\.12\.0-1-amd64"):
        processes._refuse_what_differs(manifest, "sbx-other", found)
    taken = {**found, "kernel": saved["kernel"], "pids_in_use": [{"pid": 140, "comm": "vim"}]}
    with pytest.raises(InvalidArgument, match="pid 140 is in use in sbx-other by 'vim'"):
        processes._refuse_what_differs(manifest, "sbx-other", taken)


def test_a_hostile_probe_answer_is_refused_field_by_field() -> None:
    good = {
        "pids": [140, 141],
        "comms": {"140": "python3", "141": "sleep"},
        "command": "python3 x.py",
        "cwd": "/root",
        "rss_bytes": 1 << 20,
        "open_files": ["/root/x"],
        "maps": {"/usr/bin/python3.11": [100, 5]},
        "outside_pipes": [{"pipe": "pipe:[1323]", "end": "out"}],
        "sockets": 0,
        "kernel": "6.1.0-57-amd64",
    }
    assert _description(good, 140) == good
    assert _description({"error": "no process 7"}, 7) is None
    hostile = [
        {**good, "pids": [141, 140]},  # not the tree asked for
        {**good, "pids": [140, 1]},  # init, which the host would signal
        {**good, "pids": [140, 0]},  # (kill -- 0: every process of the group)
        {**good, "pids": ["140"]},
        {**good, "rss_bytes": -1},
        {**good, "maps": {"/x": "big"}},
        {**good, "outside_pipes": [{"pipe": "pipe:[1]; rm -rf /", "end": "out"}]},
        {**good, "outside_pipes": [{"pipe": "pipe:[1]", "end": "sideways"}]},
        {key: value for key, value in good.items() if key != "kernel"},
    ]
    for answer in hostile:
        with pytest.raises(ProcessCheckpointFailed, match="malformed"):
            _description(answer, 140)
    long = _description({**good, "command": "x" * 100_000, "pids": list(range(140, 9000))}, 140)
    assert long is not None and len(long["command"]) == 4096 and len(long["pids"]) == 4096
