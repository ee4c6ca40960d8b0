"""Build the guest image from Debian packages, cached by a content key.

An image is three files and a manifest:

- ``vmlinuz``: the bzImage of Debian's ``linux-image-amd64`` package;
- ``initrd.img``: busybox, the virtio and ext4 modules in load order, our init and
  the guest agent (so changing the agent rebuilds only this, in about a second);
- ``rootfs.qcow2``: ``mmdebstrap --variant=minbase`` plus what an agent expects,
  in an ext4 filesystem (the slow part, about 40 s, cached on its own key);
- ``image.json``: the key's inputs, versions and sizes.

The key hashes every input: the recipe version, the Debian package versions the
mirror offers now, and the bytes of the files we put into the initramfs. A change
to any of them is a new image id; an unchanged key is never rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import lzma
import os
import py_compile
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import zstandard

from cryobox import config
from cryobox.errors import ImageError
from cryobox.models import Progress as Progress
from cryobox.util import write_json_atomic

#: Bump when the build steps change in a way the other inputs do not show.
RECIPE_VERSION = 4
SUITE = "bookworm"
KERNEL_METAPACKAGE = "linux-image-amd64"
ROOTFS_PACKAGES = (
    "python3",
    # The guest agent's event loop (compiled: see cryobox.guest.agent.new_loop).
    "python3-uvloop",
    # The digest of a bulk transfer's slots (XXH64: cryobox.guest.disk_copy).
    "python3-xxhash",
    "coreutils",
    "procps",
    "iproute2",
    "ca-certificates",
    "git",
    "curl",
    "tini",
    "e2fsprogs",
    "util-linux",
    "bash",
    "sudo",
    "python3-pip",
    "python3-venv",
    # `python` is python3, as most scripts (and E2B's tests) expect.
    "python-is-python3",
    # Process checkpoints (cryobox.service.processes): Debian's CRIU, run in the guest.
    "criu",
)
#: pip installs into the guest's Python without --break-system-packages (PEP 668's
#: marker is for a machine whose Python the distribution manages; a sandbox is the
#: user's): as root system-wide, as another user under ~/.local.
PIP_CONF = "[global]\nbreak-system-packages = true\n"
#: The unprivileged account E2B's SDK runs commands as by default (home /home/user).
GUEST_USER = "user"
#: Loaded by the initramfs with their dependencies, in dependency order.
INITRAMFS_MODULES = (
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "virtio_net",
    "virtio_rng",
    "ext4",
    # Volume mounts (cryobox-volume, guest/volume.c).
    "fuse",
    # CRIU finds a process's sockets through the socket diagnostics (sock_diag).
    "unix_diag",
    "inet_diag",
    "tcp_diag",
    "udp_diag",
    "netlink_diag",
    "af_packet_diag",
    # CRIU's start asks the kernel for nftables' features (netlink netfilter).
    "nf_tables",
)
#: What CRIU needs of the guest kernel (``criu check``'s list, as build options): checked
#: in the kernel package's config at build, the answer in image.json and `image info`.
CRIU_KERNEL_OPTIONS = (
    "CHECKPOINT_RESTORE",
    "NAMESPACES",
    "PID_NS",
    "FHANDLE",
    "EVENTFD",
    "EPOLL",
    "INOTIFY_USER",
    "FANOTIFY",
    "KCMP",
    "MEM_SOFT_DIRTY",
    "UNIX_DIAG",
    "INET_DIAG",
    "INET_TCP_DIAG",
    "INET_UDP_DIAG",
    "NETLINK_DIAG",
    "PACKET_DIAG",
)
ROOTFS_SIZE_GIB = 2
HOST_TOOLS = (
    "apt-get",
    "apt-cache",
    "dpkg-deb",
    "depmod",
    "modprobe",
    "mmdebstrap",
    "mkfs.ext4",
    "qemu-img",
    "busybox",
    "cpio",
    "gcc",
    "dpkg-query",
)
#: Files of this package that go into the initramfs (their bytes are part of the key).
GUEST_FILES = (
    "guest/__init__.py",
    "guest/protocol.py",
    "guest/agent.py",
    "guest/disk_copy.py",
    "guest/watch.py",
)
#: The agent's compiled front (it owns the port; see its header), built on this host with
#: Debian's gcc for the guest's glibc (both Debian 12), jansson linked in statically.
FRONT_SOURCE = "guest/front.c"
FRONT_FLAGS = ("-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror")
FRONT_LIBS = ("-Wl,-Bstatic", "-ljansson", "-Wl,-Bdynamic")
#: Debian packages the front's build uses: their versions are part of the key.
FRONT_BUILD_PACKAGES = ("gcc", "libc6-dev", "libjansson-dev", "libfuse3-dev")
IMAGE_FILES = ("initramfs-init.sh",)
#: The guest's PID 1 (see its header), compiled like the front.
INIT_SOURCE = "guest/init.c"
#: A volume's mount in the guest (see its header), libfuse 3 linked in statically.
VOLUME_SOURCE = "guest/volume.c"
VOLUME_FLAGS = ("-I/usr/include/fuse3",)
VOLUME_LIBS = ("-Wl,-Bstatic", "-lfuse3", "-Wl,-Bdynamic", "-lpthread", "-ldl")
#: Where the guest finds the C library of cryobox's own programs (init, front, volume):
#: the initramfs brings it (this host's, which compiled them) and its init copies it
#: here. Linked to it by path, they run on any root file system: one from a container
#: image may have another glibc, an older one, or none (musl).
GUEST_LOADER_DIR = "/run/cryobox/so"
GUEST_LOADER = "ld-linux-x86-64.so.2"
LOADER_FLAGS = (
    f"-Wl,--dynamic-linker={GUEST_LOADER_DIR}/{GUEST_LOADER}",
    f"-Wl,-rpath,{GUEST_LOADER_DIR}",
)


@dataclass(frozen=True)
class Image:
    """A built guest image on disk."""

    id: str
    path: Path
    kernel_version: str
    manifest: dict[str, Any]

    @property
    def kernel(self) -> Path:
        """The kernel QEMU boots: the uncompressed ELF with its PVH entry when the build
        found one (QEMU jumps straight into it: no firmware disk boot, no decompression,
        which under TCG took ~5 s of a 15 s boot), else Debian's bzImage."""
        vmlinux = self.path / "vmlinux"
        return vmlinux if vmlinux.exists() else self.path / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.path / "initrd.img"

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs.qcow2"

    @classmethod
    def load(cls, path: Path) -> Image:
        manifest = json.loads((path / "image.json").read_text())
        return cls(
            id=manifest["id"],
            path=path,
            kernel_version=manifest["kernel_version"],
            manifest=manifest,
        )


