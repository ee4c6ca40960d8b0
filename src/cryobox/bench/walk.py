"""How far a create and a fork walk through the code: ``python -m cryobox.bench.walk``.

Runs an embedded create of the ``base`` template and a fork of it over the fake VMM in
a temporary state folder, with every cryobox module imported beforehand (so that module
loading is not counted), and traces the calls made in this process (the supervisor is
another process). It prints, per walk, the files whose functions ran, the distinct
file-to-file call edges and how many calls crossed files, and the climbs: calls from a
module on a lower floor into one on a higher floor (README, "How it works"), which the
import contract forbids as imports but a callback can still make.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import pkgutil
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

#: The floor of each top-level package or module (1 is the top).
FLOORS = {
    "cli": 1,
    "bench": 1,
    "e2b": 2,
    "server": 3,
    "client": 4,
    "service": 5,
    "sandbox": 6,
    "vmm": 7,
    "qemu": 7,
    "store": 8,
    "snapshot": 8,
    "image": 8,
    "guest": 9,
    "network": 9,
}
BOTTOM = 10


def floor(relative: str) -> int:
    """The floor of a file given relative to the package (``service/service.py``)."""
    top = relative.split("/")[0].removesuffix(".py")
    return 0 if top == "__init__" else FLOORS.get(top, BOTTOM)


class Walk:
    """The cross-file calls made while it is active (in threads started meanwhile too)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.calls: list[tuple[str, str]] = []

    def _profile(self, frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(self.root):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(self.root):
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename != frame.f_code.co_filename:
            self.calls.append((self._name(caller), self._name(frame)))

    def _name(self, frame: FrameType) -> str:
        return str(Path(frame.f_code.co_filename).relative_to(self.root))

    def run(self, work: Callable[[], Any]) -> Any:
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        try:
            return work()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    def report(self, label: str) -> str:
        files = {name for call in self.calls for name in call}
        edges = set(self.calls)
        climbs = {(a, b) for a, b in edges if 0 < floor(b) < floor(a)}
        lines = [
            f"{label}: {len(files)} files, {len(edges)} file-to-file call edges "
            f"({len(self.calls)} calls across files), {len(climbs)} climbs up"
        ]
        lines += [f"  climb: {a} -> {b}" for a, b in sorted(climbs)]
        return "\n".join(lines)


def main() -> None:
    for name in ("CRYOBOX_API_URL", "CRYOBOX_API_KEY"):  # the walk is of this process's code
        os.environ.pop(name, None)
    state = tempfile.mkdtemp(prefix="cbx-walk-")
    os.environ.update(CRYOBOX_STATE_DIR=state, CRYOBOX_VMM="fake", CRYOBOX_POOL_SIZE="0")
    try:
        _walk()
    finally:
        from cryobox.service import discard_spare

        discard_spare()  # (its supervisors' zygote works in the folder)
        shutil.rmtree(state, ignore_errors=True)


def _walk() -> None:
    """Create a sandbox and fork it over the fake VMM, each walked; print both walks."""
    import cryobox
    from cryobox import AsyncSandbox

    for info in pkgutil.walk_packages(cryobox.__path__, "cryobox."):
        if info.name.startswith(("cryobox.bench", "cryobox.cli")) or "__main__" in info.name:
            continue
        with contextlib.suppress(Exception):  # a module that needs what is absent here
            importlib.import_module(info.name)
    root = str(Path(cryobox.__file__).parent) + "/"

    async def fresh_loop() -> None:  # its worker threads start inside the walk: traced
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor())

    async def create() -> str:
        await fresh_loop()
        return (await AsyncSandbox.create("base")).id

    async def fork(sandbox_id: str) -> list[str]:
        await fresh_loop()
        parent = await AsyncSandbox.connect(sandbox_id)
        return [copy.id for copy in await parent.fork(1)]

    async def kill(ids: list[str]) -> None:
        for sandbox_id in ids:
            await (await AsyncSandbox.connect(sandbox_id, resume=False)).kill()

    creating, forking = Walk(root), Walk(root)
    sandbox_id = creating.run(lambda: asyncio.run(create()))
    copies = forking.run(lambda: asyncio.run(fork(sandbox_id)))
    asyncio.run(kill([*copies, sandbox_id]))
    print(creating.report("create"))
    print(forking.report("fork (with its connect)"))


if __name__ == "__main__":
    main()
