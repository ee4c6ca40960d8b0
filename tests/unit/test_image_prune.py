"""`cryobox image prune` (a newer cryobox's key left every older image in the cache for
good, 80 MB or more each): other images go once nothing of this host boots from them and
no start loaded them lately, with the runtime trees and root file systems only they used
and what killed builds left; the current image, imports on it and every image something
still uses stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cryobox import config
from cryobox.errors import ImageError, InvalidArgument
from cryobox.image.build import USED_MARK, build_lock, find_image, images_dir, kernel_dir_of
from cryobox.image.prune import prune

CLI = [sys.executable, "-m", "cryobox.cli.main"]
HOUR = 3600.0
LOCKS = {".lock", ".use-lock"}


def _image(image_id: str, rootfs_key: str = "", *, base: str = "", **manifest: object) -> Path:
    """An image folder as a build leaves it (its root file system linked from the rootfs
    cache), or as an import does (``base``: its kernel and initramfs linked from it)."""
    folder = images_dir() / image_id
    folder.mkdir()
    for name, size in (("vmlinuz", 64), ("initrd.img", 32)):
        if base:
            os.link(images_dir() / base / name, folder / name)
        else:
            (folder / name).write_bytes(os.urandom(size * 1024))
    if rootfs_key:
        cached = config.cache_dir() / "rootfs" / f"{rootfs_key}.qcow2"
        cached.parent.mkdir(exist_ok=True)
        if not cached.exists():
            cached.write_bytes(os.urandom(128 * 1024))
        os.link(cached, folder / "rootfs.qcow2")
    else:
        (folder / "rootfs.qcow2").write_bytes(os.urandom(128 * 1024))
    body = {"id": image_id, "kernel_version": "k", "rootfs_key": rootfs_key, **manifest}
    if base:
        body |= {"base_image": base, "container": {"config": {}}}
    (folder / "image.json").write_text(json.dumps(body))
    _used(folder, 2 * HOUR, "image.json", USED_MARK)
    return folder


def _used(folder: Path, ago: float, *names: str) -> None:
    """As if a start had last loaded the image ``ago`` seconds ago."""
    then = time.time() - ago
    for name in names or (USED_MARK,):
        (folder / name).touch()
        os.utime(folder / name, (then, then))


def _runtime(name: str) -> Path:
    tree = config.cache_dir() / "runtime" / name / "bin"
    tree.mkdir(parents=True)
    (tree / "python3").write_bytes(os.urandom(8 * 1024))
    return tree.parent


def _cache() -> dict[str, tuple[int, int]]:
    """Every file of the cache: its inode and its bytes on disk."""
    found = {}
    for path in config.cache_dir().rglob("*"):
        if path.is_file() and not path.is_symlink() and path.name not in LOCKS:
            info = path.lstat()
            found[str(path.relative_to(config.cache_dir()))] = (info.st_ino, info.st_blocks * 512)
    return found


def test_images_nothing_uses_go_with_what_only_they_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_CACHE_DIR", str(tmp_path / "cache"))
    kernel = {"kernel_package": "linux", "kernel_version": "1", "modules": ["virtio_blk"]}
    _image(
        "c0ffee",
        "rootfs-now",
        created="2026-12-07T00:00:00Z",
        kernel_package="linux",
        kernel_version="1",
        modules=["virtio_blk"],
    )
    kernels = config.cache_dir() / "kernel"
    for name in (kernel_dir_of(kernel), "linux_0_0ld", "linux_2_new"):
        (kernels / name).mkdir(parents=True)
        (kernels / name / "vmlinuz").write_bytes(os.urandom(4096))
    old = time.time() - 2 * HOUR
    os.utime(kernels / "linux_0_0ld", (old, old))  # (linux_2_new: a build under way)
    _image(f"c0ffee-{'a' * 64}", base="c0ffee")  # the user's import on the current one
    _image("0ld", "rootfs-then", created="2026-11-01T00:00:00Z")
    _image("05ed", "rootfs-used", created="2026-11-02T00:00:00Z")
    _image("5ha7ed", "rootfs-then", created="2026-11-03T00:00:00Z")
    _image(f"0ld-{'b' * 64}", base="0ld", created="2026-11-04T00:00:00Z")
    _image("1a7e", "rootfs-late", created="2026-11-05T00:00:00Z")
    _used(images_dir() / "1a7e", 10 * 60)  # loaded by a start ten minutes ago
    for tree in ("c0ffee-recipe", "0ld-recipe", "0ld", "05ed-recipe", ".runtime-123"):
        _runtime(tree)
    (config.cache_dir() / "runtime" / "README").write_text("a stray file")
    (config.cache_dir() / "rootfs" / "rootfs-lost.qcow2").write_bytes(os.urandom(4096))
    (config.cache_dir() / "rootfs" / "rootfs-next.qcow2").write_bytes(b"x")  # (cut short)
    # What kills left: a half-removed image (its manifest still there), a build's work.
    half = images_dir() / ".removed-0ld"
    half.mkdir()
    (half / "image.json").write_text(json.dumps({"id": "0ld", "kernel_version": "k"}))
    (images_dir() / ".build-xyz").mkdir()
    (images_dir() / ".build-xyz" / "vmlinuz").write_bytes(os.urandom(4096))
    (config.cache_dir() / "rootfs" / ".rootfs-abc").mkdir()
    copied = images_dir() / "0ld.bak"  # a copy a user made: no image of the cache
    copied.mkdir()
    (copied / "image.json").write_text((images_dir() / "0ld" / "image.json").read_text())
    users = {"05ed": ["template old-one", "snapshot snap-1"]}

    before = _cache()
    plan = prune("c0ffee", "rootfs-next", lambda i: users.get(i, []), dry_run=True)
    assert [(p.image_id, p.kind, p.users) for p in plan.images] == [
        ("0ld", "built", ()),
        ("05ed", "built", ("template old-one", "snapshot snap-1")),
        ("5ha7ed", "built", ()),
        (f"0ld-{'b' * 64}", "imported", ()),
        ("1a7e", "built", ("a start or build 10 min ago",)),
    ]
    assert _cache() == before, "a dry run changed the cache"

    done = prune("c0ffee", "rootfs-next", lambda i: users.get(i, []))
    after = _cache()
    assert {p.name for p in images_dir().iterdir()} - LOCKS == {
        "c0ffee",
        f"c0ffee-{'a' * 64}",
        "05ed",
        "1a7e",
        "0ld.bak",
    }
    assert {p.name for p in kernels.iterdir()} == {kernel_dir_of(kernel), "linux_2_new"}
    assert {p.name for p in (config.cache_dir() / "rootfs").iterdir()} == {
        "rootfs-now.qcow2",
        "rootfs-used.qcow2",
        "rootfs-late.qcow2",
        "rootfs-next.qcow2",
    }
    assert {p.name for p in (config.cache_dir() / "runtime").iterdir()} == {
        "c0ffee-recipe",
        "05ed-recipe",
        ".runtime-123",  # (an import's, under way)
        "README",
    }
    # The bytes said freed are those whose every name went (the import's kernel, linked
    # from the image it was made on, once; the root file system two images shared, once).
    kept_inodes = {inode for inode, _ in after.values()}
    gone = {inode: size for inode, size in before.values() if inode not in kept_inodes}
    assert done.freed == sum(gone.values()) > 0
    assert done.freed == plan.freed  # the dry run said the same
    assert all(after[name] == before[name] for name in after)

    again = prune("c0ffee", "rootfs-next", lambda i: users.get(i, []), unused_for=60)
    assert [p.image_id for p in again.removed] == ["1a7e"]
    assert [p.image_id for p in again.images] == ["05ed", "1a7e"]  # (kept while used)


def test_a_prune_waits_for_a_build_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build or an import holds the images' lock while it writes the cache: a prune
    that read the cache meanwhile would take its work for a killed build's leftovers."""
    monkeypatch.setenv("CRYOBOX_CACHE_DIR", str(tmp_path / "cache"))
    _image("0ld", "rootfs-then")
    pruned = threading.Event()
    with build_lock():
        (images_dir() / ".build-underway").mkdir()

        def work() -> None:
            prune("c0ffee", "", lambda _: [], unused_for=0)
            pruned.set()

        worker = threading.Thread(target=work)
        worker.start()
        time.sleep(1)
        assert not pruned.is_set() and (images_dir() / "0ld").exists()
        (images_dir() / ".build-underway").rename(images_dir() / "c0ffee")
    worker.join(30)
    assert pruned.is_set()
    assert {p.name for p in images_dir().iterdir()} - LOCKS == {"c0ffee"}


