"""What the ``cryobox`` command costs before it does anything, for ``cryobox bench
cli-start``: each command run as a new process (as a shell or an agent runs it), beside
the same operation made in a process that is already running, in one run.

The difference is the CLI's own overhead: the interpreter's start, imports, argument
parsing and, for an embedded call, opening the host's state.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryobox.client.async_sandbox import AsyncSandbox


def command() -> list[str]:
    """The installed ``cryobox`` beside this interpreter (a venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "cryobox"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("cryobox")
    if found is None:
        raise RuntimeError("no 'cryobox' command is installed beside this Python or on PATH")
    return [found]


@dataclass
class CliFigures:
    """Seconds per run: a bare interpreter, and each command as a process and in one."""

    python: list[float] = field(default_factory=list)
    version: list[float] = field(default_factory=list)
    ls: list[float] = field(default_factory=list)
    ls_in_process: list[float] = field(default_factory=list)
    exec: list[float] = field(default_factory=list)
    exec_in_process: list[float] = field(default_factory=list)


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr!r}")
    return elapsed


async def run(quick: bool) -> CliFigures:
    """Interleaved rounds, so that a busy moment of a shared machine falls on each alike."""
    cli = command()
    found = CliFigures()
    sbx = await AsyncSandbox.create()
    try:
        await sbx.commands.run(["true"])
        for _ in range(3 if quick else 15):
            found.python.append(_wall([sys.executable, "-c", "pass"]))
            found.version.append(_wall([*cli, "--version"]))
            found.ls.append(_wall([*cli, "ls"]))
            found.exec.append(_wall([*cli, "exec", sbx.id, "--", "true"]))
            start = time.perf_counter()
            await AsyncSandbox.list()
            found.ls_in_process.append(time.perf_counter() - start)
            start = time.perf_counter()
            await sbx.commands.run(["true"])
            found.exec_in_process.append(time.perf_counter() - start)
    finally:
        await sbx.kill()
    return found