def images_dir() -> Path:
    path = config.cache_dir() / "images"
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------- key


def run_bytes(argv: Sequence[str], *, cwd: Path | None = None, input: bytes | None = None) -> bytes:
    """Run a build command and return its stdout.

    :raises ImageError: carrying the command and its output, when it fails or is missing.
    """
    try:
        done = subprocess.run(list(argv), cwd=cwd, input=input, capture_output=True, check=False)
    except FileNotFoundError as exc:
        raise ImageError(f"{argv[0]} is not installed (run `make setup`)", command=argv) from exc
    if done.returncode != 0:
        output = (done.stdout + done.stderr).decode(errors="replace")
        raise ImageError(
            f"{argv[0]} failed with exit code {done.returncode}", command=argv, output=output
        )
    return done.stdout


def run(argv: Sequence[str], *, cwd: Path | None = None) -> str:
    """:func:`run_bytes` for commands that print text."""
    return run_bytes(argv, cwd=cwd).decode(errors="replace")


def check_host_tools() -> None:
    missing = [tool for tool in HOST_TOOLS if shutil.which(tool) is None]
    if missing:
        raise ImageError(
            "missing host tools to build the guest image: "
            + ", ".join(missing)
            + " (run `make setup`, which installs them with apt-get)"
        )


def _apt_lists_stamp() -> str:
    lists = Path("/var/lib/apt/lists")
    try:
        return str(max((entry.stat().st_mtime_ns for entry in lists.iterdir()), default=0))
    except OSError:
        return "0"


