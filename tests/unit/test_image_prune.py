"""`cryobox image prune` (a newer cryobox's key left every older image in the cache for
good, 80 MB or more each): old images go once nothing of this host boots from them,
with the runtime trees and root file systems only they used; the current image, imports
on it and every image something still uses stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cryobox import config
from cryobox.errors import ImageError
from cryobox.image.build import images_dir
from cryobox.image.prune import prune

CLI = [sys.executable, "-m", "cryobox.cli.main"]


def _image(image_id: str, rootfs_key: str = "", **manifest: object) -> Path:
    """An image folder as a build leaves it: its own files, and its root file system
    linked from the rootfs cache when ``rootfs_key`` is given."""
    folder = images_dir() / image_id
    folder.mkdir()
    (folder / "vmlinuz").write_bytes(os.urandom(64 * 1024))
    (folder / "initrd.img").write_bytes(os.urandom(32 * 1024))
    if rootfs_key:
        cached = config.cache_dir() / "rootfs" / f"{rootfs_key}.qcow2"
        cached.parent.mkdir(exist_ok=True)
        if not cached.exists():
            cached.write_bytes(os.urandom(128 * 1024))
        os.link(cached, folder / "rootfs.qcow2")
    else:
        (folder / "rootfs.qcow2").write_bytes(os.urandom(128 * 1024))
    body = {"id": image_id, "kernel_version": "k", "rootfs_key": rootfs_key, **manifest}
    (folder / "image.json").write_text(json.dumps(body))
    return folder


def _runtime(name: str) -> Path:
    tree = config.cache_dir() / "runtime" / name / "bin"
    tree.mkdir(parents=True)
    (tree / "python3").write_bytes(b"x")
    return tree.parent


def test_old_images_nothing_uses_go_with_what_only_they_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_CACHE_DIR", str(tmp_path / "cache"))
    current = _image("c0ffee", "rootfs-now", created="2026-12-07T00:00:00Z")
    mine = _image(f"c0ffee-{'a' * 64}", base_image="c0ffee", container={"config": {}})
    old = _image("0ld", "rootfs-then", created="2026-11-01T00:00:00Z")
    used = _image("05ed", "rootfs-used", created="2026-11-02T00:00:00Z")
    shared = _image("5ha7ed", "rootfs-then", created="2026-11-03T00:00:00Z")
    old_import = _image(
        f"0ld-{'b' * 64}",
        base_image="0ld",
        container={"config": {}},
        created="2026-11-04T00:00:00Z",
    )
    runtimes = [_runtime("c0ffee-recipe"), _runtime("0ld-recipe"), _runtime("0ld")]
    being_made = _runtime(".runtime-123")
    unused_rootfs = config.cache_dir() / "rootfs" / "rootfs-lost.qcow2"
    unused_rootfs.write_bytes(b"x")
    next_rootfs = config.cache_dir() / "rootfs" / "rootfs-next.qcow2"  # (a build cut short)
    next_rootfs.write_bytes(b"x")
    users = {"05ed": ["template old-one", "snapshot snap-1"]}

    seen = prune("c0ffee", "rootfs-next", lambda i: users.get(i, []), dry_run=True)
    assert [(p.image_id, p.kind, p.users) for p in seen] == [
        ("0ld", "built", ()),
        ("05ed", "built", ("template old-one", "snapshot snap-1")),
        ("5ha7ed", "built", ()),
        (f"0ld-{'b' * 64}", "imported", ()),
    ]
    # What goes with each, counted once: its own files; a root file system only when
    # removing the image leaves no other name of it but the cache's.
    sizes = {p.image_id: p.size for p in seen}
    assert 96 * 1024 <= sizes["0ld"] == sizes["5ha7ed"] < 128 * 1024  # rootfs shared
    assert sizes["05ed"] == sizes["0ld"] + 128 * 1024  # its rootfs: the cache's and its own
    assert sizes[f"0ld-{'b' * 64}"] == sizes["0ld"] + 128 * 1024  # its rootfs: its own
    for folder in (current, mine, old, used, shared, old_import, *runtimes):
        assert folder.exists(), f"a dry run removed {folder}"

    prune("c0ffee", "rootfs-next", lambda i: users.get(i, []))
    assert {p.name for p in images_dir().iterdir() if not p.name.startswith(".")} == {
        "c0ffee",
        f"c0ffee-{'a' * 64}",
        "05ed",
    }
    assert not list(images_dir().glob(".removed-*"))
    assert {p.stem for p in (config.cache_dir() / "rootfs").iterdir()} == {
        "rootfs-now",
        "rootfs-used",
        "rootfs-next",
    }
    assert [r.exists() for r in runtimes] == [True, False, False]
    assert being_made.exists()
    assert (current / "rootfs.qcow2").read_bytes()  # the current image is whole

    again = prune("c0ffee", "rootfs-next", lambda i: users.get(i, []))
    assert [p.image_id for p in again] == ["05ed"]  # kept, as long as it is used


def test_the_cli_keeps_an_old_image_a_sandbox_boots_from_until_it_is_over(
    tmp_path: Path,
) -> None:
    """End to end: this host's own records say what is used (a sandbox of the fake VMM
    boots from image ``fake-image-1``, which is not the current key's)."""
    env = {
        **os.environ,
        "CRYOBOX_VMM": "fake",
        "CRYOBOX_STATE_DIR": str(tmp_path / "state"),
        "CRYOBOX_CACHE_DIR": str(tmp_path / "cache"),
    }

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*CLI, *argv], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done

    made = cli("create", "--template", "base")
    sandbox_id = made.stdout.strip().splitlines()[-1]
    cache = tmp_path / "cache" / "images"
    for name in ("fake-image-1", "0ld"):
        (cache / name).mkdir(parents=True)
        (cache / name / "vmlinuz").write_bytes(os.urandom(2_000_000))
        (cache / name / "image.json").write_text(json.dumps({"id": name, "kernel_version": "k"}))

    listed = cli("image", "prune", "--dry-run")
    rows = {line.split("\t")[0]: line.split("\t") for line in listed.stdout.splitlines()}
    assert rows["0ld"][1:] == ["built", "2 MB", "would remove"]
    assert rows["fake-image-1"][3] == f"kept: used by sandbox {sandbox_id}"
    assert "would remove 1 images, 2 MB" in listed.stderr
    assert (cache / "0ld").exists()

    cli("image", "prune")
    assert not (cache / "0ld").exists() and (cache / "fake-image-1").exists()
    cli("kill", sandbox_id)
    pruned = cli("image", "prune")
    assert "removed 1 images" in pruned.stderr
    assert not (cache / "fake-image-1").exists()


def test_a_pruned_images_absence_says_it_cannot_be_built_again() -> None:
    """`cryobox image build` makes the current image only: it was the advice given for
    any image that is not here, an older one too."""
    from cryobox.image.build import image_key
    from cryobox.qemu.vmm import QemuVmm

    current = image_key()["id"]
    with pytest.raises(ImageError) as refused:
        QemuVmm().load_image("0000000000000bad")
    assert f"the current image is {current}" in str(refused.value)
    assert "removed by `cryobox image prune`, and cannot be built again" in str(refused.value)
