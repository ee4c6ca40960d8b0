"""What a VMM backend must do for cryobox, as Protocols, and the machine it is asked for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from cryobox.errors import CryoboxError, SnapshotIncompatible
from cryobox.image.build import Image
from cryobox.network.policy import NetworkPolicy

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PortForward:
    """A TCP port of the guest reachable on the host's 127.0.0.1:host_port.

    In an isolated network the VMM forwards ``127.0.0.1:guest_port`` of the sandbox's
    namespace to the guest, and the supervisor joins the host port to it.
    """

    guest_port: int
    host_port: int


#: How many times its boot RAM a machine may have in all: the guest's kernel keeps the
#: page structures of added RAM (about 16 MiB a GiB) in its boot RAM, an eighth of it.
MAX_GROWTH = 9
#: The memory block the guest's kernel adds and onlines at once (x86-64 Linux below
#: 64 GiB): RAM added to a running machine comes in whole blocks.
MEMORY_BLOCK_MIB = 128


@dataclass(frozen=True)
class Layout:
    """How a machine's vCPUs and RAM are laid out: what it booted with, how far it may
    grow while it runs (hot-plug), and what was added since. A restore builds the same
    layout (QEMU continues a machine only on the devices it was saved with), then may
    add more.

    A machine booted before cryobox could grow one has none (:meth:`from_json` of an
    empty dict gives None): it keeps the vCPUs and RAM it was saved with.
    """

    #: vCPUs and MiB of RAM at boot (the RAM file is this large).
    boot_cpus: int
    boot_memory_mib: int
    #: The most vCPUs, memory slots and MiB of RAM in all it may have.
    max_cpus: int
    slots: int
    max_memory_mib: int
    #: vCPUs added after boot, and each added memory module's MiB, in order.
    added_cpus: int = 0
    dimms: tuple[int, ...] = ()

    @property
    def cpus(self) -> int:
        return self.boot_cpus + self.added_cpus

    @property
    def memory_mib(self) -> int:
        return self.boot_memory_mib + sum(self.dimms)

    def grown(self, cpus: int, memory_mib: int) -> Layout:
        """This layout with vCPUs and a memory module added to reach ``cpus`` and
        ``memory_mib`` (neither smaller than now; checked by :meth:`growth_problem`)."""
        extra = memory_mib - self.memory_mib
        return replace(
            self,
            added_cpus=cpus - self.boot_cpus,
            dimms=self.dimms + ((extra,) if extra else ()),
        )

    def growth_problem(self, field_name: str, wanted: int) -> str | None:
        """Why this machine cannot have ``wanted`` of ``field_name`` (``cpus`` or
        ``memory_mib``), or None when it can."""
        now = self.cpus if field_name == "cpus" else self.memory_mib
        if wanted < now:
            return f"a saved machine's {field_name} can grow, never shrink (it has {now})"
        if field_name == "cpus":
            if wanted > self.max_cpus:
                return f"this machine can grow to {self.max_cpus} vCPUs at most"
            return None
        extra = wanted - now
        if extra % MEMORY_BLOCK_MIB:
            lower = now + extra // MEMORY_BLOCK_MIB * MEMORY_BLOCK_MIB
            return (
                f"a saved machine's RAM grows in steps of {MEMORY_BLOCK_MIB} MiB from its "
                f"{now}: ask for {lower + MEMORY_BLOCK_MIB}"
                + (f" or {lower}" if lower > now else "")
            )
        if wanted > self.max_memory_mib:
            return f"this machine can grow to {self.max_memory_mib} MiB at most"
        if wanted > self.boot_memory_mib * MAX_GROWTH:
            return (
                f"a machine that booted with {self.boot_memory_mib} MiB can grow to "
                f"{self.boot_memory_mib * MAX_GROWTH} MiB (its kernel describes added RAM "
                "in the RAM it booted with)"
            )
        if extra and len(self.dimms) >= self.slots:
            return f"this machine's {self.slots} memory slots are used"
        return None

    def to_json(self) -> dict[str, Any]:
        value = asdict(self)
        value["dimms"] = list(self.dimms)
        return value

    @classmethod
    def from_json(cls, value: dict[str, Any] | None) -> Layout | None:
        if not value:
            return None
        return cls(**{**value, "dimms": tuple(int(d) for d in value.get("dimms", ()))})


#: Room every new machine gets to grow while it runs: vCPUs at most (or its own count,
#: when larger), memory modules and MiB of RAM in all.
GROWTH_CPUS = 16
GROWTH_SLOTS = 8
GROWTH_MEMORY_MIB = 64 * 1024


def new_layout(cpus: int, memory_mib: int) -> Layout:
    """The layout of a machine booted now with ``cpus`` and ``memory_mib``."""
    room = memory_mib < GROWTH_MEMORY_MIB  # QEMU wants maxmem above the boot RAM
    return Layout(
        boot_cpus=cpus,
        boot_memory_mib=memory_mib,
        max_cpus=max(cpus, GROWTH_CPUS),
        slots=GROWTH_SLOTS if room else 0,
        max_memory_mib=GROWTH_MEMORY_MIB if room else memory_mib,
    )


def boot_memory_mib(layout: dict[str, Any], memory_mib: int) -> int:
    """The RAM a machine of ``memory_mib`` in all, laid out as ``layout``, booted with:
    its RAM file's size (RAM plugged in since is not in it; all of it for a machine
    saved before machines could grow)."""
    grown = Layout.from_json(layout)
    return grown.boot_memory_mib if grown else memory_mib


def manifest_shape(manifest: Any) -> dict[str, int]:
    """A snapshot manifest's vCPUs and RAM, as :func:`check_growth` compares them."""
    return {"cpus": int(manifest.cpus), "memory_mib": int(manifest.memory_mib)}