def test_an_image_a_start_finds_is_kept_and_a_start_during_a_prune_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start marks the image it finds (an old build's, by another cryobox sharing the
    cache, say), so a prune keeps it; one that finds it while a prune is judging waits,
    then finds it gone, never half there (it read ``image.json`` of a folder being
    removed: a raw FileNotFoundError)."""
    monkeypatch.setenv("CRYOBOX_CACHE_DIR", str(tmp_path / "cache"))
    _image("0ld", "rootfs-then")
    _image("1a7e", "rootfs-late")
    found = find_image("1a7e")  # a start, now
    assert found is not None and found.id == "1a7e"
    plan = prune("c0ffee", "", lambda _: [], dry_run=True)
    assert [(p.image_id, p.users) for p in plan.images] == [
        ("0ld", ()),
        ("1a7e", ("a start or build 0 min ago",)),
    ]

    judging, go_on = threading.Event(), threading.Event()

    def users(image_id: str) -> list[str]:
        judging.set()
        go_on.wait(30)
        return []

    pruning = threading.Thread(target=lambda: prune("c0ffee", "", users, unused_for=0))
    pruning.start()
    assert judging.wait(30)
    started: list[object] = []
    start = threading.Thread(target=lambda: started.append(find_image("0ld")))
    start.start()
    time.sleep(0.5)
    assert not started, "a start found the image while a prune judged it"
    go_on.set()
    pruning.join(30)
    start.join(30)
    assert started == [None]
    assert not (images_dir() / "0ld").exists()
    with pytest.raises(InvalidArgument, match="unused_for=nan"):
        prune("c0ffee", "", lambda _: [], unused_for=float("nan"))


def test_the_cli_keeps_an_image_this_hosts_sandbox_boots_from(tmp_path: Path) -> None:
    """End to end, over this host's own records: a sandbox made before an upgrade
    (``CRYOBOX_FAKE_IMAGE``: the fake VMM's image had another id) keeps its image; an
    image nothing uses goes once no start loaded it for ``--unused-for`` minutes."""
    env = {
        **os.environ,
        "CRYOBOX_VMM": "fake",
        "CRYOBOX_STATE_DIR": str(tmp_path / "state"),
        "CRYOBOX_CACHE_DIR": str(tmp_path / "cache"),
    }

    def cli(*argv: str, **more: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*CLI, *argv], env=env | more, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done

    made = cli("create", "--template", "base", CRYOBOX_FAKE_IMAGE="fake-image-0")
    sandbox_id = made.stdout.strip().splitlines()[-1]
    cache = tmp_path / "cache" / "images"
    for name in ("fake-image-0", "0ld", "fake-image-1"):  # (the last: the VMM's own)
        (cache / name).mkdir(parents=True)
        (cache / name / "vmlinuz").write_bytes(os.urandom(2_000_000))
        (cache / name / "image.json").write_text(json.dumps({"id": name, "kernel_version": "k"}))

    def rows(done: subprocess.CompletedProcess[str]) -> dict[str, list[str]]:
        return {line.split("\t")[0]: line.split("\t")[1:] for line in done.stdout.splitlines()}

    listed = rows(cli("image", "prune", "--dry-run"))
    assert set(listed) == {"IMAGE", "0ld", "fake-image-0"}
    assert listed["0ld"] == ["built", "2 MB", "kept: used by a start or build 0 min ago"]
    assert listed["fake-image-0"][2].startswith("kept: used by ")
    assert f"sandbox {sandbox_id}" in listed["fake-image-0"][2]
    dry = cli("image", "prune", "--dry-run", "--unused-for", "0")
    assert rows(dry)["0ld"][2] == "would remove"
    assert "would remove 1 image and what only they used, 2 MB" in dry.stderr
    assert (cache / "0ld").exists()

    cli("image", "prune", "--unused-for", "0")
    assert not (cache / "0ld").exists() and (cache / "fake-image-0").exists()
    cli("kill", sandbox_id)  # (a cold boot of "base": no template was saved under it)
    after = cli("image", "prune", "--unused-for", "0")
    assert rows(after)["fake-image-0"][2] == "removed"
    assert not (cache / "fake-image-0").exists()


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
