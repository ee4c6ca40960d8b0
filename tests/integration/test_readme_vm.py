"""The README and docs/ run as written (issue 37 item 7).

Each document's runnable blocks (see ``tests/markdown_blocks.py``) run in order as one
bash script, as a user would type them into one terminal at the checkout's root: a
fresh state folder (so the first ``create`` builds the default template, as on a new
machine), the product's defaults (a pause keeps its VM for 60 s), no server variables.
The script runs in a folder of its own whose entries link to the checkout's, so the
files the blocks make (``notes.txt``, ``app.cbx``) land there. Then nothing the blocks
made may be left: no sandbox running or paused, no snapshot but the default template's,
no volume, no tenant, no server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_server import kill_vms
from markdown_blocks import DOCUMENTS, ROOT, blocks, script

pytestmark = pytest.mark.vm

#: What each document's blocks print that shows they did their work.
PRINTS = {
    "README.md": [
        "^0 42$",  # the Python tour's first command
        "^vCPUs: 3$",  # the tour's snapshot restored with a vCPU more
        "^kept sbx-[0-9a-f]{12} scoring 0$",  # best of N
        r"^ +\d+ .*python3 /root/count\.py$",  # a process restored elsewhere, seen by ps
        "^ready$",  # a file the CLI's template build made, read in a sandbox of it
    ],
    "VOLUMES.md": [r"^b'weights\\n'$"],
}
RUN = [document for document in DOCUMENTS if any(block.runs for block in blocks(document))]


@pytest.fixture
def state() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="cbx-rd-"))  # short: socket paths
    try:
        yield folder
    finally:
        kill_vms(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _checkout_view(into: Path) -> None:
    """A folder whose entries are links to the checkout's: commands find `.venv`,
    `examples` and the Makefile where the README says, and write beside them."""
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (into / entry.name).symlink_to(entry)


def _cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "cryobox"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def _rows(text: str) -> list[str]:
    """The rows of a piped table, without its header."""
    return [line for line in text.splitlines()[1:] if line.strip()]


def _vms_of(state: Path) -> list[int]:
    """Pids of QEMUs still running for sandboxes under this state folder."""
    alive = []
    for record in state.glob("**/sandboxes/*/state.json"):
        with contextlib.suppress(OSError, ValueError):
            pid = json.loads(record.read_text()).get("qemu_pid")
            if pid and record.parent.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                alive.append(int(pid))
    return alive


def _servers_of(state: Path) -> list[int]:
    """Pids of `cryobox server` processes on this state folder."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"server" in cmdline and f"CRYOBOX_STATE_DIR={state}".encode() in environ:
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize("document", RUN, ids=[str(d.relative_to(ROOT)) for d in RUN])
def test_the_document_runs_as_written_and_leaves_nothing(
    document: Path, state: Path, tmp_path: Path
) -> None:
    # The checkout's virtualenv brought up to date here first: the blocks' `make demo`
    # would otherwise install into it through the link, as `tmp_path/.venv`, and leave
    # its scripts naming an interpreter under this test's folder, gone after it.
    subprocess.run(
        ["make", "-s", "-C", str(ROOT), "VENV=.venv", ".venv/.pip-done"], check=True, timeout=900
    )
    _checkout_view(tmp_path)
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("CRYOBOX_", "E2B_"))
    }
    # The pool stays off: its refill after each create would compete with the blocks for
    # the two cores (tests/integration/test_pool_vm.py tests the pool).
    env.update(CRYOBOX_STATE_DIR=str(state), CRYOBOX_POOL_SIZE="0")
    if document.name == "README.md":  # its server block listens where the README says
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", 8080)) != 0, "port 8080 is taken here"
    run = subprocess.Popen(
        ["bash", "-c", script(document)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            output, _ = run.communicate(timeout=1200)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            output, _ = run.communicate()
            output += "\n(killed after 1200 s)"
        print(output)  # shown by pytest when the test fails
        blocks_run = [line for line in output.splitlines() if line.startswith("===== ")]
        assert run.returncode == 0, f"stopped in {blocks_run[-1:]} (its output: captured stdout)"
        for printed in PRINTS[document.name]:
            assert re.search(printed, output, re.MULTILINE), printed

        assert json.loads(_cli(env, "ls", "--json")) == []
        kept = [(s["name"], s["purpose"]) for s in json.loads(_cli(env, "snapshots", "--json"))]
        assert all(p == "template" and name == "template:default" for name, p in kept), kept
        assert _rows(_cli(env, "volume", "ls")) == []
        assert _rows(_cli(env, "tenant", "ls")) == []
        deadline = time.monotonic() + 15
        while (_servers_of(state) or _vms_of(state)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _servers_of(state) == []
        assert _vms_of(state) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        for pid in _servers_of(state):  # a server a failed block left running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
