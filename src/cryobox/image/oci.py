"""Container images as guest images: a team's own image runs as a cryobox sandbox.

``import_image("oci-archive:app.tar", base)`` makes a guest image whose root file system
is the container image's layers, unpacked in order with their whiteouts honoured
(``umoci``), and whose kernel and initramfs are ``base``'s (cryobox's own: its init and
agent come with the initramfs). The runtime the agent needs (:mod:`.runtime`) is added
at ``/.cryobox``, and what a boot mounts on (``/dev``, ``/proc``, ``/sys``, ``/run``,
``/tmp``) and reads (a ``root`` account) is made when the image lacks it. Nothing else
of the image changes.

The image is read by ``skopeo``, so an OCI archive (``podman save``, ``skopeo copy``,
``buildah push``), a ``docker save`` archive or an OCI layout folder all work; a
registry is never reached (copy the image into an archive first). Its configuration
(environment, user, working folder, entrypoint and command, exposed ports) is returned
for the template built on it, which makes them every sandbox's defaults.

An imported image is named by ``base``'s id and the archive's digest: the same archive
on the same cryobox image is imported once. It lives on this host, beside ``base``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.arguments import container_image
from cryobox.config import MAX_FORWARDED_PORTS
from cryobox.errors import ImageError, InvalidArgument
from cryobox.image import layers
from cryobox.image.build import (
    Image,
    build_lock,
    find_image,
    images_dir,
    run,
)
from cryobox.image.runtime import GUEST_DIR, guest_runtime
from cryobox.models import Progress
from cryobox.util import write_json_atomic

#: The least root disk an imported image gets, as cryobox's own has (GiB).
MIN_DISK_GIB = 2
#: The reference skopeo's copy is tagged with, for umoci to find.
_TAG = "cryobox"
_GIB = 1 << 30
#: Folders a boot mounts on or writes to, made when the image lacks them, with their modes.
_BOOT_FOLDERS = (
    ("dev", 0o755),
    ("proc", 0o555),
    ("sys", 0o555),
    ("run", 0o755),
    ("tmp", 0o1777),
    ("root", 0o700),
    ("etc", 0o755),
)


@dataclass(frozen=True)
class ImageConfig:
    """What a container image says its processes run with (its ``config``)."""

    env: dict[str, str]
    user: str | None
    workdir: str | None
    #: ENTRYPOINT then CMD, as a container runtime starts them; empty when neither.
    command: tuple[str, ...]
    #: ExposedPorts' TCP ports.
    ports: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "env": self.env,
            "user": self.user,
            "workdir": self.workdir,
            "command": list(self.command),
            "ports": list(self.ports),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ImageConfig:
        return cls(
            env={str(k): str(v) for k, v in (value.get("env") or {}).items()},
            user=value.get("user") or None,
            workdir=value.get("workdir") or None,
            command=tuple(str(a) for a in value.get("command") or ()),
            ports=tuple(int(p) for p in value.get("ports") or ()),
        )

    @classmethod
    def from_oci(cls, config: dict[str, Any]) -> ImageConfig:
        """From an OCI image configuration's ``config`` object.

        :raises InvalidArgument: naming a field of the wrong type or an unusable value.
        """
        env: dict[str, str] = {}
        for item in _strings(config, "Env"):
            name, _, value = item.partition("=")
            if name:
                env[name] = value
        ports = []
        exposed = config.get("ExposedPorts") or {}
        if not isinstance(exposed, dict):
            raise InvalidArgument("the image's ExposedPorts is not an object")
        for key in exposed:
            number, _, protocol = str(key).partition("/")
            if (protocol or "tcp") == "tcp" and number.isdigit() and 1 <= int(number) <= 65535:
                ports.append(int(number))
        if len(ports) > MAX_FORWARDED_PORTS:
            raise InvalidArgument(
                f"the image exposes {len(ports)} TCP ports: a sandbox forwards at most "
                f"{MAX_FORWARDED_PORTS}"
            )
        workdir = config.get("WorkingDir") or None
        if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
            raise InvalidArgument(f"the image's WorkingDir {workdir!r} is not an absolute path")
        user = config.get("User") or None
        if user is not None and not isinstance(user, str):
            raise InvalidArgument(f"the image's User {user!r} is not a string")
        return cls(
            env=env,
            user=user,
            workdir=workdir,
            command=_strings(config, "Entrypoint") + _strings(config, "Cmd"),
            ports=tuple(sorted(set(ports))),
        )


def _strings(config: dict[str, Any], name: str) -> tuple[str, ...]:
    """Field ``name`` of an image configuration: a list of strings, or nothing.

    :raises InvalidArgument: when it is something else.
    """
    value = config.get(name) or []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidArgument(f"the image's {name} is not a list of strings")
    return tuple(value)


def import_image(
    reference: str, base: Image, progress: Progress | None = None
) -> tuple[Image, ImageConfig]:
    """The guest image made from container image ``reference`` on ``base`` (imported
    once, then found), and the container image's configuration.

    :raises InvalidArgument: for a reference that names nothing usable here.
    :raises ImageError: when the image cannot be read or unpacked (skopeo's or umoci's
        words), or a tool is missing.
    """
    say = progress or (lambda _line: None)
    transport, path = container_image(reference)
    image_id = f"{base.id}-{_digest(path)}"  # all of it: images are shared by digest
    found = find_image(image_id)
    if found is None:
        with build_lock():
            _clear_leftovers()
            found = find_image(image_id) or _import(transport, path, image_id, base, say)
    return found, ImageConfig.from_json(found.manifest["container"]["config"])


def imported_images() -> list[Image]:
    """The guest images made from container images on this host, oldest first."""
    found = []
    for manifest in images_dir().glob("*/image.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            image = Image.load(manifest.parent)
            if "container" in image.manifest:
                found.append(image)
    return sorted(found, key=lambda image: str(image.manifest.get("created", "")))


def remove_image(image_id: str, users: list[str]) -> None:
    """Delete imported image ``image_id``, unless ``users`` (what still boots from it:
    templates, snapshots, sandboxes) is not empty.

    :raises InvalidArgument: naming what uses it, or when it is not an imported image.
    """
    if not any(image.id == image_id for image in imported_images()):
        raise InvalidArgument(f"{image_id!r} is not an image imported from a container image")
    if users:
        shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
        raise InvalidArgument(f"image {image_id} is still used by {shown}")
    with build_lock():
        doomed = images_dir() / f".removed-{image_id}"
        os.replace(images_dir() / image_id, doomed)  # gone at once for every reader
        shutil.rmtree(doomed)


def _clear_leftovers() -> None:
    """Remove what an import killed halfway left (its work folder, a runtime being made):
    every import holds the images' lock, so under it no other is under way."""
    for leftover in [
        *images_dir().glob(".import-*"),
        *images_dir().glob(".removed-*"),
        *(config.cache_dir() / "runtime").glob(".runtime-*"),
    ]:
        shutil.rmtree(leftover, ignore_errors=True)


