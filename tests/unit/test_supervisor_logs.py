"""The supervisor's log routing: in a process serving several sandboxes (a fork's
copies), each record lands in the supervisor.log of the sandbox whose task wrote it."""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryobox.sandbox import supervisor
from cryobox.sandbox.registry import SandboxDir


@pytest.fixture
def routed() -> Iterator[None]:
    root = logging.getLogger()
    level, fallback = root.level, supervisor._LOGS.fallback
    yield
    root.removeHandler(supervisor._LOGS)
    root.setLevel(level)
    supervisor._LOGS.fallback = fallback


def test_each_sandbox_of_a_shared_process_logs_to_its_own_file(
    tmp_path: Path, routed: None
) -> None:
    log = logging.getLogger("cryobox.test")
    elsewhere = io.StringIO()
    supervisor._LOGS.fallback = logging.StreamHandler(elsewhere)  # stderr, in a supervisor

    async def one(name: str) -> logging.Handler:
        folder = SandboxDir(tmp_path / name)
        folder.path.mkdir()
        handler = supervisor._log_to(folder, only=False)
        await asyncio.sleep(0)  # the other sandbox's task runs between these lines
        log.info("%s in its task", name)
        await asyncio.to_thread(log.info, "%s in a worker thread", name)
        await asyncio.sleep(0)
        log.info("%s again", name)
        return handler

    async def both() -> list[logging.Handler]:
        return list(await asyncio.gather(one("sbx-a"), one("sbx-b")))

    handlers = asyncio.run(both())
    thread = threading.Thread(target=log.info, args=("a thread of no sandbox's",))
    thread.start()
    thread.join()
    for handler in handlers:
        handler.close()
    for name in ("sbx-a", "sbx-b"):
        text = (tmp_path / name / "supervisor.log").read_text()
        assert [line.split(" INFO ")[1] for line in text.splitlines()] == [
            f"{name} in its task",
            f"{name} in a worker thread",
            f"{name} again",
        ]
    assert elsewhere.getvalue() == "a thread of no sandbox's\n"


def test_a_process_serving_one_sandbox_logs_everything_there(tmp_path: Path, routed: None) -> None:
    folder = SandboxDir(tmp_path / "sbx-only")
    folder.path.mkdir()
    handler = supervisor._log_to(folder, only=True)
    thread = threading.Thread(target=logging.getLogger("cryobox.test").info, args=("thread",))
    thread.start()
    thread.join()
    handler.close()
    assert folder.supervisor_log.read_text().rstrip().endswith("INFO thread")