def check_growth(
    snapshot_id: str, layout: dict[str, Any], saved: dict[str, int], wanted: dict[str, int]
) -> None:
    """Refuse vCPUs or RAM (``wanted``) a saved machine (``saved`` of them, laid out as
    ``layout``) cannot be given by adding to it: fewer than it has, past its room, RAM
    not in whole memory blocks, or a machine saved before cryobox could grow one.

    :raises SnapshotIncompatible: naming the field, with why and what would do.
    """
    grown = Layout.from_json(layout)
    for name, value in wanted.items():
        if value == saved[name]:
            continue
        problem = (
            grown.growth_problem(name, value)
            if grown
            else "it was saved by a cryobox that could not add vCPUs or RAM to a machine "
            "(before 2026-12-04): build the template again, or save the snapshot again "
            "from a sandbox started now, to give it more"
        )
        if problem:
            raise SnapshotIncompatible(snapshot_id, name, saved[name], value, hint=problem)


@dataclass(frozen=True)
class MachineSpec:
    """Everything a backend needs to run one machine; paths are absolute.

    ``disk_chain`` is the root disk's layers, the writable one first, each backed by the
    next: the backend opens them as given, so no layer has to name its backing by path.
    """

    name: str
    #: At boot (with a ``layout``, its boot values; vCPUs and RAM added since come as
    #: devices of their own).
    cpus: int
    memory_mib: int
    accelerator: str
    kernel: Path
    initrd: Path
    disk_chain: tuple[Path, ...]
    memory_file: Path
    monitor_socket: Path
    agent_socket: Path
    console_log: Path
    kernel_args: tuple[str, ...] = ()
    ports: tuple[PortForward, ...] = ()
    #: Map guest RAM shared (writes reach the file) or private (copy-on-write).
    memory_shared: bool = True
    #: Wait for saved device state (a restore) instead of booting.
    incoming: bool = False
    #: What the guest may reach; enforced when ``isolated`` (a namespace of its own).
    network: NetworkPolicy = field(default_factory=NetworkPolicy)
    isolated: bool = False
    #: TCG's threading for this VM ("single" or "multi"); "" for the host's setting
    #: (``config.tcg_threads``).
    tcg_threads: str = ""
    #: Open the writable disk layer with O_DIRECT (``config.disk_cache``): only where
    #: its file system has it.
    disk_direct: bool = False
    #: A raw file of ``TRANSFER_BYTES`` for bulk file transfers; ``None``: no such disk.
    transfer_disk: Path | None = None
    #: The sockets of the guest's volume ports, one per mount slot (every machine has
    #: them all: a restore needs the devices it was saved with).
    volume_sockets: tuple[Path, ...] = ()
    #: The raw file READs reach its volume mounts through
    #: (:mod:`cryobox.volume.read_disk`); ``None``: no such disk.
    read_disk: Path | None = None
    #: Room to add vCPUs and RAM while it runs, and those added; None: none (a machine
    #: saved before cryobox could grow one).
    layout: Layout | None = None
    #: Extra CAs (PEM) the header proxy trusts besides the host's, when the policy sets
    #: headers (:mod:`cryobox.network.header_proxy`); read at each connection.
    egress_trust: Path | None = None


