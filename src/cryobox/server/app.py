"""The HTTP API of ``cryobox server``: FastAPI routes over the :class:`~.hub.Hub`.

Resources are plural nouns at the root (``/sandboxes``, ``/snapshots``, ``/templates``,
``/usage``). Every route but ``/health`` and the docs needs a tenant key
(``Authorization: Bearer KEY`` or ``X-API-Key: KEY``). cryobox errors become a JSON body
``{"detail": message, "error": {"type", "message", "fields"}}`` with the status below,
from which the SDK raises the same exception type.

Streams: a command's output is NDJSON (one JSON object per line: ``started``, then
``stdout``/``stderr`` with base64 ``data``, then ``exit`` or ``error``); a file download
is the file's bytes; ``/sandboxes/{id}/events`` is server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask

from cryobox import config, streams
from cryobox import errors as e
from cryobox import wire as s
from cryobox.arguments import key_values
from cryobox.guest import protocol as p
from cryobox.models import (
    CommandRequest,
    CreateRequest,
    EntryInfo,
    LineageNode,
    ProcessCheckpointInfo,
    SandboxInfo,
    SnapshotInfo,
    TemplateInfo,
    VolumeInfo,
    matches,
)
from cryobox.snapshot.manifest import SnapshotPurpose
from cryobox.util import rechunked

from . import host_routes, stack_dump, uploads
from .backlog import Backlog
from .console import install_console
from .extensions import Extension
from .forward import Forward, credentials
from .host_routes import HostAliases, HostRoutes
from .hosts import HEARTBEAT
from .hub import Hub
from .limits import BodyLimit
from .meter import usage_days
from .slow_clients import SendDeadline, arm_write_deadline
from .tenants import Tenant, api_key
from .terminal import install_terminal

log = logging.getLogger(__name__)

#: A command whose output waits unread past this many bytes is killed (a client that
#: stopped reading must not hold the server's memory).
STREAM_BACKLOG_LIMIT = 64 * 1024 * 1024
#: Bytes of a folder watch's events waiting unread, at most; then its stream ends with
#: an error and the guest stops watching.
WATCH_BACKLOG = 4 * 1024 * 1024
#: Seconds of quiet after which a watch stream says it is still there.
WATCH_KEEPALIVE = 15.0
#: Threads for the blocking work the server hands off (``asyncio.to_thread``): a lock
#: waited for behind a fold, a pull, a move's transfer, a delete. Python's default is
#: the cores + 4 (6 on a 2-core host): six such calls at once would stall every other
#: call that needs a thread, the monitor's idle pauses among them. Idle threads cost
#: nothing (made when needed); 64 matches the order of Starlette's thread limit (40).
WORKER_THREADS = 64

STATUS: tuple[tuple[type[e.CryoboxError], int], ...] = (
    (e.AuthenticationError, 401),
    (e.SandboxNotFound, 404),
    (e.SnapshotNotFound, 404),
    (e.GuestFileNotFound, 404),
    (e.CommandNotFound, 404),
    (e.TemplateNotFound, 404),
    (e.VolumeNotFound, 404),
    (e.VolumeExists, 409),
    (e.VolumeInUse, 409),
    (e.GuestPermissionError, 403),
    (e.QuotaExceeded, 429),
    (e.StateError, 409),
    (e.AlreadySupervised, 409),
    (e.SandboxDead, 409),
    (e.SnapshotError, 409),
    (e.InvalidArgument, 400),
    (e.GuestError, 400),
    (e.CapacityError, 429),
    (e.StorageError, 507),
    (e.StoreError, 503),
    (e.HostUnavailable, 503),
    (e.NoHostAvailable, 503),
    (e.ChannelError, 502),
)

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": s.ErrorBody} for code in (400, 401, 404, 409, 429)
}


def status_of(exc: e.CryoboxError) -> int:
    for cls, code in STATUS:
        if isinstance(exc, cls):
            return code
    return 500


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite number replaced by its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def _no_key(_headers: Mapping[str, str]) -> str | None:
    return None


def error_response(exc: e.CryoboxError) -> JSONResponse:
    headers = {}
    if isinstance(exc, e.AuthenticationError):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, e.HostUnavailable) and exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    return JSONResponse(
        {"detail": str(exc), "error": e.error_detail(exc)},
        status_code=status_of(exc),
        headers=headers or None,
    )


def current_tenant(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_api_key: Annotated[str | None, Header()] = None,
) -> Tenant:
    """The tenant whose key the request carries (``Authorization: Bearer KEY`` or
    ``X-API-Key: KEY``).

    :raises AuthenticationError: when there is none or it is not valid.
    """
    hub: Hub = request.app.state.hub
    key = api_key(authorization, x_api_key)
    found = hub.tenants.authenticate(key) if key else None
    if found is None:
        raise e.AuthenticationError(
            "an API key is required (Authorization: Bearer KEY or X-API-Key: KEY)"
            if not key
            else "the API key is not valid"
        )
    return found


Me = Annotated[Tenant, Depends(current_tenant)]
PathQ = Annotated[str, Query(min_length=1, max_length=4096)]


def create_app(
    hub: Hub,
    *,
    tick: float = 1.0,
    storage_interval: float = 60.0,
    collect_interval: float = 3600.0,
    extensions: Sequence[Extension] = (),
) -> FastAPI:
    """The API over ``hub``, with ``extensions`` mounted beside it (the E2B-compatible
    API, for one); its lifespan runs the monitor (idle pauses, metering, state-change
    events) every ``tick`` seconds and measures saved state every ``storage_interval``
    seconds."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="cryobox-worker")
        )
        stack_dump.on_usr2_dump_tasks(loop)
        await hub.start()
        monitor = asyncio.create_task(_monitor(hub, tick, storage_interval, collect_interval))
        stop = threading.Event()
        threading.Thread(
            target=_heartbeat, args=(hub, stop), name="cryobox-heartbeat", daemon=True
        ).start()
        try:
            yield
        finally:
            stop.set()
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            await hub.close()

    app = FastAPI(
        title="cryobox",
        version=version("cryobox"),
        description="Real VM sandboxes for AI agents: create, run, pause, fork, snapshot.",
        lifespan=lifespan,
        responses=ERRORS,
    )

    app.state.hub = hub

    def extension_of(request: Request) -> Extension | None:
        return next((x for x in extensions if x.owns(request.url.path)), None)

    @app.exception_handler(e.CryoboxError)
    async def cryobox_error(request: Request, exc: e.CryoboxError) -> JSONResponse:
        extension = extension_of(request)
        if extension is not None:
            return extension.error_response(exc, status_of(exc))
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        extension = extension_of(request)
        if extension is not None:
            return extension.invalid_request(exc)
        # The answer echoes what was sent, which may hold NaN or Infinity (Python's JSON
        # reader takes them; no JSON writer may): such numbers are answered as text.
        try:
            detail = json_safe(jsonable_encoder(exc.errors()))
        except RecursionError:  # the input nested too deep to echo: named, not echoed
            detail = [
                {k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()
            ]
        return JSONResponse({"detail": detail}, 422)

    for extension in extensions:  # E2B's control plane and envd under /e2b, for one
        extension.install(app, hub)

    # Another host's sandbox: passed on whole, before any route or extension reads it.
    def refusal(path: str, exc: e.CryoboxError) -> JSONResponse:
        extension = next((x for x in extensions if x.owns(path)), None)
        return extension.error_response(exc, status_of(exc)) if extension else error_response(exc)

    # Ports by host name (PORT-ID.DOMAIN), inside forwarding: on a fleet, the request
    # reaches the host that runs the sandbox first.
    app.add_middleware(
        HostRoutes,
        domain=hub.domain,
        port_of=hub.traffic_port,
        admit=hub.admit_traffic,
        busy=hub.busy,
    )

    def by_host(sandbox_id: str, headers: Mapping[str, str]) -> bool:
        """A request by host name may move the sandbox to another host when its rules
        admit it (a public URL is anyone's) and traffic wakes it here too."""
        route = host_routes.route_of(headers.get("host"), hub.domain)
        return (
            route is not None
            and route[0] == sandbox_id
            and hub.traffic_wakes_it(sandbox_id)
            and hub.admit_traffic(sandbox_id, route[1], headers).allowed
        )

    app.add_middleware(
        Forward,
        hub=hub,
        targets=[x.target for x in extensions],
        by_host=host_routes.target(hub.domain),
        credentials=[by_host, *(functools.partial(x.may_use, hub) for x in extensions)],
        creates={
            "/sandboxes": lambda h: api_key(h.get("authorization"), h.get("x-api-key")),
            **{path: x.create_key or _no_key for x in extensions for path in x.creates},
        },
        refusal=refusal,
    )
    app.add_middleware(  # before anything reads a body (a port's traffic is the guest's)
        BodyLimit,
        streaming=[x.streaming for x in extensions if x.streaming is not None],
        passes=lambda scope: host_routes.route_in(scope, hub.domain) is not None,
    )
    app.add_middleware(SendDeadline)  # a response's writes, when it arms one
    app.add_middleware(  # outermost: an extension's host names become its paths
        HostAliases,
        domain=hub.domain,
        aliases=[x.host_alias for x in extensions if x.host_alias is not None],
    )

    # ------------------------------------------------------------------ health

    @app.get("/health", tags=["server"])
    async def health() -> s.Health:
        return s.Health(status="ok", version=version("cryobox"))

    # ------------------------------------------------------------------ sandboxes

    @app.post("/sandboxes", status_code=201, tags=["sandboxes"])
    async def create_sandbox(body: CreateRequest, me: Me) -> SandboxInfo:
        """Start a sandbox; answers once its guest runs commands."""
        return await hub.create(me, body, body.idle_timeout)

    @app.get("/sandboxes", tags=["sandboxes"])
    async def list_sandboxes(
        request: Request,
        me: Me,
        all: bool = False,
        state: Annotated[str | None, Query(max_length=20)] = None,
        label: Annotated[list[str] | None, Query(max_length=64)] = None,
    ) -> list[SandboxInfo]:
        """The tenant's sandboxes (killed and dead ones too with ``all``), by ``state``,
        and by labels (``label=KEY=VALUE``, repeatable: all must match)."""
        wanted = key_values("label", label or [])
        found = await hub.list(
            me, all=all or state in ("killed", "dead"), credentials=credentials(request)
        )
        return [info for info in found if matches(info, state, wanted)]

    @app.get("/sandboxes/{sandbox_id}", tags=["sandboxes"])
    async def get_sandbox(sandbox_id: str, me: Me) -> SandboxInfo:
        return await hub.get(me, sandbox_id)

    @app.delete("/sandboxes/{sandbox_id}", status_code=204, tags=["sandboxes"])
    async def kill_sandbox(sandbox_id: str, me: Me) -> Response:
        await hub.kill(me, sandbox_id)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/timeout", status_code=204, tags=["sandboxes"])
    async def set_timeout(sandbox_id: str, body: s.SetTimeout, me: Me) -> Response:
        await hub.set_timeout(me, sandbox_id, body.seconds)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/pause", status_code=204, tags=["sandboxes"])
    async def pause(sandbox_id: str, me: Me, memory: bool = True) -> Response:
        """Pause it: the whole machine, or with ``memory=false`` its disk only (its
        resume boots it again)."""
        await hub.pause(me, sandbox_id, memory=memory)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/resume", tags=["sandboxes"])
    async def resume(sandbox_id: str, me: Me) -> SandboxInfo:
        return await hub.resume(me, sandbox_id)

    @app.post("/sandboxes/{sandbox_id}/checkpoints", status_code=201, tags=["sandboxes"])
    async def checkpoint(sandbox_id: str, body: s.Capture, me: Me) -> SnapshotInfo:
        return await hub.capture(me, sandbox_id, SnapshotPurpose.CHECKPOINT, body.name)

    @app.get("/sandboxes/{sandbox_id}/checkpoints", tags=["sandboxes"])
    async def checkpoints(sandbox_id: str, me: Me) -> list[SnapshotInfo]:
        await hub.get(me, sandbox_id)
        return [
            snap
            for snap in await hub.snapshots(me)
            if snap.source_sandbox == sandbox_id and snap.purpose == SnapshotPurpose.CHECKPOINT
        ]

    @app.post("/sandboxes/{sandbox_id}/rollback", status_code=204, tags=["sandboxes"])
    async def rollback(sandbox_id: str, body: s.Rollback, me: Me) -> Response:
        await hub.rollback(me, sandbox_id, body.checkpoint)
        return Response(status_code=204)

    @app.post("/sandboxes/{sandbox_id}/snapshots", status_code=201, tags=["sandboxes"])
    async def snapshot(sandbox_id: str, body: s.Capture, me: Me) -> SnapshotInfo:
        if not body.name:
            raise e.InvalidArgument("name: a snapshot needs a name")
        return await hub.capture(
            me,
            sandbox_id,
            SnapshotPurpose.SNAPSHOT,
            body.name,
            memory=body.memory,
            overwrite=body.overwrite,
        )

    @app.post("/sandboxes/{sandbox_id}/template", status_code=201, tags=["sandboxes"])
    async def save_template(sandbox_id: str, body: s.SaveTemplate, me: Me) -> SnapshotInfo:
        """Save the running sandbox as template ``name`` (replacing one of that name): new
        sandboxes created from it continue from this instant, with ``ports`` forwarded."""
        return await hub.save_template(me, sandbox_id, body.name, body.ports)

    @app.post("/sandboxes/{sandbox_id}/forks", status_code=201, tags=["sandboxes"])
    async def fork(sandbox_id: str, body: s.Fork, request: Request, me: Me) -> list[SandboxInfo]:
        return await hub.fork(me, sandbox_id, body.count, body.timeout, credentials(request))

    @app.post("/sandboxes/{sandbox_id}/ports", tags=["sandboxes"])
    async def expose_port(sandbox_id: str, body: s.ExposePort, me: Me) -> s.HostPort:
        host_port = await hub.expose_port(me, sandbox_id, body.guest_port)
        return s.HostPort(guest_port=body.guest_port, host_port=host_port)

    @app.put("/sandboxes/{sandbox_id}/network", tags=["sandboxes"])
    async def update_network(sandbox_id: str, body: s.UpdateNetwork, me: Me) -> s.NetworkSet:
        """Replace a running sandbox's network policy, in force at once (no restart)."""
        return s.NetworkSet(await hub.update_network(me, sandbox_id, body.network))

    @app.get("/sandboxes/{sandbox_id}/logs", response_class=PlainTextResponse, tags=["sandboxes"])
    async def logs(sandbox_id: str, me: Me) -> str:
        return await hub.logs(me, sandbox_id)

    @app.post("/sandboxes/{sandbox_id}/ping", status_code=204, tags=["sandboxes"])
    async def ping(sandbox_id: str, me: Me) -> Response:
        await hub.use(me, sandbox_id)
        await hub.service.guest.ping(sandbox_id)
        return Response(status_code=204)

    @app.get("/sandboxes/{sandbox_id}/lineage", tags=["sandboxes"])
    async def sandbox_lineage(sandbox_id: str, me: Me, request: Request) -> list[LineageNode]:
        """The sandbox and its ancestors: the snapshots and sandboxes it came from."""
        await hub.get(me, sandbox_id)
        nodes = {node.id: node for node in await hub.lineage(me, credentials(request))}
        chain, current = [], nodes.get(sandbox_id)
        while current is not None and current not in chain:
            chain.append(current)
            current = nodes.get(current.parent or "")
        return chain

    @app.get("/lineage", tags=["sandboxes"])
    async def lineage(me: Me, request: Request) -> list[LineageNode]:
        return await hub.lineage(me, credentials(request))

    @app.get("/sandboxes/{sandbox_id}/events", tags=["sandboxes"])
    async def events(sandbox_id: str, me: Me, request: Request) -> StreamingResponse:
        """Server-sent events of the sandbox's state changes (created, paused, resumed,
        forked, snapshot stored, rolled back, timed out, died, killed)."""
        await hub.get(me, sandbox_id)
        return StreamingResponse(
            _event_stream(hub, me, sandbox_id, request), media_type="text/event-stream"
        )

    # ------------------------------------------------------------------ commands

    @app.post(
        "/sandboxes/{sandbox_id}/commands",
        tags=["commands"],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}}},
    )
    async def run_command(
        sandbox_id: str, body: s.RunCommand, me: Me, http: Request
    ) -> StreamingResponse:
        """Run a command; its output streams back as it is produced (NDJSON). A client
        that disconnects kills the command."""
        await hub.use(me, sandbox_id)
        request = CommandRequest(
            shell=body.cmd if isinstance(body.cmd, str) else None,
            argv=tuple(body.cmd) if isinstance(body.cmd, list) else None,
            env=body.env,
            cwd=body.cwd,
            user=body.user,
            timeout=body.timeout,
            stdin=body.stdin,
            pty=None if body.pty is None else (body.pty.cols, body.pty.rows),
        )

        def kill() -> None:  # its output went unread: the command ends, its stream says so
            killing = asyncio.ensure_future(session.kill())
            killing.add_done_callback(lambda t: t.cancelled() or t.exception())

        backlog: Backlog[tuple[str, bytes]] = Backlog(STREAM_BACKLOG_LIMIT, kill)
        session = await hub.service.guest.start_command(
            sandbox_id, request, lambda stream, data: backlog.put((stream, data), len(data))
        )
        await session.started()  # a missing program or cwd is answered with its status
        command_id = hub.register_command(me, sandbox_id, session)
        ended = asyncio.ensure_future(session.wait())
        ended.add_done_callback(lambda _: backlog.end())
        # Once it has ended (or been killed for output nobody read), a client that reads
        # nothing for a while is given up: the stream does not hold on for it.
        arm_write_deadline(http.scope, lambda: ended.done() or backlog.overflowed)

        async def lines() -> AsyncIterator[bytes]:
            async with hub.busy(sandbox_id):
                yield streams.encode(streams.Started(session.pid, command_id))
                while (item := await backlog.get()) is not None:
                    yield streams.encode(streams.Output(*item))
                try:
                    result = await ended
                except e.CryoboxError as exc:
                    yield streams.encode(streams.Failed(exc))
                    return
                if backlog.overflowed:
                    limit = STREAM_BACKLOG_LIMIT >> 20
                    error = e.ChannelError(f"more than {limit} MiB of output went unread")
                    yield streams.encode(streams.Failed(error))
                else:
                    yield streams.encode(streams.Exited(result))

        async def cleanup() -> None:
            """After the response, however it ended (a client that left before or during
            the stream included): the command ends with it."""
            hub.commands.pop(command_id, None)
            if not ended.done():
                with contextlib.suppress(e.CryoboxError):
                    await session.kill()
            with contextlib.suppress(e.CryoboxError, asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(ended), 5)

        return StreamingResponse(
            lines(), media_type="application/x-ndjson", background=BackgroundTask(cleanup)
        )

    @app.post(
        "/sandboxes/{sandbox_id}/commands/{command_id}/stdin", status_code=204, tags=["commands"]
    )
    async def command_stdin(
        sandbox_id: str, command_id: str, me: Me, request: Request, eof: bool = False
    ) -> Response:
        """Feed the raw request body to the command's stdin (``eof`` closes it after),
        streamed as it arrives."""
        await hub.use(me, sandbox_id)
        session = hub.command(me, sandbox_id, command_id)
        async for data in rechunked(request.stream(), p.CHUNK):
            await session.send_stdin(data)
        if eof:
            await session.send_stdin(b"", eof=True)
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/commands/{command_id}/kill", status_code=204, tags=["commands"]
    )
    async def command_kill(sandbox_id: str, command_id: str, body: s.Signal, me: Me) -> Response:
        await hub.use(me, sandbox_id)
        await hub.command(me, sandbox_id, command_id).kill(body.signal)
        return Response(status_code=204)

    @app.post(
        "/sandboxes/{sandbox_id}/commands/{command_id}/resize",
        status_code=204,
        tags=["commands"],
    )
    async def command_resize(
        sandbox_id: str, command_id: str, body: s.TerminalSize, me: Me
    ) -> Response:
        """Set the terminal size of a command started with ``pty``."""
        await hub.use(me, sandbox_id)
        await hub.command(me, sandbox_id, command_id).resize(body.cols, body.rows)
        return Response(status_code=204)

    # ------------------------------------------------------------------ files

    @app.get(
        "/sandboxes/{sandbox_id}/files",
        tags=["files"],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    async def download(sandbox_id: str, path: PathQ, me: Me) -> StreamingResponse:
        """The file's bytes, streamed."""
        await hub.use(me, sandbox_id)
        chunks = hub.service.guest.read_file(sandbox_id, path)
        try:
            first = await anext(chunks)  # a missing file is a 404, not an empty body
        except StopAsyncIteration:
            first = b""

        async def body() -> AsyncIterator[bytes]:
            async with hub.busy(sandbox_id):
                yield first
                async for chunk in chunks:
                    yield chunk

        return StreamingResponse(
            body(), media_type="application/octet-stream", background=BackgroundTask(chunks.aclose)
        )

    @app.put("/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
    async def upload(
        sandbox_id: str,
        path: PathQ,
        me: Me,
        request: Request,
        mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
    ) -> Response:
        """Write the streamed request body to ``path`` (replaced atomically)."""
        await hub.use(me, sandbox_id)
        async with hub.busy(sandbox_id):
            await hub.service.guest.write_file(sandbox_id, path, request.stream(), mode)
        return Response(status_code=204)

    @app.delete("/sandboxes/{sandbox_id}/files", status_code=204, tags=["files"])
    async def remove(sandbox_id: str, path: PathQ, me: Me, recursive: bool = False) -> Response:
        await hub.use(me, sandbox_id)
        await hub.service.guest.remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @app.get("/sandboxes/{sandbox_id}/files/list", tags=["files"])
    async def list_dir(sandbox_id: str, path: PathQ, me: Me) -> list[EntryInfo]:
        await hub.use(me, sandbox_id)
        return await hub.service.guest.list_dir(sandbox_id, path)

    @app.get("/sandboxes/{sandbox_id}/files/stat", tags=["files"])
    async def stat(sandbox_id: str, path: PathQ, me: Me) -> EntryInfo:
        await hub.use(me, sandbox_id)
        return await hub.service.guest.stat(sandbox_id, path)

    @app.get(
        "/sandboxes/{sandbox_id}/files/watch",
        tags=["files"],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}}},
    )
    async def watch(
        sandbox_id: str, path: PathQ, me: Me, recursive: bool = False
    ) -> StreamingResponse:
        """Changes under the folder ``path`` as NDJSON: ``watching`` once the guest
        watches, then ``{"type": "event", "event": KIND, "name": NAME}`` per change and a
        ``keepalive`` every 15 s of quiet. It ends when the client leaves or the sandbox
        stops; more than WATCH_BACKLOG bytes of events unread end it with an ``error``.
        An open watch keeps the sandbox from being idle-paused, as a command stream does.
        """
        await hub.use(me, sandbox_id)

        def stop() -> None:  # its events went unread: the stream ends, the guest stops too
            backlog.end()
            ending = asyncio.ensure_future(folder.stop())
            ending.add_done_callback(lambda t: t.cancelled() or t.exception())

        backlog: Backlog[tuple[str, str]] = Backlog(WATCH_BACKLOG, stop)
        folder = await hub.service.guest.watch(
            sandbox_id,
            path,
            recursive,
            lambda kind, name: backlog.put((kind, name), len(name) + 64),
        )
        folder.ended.add_done_callback(lambda _: backlog.end())

        async def lines() -> AsyncIterator[bytes]:
            async with hub.busy(sandbox_id):
                yield streams.encode(streams.Watching())
                while True:
                    try:
                        item = await asyncio.wait_for(backlog.get(), WATCH_KEEPALIVE)
                    except TimeoutError:
                        yield streams.encode(streams.KeepAlive())
                        continue
                    if item is None:
                        break
                    yield streams.encode(streams.FileChanged(*item))
                if backlog.overflowed:
                    limit = WATCH_BACKLOG >> 20
                    error = e.ChannelError(f"more than {limit} MiB of watch events went unread")
                    yield streams.encode(streams.Failed(error))

        return StreamingResponse(
            lines(), media_type="application/x-ndjson", background=BackgroundTask(folder.stop)
        )

    @app.post("/sandboxes/{sandbox_id}/files/mkdir", status_code=204, tags=["files"])
    async def mkdir(sandbox_id: str, body: s.MakeDir, me: Me) -> Response:
        await hub.use(me, sandbox_id)
        await hub.service.guest.mkdir(sandbox_id, body.path, body.parents)
        return Response(status_code=204)

    # ------------------------------------------------------------------ snapshots, templates

    @app.get("/snapshots", tags=["snapshots"])
    async def snapshots(me: Me) -> list[SnapshotInfo]:
        return await hub.snapshots(me)

    @app.get("/snapshots/{ref}", tags=["snapshots"])
    async def get_snapshot(ref: str, me: Me) -> SnapshotInfo:
        return await hub.snapshot(me, ref)

    @app.delete("/snapshots/{ref}", tags=["snapshots"])
    async def delete_snapshot(ref: str, me: Me, cascade: bool = False) -> s.Deleted:
        """Delete a snapshot; ``cascade`` deletes the snapshots built on it first."""
        return s.Deleted(deleted=await hub.delete_snapshot(me, ref, cascade=cascade))

    @app.post("/sandboxes/{sandbox_id}/processes/checkpoints", status_code=201, tags=["processes"])
    async def checkpoint_process(
        sandbox_id: str, body: s.ProcessCheckpoint, me: Me
    ) -> ProcessCheckpointInfo:
        """Checkpoint a process tree in the sandbox (CRIU in the guest)."""
        return await hub.checkpoint_process(me, sandbox_id, body)

    @app.post("/sandboxes/{sandbox_id}/processes/restore", tags=["processes"])
    async def restore_process(sandbox_id: str, body: s.ProcessRestore, me: Me) -> s.RestoredProcess:
        """Restore a process checkpoint into the sandbox; the pid of its root."""
        return s.RestoredProcess(await hub.restore_process(me, sandbox_id, body.checkpoint))

    @app.get("/process-checkpoints", tags=["processes"])
    async def process_checkpoints(me: Me) -> list[ProcessCheckpointInfo]:
        return await hub.process_checkpoints(me)

    @app.delete("/process-checkpoints/{ref}", status_code=204, tags=["processes"])
    async def delete_process_checkpoint(ref: str, me: Me) -> Response:
        await hub.delete_process_checkpoint(me, ref)
        return Response(status_code=204)

    @app.get("/templates", tags=["templates"])
    async def templates(me: Me) -> list[TemplateInfo]:
        return await hub.templates(me)

    @app.post("/templates", status_code=201, tags=["templates"])
    async def build_template(body: s.BuildTemplate, me: Me) -> SnapshotInfo:
        """Boot the image, run the setup commands, save the machine as a template."""
        return await hub.build_template(
            me, body.name, body.setup, body.cpus, body.memory_mib, body.disk_gib
        )

    @app.post("/templates/{name}/image", status_code=201, tags=["templates"])
    async def build_template_from_image(
        name: str,
        request: Request,
        me: Me,
        transport: str = "oci-archive",
        cpus: Annotated[int, Query(ge=1, le=config.MAX_CPUS)] = config.DEFAULT_CPUS,
        memory_mib: Annotated[
            int, Query(ge=config.MIN_MEMORY_MIB, le=config.MAX_MEMORY_MIB)
        ] = config.DEFAULT_MEMORY_MIB,
        disk_gib: Annotated[
            int, Query(ge=config.MIN_DISK_GIB, le=config.MAX_DISK_GIB)
        ] = config.DEFAULT_DISK_GIB,
        setup: Annotated[list[str] | None, Query(max_length=100)] = None,
    ) -> SnapshotInfo:
        """Build template NAME from the container image archive in the body
        (``transport``: ``oci-archive`` or ``docker-archive``): its layers boot with
        cryobox's kernel and agent, its ENV, USER, WORKDIR, command and ports are kept,
        ``setup`` runs in it. The archive is kept on this host as a guest image."""
        if transport not in ("oci-archive", "docker-archive"):
            raise e.InvalidArgument(
                f"transport={transport!r}: an upload is an oci-archive or a docker-archive"
            )
        hub.check_storage(me)  # before the body is read, as again before the build
        async with uploads.received(request.stream(), uploads.max_image_bytes(), ".tar") as path:
            return await hub.build_template(
                me, name, setup or [], cpus, memory_mib, disk_gib, image=f"{transport}:{path}"
            )

    @app.delete("/templates/{name}", status_code=204, tags=["templates"])
    async def delete_template(name: str, me: Me) -> Response:
        await hub.delete_template(me, name)
        return Response(status_code=204)

    # ------------------------------------------------------------------ usage

    @app.get("/usage", tags=["usage"])
    async def usage(
        me: Me, sandbox_id: Annotated[str | None, Query(max_length=200)] = None
    ) -> s.UsageReport | s.SandboxUsage:
        """Compute (vCPU-seconds, GiB-seconds, only while running) and saved state
        (GB-months) so far, priced."""
        return hub.usage(me, sandbox_id)

    @app.get("/usage/days", tags=["usage"])
    async def usage_per_day(me: Me, days: Annotated[int, Query(ge=1, le=366)] = 30) -> s.UsageDays:
        """Compute and saved state per UTC day, the last ``days`` days that had any."""
        prices = dataclasses.asdict(hub.prices)
        return s.UsageDays(prices=prices, days=usage_days(hub.db, me.id, hub.prices, days))

    # ------------------------------------------------------------------ volumes

    @app.post("/volumes", status_code=201, tags=["volumes"])
    async def create_volume(body: s.CreateVolume, me: Me) -> VolumeInfo:
        """An empty volume, or one holding a volume snapshot's files (``from_snapshot``)."""
        source = await hub.find_snapshot(me, body.from_snapshot) if body.from_snapshot else None
        return await hub.volumes.create(
            me, body.name, body.size_gib, hub.stored_bytes(me), from_snapshot=source
        )

    @app.post("/volumes/{name}/snapshots", status_code=201, tags=["volumes"])
    async def snapshot_volume(name: str, body: s.VolumeSnapshot, me: Me) -> SnapshotInfo:
        """The volume's files at one instant, into the tenant's snapshots and the store."""
        return await hub.volumes.snapshot(me, name, body.name, hub.stored_bytes(me))

    @app.get("/volumes", tags=["volumes"])
    async def list_volumes(me: Me) -> list[VolumeInfo]:
        return await hub.volumes.list(me)

    @app.get("/volumes/{name}", tags=["volumes"])
    async def get_volume(name: str, me: Me) -> VolumeInfo:
        return await hub.volumes.get(me, name)

    @app.delete("/volumes/{name}", status_code=204, tags=["volumes"])
    async def delete_volume(name: str, me: Me) -> Response:
        """Refused (409) while sandboxes mount it, naming them."""
        await hub.volumes.delete(me, name)
        return Response(status_code=204)

    @app.get(
        "/volumes/{name}/files",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/octet-stream": {}}}},
        tags=["volumes"],
    )
    async def read_volume_file(name: str, path: PathQ, me: Me) -> StreamingResponse:
        chunks = hub.volumes.read_file(me, name, path)
        first = await anext(chunks, b"")  # a missing file is a 404, not a broken stream
        return StreamingResponse(_prepended(first, chunks), media_type="application/octet-stream")

    @app.put("/volumes/{name}/files", status_code=204, tags=["volumes"])
    async def write_volume_file(name: str, path: PathQ, me: Me, request: Request) -> Response:
        """Write the streamed body to ``path`` in the volume (folders made as needed)."""
        await hub.volumes.write_file(me, name, path, request.stream())
        return Response(status_code=204)

    @app.get("/volumes/{name}/files/list", tags=["volumes"])
    async def list_volume(name: str, path: PathQ, me: Me) -> list[EntryInfo]:
        return await hub.volumes.list_dir(me, name, path)

    # ------------------------------------------------------------------ the console

    @app.get("/events", tags=["sandboxes"])
    async def tenant_events(me: Me, request: Request) -> StreamingResponse:
        """Server-sent events of every sandbox of the tenant (what each sandbox's
        ``/events`` says, with its ``sandbox_id``): what the console follows."""
        return StreamingResponse(
            _event_stream(hub, me, None, request), media_type="text/event-stream"
        )

    install_terminal(app, hub)
    install_console(app)
    return app


