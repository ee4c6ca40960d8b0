"""Old guest images out of the cache: ``cryobox image prune``.

Every change of the image's key (a newer cryobox, a Debian point release of a package
it pins) builds a new image beside the old ones, and nothing removed those: 80 MB of its
own each (its kernel, initramfs and the root file system's blocks no other image
shares), more once its root file system is no longer the current one.

What goes: a built image other than the current one, and an image imported from a
container image on top of one of those (an import on the current image is the user's,
removed by ``cryobox image rm``), each only when nothing of this host boots from it (a
template, a snapshot, a sandbox that is not over, as ``users`` tells). Then what only
those images used: the runtime tree made for them (:mod:`.runtime`) and the cached root
file systems (:func:`.build._rootfs`) no image links any more, the current key's kept.

Everything is done under the images' build lock, so no build or import runs meanwhile;
each image is renamed before it is removed, so no reader ever sees one half gone.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from cryobox import config
from cryobox.image.build import Image, build_lock, images_dir


@dataclass(frozen=True)
class Pruned:
    """One old image, and what became of it."""

    image_id: str
    kind: str  # "built" or "imported"
    size: int  # bytes of its own: freed when it goes (its root file system's, if no other links it)
    users: tuple[str, ...]  # what still boots from it (then it is kept)

    @property
    def kept(self) -> bool:
        return bool(self.users)


def prune(
    current: str,
    current_rootfs: str,
    users: Callable[[str], list[str]],
    *,
    dry_run: bool = False,
) -> list[Pruned]:
    """Remove the images other than ``current`` (the current key's id, built or not)
    that nothing uses, and the cache entries only they used (the current key's root file
    system, ``current_rootfs``, kept); ``dry_run`` removes nothing. Returns every old
    image, kept or not, oldest first."""
    with build_lock():
        found = [
            Pruned(
                image.id,
                _kind(image),
                _own_bytes(image, current_rootfs),
                tuple(users(image.id)),
            )
            for image in _old_images(current)
        ]
        if not dry_run:
            for pruned in found:
                if not pruned.kept:
                    doomed = images_dir() / f".removed-{pruned.image_id}"
                    os.replace(images_dir() / pruned.image_id, doomed)  # gone for readers
                    shutil.rmtree(doomed)
            _remove_unused_runtimes()
            _remove_unlinked_rootfs(current_rootfs)
    return found


def _old_images(current: str) -> list[Image]:
    """Every image but ``current`` and the imports on it, oldest first."""
    old = []
    for manifest in images_dir().glob("*/image.json"):
        try:
            image = Image.load(manifest.parent)
        except (OSError, ValueError, KeyError):
            continue  # (not an image this cryobox wrote: left alone)
        if current in (image.id, image.manifest.get("base_image")):
            continue
        old.append(image)
    return sorted(old, key=lambda image: str(image.manifest.get("created", "")))


def _kind(image: Image) -> str:
    return "imported" if "container" in image.manifest else "built"


def _own_bytes(image: Image, current_rootfs: str) -> int:
    """The bytes removing ``image`` frees: of its files no other name links, and of its
    root file system when its only other name is the cache's (then removed after it), but
    for the current key's."""
    cached = config.cache_dir() / "rootfs" / f"{image.manifest.get('rootfs_key', '')}.qcow2"
    total = 0
    for path in image.path.rglob("*"):
        info = path.lstat()
        if not path.is_file() or path.is_symlink():
            continue
        alone = info.st_nlink == 1
        if info.st_nlink == 2 and cached.stem != current_rootfs:
            try:
                alone = os.path.samestat(info, cached.stat())
            except OSError:
                alone = False
        if alone:
            total += info.st_blocks * 512
    return total


def _remove_unused_runtimes() -> None:
    """The runtime trees of images no longer here (named ``ID-RECIPE``, or ``ID`` by an
    older cryobox); trees being made (``.runtime-*``) are left alone."""
    folder = config.cache_dir() / "runtime"
    if not folder.is_dir():
        return
    here = {path.name for path in images_dir().iterdir()}
    for tree in folder.iterdir():
        if tree.name.startswith("."):
            continue
        image_id = tree.name.rsplit("-", 1)[0] if "-" in tree.name else tree.name
        if image_id not in here and tree.name not in here:
            doomed = tree.with_name(f".stale-{tree.name}-{os.getpid()}")
            os.replace(tree, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _remove_unlinked_rootfs(current_key: str) -> None:
    """The cached root file systems no image links (each image holds its own by a hard
    link), but the current key's: a build that stopped after it reuses it."""
    folder = config.cache_dir() / "rootfs"
    if not folder.is_dir():
        return
    for path in folder.glob("*.qcow2"):
        if path.stem != current_key and path.stat().st_nlink == 1:
            path.unlink()
