"""Where cryobox keeps things, and its defaults. Overridable by environment variables.

- ``CRYOBOX_CACHE_DIR``: built guest images (expensive, keyed by content), default
  the user's cache directory.
- ``CRYOBOX_STATE_DIR``: running sandboxes (disks, memory files, sockets, logs),
  default the user's data directory.
- ``CRYOBOX_FINISHED_KEEP``: seconds an ended sandbox stays listed (default an hour).
- ``CRYOBOX_GUEST_ASLR``: ``auto`` (default), ``on`` or ``off``: whether a cold-booted
  guest randomizes its processes' address spaces (see :func:`guest_aslr`).
- ``CRYOBOX_TCG_THREADS``: ``multi`` (default) or ``single`` (see :func:`tcg_threads`);
  unset, a fork of at least as many copies as the host has cores starts them
  ``single`` (see :func:`fork_tcg_threads`).
- ``CRYOBOX_DISK_CACHE``: ``direct`` (default) or ``host``: whether a sandbox's
  writable disk layer bypasses the host's page cache (see :func:`disk_cache`).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

DEFAULT_CPUS = 2
DEFAULT_MEMORY_MIB = 1024
DEFAULT_DISK_GIB = 4
#: Seconds a sandbox lives unless extended; the countdown restarts on extension.
DEFAULT_TIMEOUT = 300.0
#: The longest timeout (and idle timeout) a sandbox may be given: 30 days.
MAX_TIMEOUT = 30 * 86400.0
#: The tenant of everything done without a server (the embedded SDK and the CLI).
LOCAL_TENANT = "local"
#: Most members one template's warm pool may keep.
MAX_POOL_SIZE = 16
#: ``cryobox image prune`` keeps an image a start loaded within this many seconds.
IMAGE_UNUSED_FOR = 3600.0
#: Copies one fork may make.
MAX_FORKS = 100
#: The most guest ports one sandbox forwards to the host at once. Each is a listening
#: socket on the host (two for a server that publishes it), kept while the sandbox
#: lives: without a bound, one tenant asking for every port of its sandboxes used up
#: the host's descriptors and ports for every tenant.
MAX_FORWARDED_PORTS = 64
MAX_CPUS = 64
MIN_MEMORY_MIB = 128
MAX_MEMORY_MIB = 64 * 1024
#: The image's filesystem is 2 GiB; a larger disk is grown into at boot.
MIN_DISK_GIB = 2
MAX_DISK_GIB = 1024
#: A named volume's size limit, and how many volumes one sandbox mounts at most (the
#: guest's volume ports: a fixed number, as a restore needs the devices it was saved with).
DEFAULT_VOLUME_GIB = 10
MAX_VOLUME_GIB = 16384
MAX_MOUNTS = 4
#: A rewindable history (``checkpoint_every``): its period's bounds in seconds (each
#: automatic checkpoint stops the guest for a moment and stores its RAM), and how many
#: checkpoints it keeps unless told.
MIN_CHECKPOINT_EVERY = 5.0
MAX_CHECKPOINT_EVERY = 86400.0
DEFAULT_KEEP_CHECKPOINTS = 10
MAX_KEEP_CHECKPOINTS = 1000


def _private(path: Path) -> Path:
    """The folder, made if missing, readable by its owner only (0700): it holds guest
    RAM, disks and logs that may contain any secret a guest had."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def cache_dir() -> Path:
    path = Path(os.environ.get("CRYOBOX_CACHE_DIR") or platformdirs.user_cache_dir("cryobox"))
    return _private(path)


def _state_path() -> Path:
    return Path(os.environ.get("CRYOBOX_STATE_DIR") or platformdirs.user_data_dir("cryobox"))


def state_dir() -> Path:
    return _private(_state_path())


def volumes_dir() -> Path:
    path = state_dir() / "volumes"
    return _private(path)


def sandboxes_dir() -> Path:
    path = state_dir() / "sandboxes"
    return _private(path)


def env_number(name: str, default: float) -> float:
    """A non-negative number from the environment variable ``name`` (``default`` when
    unset or empty).

    :raises InvalidArgument: naming the variable, when it is not such a number.
    """
    from cryobox.errors import InvalidArgument

    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not a number") from None
    if not value >= 0:
        raise InvalidArgument(f"{name}={raw!r} must be a number >= 0")
    return value


#: Seconds a killed, timed-out or dead sandbox stays listed by ``ls --all`` (its record
#: and logs only) before it is forgotten.
FINISHED_KEEP = 3600.0


def finished_keep() -> float:
    """``CRYOBOX_FINISHED_KEEP`` seconds, else :data:`FINISHED_KEEP`."""
    return env_number("CRYOBOX_FINISHED_KEEP", FINISHED_KEEP)