def package_versions() -> dict[str, str]:
    """Versions the Debian mirror offers for our packages, cached per ``apt-get update``."""
    cache = config.cache_dir() / "apt-versions.json"
    names = (*ROOTFS_PACKAGES, KERNEL_METAPACKAGE)
    stamp = f"{_apt_lists_stamp()} {' '.join(sorted(names))}"  # new packages: asked again
    with contextlib.suppress(OSError, ValueError):
        cached = json.loads(cache.read_text())
        if cached.get("stamp") == stamp:
            return dict(cached["versions"])
    versions = _candidates(run(["apt-cache", "policy", *names]))
    kernel = next(
        (
            line.split()[1]
            for line in run(["apt-cache", "depends", KERNEL_METAPACKAGE]).splitlines()
            if line.strip().startswith("Depends: linux-image-")
        ),
        None,
    )
    missing = [name for name in names if not versions.get(name)]
    if missing or kernel is None:
        raise ImageError(
            "apt knows no candidate version for "
            + ", ".join(missing or [KERNEL_METAPACKAGE])
            + " (run `apt-get update`, or `make setup`)"
        )
    versions["kernel-package"] = kernel
    write_json_atomic(cache, {"stamp": stamp, "versions": versions})
    return versions


def _candidates(policy: str) -> dict[str, str]:
    versions: dict[str, str] = {}
    current = ""
    for line in policy.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = line[:-1]
        elif line.strip().startswith("Candidate:"):
            value = line.split(":", 1)[1].strip()
            versions[current] = "" if value == "(none)" else value
    return versions


def _source_bytes(name: str) -> bytes:
    package, _, filename = name.rpartition("/")
    base = resources.files("cryobox") / package if package else resources.files("cryobox.image")
    return (base / filename).read_bytes()


def image_key() -> dict[str, Any]:
    """Every input of the build; the image id is the hash of this."""
    versions = package_versions()
    rootfs_inputs = {
        "recipe": RECIPE_VERSION,
        "suite": SUITE,
        "size_gib": ROOTFS_SIZE_GIB,
        "packages": {name: versions[name] for name in ROOTFS_PACKAGES},
    }
    sources = {
        name: hashlib.sha256(_source_bytes(name)).hexdigest()
        for name in (*GUEST_FILES, FRONT_SOURCE, INIT_SOURCE, VOLUME_SOURCE, *IMAGE_FILES)
    }
    key: dict[str, Any] = {
        "rootfs": rootfs_inputs,
        "rootfs_key": _digest(rootfs_inputs),
        "kernel_package": versions["kernel-package"],
        "kernel_version": versions[KERNEL_METAPACKAGE],
        "modules": list(INITRAMFS_MODULES),
        "sources": sources,
        # How the kernel is booted and the agent loaded (see Image.kernel, _initramfs).
        "boot": "pvh-vmlinux",
        "agent_bytecode": "unchecked-hash",
        "front_build": {
            "flags": [*FRONT_FLAGS, *FRONT_LIBS, *VOLUME_FLAGS, *VOLUME_LIBS, *LOADER_FLAGS],
            **front_build_versions(),
        },
    }
    key["id"] = _digest(key)
    return key


#: dpkg's database: any package installed or removed changes it.
DPKG_STATUS = Path("/var/lib/dpkg/status")
#: What dpkg-query says of each package: "gcc 4:12.2.0-3 ii" when installed.
DPKG_FORMAT = "${Package} ${Version} ${db:Status-Abbrev}\n"


