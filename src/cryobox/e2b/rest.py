"""E2B's control-plane REST API under ``/e2b``, mapped onto the hub.

The paths, field names (camelCase) and statuses are the ones the official ``e2b`` SDK
(2.63) calls and parses; errors carry E2B's body ``{"code": status, "message": ...}``.
Keys are cryobox tenant keys, sent by the SDK as ``X-API-KEY``. E2B's default template
``base`` is cryobox's ``default`` template (a restore, not a cold boot); another name is
one of the tenant's (or the host's) templates, or one of the tenant's snapshots (E2B
starts sandboxes from a snapshot by passing its id as the template).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, unquote

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from cryobox.errors import (
    AuthenticationError,
    CryoboxError,
    InvalidArgument,
    SandboxNotFound,
    SnapshotNotFound,
    StateError,
)
from cryobox.models import CommandRequest, CreateRequest, NetworkJson, SandboxInfo
from cryobox.server.forward import credentials
from cryobox.server.hub import Hub
from cryobox.server.tenants import Tenant
from cryobox.snapshot.manifest import SnapshotPurpose

from . import metrics
from .records import E2bRecords, E2bSandbox

#: The envd version cryobox answers as: the SDK enables every feature it knows from 0.6.4.
ENVD_VERSION = "0.6.4"
#: E2B's default sandbox life when create names none (the SDK's own default).
DEFAULT_TIMEOUT = 300
PAGE_LIMIT = 100


class ContentError(CryoboxError):
    """An answer of E2B's volume content API other than 2xx: its status and message."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


class Unsupported(CryoboxError):
    """An E2B feature cryobox does not offer (answered 501 naming it)."""


