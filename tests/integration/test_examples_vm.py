"""The examples run as a user runs them, on real VMs, and do what they say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cryobox import Sandbox

pytestmark = pytest.mark.vm
EXAMPLES = Path(__file__).parents[2] / "examples"


def run_example(name: str) -> str:
    """What the example printed; it must exit 0."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_the_agent_session_example_runs_end_to_end() -> None:
    out = run_example("agent_session.py")
    assert "ran the tests: OK" in out and "broke it: FAILED" in out
    assert "rolled back: tests pass, the server never stopped" in out
    # pip ran, or its skip says so plainly.
    assert "pip-installed a dependency (six " in out or "SKIPPED pip install: " in out
    verdicts = [line.split()[2] for line in out.splitlines() if line.startswith("    mul-")]
    assert sorted(verdicts) == ["FAIL", "FAIL", "PASS"]
    assert "picked mul-by-operator" in out and out.rstrip().endswith("agent session: done")


def test_the_mcp_agent_example_keeps_the_one_fix_that_passes() -> None:
    """examples/mcp_agent.py: best-of-N through ``cryobox mcp`` over stdio only."""
    out = run_example("mcp_agent.py")
    fixes = [line.split() for line in out.splitlines() if line.startswith("    fix-")]
    assert {fix[0]: fix[2] for fix in fixes} == {
        "fix-subtract": "FAIL",
        "fix-multiply": "PASS",
        "fix-ignore": "FAIL",
    }
    assert out.rstrip().endswith("mcp agent: done")
    # The server it started worked in this caller's state folder, with its settings (an
    # MCP client passes only a few variables unless told: the server used the user's
    # default folder and left a warm-pool member running there).
    ran = [s for s in Sandbox.list(all=True) if s.metadata.get("example") == "mcp-agent"]
    assert len(ran) == 4 and all(s.state == "killed" for s in ran)