#: The version the key records for a build package that is not installed.
NOT_INSTALLED = "not installed"


def front_build_versions() -> dict[str, str]:
    """The installed versions of what compiles the front (a new gcc: a new image), asked
    of dpkg once per state of its database (every create computes the image key); a
    package that is missing is said so (the build then refuses, naming it)."""
    try:
        st = DPKG_STATUS.stat()
    except OSError:
        return _front_build_versions(0, 0, 0)
    return _front_build_versions(st.st_ino, st.st_size, st.st_mtime_ns)


@functools.cache
def _front_build_versions(inode: int, size: int, mtime_ns: int) -> dict[str, str]:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f", DPKG_FORMAT, *FRONT_BUILD_PACKAGES],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except FileNotFoundError:
        out = ""
    installed = {
        words[0]: words[1]
        for words in (line.split() for line in out.splitlines())
        if len(words) >= 3 and words[2].startswith("ii")
    }
    return {name: installed.get(name, NOT_INSTALLED) for name in FRONT_BUILD_PACKAGES}


def compile_front(output: Path, *, guest: bool = False) -> None:
    """Compile the agent's front (``cryobox-agent``) to ``output`` (``guest``: linked to
    the guest's copy of the C library, :data:`LOADER_FLAGS`; else this host's).

    :raises ImageError: naming the Debian packages missing for it, or with the
        compiler's output when it fails.
    """
    missing = [name for name, v in front_build_versions().items() if v == NOT_INSTALLED]
    if missing:
        raise ImageError(
            "missing Debian packages to build the guest agent: "
            + ", ".join(missing)
            + " (run `make setup`, which installs them with apt-get)"
        )
    with tempfile.TemporaryDirectory(prefix="cryobox-front-") as temp:
        source = Path(temp) / "front.c"
        source.write_bytes(_source_bytes(FRONT_SOURCE))
        loader = LOADER_FLAGS if guest else ()
        run(["gcc", *FRONT_FLAGS, *loader, "-o", str(output), str(source), *FRONT_LIBS])


def compile_init(output: Path) -> None:
    """Compile the guest's PID 1 (``cryobox-init``) to ``output``, as the front is.

    :raises ImageError: with the compiler's output when it fails.
    """
    with tempfile.TemporaryDirectory(prefix="cryobox-init-") as temp:
        source = Path(temp) / "init.c"
        source.write_bytes(_source_bytes(INIT_SOURCE))
        run(["gcc", *FRONT_FLAGS, *LOADER_FLAGS, "-o", str(output), str(source)])


def compile_volume(output: Path) -> None:
    """Compile the guest's volume mount (``cryobox-volume``) to ``output``.

    :raises ImageError: with the compiler's output when it fails.
    """
    with tempfile.TemporaryDirectory(prefix="cryobox-volume-") as temp:
        source = Path(temp) / "volume.c"
        source.write_bytes(_source_bytes(VOLUME_SOURCE))
        flags = (*FRONT_FLAGS, *VOLUME_FLAGS, *LOADER_FLAGS)
        run(["gcc", *flags, "-o", str(output), str(source), *VOLUME_LIBS])


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- build


#: Touched in an image's folder each time a start finds it: ``cryobox image prune``
#: keeps an image something used lately (:mod:`.prune`).
USED_MARK = ".used"


def find_image(image_id: str | None = None) -> Image | None:
    """The built image with this id (default: the current key's), or None; marked used,
    under the images' use lock (shared: a prune holds it alone while it removes)."""
    image_id = image_id or image_key()["id"]
    path = images_dir() / image_id
    with use_lock(fcntl.LOCK_SH):
        if not (path / "image.json").exists():
            return None
        with contextlib.suppress(OSError):  # (a cache nobody may write to, nobody prunes)
            (path / USED_MARK).touch()
        try:
            return Image.load(path)
        except FileNotFoundError:
            return None  # (removed by hand meanwhile)


