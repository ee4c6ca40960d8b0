"""The examples run as a user runs them, on real VMs, and do what they say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm
EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_agent_session_example_runs_end_to_end() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "agent_session.py")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout
    assert "ran the tests: OK" in out and "broke it: FAILED" in out
    assert "rolled back: tests pass, the server never stopped" in out
    # pip ran, or its skip says so plainly.
    assert "pip-installed a dependency (six " in out or "SKIPPED pip install: " in out
    verdicts = [line.split()[2] for line in out.splitlines() if line.startswith("    mul-")]
    assert sorted(verdicts) == ["FAIL", "FAIL", "PASS"]
    assert "picked mul-by-operator" in out and out.rstrip().endswith("agent session: done")