def _digest(path: Path) -> str:
    """The archive's SHA-256 (a layout folder's: of its index and blobs' names)."""
    digest = hashlib.sha256()
    if path.is_dir():
        digest.update((path / "index.json").read_bytes() if (path / "index.json").exists() else b"")
        for blob in sorted((path / "blobs").rglob("*")):
            digest.update(str(blob.relative_to(path)).encode())
        return digest.hexdigest()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _import(transport: str, path: Path, image_id: str, base: Image, say: Progress) -> Image:
    for tool in ("skopeo", "umoci", "mkfs.ext4", "qemu-img"):
        if shutil.which(tool) is None:
            raise ImageError(f"{tool} is not installed (run `make setup`)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=images_dir(), prefix=".import-") as temp:
        work = Path(temp)
        layout = work / "layout"
        say(f"reading {transport}:{path.name}")
        copy = [
            "skopeo",
            "--insecure-policy",  # a local file the caller chose, no registry's trust
            "copy",
            "--quiet",
            f"{transport}:{path}",
            f"oci:{layout}:{_TAG}",
        ]
        with _unreadable(transport, path):
            run(copy)
            config = ImageConfig.from_oci(_oci_config(layout))
        say("counting what its layers hold")
        try:
            layers.check(layout)  # before a byte is unpacked: a layer may be a bomb
        except InvalidArgument as exc:
            raise InvalidArgument(f"image={transport}:{path.name}: {exc}") from None
        tree = work / "tree"
        say("unpacking its layers")
        unpack = ["umoci", "raw", "unpack", "--image", f"{layout}:{_TAG}", str(tree)]
        if os.geteuid() != 0:
            unpack.append("--rootless")  # owners as they can be, without root
        with _unreadable(transport, path):
            run(unpack)
        shutil.rmtree(layout)
        say("adding cryobox's runtime")
        _prepare(tree, guest_runtime(base))
        say("making its disk")
        used, entries = _usage(tree)
        size_gib = max(MIN_DISK_GIB, -(-(used * 3 // 2 + (256 << 20)) // _GIB))
        raw = work / "rootfs.ext4"
        with open(raw, "wb") as handle:
            handle.truncate(size_gib * _GIB)
        # Inodes for every entry and as many again (the default, one per 16 KiB, runs
        # out first for images of many small files: node_modules).
        inodes = str(max(entries * 2, (size_gib * _GIB) >> 14))
        make = ["mkfs.ext4", "-q", "-F", "-N", inodes, "-L", "cryobox-root", "-d", str(tree)]
        run([*make, str(raw)])
        shutil.rmtree(tree)
        out = work / "image"
        out.mkdir()
        run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(out / "rootfs.qcow2")])
        raw.unlink()
        for name in ("vmlinuz", "vmlinux", "initrd.img"):
            if (base.path / name).exists():
                os.link(base.path / name, out / name)
        manifest = {
            **base.manifest,
            "id": image_id,
            "base_image": base.id,
            "container": {
                "reference": f"{transport}:{path.name}",
                "digest": image_id.rsplit("-", 1)[1],
                "config": config.to_json(),
                "disk_gib": size_gib,
            },
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - started, 1),
            "sizes": {n: (out / n).stat().st_size for n in os.listdir(out)},
        }
        write_json_atomic(out / "image.json", manifest)
        os.replace(out, images_dir() / image_id)
    say(f"image {image_id} ready")
    return Image.load(images_dir() / image_id)


@contextlib.contextmanager
def _unreadable(transport: str, path: Path) -> Iterator[None]:
    """A failure to read or unpack the image is the caller's bad input, in the tool's words.

    :raises InvalidArgument:
    """
    try:
        yield
    except ImageError as exc:
        said = exc.output.strip().splitlines()[-3:] or [str(exc)]
        raise InvalidArgument(
            f"image={transport}:{path.name}: cannot be read ({' '.join(said)[:600]})"
        ) from None


def _oci_config(layout: Path) -> dict[str, Any]:
    """The ``config`` object of the one image in OCI layout ``layout``."""
    try:
        manifest = layers.image_manifest(layout)
        return dict(layers.json_blob(layout, manifest["config"]["digest"]).get("config") or {})
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ImageError(f"cannot read the image's configuration: {exc!r}") from exc


def _prepare(tree: Path, runtime: Path) -> None:
    """Add what a cryobox boot needs to the unpacked image ``tree``.

    The tree is the image's: any of its paths may be a symbolic link to anywhere on this
    host. So nothing here follows one: ``/etc`` and the files edited must be what they
    say (a link is refused by name), and files are opened with ``O_NOFOLLOW``.

    :raises InvalidArgument: for an image whose ``/etc`` or ``/.cryobox`` cannot be used.
    """
    for folder, mode in _BOOT_FOLDERS:
        path = tree / folder
        if not os.path.lexists(path):
            path.mkdir()
            path.chmod(mode)
    etc = tree / "etc"
    if etc.is_symlink() or not etc.is_dir():
        raise InvalidArgument("the image's /etc is not a folder")
    for name, line in (
        ("passwd", "root:x:0:0:root:/root:/bin/sh\n"),
        ("group", "root:x:0:\n"),
    ):
        text = _read_own(etc / name)
        if not any(entry.startswith("root:") for entry in text.splitlines()):
            ending = "" if not text or text.endswith("\n") else "\n"
            _write_own(etc / name, text + ending + line)
    for name, text in (("hostname", "cryobox\n"), ("machine-id", "")):
        if not os.path.lexists(etc / name):
            _write_own(etc / name, text)
    target = tree / GUEST_DIR.lstrip("/")
    if os.path.lexists(target):
        raise InvalidArgument(f"the image has its own {GUEST_DIR}, where cryobox's runtime goes")
    shutil.copytree(runtime, target, symlinks=True)


#: The most of an /etc file cryobox reads to edit it.
_ETC_LIMIT = 1 << 20


def _read_own(path: Path) -> str:
    """The text of the image's file ``path`` ("" when missing), never through a link.

    :raises InvalidArgument: when it is a link, not a file, or larger than 1 MiB.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise InvalidArgument(
            f"the image's /etc/{path.name} cannot be read ({exc.strerror})"
        ) from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise InvalidArgument(f"the image's /etc/{path.name} is not a file")
        data = file.read(_ETC_LIMIT + 1)
    if len(data) > _ETC_LIMIT:
        raise InvalidArgument(f"the image's /etc/{path.name} is larger than 1 MiB")
    return data.decode(errors="replace")


def _write_own(path: Path, text: str) -> None:
    """Replace the image's file ``path`` with ``text``: a new file renamed over it (a
    link is replaced, never followed)."""
    temp = path.with_name(f".{path.name}.cryobox")
    if os.path.lexists(temp):
        os.unlink(temp)  # the image's own, or a link: removed, never followed
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(text.encode())
    os.replace(temp, path)


def _usage(tree: Path) -> tuple[int, int]:
    """Bytes the tree's files take, and how many entries it has."""
    total = entries = 0
    for folder, dirs, files in os.walk(tree):
        entries += len(dirs) + len(files)
        for name in files:
            total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total, entries


__all__ = ["ImageConfig", "import_image", "imported_images", "remove_image"]