def _kernel_dir_name(package: str, version: str, modules: Sequence[str]) -> str:
    """The folder :func:`_kernel` unpacks a kernel package into, for these modules."""
    return f"{package}_{version}_{_digest(list(modules))[:8]}"


def kernel_dir_of(manifest: dict[str, Any]) -> str:
    """The kernel folder the image of ``manifest`` was built from ("" for an import)."""
    try:
        return _kernel_dir_name(
            manifest["kernel_package"], manifest["kernel_version"], manifest["modules"]
        )
    except (KeyError, TypeError):
        return ""


def ensure_image(progress: Progress | None = None) -> Image:
    """The image for the current key, built first if it is not in the cache.

    :raises ImageError: when a host tool is missing or a build step fails.
    """
    key = image_key()
    image = find_image(key["id"])
    if image is not None:
        return image
    with build_lock():
        image = find_image(key["id"])  # built by another process while we waited
        if image is not None:
            return image
        return _build(key, progress or (lambda _: None))


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    with open(images_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def use_lock(mode: int) -> Iterator[None]:
    """Held shared by each start that finds an image (:func:`find_image`), alone by a
    prune while it judges and removes images (taken after :func:`build_lock`, never
    before it)."""
    try:
        lock = open(images_dir() / ".use-lock", "a")  # noqa: SIM115 (closed below)
    except OSError:  # (a cache nobody may write to: nobody prunes it either)
        yield
        return
    with lock:
        fcntl.flock(lock, mode)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(key: dict[str, Any], progress: Progress) -> Image:
    check_host_tools()
    started = time.monotonic()
    final = images_dir() / key["id"]
    with tempfile.TemporaryDirectory(dir=images_dir(), prefix=".build-") as temp:
        work = Path(temp)
        progress(f"kernel {key['kernel_package']} {key['kernel_version']}")
        kernel_dir = _kernel(key["kernel_package"], key["kernel_version"])
        progress("root filesystem (mmdebstrap, the slow step)")
        rootfs = _rootfs(key["rootfs_key"], key["rootfs"]["packages"])
        progress("initramfs")
        out = work / "image"
        out.mkdir()
        shutil.copyfile(kernel_dir / "vmlinuz", out / "vmlinuz")
        vmlinux = pvh_kernel((out / "vmlinuz").read_bytes())
        if vmlinux is not None:
            (out / "vmlinux").write_bytes(vmlinux)
        _initramfs(kernel_dir, out / "initrd.img", work / "initramfs")
        os.link(rootfs, out / "rootfs.qcow2")
        manifest = {
            **key,
            "criu": criu_support(kernel_dir / "config", key["rootfs"]["packages"]["criu"]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - started, 1),
            "sizes": {
                name: (out / name).stat().st_size
                for name in ("vmlinuz", "vmlinux", "initrd.img", "rootfs.qcow2")
                if (out / name).exists()
            },
        }
        write_json_atomic(out / "image.json", manifest)
        os.replace(out, final)
    progress(f"image {key['id']} ready")
    return Image.load(final)


def criu_support(kernel_config: Path, version: str) -> dict[str, Any]:
    """Whether the guest kernel has what CRIU needs: ``{"version", "kernel": "ok"}`` or
    ``"kernel": "missing CONFIG_..."`` (then process checkpoints are refused, saying so)."""
    options = {}
    for line in kernel_config.read_text().splitlines():
        name, _, value = line.partition("=")
        if name.startswith("CONFIG_"):
            options[name.removeprefix("CONFIG_")] = value
    missing = [f"CONFIG_{o}" for o in CRIU_KERNEL_OPTIONS if options.get(o) not in ("y", "m")]
    modules = [o for o in CRIU_KERNEL_OPTIONS if options.get(o) == "m"]
    return {
        "version": version,
        "kernel": "ok" if not missing else "missing " + " ".join(missing),
        "modules": modules,
    }


def _kernel(package: str, version: str) -> Path:
    """Download and unpack the kernel package once: bzImage plus the modules we load
    (cached by both: another module list unpacks again)."""
    target = config.cache_dir() / "kernel" / _kernel_dir_name(package, version, INITRAMFS_MODULES)
    if (target / "order").exists() and (target / "config").exists():
        return target
    shutil.rmtree(target, ignore_errors=True)  # one unpacked before the config was kept
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".kernel-") as temp:
        work = Path(temp)
        run(["apt-get", "download", f"{package}={version}"], cwd=work)
        deb = next(work.glob("*.deb"))
        tree = work / "tree"
        run(["dpkg-deb", "-x", str(deb), str(tree)])
        release = next((tree / "lib/modules").iterdir()).name
        run(["depmod", "-b", str(tree), release])
        out = work / "out"
        (out / "modules").mkdir(parents=True)
        shutil.copyfile(next((tree / "boot").glob("vmlinuz-*")), out / "vmlinuz")
        shutil.copyfile(next((tree / "boot").glob("config-*")), out / "config")
        order: list[str] = []
        for module in INITRAMFS_MODULES:
            listing = run(["modprobe", "-d", str(tree), "-S", release, "--show-depends", module])
            for line in listing.splitlines():
                words = line.split()
                if words[:1] == ["insmod"]:
                    name = Path(words[1]).name
                    if name not in order:
                        shutil.copyfile(words[1], out / "modules" / name)
                        order.append(name)
        (out / "release").write_text(release + "\n")
        (out / "order").write_text("\n".join(order) + "\n")
        os.replace(out, target)
    return target


