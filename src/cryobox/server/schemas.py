"""What the HTTP API accepts: one pydantic model per request body, each field bounded so
that a bad value is answered with a 422 naming the field, before any work starts."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from cryobox import config
from cryobox.service.service import MAX_FORKS

Seconds = Annotated[float, Field(gt=0, le=30 * 86400, allow_inf_nan=False)]
Port = Annotated[int, Field(ge=1, le=65535)]
Text = Annotated[str, Field(min_length=1, max_length=4096)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SetTimeout(Body):
    seconds: Seconds


class Capture(Body):
    name: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    memory: bool = True
    #: A snapshot's name is the tenant's one snapshot of that name: taken again only
    #: with ``overwrite`` (the older one is then deleted, unless something uses it).
    overwrite: bool = False


class Rollback(Body):
    checkpoint: Annotated[str, Field(min_length=1, max_length=200)]


class Fork(Body):
    count: Annotated[int, Field(ge=1, le=MAX_FORKS)] = 1
    timeout: Seconds | None = None


class ExposePort(Body):
    guest_port: Port


class TerminalSize(Body):
    cols: Annotated[int, Field(ge=1, le=4096)]
    rows: Annotated[int, Field(ge=1, le=4096)]


class RunCommand(Body):
    #: A string runs under ``/bin/sh -c``; a list is the argv itself.
    cmd: Text | Annotated[list[Text], Field(min_length=1, max_length=4096)]
    env: Annotated[dict[str, str], Field(max_length=256)] = {}
    cwd: Text | None = None
    user: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    timeout: Seconds | None = None
    #: Whether stdin will be fed through ``.../stdin`` (else the command's stdin is empty).
    stdin: bool = False
    #: Run it on a pseudo-terminal of this size (all its output then comes as stdout).
    pty: TerminalSize | None = None


class Signal(Body):
    signal: Annotated[int, Field(ge=1, le=64)] = 9


class MakeDir(Body):
    path: Text
    parents: bool = True


class BuildTemplate(Body):
    name: Annotated[
        str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
    ]
    setup: Annotated[list[Text], Field(max_length=100)] = []
    cpus: Annotated[int, Field(ge=1, le=config.MAX_CPUS)] = config.DEFAULT_CPUS
    memory_mib: Annotated[int, Field(ge=config.MIN_MEMORY_MIB, le=config.MAX_MEMORY_MIB)] = (
        config.DEFAULT_MEMORY_MIB
    )
    disk_gib: Annotated[int, Field(ge=config.MIN_DISK_GIB, le=config.MAX_DISK_GIB)] = (
        config.DEFAULT_DISK_GIB
    )


class ErrorBody(BaseModel):
    """Every 4xx/5xx of cryobox's own: the message, and the error's type and context
    (the SDK raises the same exception type from it)."""

    detail: str
    error: dict[str, Any]


class Deleted(BaseModel):
    """What a delete removed (a cascade removes more than one)."""

    deleted: list[str]


class HostPort(BaseModel):
    guest_port: int
    host_port: int


class Health(BaseModel):
    status: str
    version: str