class Vm(Protocol):
    """One running machine."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int:
        """Return the exit code once the machine's process has ended."""
        ...

    async def stop_cpus(self) -> None:
        """Freeze the guest: nothing in it runs, its disk is flushed."""
        ...

    async def continue_cpus(self) -> None: ...

    async def save_state(self, path: Path) -> None:
        """Write the frozen machine's device state (and RAM not in its file) to ``path``."""
        ...

    async def load_state(self, path: Path) -> None:
        """Load a saved device state into a machine started with ``incoming``."""
        ...

    async def add_port_forward(self, forward: PortForward) -> None: ...

    async def resize_disk(self, size_bytes: int) -> None:
        """Make the root disk ``size_bytes`` long (larger only) while the machine runs;
        the guest's kernel is told and sees the new size."""
        ...

    async def add_cpu(self, index: int) -> None:
        """Plug in vCPU ``index`` (the machine's vCPUs so far are 0 to index - 1); the
        guest is told and brings it online when asked (``sys.online``)."""
        ...

    async def add_memory(self, slot: int, mib: int) -> int:
        """Plug in a memory module of ``mib`` MiB in ``slot``; its guest-physical
        address, for the guest to bring its blocks online (``sys.online``)."""
        ...

    async def set_network(self, policy: NetworkPolicy) -> None:
        """Put ``policy`` in force for the running guest (no restart; connections
        already open that it refuses are cut). A VMM that does not isolate its guests
        refuses it.

        :raises NetworkError: when it cannot be applied (the old policy stays)."""
        ...

    async def run_state(self) -> str:
        """The machine's own state: "running", "paused", or "inmigrate" while it still
        waits for the device state of a restore."""
        ...

    async def kill(self) -> None:
        """End the machine at once and reap it."""
        ...

    def error(self, message: str) -> CryoboxError:
        """An error that carries what the backend knows (command, exit code, stderr)."""
        ...

    def stderr_text(self) -> str: ...

    #: Why the guest ended its own run (powered off, rebooted, panicked), when it did.
    guest_ending: str | None


class Vmm(Protocol):
    """A virtual machine monitor backend."""

    name: str
    #: Whether its machines run in a network namespace of their own (policy enforced).
    isolates_network: bool

    def check_installed(self) -> None:
        """:raises QemuNotInstalled: (or the backend's own) when it cannot run here."""
        ...

    def ensure_image(self, progress: Progress | None = None) -> Image:
        """The guest image this backend boots, built first if missing."""
        ...

    def load_image(self, image_id: str) -> Image:
        """:raises ImageError: when the image with that id is not on this host."""
        ...

    def current_image(self) -> tuple[str, str]:
        """The id of the image :meth:`ensure_image` gives, built or not, and the key of
        its root file system ("" when it has none of its own)."""
        ...

    def accelerator(self, image: Image) -> str: ...

    def facts(self, cpus: int, memory_mib: int, accelerator: str, image: Image) -> dict[str, Any]:
        """What a memory snapshot taken under this backend must match to continue here."""
        ...

    def platform(self) -> dict[str, str]:
        """The part of :meth:`facts` that is the host's, whatever the sandbox (its VMM,
        version, machine type; the accelerator and CPU model when they are known
        without a probe): what placement compares with a saved machine's, so that a
        host that cannot continue it is never tried."""
        ...

    def create_layer(self, path: Path, backing: Path, size_gib: int) -> None:
        """A new writable disk layer at ``path`` over the frozen ``backing`` layer."""
        ...

    async def start(
        self,
        spec: MachineSpec,
        stderr_path: Path,
        on_spawn: Callable[[int], None] | None = None,
    ) -> Vm:
        """Start the machine (booting, or waiting for state when ``spec.incoming``);
        ``on_spawn`` hears its process id as soon as it exists."""
        ...

    async def adopt(self, spec: MachineSpec, pid: int, stderr_path: Path) -> Vm:
        """Take over the running machine process ``pid`` whose supervisor died.

        :raises CryoboxError: when it cannot be taken over (it is then killed by the caller).
        """
        ...