def _rootfs(rootfs_key: str, packages: dict[str, str]) -> Path:
    """mmdebstrap the root filesystem into an ext4 qcow2, once per key."""
    target = config.cache_dir() / "rootfs" / f"{rootfs_key}.qcow2"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".rootfs-") as temp:
        work = Path(temp)
        tree = work / "tree"
        run(
            [
                "mmdebstrap",
                "--variant=minbase",
                "--include=" + ",".join(sorted(packages)),
                "--dpkgopt=path-exclude=/usr/share/doc/*",
                "--dpkgopt=path-exclude=/usr/share/man/*",
                "--dpkgopt=path-exclude=/usr/share/locale/*",
                '--customize-hook=rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*',
                '--customize-hook=echo cryobox > "$1"/etc/hostname',
                '--customize-hook=: > "$1"/etc/machine-id',
                f'--customize-hook=chroot "$1" useradd -m -u 1000 -s /bin/bash {GUEST_USER}',
                f"--customize-hook=echo '{GUEST_USER} ALL=(ALL) NOPASSWD:ALL' "
                f'> "$1"/etc/sudoers.d/{GUEST_USER} && chmod 0440 "$1"/etc/sudoers.d/{GUEST_USER}',
                f"--customize-hook=printf '{PIP_CONF}' > \"$1\"/etc/pip.conf",
                SUITE,
                str(tree),
            ]
        )
        raw = work / "rootfs.ext4"
        with open(raw, "wb") as handle:
            handle.truncate(ROOTFS_SIZE_GIB << 30)
        run(
            [
                "mkfs.ext4",
                "-q",
                "-F",
                "-L",
                "cryobox-root",
                "-d",
                str(tree),
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
                str(raw),
            ]
        )
        qcow2 = work / "rootfs.qcow2"
        run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(qcow2)])
        os.replace(qcow2, target)
    return target


#: Compressed payload magics in a bzImage, and how to open them.
_PAYLOADS = (
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\x1f\x8b\x08", "gzip"),
)
#: An ELF note "Xen" of type XEN_ELFNOTE_PHYS32_ENTRY (18): the kernel's PVH entry point.
_PVH_NOTES = tuple(struct.pack("<III", 4, size, 18) + b"Xen\x00" for size in (4, 8))


