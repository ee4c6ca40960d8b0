"""Guest images no longer used, out of the cache: ``cryobox image prune``.

Every change of the image's key (a newer cryobox, a Debian point release of a package
it pins) builds a new image beside the old ones, and nothing removed those: 80 MB of its
own each (its kernel, initramfs and the root file system's blocks no other image
shares), more once its root file system is no longer the current one.

What goes: an image other than the current one, built or imported from a container
image on top of one (an import on the current image is the user's, removed by
``cryobox image rm``), when nothing of this host boots from it (a template, a snapshot,
a sandbox that is not over, as ``users`` tells) and no start has loaded it for
``unused_for`` seconds (another cryobox sharing the cache, or a create between finding
its image and recording its sandbox). Then what only the images gone used: their runtime
trees (:mod:`.runtime`) and the cached root file systems (:func:`.build._rootfs`) no
image links any more (the current key's kept); and what builds and imports killed
halfway left behind.

Everything is done under the images' build lock, which every build and import holds, so
none runs meanwhile; each image is renamed before it is removed, so no reader ever sees
one half gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cryobox import config
from cryobox.errors import ImageError, InvalidArgument
from cryobox.image.build import (
    USED_MARK,
    Image,
    build_lock,
    images_dir,
    kernel_dir_of,
    use_lock,
)

#: A start that loaded an image in the last hour keeps it (``--unused-for``).
UNUSED_FOR = config.IMAGE_UNUSED_FOR
#: What builds, imports and removals killed halfway leave in the cache, by folder.
_LEFTOVERS = {
    "images": (".build-*", ".import-*", ".removed-*"),
    "rootfs": (".rootfs-*", ".removed-*"),
    "kernel": (".kernel-*", ".removed-*"),
    "runtime": (".stale-*", ".removed-*"),
}


@dataclass(frozen=True)
class Pruned:
    """An image other than the current one, and why it is kept, if it is."""

    image_id: str
    kind: str  # "built" or "imported"
    size: int  # bytes of its folder (a file linked twice in it counted once)
    users: tuple[str, ...]  # what still boots from it, or the start that loaded it lately

    @property
    def kept(self) -> bool:
        return bool(self.users)


@dataclass
class Plan:
    """What a prune removes (or, dry, would remove) and the bytes that frees."""

    images: list[Pruned] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)  # every folder and file that goes
    freed: int = 0

    @property
    def removed(self) -> list[Pruned]:
        return [image for image in self.images if not image.kept]


def prune(
    current: str,
    current_rootfs: str,
    users: Callable[[str], list[str]],
    *,
    unused_for: float = UNUSED_FOR,
    dry_run: bool = False,
) -> Plan:
    """Remove the images other than ``current`` (the current key's id, built or not)
    that nothing uses, and the cache entries only they used (the current key's root file
    system, ``current_rootfs``, kept); ``dry_run`` removes nothing. The plan lists every
    image other than the current one, kept or not, oldest first."""
    if not math.isfinite(unused_for) or unused_for < 0:
        raise InvalidArgument(f"unused_for={unused_for!r}: give a number of seconds, 0 or more")
    # The use lock alone for the whole of it: a start that finds an image meanwhile waits,
    # then finds it gone or kept (its mark is read here, under the same lock).
    with build_lock(), use_lock(fcntl.LOCK_EX):
        plan = _plan(current, current_rootfs, users, unused_for)
        if not dry_run:
            for path in plan.paths:
                _remove(path)
    return plan


def _plan(
    current: str, current_rootfs: str, users: Callable[[str], list[str]], unused_for: float
) -> Plan:
    plan = Plan()
    for image in _other_images(current):
        using = list(users(image.id))
        if not using and (ago := _used_ago(image)) < unused_for:
            using.append(f"a start or build {ago / 60:.0f} min ago")
        plan.images.append(Pruned(image.id, _kind(image), _size(image.path), tuple(using)))
    going = {image.image_id for image in plan.removed}
    plan.paths = _leftovers()  # (first: a half-removed image's name is taken for the next)
    plan.paths += [images_dir() / image_id for image_id in sorted(going)]
    staying = {path.name for path in images_dir().iterdir()} - going
    plan.paths += _runtimes_of_none(staying)
    plan.paths += _kernels_of_none(staying, unused_for)
    plan.paths += _rootfs_unlinked(plan.paths, current_rootfs)
    plan.freed = _freed(plan.paths)
    return plan


def _other_images(current: str) -> list[Image]:
    """Every image but ``current`` and the imports on it, oldest first. A folder whose
    name is not its manifest's id (a copy, one half removed) is no image of the cache."""
    found = []
    for folder in images_dir().iterdir():
        if folder.name.startswith(".") or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            image = Image.load(folder)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # (not an image this cryobox wrote: left alone)
        if image.id != folder.name or current in (image.id, image.manifest.get("base_image")):
            continue
        found.append(image)
    return sorted(found, key=lambda image: str(image.manifest.get("created", "")))


def _kind(image: Image) -> str:
    return "imported" if "container" in image.manifest else "built"


def _used_ago(image: Image) -> float:
    """Seconds since a start last loaded ``image`` (its build, when none has)."""
    for path in (image.path / USED_MARK, image.path / "image.json"):
        with contextlib.suppress(OSError):
            return max(0.0, time.time() - path.stat().st_mtime)
    return float("inf")


def _size(folder: Path) -> int:
    return sum(info.st_blocks * 512 for info, _ in _files(folder).values())


def _files(path: Path) -> dict[tuple[int, int], tuple[os.stat_result, int]]:
    """The regular files at or under ``path`` by inode, each with how many of its names
    are there (symlinks not followed)."""
    found: dict[tuple[int, int], tuple[os.stat_result, int]] = {}
    for each in [path, *path.rglob("*")] if path.is_dir() else [path]:
        with contextlib.suppress(OSError):
            info = each.lstat()
            if each.is_file() and not each.is_symlink():
                inode = (info.st_dev, info.st_ino)
                found[inode] = (info, found.get(inode, (info, 0))[1] + 1)
    return found


def _runtimes_of_none(images: set[str]) -> list[Path]:
    """The runtime trees (named ``ID-RECIPE``, or ``ID`` by an older cryobox) of images
    not among ``images``; trees being made (``.runtime-*``) are an import's, left alone."""
    folder = config.cache_dir() / "runtime"
    if not folder.is_dir():
        return []
    return [
        tree
        for tree in sorted(folder.iterdir())
        if tree.is_dir()
        and not tree.name.startswith(".")
        and tree.name not in images
        and tree.name.rsplit("-", 1)[0] not in images
    ]


def _kernels_of_none(images: set[str], unused_for: float) -> list[Path]:
    """The unpacked kernel packages (:func:`.build._kernel`) no image among ``images``
    was built from, but one unpacked within ``unused_for`` (a build under way, or one
    that stopped after it, uses it again)."""
    folder = config.cache_dir() / "kernel"
    if not folder.is_dir():
        return []
    named = set()
    for image_id in images:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            named.add(kernel_dir_of(Image.load(images_dir() / image_id).manifest))
    found = []
    for tree in sorted(folder.iterdir()):
        with contextlib.suppress(OSError):
            recent = time.time() - tree.stat().st_mtime < unused_for
            if tree.is_dir() and not tree.name.startswith(".") and tree.name not in named:
                found += [] if recent else [tree]
    return found


def _rootfs_unlinked(going: Iterable[Path], current_rootfs: str) -> list[Path]:
    """The cached root file systems no image will link once ``going`` is gone, but the
    current key's (a build that stopped after it uses it again)."""
    folder = config.cache_dir() / "rootfs"
    if not folder.is_dir():
        return []
    links: dict[tuple[int, int], int] = {}
    for path in going:
        for inode, (_, names) in _files(path).items():
            links[inode] = links.get(inode, 0) + names
    unlinked = []
    for path in sorted(folder.glob("*.qcow2")):
        with contextlib.suppress(OSError):
            info = path.stat()
            if path.stem != current_rootfs and info.st_nlink - 1 == links.get(
                (info.st_dev, info.st_ino), 0
            ):
                unlinked.append(path)
    return unlinked


def _leftovers() -> list[Path]:
    """What a build, import or removal killed halfway left: none runs under the lock."""
    found = []
    for name, patterns in _LEFTOVERS.items():
        folder = config.cache_dir() / name
        for pattern in patterns:
            found += sorted(folder.glob(pattern)) if folder.is_dir() else []
    return found


def _freed(paths: Iterable[Path]) -> int:
    """The bytes removing ``paths`` frees: of the files all of whose names are among
    them (one linked from elsewhere too stays)."""
    seen: dict[tuple[int, int], tuple[os.stat_result, int]] = {}
    for path in paths:
        for inode, (info, names) in _files(path).items():
            seen[inode] = (info, seen.get(inode, (info, 0))[1] + names)
    return sum(info.st_blocks * 512 for info, names in seen.values() if names >= info.st_nlink)


def _remove(path: Path) -> None:
    """Rename, then remove: nothing is ever seen half gone under its own name.

    :raises ImageError: naming what could not be removed (what went before stays gone).
    """
    try:
        if path.is_dir() and not path.is_symlink():
            hidden = path.name.startswith(".")
            doomed = path if hidden else path.with_name(f".removed-{path.name}-{os.getpid()}")
            if doomed != path:
                os.replace(path, doomed)
            shutil.rmtree(doomed)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise ImageError(f"could not remove {path} from the image cache: {exc}") from exc


def describe(plan: Plan) -> str:
    """One line of what a prune freed, or would."""
    count = len(plan.removed)
    images = f"{count} image{'' if count == 1 else 's'}"
    return f"{images} and what only they used, {plan.freed / 1e6:.0f} MB"
