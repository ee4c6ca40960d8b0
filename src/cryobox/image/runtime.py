"""The runtime cryobox carries into a root file system that is not its own.

The guest agent is Python (3.11, with uvloop and xxhash) and sets the guest up with a few programs
(``ip``, ``resize2fs``, ``setsid``). cryobox's own image has them; a container image
may have another Python, no Python at all, another C library or none (busy box images,
distroless ones, Alpine's musl). So a root file system made from a container image gets
``/.cryobox``: those programs as cryobox's own image has them, with every library they
load and the dynamic loader itself, each program pointed at that loader and those
libraries by path (patchelf). They never use the image's libraries, and the image's
programs never see them: commands get the image's own ``PATH``.

The files come out of cryobox's own root file system (``debugfs``: no mount, no root
needed), so they are exactly the guest's Debian packages; the tree is made once per
guest image and kept in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from cryobox import config
from cryobox.errors import ImageError
from cryobox.image.build import GUEST_LOADER, Image, run

#: Where the runtime lives in a guest's root file system (init.c looks for its Python).
GUEST_DIR = "/.cryobox"
#: Programs the agent runs, as cryobox's image has them, and where they land.
PROGRAMS = {
    "/usr/bin/python3.11": "python3",
    "/usr/bin/ip": "ip",
    "/usr/sbin/resize2fs": "resize2fs",
    "/usr/bin/setsid": "setsid",
}
#: Folders of Python: the standard library, uvloop (the agent's event loop) and xxhash
#: (the digest of a bulk transfer's slots; its libxxhash comes as a library it needs).
PYTHON_TREES = {
    "/usr/lib/python3.11": "lib/python3.11",
    "/usr/lib/python3/dist-packages/uvloop": "lib/python3/dist-packages/uvloop",
    "/usr/lib/python3/dist-packages/xxhash": "lib/python3/dist-packages/xxhash",
}
LIBRARIES = "/usr/lib/x86_64-linux-gnu"
_NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[(.+?)\]")


def guest_runtime(image: Image) -> Path:
    """The runtime tree for ``image`` (made on first use, then kept): copy it to
    :data:`GUEST_DIR` of a root file system.

    :raises ImageError: when a tool is missing or the image lacks a file the runtime needs.
    """
    target = config.cache_dir() / "runtime" / f"{image.id}-{_recipe()}"
    if (target / "bin/python3").exists():
        _remove_stale(target)
        return target
    for tool in ("debugfs", "patchelf", "readelf", "qemu-img"):
        if shutil.which(tool) is None:
            raise ImageError(f"{tool} is not installed (run `make setup`)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".runtime-") as temp:
        work = Path(temp)
        raw = work / "root.raw"
        run(["qemu-img", "convert", "-O", "raw", str(image.rootfs), str(raw)])
        tree = work / "tree"
        for folder in ("bin", "lib/python3/dist-packages"):
            (tree / folder).mkdir(parents=True, exist_ok=True)
        for source, name in PROGRAMS.items():
            _debugfs(raw, f"dump {source} {tree / 'bin' / name}")
        for source, dest in PYTHON_TREES.items():
            _debugfs(raw, f"rdump {source} {(tree / dest).parent}")
        _debugfs(raw, f"rdump {LIBRARIES} {work}")
        libraries = work / Path(LIBRARIES).name
        _copy_needed(tree, libraries)
        shutil.copyfile(libraries / GUEST_LOADER, tree / "lib" / GUEST_LOADER)
        busybox = shutil.which("busybox")
        if busybox is None:
            raise ImageError("busybox is not installed (run `make setup`)")
        shutil.copyfile(busybox, tree / "bin/busybox")  # static: sh for a CMD in any image
        for program in (tree / "bin").iterdir():
            program.chmod(0o755)
            if program.name != "busybox":
                run(
                    [
                        "patchelf",
                        "--set-interpreter",
                        f"{GUEST_DIR}/lib/{GUEST_LOADER}",
                        "--force-rpath",  # DT_RPATH: also for the libraries' own needs
                        "--set-rpath",
                        f"{GUEST_DIR}/lib",
                        str(program),
                    ]
                )
        for library in (tree / "lib").glob("*.so*"):
            library.chmod(0o755)
        os.replace(tree, target)
    _remove_stale(target)
    return target


def _remove_stale(target: Path) -> None:
    """Remove the trees made for the same image by another recipe (an older cryobox's:
    56 MiB each, otherwise kept for good). Each is renamed first, so no tree is ever
    seen half removed under its own name; trees of other images, and trees being made
    (``.runtime-*``), are left alone."""
    image_id = target.name.rsplit("-", 1)[0]
    for tree in target.parent.iterdir():
        stale = tree != target and (tree.name == image_id or tree.name.startswith(f"{image_id}-"))
        if stale:
            doomed = tree.with_name(f".stale-{tree.name}-{os.getpid()}")
            try:
                tree.rename(doomed)
            except OSError:  # (removed by another process meanwhile)
                continue
            shutil.rmtree(doomed, ignore_errors=True)
        elif tree.name.startswith(".stale-"):  # (left by a process that died removing it)
            shutil.rmtree(tree, ignore_errors=True)


def _recipe() -> str:
    """A key of what the tree holds beside the image's files: a tree made with other
    programs or folders (xxhash came later than uvloop) is made again."""
    listed = json.dumps([PROGRAMS, PYTHON_TREES, LIBRARIES, GUEST_DIR], sort_keys=True)
    return hashlib.sha256(listed.encode()).hexdigest()[:12]


def _debugfs(raw: Path, request: str) -> None:
    """Run one debugfs request on the ext4 image ``raw``; it says failures on stderr
    with exit status 0, so a missing file is found by what it prints."""
    done = subprocess.run(
        ["debugfs", "-R", request, str(raw)], capture_output=True, text=True, check=False
    )
    said = [
        line
        for line in done.stderr.splitlines()
        if line.strip() and not line.startswith("debugfs ")
    ]
    if done.returncode != 0 or said:
        raise ImageError(
            f"cannot copy out of the guest image: debugfs {request}",
            command=["debugfs", "-R", request],
            output="\n".join(said),
        )


def _copy_needed(tree: Path, libraries: Path) -> None:
    """Copy into ``tree/lib`` every shared library the programs and Python's extension
    modules in ``tree`` load, transitively, from the guest's ``libraries``."""
    queue = [
        *(tree / "bin").iterdir(),
        *(tree / "lib").rglob("*.so"),
    ]
    seen: set[str] = set()
    while queue:
        elf = queue.pop()
        for name in _NEEDED.findall(run(["readelf", "-d", str(elf)])):
            if name in seen:
                continue
            seen.add(name)
            found = libraries / name
            if not found.exists():
                raise ImageError(f"{elf.name} needs {name}, which the guest image lacks")
            copy = tree / "lib" / name
            shutil.copyfile(found.resolve(), copy)
            queue.append(copy)


__all__ = ["GUEST_DIR", "guest_runtime"]
