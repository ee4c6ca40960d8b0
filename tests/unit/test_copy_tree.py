"""``cryobox cp -r``'s archives: what goes in, and what an archive from the guest (not
trusted) may unpack on the host. Copies through real sandboxes, both ways, are in
``tests/integration/test_sandbox_vm.py``."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from cryobox.cli import copy_tree
from cryobox.errors import CryoboxError


def test_the_archive_holds_folders_and_files_and_names_what_it_skips(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "b.sh").write_text("b")
    (tree / "sub" / "b.sh").chmod(0o750)
    (tree / "link").symlink_to("a.txt")
    (tree / "dirlink").symlink_to("sub")
    skipped: list[str] = []
    archive = tmp_path / "t.tar"
    assert copy_tree._archive_of(tree, archive, skipped.append) == 2
    assert sorted(skipped) == [f"symlink {tree / 'dirlink'}", f"symlink {tree / 'link'}"]
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar}
    assert sorted(members) == [".", "a.txt", "sub", "sub/b.sh"]
    assert members["sub/b.sh"].mode & 0o777 == 0o750


def _archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


def _info(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, mode
    return info


def test_unpacking_takes_files_and_folders_keeps_modes_and_skips_links(tmp_path: Path) -> None:
    archive = tmp_path / "t.tar"
    link = _info("./ln", tarfile.SYMTYPE)
    link.linkname = "/etc/passwd"
    _archive(
        archive,
        [
            (_info(".", tarfile.DIRTYPE, 0o755), b""),
            (_info("./d", tarfile.DIRTYPE, 0o700), b""),
            (_info("./d/run.sh", mode=0o755), b"#!/bin/sh\n"),
            (link, b""),
            (_info("./fifo", tarfile.FIFOTYPE), b""),
        ],
    )
    skipped: list[str] = []
    out = tmp_path / "out"
    assert copy_tree._unpack(archive, out, "/root/x", skipped.append) == 1
    assert (out / "d" / "run.sh").read_bytes() == b"#!/bin/sh\n"
    assert (out / "d" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert not (out / "ln").exists() and not (out / "ln").is_symlink()
    assert skipped == ["symlink /root/x/ln", "special file /root/x/fifo"]


@pytest.mark.parametrize("name", ["../escape", "/etc/cron.d/x", "d/../../escape"])
def test_an_archive_that_names_a_place_outside_the_target_is_refused(
    tmp_path: Path, name: str
) -> None:
    archive = tmp_path / "t.tar"
    _archive(archive, [(_info(name), b"owned")])
    with pytest.raises(CryoboxError, match="refused"):
        copy_tree._unpack(archive, tmp_path / "out", "/root/x", lambda _: None)
    assert not (tmp_path / "escape").exists()