async def _prepended(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk


async def _event_stream(
    hub: Hub, me: Tenant, sandbox_id: str | None, request: Request
) -> AsyncIterator[str]:
    """Server-sent events of one sandbox of the tenant, or of all of them (None)."""
    async with hub.events.subscribe(me.id, sandbox_id) as sub:
        yield ": subscribed\n\n"
        while not await request.is_disconnected():
            try:
                event = await asyncio.wait_for(sub.queue.get(), 15)
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            payload = {**event.to_json(), "dropped": sub.dropped}
            yield f"event: {event.type}\ndata: {json.dumps(payload)}\n\n"


async def _monitor(hub: Hub, tick: float, storage_interval: float, collect_interval: float) -> None:
    """The server's clock: every ``tick``, state changes, metering and idle pauses; every
    ``collect_interval``, retention and collection of the chunk store, in a task of its
    own (one at a time): it waits on the store with the S3 client's patience, minutes
    per request when the store does not answer, and the tick's idle pauses and timeouts
    went on only after it."""
    last_storage = last_collect = asyncio.get_running_loop().time()
    collecting: asyncio.Task[None] | None = None
    try:
        await _guarded(hub.measure_storage, 0.0)
        while True:
            await asyncio.sleep(tick)
            await _guarded(hub.observe)
            now = asyncio.get_running_loop().time()
            if now - last_storage >= storage_interval:
                await _guarded(hub.measure_storage, now - last_storage)
                last_storage = now
            if (
                collect_interval > 0
                and now - last_collect >= collect_interval
                and (collecting is None or collecting.done())
            ):
                collecting = asyncio.create_task(_guarded(hub.collect), name="collection")
                last_collect = now
    finally:
        if collecting is not None:
            collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collecting


def _heartbeat(hub: Hub, stop: threading.Event) -> None:
    """This host's heartbeat, in a thread of its own until ``stop``: neither a monitor
    tick that takes long (a pause of a big machine, a drain, the store's collection),
    nor busy worker threads, nor a blocked event loop may make the other hosts take this
    one for lost and start its sandboxes again elsewhere. (A beat in flight when the
    server stops cannot undo its stop: see ``Hosts.leave``.)"""
    while not stop.wait(HEARTBEAT / 4):
        try:
            hub.hosts.heartbeat()
        except Exception:  # the database, for now: the next beat tries again
            log.exception("heartbeat failed")


async def _guarded(step: Callable[..., Awaitable[None]], *args: Any) -> None:
    try:
        await step(*args)
    except Exception:  # the monitor must outlive any one failure; the log says what
        log.exception("monitor step %s failed", getattr(step, "__name__", step))
