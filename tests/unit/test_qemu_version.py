"""QEMU's version is asked of its binary once per version of the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cryobox.errors import QemuError
from cryobox.qemu import process
from cryobox.qemu.process import qemu_version


def fake_qemu(path: Path, version: str, calls: Path) -> None:
    path.write_text(f'#!/bin/sh\necho run >> "{calls}"\necho "QEMU emulator version {version}"\n')
    path.chmod(0o755)


def test_the_version_is_asked_once_and_again_after_an_upgrade(tmp_path: Path) -> None:
    binary, calls = tmp_path / "qemu-system-x86_64", tmp_path / "calls"
    fake_qemu(binary, "7.2.1", calls)

    assert qemu_version(str(binary)) == "7.2.1"
    assert qemu_version(str(binary)) == "7.2.1"
    assert calls.read_text().count("run") == 1

    # An upgrade replaces the file (a new inode, as dpkg does): the new version is asked.
    upgraded = tmp_path / "new"
    fake_qemu(upgraded, "8.0.0", calls)
    os.replace(upgraded, binary)
    assert qemu_version(str(binary)) == "8.0.0"
    assert calls.read_text().count("run") == 2


def test_a_binary_that_does_not_answer_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "qemu-system-x86_64"
    binary.write_text("#!/bin/sh\nexec sleep 5\n")  # killed on timeout, nothing left
    binary.chmod(0o755)
    monkeypatch.setattr(process, "VERSION_TIMEOUT", 0.3)

    with pytest.raises(QemuError, match="--version did not answer"):
        qemu_version(str(binary))
