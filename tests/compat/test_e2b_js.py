"""E2B's JavaScript SDK (``e2b`` on npm, pinned in tests/compat/js/package-lock.json and
installed by ``make setup``), unchanged, against a real ``cryobox server`` and real VMs,
with a tenant key in E2B's shape (``cryobox tenant create NAME --e2b-key``): the SDK
refuses any other before it sends anything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from api_server import ApiServer

pytestmark = pytest.mark.vm

HERE = Path(__file__).parent / "js"


def test_the_js_sdk_runs_a_session_with_an_e2b_shaped_key(api_server: ApiServer) -> None:
    node = shutil.which("node")
    assert node is not None, "node is not installed"
    assert (HERE / "node_modules" / "e2b").is_dir(), "run make setup: it installs the JS SDK"
    key = api_server.tenant(f"js-{os.urandom(3).hex()}", "--e2b-key")
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", key), key
    env = {
        **os.environ,
        "E2B_API_URL": f"{api_server.url}/e2b",
        "E2B_SANDBOX_URL": f"{api_server.url}/e2b",
        "E2B_API_KEY": key,
    }
    done = subprocess.run(
        [node, "session.mjs"], cwd=HERE, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    [run] = [line for line in lines if line.startswith("run: ")]
    assert re.fullmatch(r"run: hello-42 sbx-[0-9a-f]{12}", run), run
    assert "read: from the JS SDK" in lines
    assert "listed: true" in lines and "killed: true" in lines
    assert "killed during a run: TimeoutError true" in lines
    assert "info: true js" in lines and lines[-1] == "js sdk: done"
