"""The HTTP API's request and reply bodies, declared once: the server validates what it
receives against them (FastAPI reads their fields and :mod:`annotated_types` bounds, and
answers a bad value with a 422 naming the field; unknown fields are refused), and the
SDK's HTTP client builds what it sends from them.

Plain dataclasses, not pydantic models, so that a remote caller of the SDK (and every
CLI command) does not pay for importing pydantic; the server's FastAPI turns them into
validators. The create body is :class:`cryobox.models.CreateRequest` (the SDK's own
record); command output and events are :mod:`cryobox.streams`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, ClassVar, cast

from annotated_types import Ge, Le, MaxLen, MinLen, Predicate

from cryobox import config
from cryobox.models import NetworkJson, NetworkRequest, Port, Seconds, Text

#: What refuses an unknown field (FastAPI builds its validator with this configuration).
STRICT: dict[str, Any] = {"extra": "forbid"}
Name = Annotated[str, MinLen(1), MaxLen(200)]
TemplateName = Annotated[
    str, MinLen(1), MaxLen(100), Predicate(re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*").fullmatch)
]


class Body:
    """A JSON body: its fields as the wire carries them."""

    __pydantic_config__: ClassVar[dict[str, Any]] = STRICT

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = asdict(cast(Any, self))  # every subclass is a dataclass
        return body


@dataclass(frozen=True)
class SetTimeout(Body):
    seconds: Seconds


@dataclass(frozen=True)
class Capture(Body):
    name: Name | None = None
    memory: bool = True
    #: A snapshot's name is the tenant's one snapshot of that name: taken again only
    #: with ``overwrite`` (the older one is then deleted, unless something uses it).
    overwrite: bool = False


@dataclass(frozen=True)
class Rollback(Body):
    checkpoint: Name


@dataclass(frozen=True)
class SaveTemplate(Body):
    name: TemplateName
    #: Guest ports every sandbox of the template has forwarded (a Dockerfile's EXPOSE).
    ports: Annotated[list[Port], MaxLen(64)] = field(default_factory=list)


@dataclass(frozen=True)
class Fork(Body):
    count: Annotated[int, Ge(1), Le(config.MAX_FORKS)] = 1
    timeout: Seconds | None = None


@dataclass(frozen=True)
class ExposePort(Body):
    guest_port: Port


@dataclass(frozen=True)
class UpdateNetwork(Body):
    """A running sandbox's new network policy (see :mod:`cryobox.network.policy`)."""

    network: NetworkRequest


@dataclass(frozen=True)
class NetworkSet:
    """The policy in force, as kept (host names resolved)."""

    network: NetworkJson


@dataclass(frozen=True)
class TerminalSize(Body):
    cols: Annotated[int, Ge(1), Le(4096)]
    rows: Annotated[int, Ge(1), Le(4096)]


@dataclass(frozen=True)
class RunCommand(Body):
    #: A string runs under ``/bin/sh -c``; a list is the argv itself.
    cmd: Text | Annotated[list[Text], MinLen(1), MaxLen(4096)]
    env: Annotated[dict[str, str], MaxLen(256)] = field(default_factory=dict)
    cwd: Text | None = None
    user: Annotated[str, MinLen(1), MaxLen(64)] | None = None
    timeout: Seconds | None = None
    #: Whether stdin will be fed through ``.../stdin`` (else the command's stdin is empty).
    stdin: bool = False
    #: Run it on a pseudo-terminal of this size (all its output then comes as stdout).
    pty: TerminalSize | None = None

    def to_wire(self) -> dict[str, Any]:
        """Without ``pty`` unless asked: a server without terminals runs the rest."""
        body = asdict(self)
        if self.pty is None:
            del body["pty"]
        return body


@dataclass(frozen=True)
class Signal(Body):
    signal: Annotated[int, Ge(1), Le(64)] = 9


@dataclass(frozen=True)
class CreateVolume(Body):
    name: Annotated[str, MinLen(1), MaxLen(100)]
    #: None: 10 GiB, or the saved volume's size with ``from_snapshot``.
    size_gib: Annotated[int, Ge(1), Le(config.MAX_VOLUME_GIB)] | None = None
    #: A volume snapshot (id or name) whose files the new volume starts with.
    from_snapshot: Annotated[str, MinLen(1), MaxLen(200)] | None = None


@dataclass(frozen=True)
class ProcessCheckpoint(Body):
    """``sbx.processes.checkpoint``: see :mod:`cryobox.service.processes`."""

    pid: Annotated[int, Ge(2)]
    name: Name | None = None
    leave_running: bool = True
    tcp: Annotated[str, Predicate(lambda mode: mode in ("close", "established"))] = "close"
    with_files: Annotated[list[Annotated[str, MinLen(1), MaxLen(4096)]], MaxLen(1000)] = field(
        default_factory=list
    )


@dataclass(frozen=True)
class ProcessRestore(Body):
    checkpoint: Name