class NewSandbox(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    template_id: str = Field(alias="templateID", min_length=1, max_length=200)
    timeout: int | None = Field(default=None, ge=0, le=30 * 86400)
    metadata: dict[str, str] | None = Field(default=None, max_length=64)
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars", max_length=256)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    #: With ``autoPause``: False for a filesystem-only pause (None: the whole machine).
    auto_pause_memory: bool | None = Field(default=None, alias="autoPauseMemory")
    #: ``{"enabled": bool}``: whether the next request wakes a sandbox its timeout paused.
    auto_resume: dict[str, Any] | None = Field(default=None, alias="autoResume")
    allow_internet_access: bool | None = None
    mcp: Any = None
    network: dict[str, Any] | None = None
    volume_mounts: list[dict[str, Any]] | None = Field(default=None, alias="volumeMounts")


class NetworkUpdate(BaseModel):
    """E2B's ``update_network`` body (``SandboxNetworkUpdateConfig``)."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    allow_out: list[str] | None = Field(default=None, alias="allowOut", max_length=256)
    deny_out: list[str] | None = Field(default=None, alias="denyOut", max_length=256)
    allow_internet_access: bool | None = Field(default=None, alias="allowInternetAccess")
    rules: dict[str, Any] | None = None
    egress_proxy: dict[str, Any] | None = Field(default=None, alias="egressProxy")


#: E2B's name for every IPv4 destination (its SDK's ``ALL_TRAFFIC``).
ALL_TRAFFIC = "0.0.0.0/0"


def egress_policy(network: dict[str, Any], internet: bool | None) -> NetworkJson | None:
    """E2B's network options as a cryobox policy (None: the default, the internet).

    ``allowOut`` and ``denyOut`` become the policy's allowed and denied entries (an
    allowed one wins, as in E2B); ``allowInternetAccess=False`` denies everything not
    allowed. Domains in ``allowOut`` are resolved once, when the policy is set, rather
    than matched per connection by a proxy as E2B's are. Per-domain ``rules`` with a
    ``transform`` of headers become the policy's headers, which the host's header proxy
    sets (:func:`transform_headers`). A SOCKS5 ``egressProxy`` of the user's own is
    refused by name, as E2B's open-source deployment refuses it. (Its options for
    requests by host name, ``allowPublicTraffic`` and ``maskRequestHost``, are
    :func:`traffic_options`'.)
    """
    if network.get("egressProxy"):
        raise Unsupported(
            "network.egressProxy (a SOCKS5 proxy of your own) is not supported by cryobox"
        )
    headers = transform_headers(network.get("rules") or {})
    allow = [str(entry) for entry in network.get("allowOut") or ()]
    deny = [str(entry) for entry in network.get("denyOut") or ()]
    if internet is False and ALL_TRAFFIC not in deny:
        deny.append(ALL_TRAFFIC)
    if not allow and not deny and not headers:
        return None
    if not allow and ALL_TRAFFIC in deny and not headers:
        return "none"
    policy: dict[str, Any] = {"allow": allow, "deny": deny}
    if headers:
        policy["headers"] = headers
    return policy


#: How E2B's SDK writes a workload identity token it asks its proxy to mint.
_IAM_PLACEHOLDER = "${e2b.identity."


def transform_headers(rules: Any) -> dict[str, dict[str, str]]:
    """E2B's per-destination ``rules`` (``{host: [{"transform": {"headers": {...}}}]}``)
    as cryobox's ``headers``: a destination's rules in order, a later header replacing
    an earlier one of its name. A rule with no transform sets nothing.

    :raises InvalidArgument: for rules not of that shape.
    :raises Unsupported: for a workload identity token (E2B's ``iam``), which cryobox
        does not mint.
    """
    if not isinstance(rules, dict):
        raise InvalidArgument("network.rules: must map a host to a list of rules")
    found: dict[str, dict[str, str]] = {}
    for host, entries in rules.items():
        if not isinstance(entries, list):
            raise InvalidArgument(f"network.rules[{host!r}]: must be a list of rules")
        headers: dict[str, str] = {}
        for entry in entries:
            transform = entry.get("transform") if isinstance(entry, dict) else None
            if not isinstance(transform, dict | None):
                raise InvalidArgument(f"network.rules[{host!r}]: a transform is a map")
            for name, value in ((transform or {}).get("headers") or {}).items():
                if _IAM_PLACEHOLDER in str(value):
                    raise Unsupported(
                        f"network.rules[{host!r}] header {name!r}: workload identity "
                        "tokens (iam) are not supported by cryobox"
                    )
                headers[str(name)] = str(value)
        if headers:
            found[str(host)] = headers
    return found


def network_detail(policy: NetworkJson, private_traffic: bool, mask: str) -> dict[str, Any]:
    """A sandbox's policy as E2B's sandbox info shows it (``SandboxNetworkConfig``): the
    allowed and denied destinations, its headers as ``transform`` rules, and its rules
    for requests by host name. A name in ``allowOut`` shows as the addresses it was
    resolved to when the policy was set (cryobox filters by address)."""
    found: dict[str, Any] = {"allowPublicTraffic": not private_traffic}
    if mask:
        found["maskRequestHost"] = mask
    if policy == "none":
        found["denyOut"] = [ALL_TRAFFIC]
    elif isinstance(policy, list):  # an allow list: everything else denied
        found["allowOut"] = [str(entry) for entry in policy]
        found["denyOut"] = [ALL_TRAFFIC]
    elif isinstance(policy, dict):
        found["allowOut"] = [str(entry) for entry in policy.get("allow") or ()]
        found["denyOut"] = [str(entry) for entry in policy.get("deny") or ()]
        headers = policy.get("headers") or {}
        if headers:
            found["rules"] = {
                str(host): [{"transform": {"headers": dict(values)}}]
                for host, values in headers.items()
            }
    return found


def traffic_options(network: dict[str, Any]) -> dict[str, Any]:
    """E2B's rules for requests to the sandbox's ports by host name (``get_host``): its
    traffic token required (``allowPublicTraffic=false``; cryobox's envd calls always
    need the access token, as E2B's ``secure`` sandboxes do), and the Host header the
    guest's servers see (``maskRequestHost``, its ``${PORT}`` replaced by the port)."""
    private = network.get("allowPublicTraffic") is False
    mask = network.get("maskRequestHost") or ""
    if not isinstance(mask, str) or len(mask) > 253 or any(c in mask for c in " \r\n/"):
        raise InvalidArgument(f"network.maskRequestHost {mask!r}: must be a host name")
    return {"private_traffic": private, "mask_request_host": mask}


class Timeout(BaseModel):
    timeout: int = Field(ge=0, le=30 * 86400)


class Connect(BaseModel):
    model_config = ConfigDict(extra="ignore")

    timeout: int | None = Field(default=None, ge=0, le=30 * 86400)
    memory: bool | None = None


class Pause(BaseModel):
    model_config = ConfigDict(extra="ignore")

    memory: bool | None = None


class Fork(BaseModel):
    timeout: int | None = Field(default=None, ge=1, le=30 * 86400)
    count: int | None = Field(default=None, ge=1, le=100)


class NewSnapshot(BaseModel):
    name: str | None = Field(default=None, min_length=1, max_length=200)
    memory: bool | None = None


def _parse_time(value: str) -> float:
    """An RFC 3339 time as E2B's SDK sends it (a '+' may arrive decoded as a space)."""
    try:
        return datetime.datetime.fromisoformat(value.replace(" ", "+")).timestamp()
    except ValueError as exc:
        raise InvalidArgument(f"startedAfter={value!r} is not an RFC 3339 time") from exc


def iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.UTC).isoformat()


def e2b_tenant(request: Request, x_api_key: Annotated[str | None, Header()] = None) -> Tenant:
    """The tenant whose key E2B's SDK sends (``X-API-KEY``)."""
    hub: Hub = request.app.state.hub
    found = hub.tenants.authenticate(x_api_key) if x_api_key else None
    if found is None:
        raise AuthenticationError("a valid cryobox tenant key is required in X-API-KEY")
    return found


Me = Annotated[Tenant, Depends(e2b_tenant)]


def e2b_router(hub: Hub, records: E2bRecords, forget: Callable[[str], None]) -> APIRouter:
    """E2B's REST paths; ``forget(sandbox_id)`` drops the in-sandbox API's tracking of a
    sandbox that is killed here."""
    router = APIRouter(prefix="/e2b", include_in_schema=False)
    samples = metrics.Samples()

    def record(me: Tenant, sandbox_id: str) -> E2bSandbox:
        found = records.get(sandbox_id)
        if found is None or found.tenant_id != me.id:
            raise SandboxNotFound(sandbox_id)
        return found

    def sandbox(info: SandboxInfo, rec: E2bSandbox) -> dict[str, Any]:
        return {
            "templateID": rec.template_id,
            "sandboxID": info.id,
            "clientID": "cryobox",
            "envdVersion": ENVD_VERSION,
            "envdAccessToken": rec.access_token,
            "trafficAccessToken": rec.traffic_token,
            "domain": hub.domain,  # get_host(port): PORT-ID.DOMAIN (None: not served)
        }

    def detail(info: SandboxInfo, rec: E2bSandbox) -> dict[str, Any]:
        return {
            **sandbox(info, rec),
            "startedAt": iso(info.created_at),
            "endAt": iso(info.deadline or time.time()),
            "cpuCount": info.cpus,
            "memoryMB": info.memory_mib,
            "diskSizeMB": info.disk_gib * 1024,
            "state": "paused" if info.state == "paused" else "running",
            "metadata": rec.metadata,
            "network": network_detail(info.network, rec.private_traffic, rec.mask_request_host),
            "lifecycle": {
                "onTimeout": "pause" if info.on_timeout.startswith("pause") else "kill",
                "autoResume": rec.auto_resume,
            },
            "volumeMounts": [
                {"name": name.removesuffix(":ro"), "path": path}
                for path, name in info.volumes.items()
            ],
        }

    async def start(
        me: Tenant,
        template: str,
        timeout: int,
        metadata: dict[str, str],
        envs: dict[str, str],
        network: NetworkJson | None,
        volumes: dict[str, str] | None = None,
        *,
        on_timeout: Literal["kill", "pause", "pause-disk"] = "kill",
        auto_resume: bool = False,
        traffic: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        # The variables go with the sandbox (sealed in its spec, given to every command),
        # never into the database.
        request = CreateRequest(
            template="default",
            timeout=timeout,
            on_timeout=on_timeout,
            network=network,
            envs=envs,
            volumes=volumes or {},
        )
        if template != "base":
            try:
                snapshot = await hub.find_snapshot(me, template, prefix=False)
                request = dataclasses.replace(request, from_snapshot=snapshot.id)
            except SnapshotNotFound:
                request = dataclasses.replace(request, template=template)
        info = await hub.create(me, request, idle_timeout=0)
        rec = records.add(info.id, me.id, template, metadata, {}, auto_resume, **(traffic or {}))
        return sandbox(info, rec)

    @router.post("/sandboxes", status_code=201)
    @router.post("/v2/sandboxes", status_code=201)
    async def create(body: NewSandbox, me: Me) -> dict[str, Any]:
        auto_resume = bool((body.auto_resume or {}).get("enabled"))
        if auto_resume and not body.auto_pause:
            raise InvalidArgument("autoResume needs autoPause (lifecycle on_timeout='pause')")
        files_only = bool(body.auto_pause) and body.auto_pause_memory is False
        if auto_resume and files_only:
            raise InvalidArgument(
                "autoResume cannot be combined with a filesystem-only autoPause: its resume "
                "boots the sandbox again, which only connect() asks for"
            )
        if body.mcp:
            raise Unsupported("mcp gateways are not supported by cryobox")
        timeout = body.timeout or DEFAULT_TIMEOUT
        network = egress_policy(body.network or {}, body.allow_internet_access)
        traffic = traffic_options(body.network or {})
        volumes = {str(m.get("path")): str(m.get("name")) for m in body.volume_mounts or ()}
        return await start(
            me,
            body.template_id,
            timeout,
            body.metadata or {},
            body.env_vars or {},
            network,
            volumes,
            on_timeout="pause-disk" if files_only else "pause" if body.auto_pause else "kill",
            auto_resume=auto_resume,
            traffic=traffic,
        )

    @router.get("/sandboxes/{sandbox_id}")
    async def get_info(sandbox_id: str, me: Me) -> dict[str, Any]:
        rec = record(me, sandbox_id)
        return detail(await hub.get(me, sandbox_id), rec)

    @router.get("/sandboxes")
    @router.get("/v2/sandboxes")
    async def list_sandboxes(
        request: Request,
        me: Me,
        metadata: str | None = None,
        state: str | None = None,
        template: str | None = None,
        startedAfter: str | None = None,
        order: str = "desc",
        limit: int = PAGE_LIMIT,
        nextToken: str | None = None,
    ) -> Response:
        """E2B's names for the query parameters (camelCase), newest first by default."""
        wanted_states = set((state or "running,paused").split(","))
        after = _parse_time(startedAfter) if startedAfter else None
        wanted_meta = {unquote(k): unquote(v) for k, v in parse_qsl(metadata or "")}
        found = []
        for info in await hub.list(me, credentials=credentials(request)):
            rec = records.get(info.id)
            if rec is None or detail(info, rec)["state"] not in wanted_states:
                continue
            if any(rec.metadata.get(k) != v for k, v in wanted_meta.items()):
                continue
            if template is not None and rec.template_id != template:
                continue
            if after is not None and info.created_at + 1e-6 < after:  # times shown to the µs
                continue
            found.append(detail(info, rec))
        found.sort(key=lambda d: d["startedAt"], reverse=order != "asc")
        start = int(nextToken or 0) if (nextToken or "0").isdigit() else 0
        limit = max(1, min(limit, PAGE_LIMIT))
        page = found[start : start + limit]
        headers = {"x-next-token": str(start + limit)} if start + limit < len(found) else {}
        return JSONResponse(page, headers=headers)

    @router.delete("/sandboxes/{sandbox_id}", status_code=204)
    async def kill(sandbox_id: str, me: Me) -> Response:
        record(me, sandbox_id)
        await hub.kill(me, sandbox_id)
        records.remove(sandbox_id)
        forget(sandbox_id)
        samples.forget(sandbox_id)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(sandbox_id: str, body: Timeout, me: Me) -> Response:
        record(me, sandbox_id)
        info = await hub.get(me, sandbox_id) if body.timeout == 0 else None
        if info is not None and info.on_timeout in ("pause", "pause-disk"):
            if info.state == "running":  # the timeout's pause, now (E2B's way to force it)
                await hub.pause(me, sandbox_id, memory=info.on_timeout == "pause")
        elif body.timeout == 0:
            await hub.kill(me, sandbox_id)
            records.remove(sandbox_id)
            forget(sandbox_id)
            samples.forget(sandbox_id)
        else:
            await hub.set_timeout(me, sandbox_id, body.timeout)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(sandbox_id: str, me: Me, body: Pause | None = None) -> Response:
        record(me, sandbox_id)
        if (await hub.get(me, sandbox_id)).state == "paused":
            raise StateError(sandbox_id, "paused", ["running"], "pause")
        # mode="filesystem" (memory false): the disk only, booted again on connect.
        await hub.pause(me, sandbox_id, memory=body is None or body.memory is not False)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/connect")
    @router.post("/v2/sandboxes/{sandbox_id}/connect")
    @router.post("/sandboxes/{sandbox_id}/resume")
    async def connect(sandbox_id: str, me: Me, body: Connect | None = None) -> JSONResponse:
        """Resume a paused sandbox (201) or extend a running one's timeout (200)."""
        rec = record(me, sandbox_id)
        if body is not None and body.memory is False:
            raise Unsupported("connect(on_resume='reboot') is not supported by cryobox")
        info = await hub.get(me, sandbox_id)
        status = 200
        if info.state == "paused":
            info = await hub.resume(me, sandbox_id)
            status = 201
        if body is not None and body.timeout:
            left = (info.deadline or 0) - time.time()
            if body.timeout > left or status == 201:
                await hub.set_timeout(me, sandbox_id, body.timeout)
                info = await hub.get(me, sandbox_id)
        return JSONResponse(sandbox(info, rec), status_code=status)

    @router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(sandbox_id: str, body: Fork, me: Me, request: Request) -> list[dict[str, Any]]:
        rec = record(me, sandbox_id)
        # (as the caller: forks that do not fit this host are asked of another)
        forks = await hub.fork(
            me, sandbox_id, body.count or 1, body.timeout, credentials=credentials(request)
        )
        made = []
        for info in forks:
            # A fork keeps its parent's variables in its own spec.
            child = records.add(
                info.id,
                me.id,
                rec.template_id,
                rec.metadata,
                rec.envs,
                rec.auto_resume,
                private_traffic=rec.private_traffic,
                mask_request_host=rec.mask_request_host,
            )
            made.append({"sandbox": sandbox(info, child)})
        return made

    @router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def snapshot(sandbox_id: str, body: NewSnapshot, me: Me) -> dict[str, Any]:
        record(me, sandbox_id)
        name = body.name or f"snapshot-of-{sandbox_id}-{int(time.time())}"
        info = await hub.capture(  # E2B's names are tags: the newest snapshot has it
            me,
            sandbox_id,
            SnapshotPurpose.SNAPSHOT,
            name,
            memory=body.memory is not False,
            unique=False,
        )
        return {"snapshotID": info.id, "names": [name]}

    @router.get("/snapshots")
    async def snapshots(
        me: Me,
        sandboxID: str | None = None,
        name: str | None = None,
    ) -> list[dict[str, Any]]:
        return [
            {"snapshotID": s.id, "names": [s.name] if s.name else []}
            for s in await hub.snapshots(me)
            if s.purpose == SnapshotPurpose.SNAPSHOT
            and sandboxID in (None, s.source_sandbox)
            and name in (None, s.name)
        ]

    @router.delete("/templates/{ref}", status_code=204)
    async def delete_snapshot(ref: str, me: Me) -> Response:
        await hub.delete_snapshot(me, ref)
        return Response(status_code=204)

    @router.get("/sandboxes/{sandbox_id}/metrics")
    async def sandbox_metrics(
        sandbox_id: str, me: Me, start: int | None = None, end: int | None = None
    ) -> list[Any]:
        """CPU, memory and disk samples of the sandbox (one taken now when the range
        reaches the present and the sandbox runs)."""
        record(me, sandbox_id)
        info = await hub.get(me, sandbox_id)
        if info.state == "running" and metrics.wanted_now(end):
            output = bytearray()
            try:
                session = await hub.service.guest.start_command(
                    sandbox_id,
                    CommandRequest(argv=("sh", "-c", metrics.SCRIPT), user="root", timeout=10),
                    lambda stream, data: output.extend(data[:4096] if stream == "stdout" else b""),
                )
                if (await session.wait()).exit_code == 0:
                    samples.add(
                        sandbox_id, metrics.parse(output.decode(errors="replace"), time.time())
                    )
            except (CryoboxError, ValueError):
                pass  # a paused, busy or odd guest: the samples so far
        return [s.to_e2b() for s in samples.between(sandbox_id, start, end)]

    @router.put("/sandboxes/{sandbox_id}/network", status_code=204)
    async def network(sandbox_id: str, body: NetworkUpdate, me: Me) -> Response:
        """Replace the sandbox's egress rules; a field left out is cleared, as E2B does."""
        record(me, sandbox_id)
        rules = body.model_dump(by_alias=True, exclude={"allow_internet_access"})
        policy = egress_policy(rules, body.allow_internet_access) or "internet"
        await hub.update_network(me, sandbox_id, policy)
        return Response(status_code=204)

    return router


def error_body(status: int, exc: Exception) -> JSONResponse:
    """E2B's error shape, which its SDK parses on every failed call."""
    return JSONResponse({"code": status, "message": str(exc)}, status_code=status)


def status_of_e2b(exc: CryoboxError, default: int) -> int:
    if isinstance(exc, Unsupported):
        return 501
    if isinstance(exc, ContentError):
        return exc.status
    if isinstance(exc, InvalidArgument) and default == 500:
        return 400
    return default