def pvh_kernel(bzimage: bytes) -> bytes | None:
    """The uncompressed kernel (ELF) inside ``bzimage`` if it has a PVH entry, else None."""
    for magic, kind in _PAYLOADS:
        offset = bzimage.find(magic)
        while offset != -1:
            elf = _decompress(bzimage[offset:], kind)
            if elf is not None and elf.startswith(b"\x7fELF"):
                return elf if any(note in elf for note in _PVH_NOTES) else None
            offset = bzimage.find(magic, offset + 1)
    return None


def _decompress(data: bytes, kind: str) -> bytes | None:
    """The first stream of ``data`` decompressed (trailing bytes ignored), or None."""
    try:
        if kind == "xz":
            return lzma.LZMADecompressor().decompress(data)
        if kind == "zstd":
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        return zlib.decompressobj(wbits=31).decompress(data)
    except (lzma.LZMAError, zstandard.ZstdError, zlib.error):
        return None


def _guest_loader(programs: Sequence[Path], target: Path) -> None:
    """Copy this host's dynamic loader and the libraries ``programs`` need into
    ``target`` (the initramfs's copy of :data:`GUEST_LOADER_DIR`)."""
    target.mkdir(parents=True, exist_ok=True)
    for program in programs:
        for line in run(["ldd", str(program)]).splitlines():
            words = line.split()
            # "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)", and the loader's
            # "/run/cryobox/so/ld-linux-x86-64.so.2 => /lib64/ld-linux-x86-64.so.2".
            if len(words) >= 3 and words[1] == "=>" and words[2].startswith("/"):
                shutil.copyfile(words[2], target / Path(words[0]).name)
    if not (target / GUEST_LOADER).exists():
        raise ImageError(f"ldd did not name the dynamic loader {GUEST_LOADER} of {programs[0]}")
    for path in target.iterdir():
        path.chmod(0o755)


def _initramfs(kernel_dir: Path, output: Path, work: Path) -> None:
    """Assemble the initramfs: busybox, modules, init, and the guest agent package."""
    for folder in (
        "bin",
        "dev",
        "proc",
        "sys",
        "newroot",
        "lib/modules",
        "cryobox/lib/cryobox/guest",
    ):
        (work / folder).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox")
    assert busybox is not None
    shutil.copyfile(busybox, work / "bin/busybox")
    os.chmod(work / "bin/busybox", 0o755)
    (work / "bin/sh").symlink_to("busybox")
    for module in (kernel_dir / "modules").iterdir():
        shutil.copyfile(module, work / "lib/modules" / module.name)
    shutil.copyfile(kernel_dir / "order", work / "lib/modules/order")
    init = work / "init"
    init.write_bytes(_source_bytes("initramfs-init.sh"))
    init.chmod(0o755)
    programs = [work / "cryobox" / f"cryobox-{name}" for name in ("agent", "init", "volume")]
    compile_front(programs[0], guest=True)
    compile_init(programs[1])
    compile_volume(programs[2])
    _guest_loader(programs, work / "cryobox/so")
    lib = work / "cryobox/lib/cryobox"
    (lib / "__init__.py").write_text('"""cryobox guest side: only the agent and its protocol."""\n')
    for name in GUEST_FILES:
        (lib / name).write_bytes(_source_bytes(name))
    # Compiled here: the guest would compile the agent from source at every boot (its
    # folder is a fresh tmpfs), ~0.1 s of Python under emulation. Unchecked hash: valid
    # whatever the files' times. A guest Python of another version ignores them.
    for source in lib.rglob("*.py"):
        py_compile.compile(
            str(source),
            cfile=importlib.util.cache_from_source(str(source)),
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            doraise=True,
        )
    names = sorted(str(path.relative_to(work)) for path in work.rglob("*"))
    archive = run_bytes(
        ["cpio", "--quiet", "-o", "-H", "newc", "--reproducible"],
        cwd=work,
        input="\n".join(names).encode(),
    )
    output.write_bytes(archive)