#: What ``CRYOBOX_GUEST_ASLR`` may say.
GUEST_ASLR_MODES = ("auto", "on", "off")


def env_choice(name: str, choices: tuple[str, ...], default: str, *, fold: bool = False) -> str:
    """The environment variable ``name``, one of ``choices`` (``default`` when unset or
    empty); ``fold`` ignores case and surrounding spaces.

    :raises InvalidArgument: naming the variable and what it may say, for anything else.
    """
    from cryobox.errors import InvalidArgument

    raw = os.environ.get(name)
    value = raw or default
    if fold:
        value = value.strip().lower()
    if value not in choices:
        raise InvalidArgument(f"{name}={raw!r}: must be one of {', '.join(choices)}")
    return value


def guest_aslr_mode() -> str:
    """``CRYOBOX_GUEST_ASLR``, lower-cased: ``auto`` when unset or empty.

    :raises InvalidArgument: naming the variable and what it may say, for anything else.
    """
    return env_choice("CRYOBOX_GUEST_ASLR", GUEST_ASLR_MODES, "auto", fold=True)


def guest_aslr(accelerator: str) -> bool:
    """Whether a guest cold-booted under ``accelerator`` randomizes where its processes'
    programs and libraries are mapped (``kernel.randomize_va_space``).

    ``auto`` turns it off under TCG only. TCG keeps the code it translated by guest
    address: with randomized mappings every new process runs its libraries at new
    addresses and has them translated again, so under TCG a ``true`` takes 3x as long
    (docs/BENCHMARKS.md, ``guest-spawn-aslr``). KVM runs guest code natively and gains
    nothing, so it keeps the guest's default. The VM, not the guest's layout, is the
    boundary a sandbox relies on (docs/SECURITY.md); root in the guest can turn it back
    on (``sysctl kernel.randomize_va_space=2``). It is decided at each cold boot; what
    starts from a memory snapshot (template, fork, restore, resume) keeps the setting of
    the machine it was saved from.
    """
    mode = guest_aslr_mode()
    return mode == "on" or (mode == "auto" and accelerator != "tcg")


#: What ``CRYOBOX_TCG_THREADS`` may say: a host thread per vCPU (QEMU's MTTCG), or all
#: of a VM's vCPUs taking turns on one.
TCG_THREADS = ("multi", "single")


def tcg_threads() -> str:
    """``CRYOBOX_TCG_THREADS`` (default ``multi``).

    ``multi`` lets one sandbox use as many host cores as it has vCPUs: two CPU-bound
    processes in a 2-vCPU guest on 2 cores took 0.9-1.6 s, against 2.4 s with
    ``single`` (measured by hand, 2026-12-01). ``single`` spends less CPU per VM where
    VMs outnumber cores, as no second vCPU thread translates and waits on its own: in
    four runs of 10 forks of a 2-vCPU guest the same day, 2.4-2.8 s against 2.8-3.2 s,
    its vCPU threads' CPU 0.29 against 0.34-0.36 s per fork (``fork-10-multi`` in
    docs/BENCHMARKS.md compares them in every bench run). It applies to VMs started
    after it is set.

    :raises InvalidArgument: naming the variable, for another value.
    """
    return env_choice("CRYOBOX_TCG_THREADS", TCG_THREADS, "multi")


#: What ``CRYOBOX_DISK_CACHE`` may say: the writable disk layer written through the
#: host's page cache, or around it (O_DIRECT).
DISK_CACHES = ("host", "direct")


def disk_cache() -> str:
    """``CRYOBOX_DISK_CACHE`` (default ``direct``): how QEMU opens a sandbox's writable
    disk layer (the layers below it, shared by forks and restores, stay cached).

    ``direct`` (QEMU's ``cache.direct=on``, what libvirt calls ``cache=none``): the
    guest's writes go to the host's disk without a second copy in the host's page
    cache; the guest caches them itself. 200 MB through ``files.write`` ran at 171-203
    and 138-166 MB/s (embedded, over HTTP) against 135-149 and 113-118 MB/s through the
    host's cache, which spent its time allocating page-cache pages for every block
    written; the guest's own read of that file, pause, checkpoint, rollback, restores
    and forks did not change (``docs/BENCHMARKS.md``, 2026-12-06). What OpenStack Nova
    chooses where O_DIRECT works. ``host`` keeps the host's cache (a host with RAM to
    spare and a slow disk). ``host`` is used where the file system has no O_DIRECT
    (tmpfs before Linux 6.6, some FUSE and network ones) or checksums data (btrfs, ZFS,
    bcachefs: a page the guest changes while its write is in flight reads back as
    corrupt there), and on overlayfs (``util.has_direct_io``). Flushes reach the disk
    either way. It applies to VMs started after it is set.

    :raises InvalidArgument: naming the variable, for another value.
    """
    return env_choice("CRYOBOX_DISK_CACHE", DISK_CACHES, "direct")