@dataclass(frozen=True)
class RestoredProcess:
    """The pid of the restored tree's root (the pid it had when checkpointed)."""

    pid: int


@dataclass(frozen=True)
class VolumeSnapshot(Body):
    name: Annotated[str, MinLen(1), MaxLen(200)] | None = None


@dataclass(frozen=True)
class MakeDir(Body):
    path: Text
    parents: bool = True


@dataclass(frozen=True)
class BuildTemplate(Body):
    name: TemplateName
    setup: Annotated[list[Text], MaxLen(100)] = field(default_factory=list)
    cpus: Annotated[int, Ge(1), Le(config.MAX_CPUS)] = config.DEFAULT_CPUS
    memory_mib: Annotated[int, Ge(config.MIN_MEMORY_MIB), Le(config.MAX_MEMORY_MIB)] = (
        config.DEFAULT_MEMORY_MIB
    )
    disk_gib: Annotated[int, Ge(config.MIN_DISK_GIB), Le(config.MAX_DISK_GIB)] = (
        config.DEFAULT_DISK_GIB
    )


@dataclass(frozen=True)
class ErrorBody:
    """Every 4xx/5xx of cryobox's own: the message, and the error's type and context
    (the SDK raises the same exception type from it)."""

    detail: str
    error: dict[str, Any]


@dataclass(frozen=True)
class Deleted:
    """What a delete removed (a cascade removes more than one)."""

    deleted: list[str]


@dataclass(frozen=True)
class HostPort:
    guest_port: int
    host_port: int


@dataclass(frozen=True)
class Health:
    status: str
    version: str


@dataclass(frozen=True)
class SandboxUsage:
    """One sandbox's metered use: compute while it ran, saved state while kept."""

    id: str
    state: str = ""
    vcpu_seconds: float = 0.0
    gib_seconds: float = 0.0
    stored_bytes: int = 0
    stored_gb_months: float = 0.0
    #: Its tenant (in the answer about one sandbox).
    tenant_id: str = ""

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SandboxUsage:
        """:raises ValueError: for a field of the wrong type."""
        return cls(
            id=_text(value, "id"),
            state=_text(value, "state", ""),
            vcpu_seconds=_number(value, "vcpu_seconds"),
            gib_seconds=_number(value, "gib_seconds"),
            stored_bytes=int(_number(value, "stored_bytes")),
            stored_gb_months=_number(value, "stored_gb_months"),
            tenant_id=_text(value, "tenant_id", ""),
        )


@dataclass(frozen=True)
class Costs:
    """Dollars so far."""

    compute: float
    storage: float
    total: float


@dataclass(frozen=True)
class UsageDay:
    """A tenant's use on one UTC day, priced."""

    day: str
    vcpu_seconds: float
    gib_seconds: float
    stored_gb_months: float
    cost_usd: Costs


@dataclass(frozen=True)
class UsageDays:
    """A tenant's use per day (``GET /usage/days``), with the prices it is counted at."""

    prices: dict[str, float]
    days: list[UsageDay]


@dataclass(frozen=True)
class UsageReport:
    """A tenant's metered use so far, priced, with a line per sandbox."""

    tenant_id: str
    vcpu_seconds: float
    gib_seconds: float
    stored_bytes: int
    stored_gb_months: float
    #: Dollars per vCPU-hour, GiB-hour of RAM, GB-month of saved state.
    prices: dict[str, float]
    cost_usd: Costs
    sandboxes: list[SandboxUsage]

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> UsageReport:
        """:raises ValueError: for a field missing or of the wrong type."""
        cost, prices, lines = value.get("cost_usd"), value.get("prices"), value.get("sandboxes")
        if not isinstance(cost, dict) or not isinstance(prices, dict):
            raise ValueError("a usage report without its costs and prices")
        if not isinstance(lines, list) or not all(isinstance(line, dict) for line in lines):
            raise ValueError("a usage report without its list of sandboxes")
        return cls(
            tenant_id=_text(value, "tenant_id"),
            vcpu_seconds=_number(value, "vcpu_seconds"),
            gib_seconds=_number(value, "gib_seconds"),
            stored_bytes=int(_number(value, "stored_bytes")),
            stored_gb_months=_number(value, "stored_gb_months"),
            prices={str(k): _number(prices, k) for k in prices},
            cost_usd=Costs(*(_number(cost, k) for k in ("compute", "storage", "total"))),
            sandboxes=[SandboxUsage.from_json(line) for line in lines],
        )


def _text(value: dict[str, Any], key: str, default: str | None = None) -> str:
    found = value.get(key, default)
    if not isinstance(found, str):
        raise ValueError(f"{key}={found!r}, not a string")
    return found


def _number(value: dict[str, Any], key: str) -> float:
    found = value.get(key, 0)
    if isinstance(found, bool) or not isinstance(found, int | float):
        raise ValueError(f"{key}={found!r}, not a number")
    return float(found)
