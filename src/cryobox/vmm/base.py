"""What a VMM backend must do for cryobox, as Protocols, and the machine it is asked for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryobox.errors import CryoboxError
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


@dataclass(frozen=True)
class MachineSpec:
    """Everything a backend needs to run one machine; paths are absolute.

    ``disk_chain`` is the root disk's layers, the writable one first, each backed by the
    next: the backend opens them as given, so no layer has to name its backing by path.
    """

    name: str
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
    #: A raw file of ``TRANSFER_BYTES`` for bulk file transfers; ``None``: no such disk.
    transfer_disk: Path | None = None
    #: The sockets of the guest's volume ports, one per mount slot (every machine has
    #: them all: a restore needs the devices it was saved with).
    volume_sockets: tuple[Path, ...] = ()
    #: The raw file READs reach its volume mounts through
    #: (:mod:`cryobox.volume.read_disk`); ``None``: no such disk.
    read_disk: Path | None = None


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