def fork_tcg_threads(count: int) -> str:
    """How the VMs of a fork of ``count`` copies start: ``single`` when they are at least
    as many as the host's cores and ``CRYOBOX_TCG_THREADS`` is unset; else "" (the
    host's setting, :func:`tcg_threads`).

    Copies that outnumber the cores cannot run their vCPUs side by side anyway, and a
    second vCPU thread per VM costs CPU (a translator and a waiter of its own): 10
    forks on this 2-core host answered in 2.0 s single against 2.4-3.0 s multi, QEMU
    CPU 0.27 against 0.35-0.43 s per fork (2026-12-01). It holds for each copy's first
    VM only: one that is later resumed from its files or rolled back starts a new VM
    with the host's setting. Under KVM there are no TCG threads: nothing changes.

    :raises InvalidArgument: naming ``CRYOBOX_TCG_THREADS``, for a value it cannot take.
    """
    tcg_threads()  # a bad setting is named here, not by the forks' supervisors
    if os.environ.get("CRYOBOX_TCG_THREADS", "").strip():
        return ""
    return "single" if count >= host_cores() else ""


def host_cores() -> int:
    """The cores this process may run on (its affinity: a container's cpuset, say)."""
    return len(os.sched_getaffinity(0)) or 1


#: Seconds a paused sandbox's VM is kept, stopped, after its pause was saved: a resume
#: within them continues it where it stands (no new QEMU, no state to load).
PAUSE_HOLD = 60.0
#: The longest hold accepted (a day).
MAX_PAUSE_HOLD = 86400.0


def pause_hold() -> float:
    """``CRYOBOX_PAUSE_HOLD`` seconds (default :data:`PAUSE_HOLD`; 0 ends the VM at once).

    A pause always writes the whole machine to disk first, so nothing depends on the
    hold: once it ends (or the host runs short of memory, or the supervisor is killed)
    the VM goes and the sandbox is paused as it would be without one. What it holds
    meanwhile is memory, not CPU: QEMU's own (its translated code and heap, tens of
    MiB) and the guest RAM's pages it keeps mapped. A resume within the hold took
    0.04 s against 0.28 s for one that starts a new QEMU (docs/BENCHMARKS.md,
    ``resume`` and ``resume-released``). Read by the service at each pause.

    :raises InvalidArgument: naming the variable, when it is not a number of seconds
        from 0 to :data:`MAX_PAUSE_HOLD`.
    """
    from cryobox.errors import InvalidArgument

    seconds = env_number("CRYOBOX_PAUSE_HOLD", PAUSE_HOLD)
    if seconds > MAX_PAUSE_HOLD:
        raise InvalidArgument(
            f"CRYOBOX_PAUSE_HOLD={seconds:g} is longer than a day ({MAX_PAUSE_HOLD:g} s)"
        )
    return seconds


#: The longest path a unix socket may be bound at: ``sun_path``'s 108 bytes, less its NUL.
SOCKET_PATH_MAX = 107
#: The longest socket a sandbox's folder holds (its last volume port), as a sandbox id
#: (``sbx-`` and 12 hex digits) names that folder.
LONGEST_SANDBOX_SOCKET = f"sbx-{'0' * 12}/volume-{MAX_MOUNTS - 1}.sock"


def socket_room() -> None:
    """Raise when a sandbox's sockets (monitor, agent, control, volume ports), which
    live in its folder under ``CRYOBOX_STATE_DIR``, would be longer than a unix socket
    path may be: its supervisor could not listen, and every create would fail as a
    supervisor that "exited while starting".

    :raises InvalidArgument: naming the folder, its length and the room there is.
    """
    from cryobox.errors import InvalidArgument

    state = _state_path()  # (measured, not made: a folder refused is left unmade)
    length = len(os.fsencode(state))
    longest = len(os.fsencode(state / "sandboxes")) + 1 + len(LONGEST_SANDBOX_SOCKET)
    if longest > SOCKET_PATH_MAX:
        raise InvalidArgument(
            f"the state folder {str(state)!r} (CRYOBOX_STATE_DIR) is {length} bytes long: "
            f"a sandbox's sockets under it would be {longest} bytes, past the "
            f"{SOCKET_PATH_MAX} a unix socket path may have; choose a folder of at most "
            f"{SOCKET_PATH_MAX - (longest - length)} bytes"
        )


def check_settings() -> None:
    """Raise on a bad setting a VM's start depends on, before anything is started.

    :raises InvalidArgument: naming the variable and what it may say.
    """
    guest_aslr_mode()
    tcg_threads()
    disk_cache()
    pause_hold()
    socket_room()
