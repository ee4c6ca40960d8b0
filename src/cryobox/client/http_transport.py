"""The SDK's transport to a ``cryobox server`` over HTTP (httpx).

Each call is one request to the server's REST API (:mod:`cryobox.server.app`); errors
come back as the same exception types the embedded service raises, rebuilt from the
body's ``error`` detail. A command's output streams back as NDJSON lines while it
runs; files stream both ways in chunks.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import signal as signals
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from typing import Any
from urllib.parse import quote

import httpx

from cryobox import config, streams, wire
from cryobox.arguments import container_image
from cryobox.errors import (
    AuthenticationError,
    ChannelError,
    CryoboxError,
    InvalidArgument,
    ProtocolError,
    error_from_detail,
)
from cryobox.models import (
    CommandRequest,
    CreateRequest,
    EntryInfo,
    ExitStatus,
    LineageNode,
    NetworkJson,
    OutputSink,
    ProcessCheckpointInfo,
    Progress,
    SandboxInfo,
    SnapshotInfo,
    SnapshotPurpose,
    TemplateInfo,
    VolumeInfo,
    WatchSink,
)
from cryobox.util import each_chunk

#: Calls that answer at once; lifecycle calls (create, fork, template build) may take
#: minutes under TCG; command streams last as long as their command.
QUICK = httpx.Timeout(60.0, connect=15.0)
#: Seconds a request answered "503, retry after N s" is sent again for.
RETRY_FOR = 15.0
LONG = httpx.Timeout(1800.0, connect=15.0)
STREAM = httpx.Timeout(None, connect=15.0)


def _fields(cls: type, value: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in value.items() if k in names}


def sandbox_info(value: dict[str, Any]) -> SandboxInfo:
    fields = _fields(SandboxInfo, value)
    fields["ports"] = {int(g): int(h) for g, h in (value.get("ports") or {}).items()}
    return SandboxInfo(**fields)


def snapshot_info(value: dict[str, Any]) -> SnapshotInfo:
    return SnapshotInfo(**_fields(SnapshotInfo, value))


def template_info(value: dict[str, Any]) -> TemplateInfo:
    fields = _fields(TemplateInfo, value)
    fields["setup"] = tuple(fields.get("setup") or ())
    return TemplateInfo(**fields)


def process_checkpoint_info(value: dict[str, Any]) -> ProcessCheckpointInfo:
    fields = _fields(ProcessCheckpointInfo, value)
    fields["pids"] = tuple(int(pid) for pid in fields.get("pids") or ())
    fields["files"] = tuple(fields.get("files") or ())
    return ProcessCheckpointInfo(**fields)


def volume_info(value: dict[str, Any]) -> VolumeInfo:
    fields = _fields(VolumeInfo, value)
    fields["mounted_by"] = tuple(fields.get("mounted_by") or ())
    return VolumeInfo(**fields)


def raise_for(response: httpx.Response) -> None:
    """Raise the cryobox error a failed response describes."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = {"detail": response.text}
    detail = body.get("detail") if isinstance(body, dict) else body
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        rebuilt = error_from_detail(error, str(detail))
        if rebuilt is not None:
            raise rebuilt
    if response.status_code == 422 and isinstance(detail, list):
        raise InvalidArgument(
            "; ".join(
                f"{'.'.join(str(part) for part in item.get('loc', ())[1:])}: {item.get('msg')}"
                for item in detail
                if isinstance(item, dict)
            )
        )
    if response.status_code == 401:
        raise AuthenticationError(str(detail))
    raise CryoboxError(f"HTTP {response.status_code} from {response.url}: {detail}")


async def open_stream(
    client: httpx.AsyncClient, request: httpx.Request, doing: str
) -> httpx.Response:
    """Send ``request`` and return its response with the body still to read.

    :raises ChannelError: when the server does not answer.
    :raises CryoboxError: the error a failed response describes (the response closed).
    """
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise ChannelError(f"{doing}: {exc}") from exc
    if response.status_code >= 400:
        try:
            await response.aread()
        finally:
            await response.aclose()
        raise_for(response)
    return response


class HttpWatch:
    """A folder watch behind the server: its event stream is read as it comes; closing
    the stream ends the watch in the guest."""

    def __init__(self, client: httpx.AsyncClient, on_event: WatchSink) -> None:
        self._client = client
        self._on_event = on_event
        self._reader: asyncio.Future[None] | None = None

    async def start(self, url: str, params: dict[str, str]) -> None:
        request = self._client.build_request("GET", url, params=params, timeout=STREAM)
        response = await open_stream(self._client, request, "starting the watch")
        try:
            lines = response.aiter_lines()
            first = streams.read_watch_event(await anext(lines))
            if isinstance(first, streams.Failed):
                raise first.error
            if not isinstance(first, streams.Watching):
                raise ChannelError(f"the server answered a watch with {first!r}")
        except BaseException:
            await response.aclose()
            raise
        self._reader = asyncio.ensure_future(self._read(response, lines))
        self._reader.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _read(self, response: httpx.Response, lines: AsyncIterator[str]) -> None:
        try:
            async for line in lines:
                match streams.read_watch_event(line):
                    case streams.FileChanged(kind, name):
                        self._on_event(kind, name)
                    case streams.Failed(error):
                        raise error
        except httpx.HTTPError as exc:
            raise ChannelError(f"the watch's event stream broke: {exc}") from exc
        finally:
            await response.aclose()

    async def stop(self) -> None:
        """End the watch; raises what ended it before, if something did (an overflow,
        a broken stream). A watch whose sandbox stopped just ends."""
        if self._reader is None:
            return
        if not self._reader.done():
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        elif not self._reader.cancelled() and self._reader.exception() is not None:
            raise self._reader.exception()  # type: ignore[misc]


class HttpCommand:
    """A command running behind the server: its output stream is read as it comes."""

    def __init__(self, client: httpx.AsyncClient, base: str, on_output: OutputSink) -> None:
        self._client = client
        self._base = base
        self._on_output = on_output
        self.pid = 0
        self._id = ""
        self._reader: asyncio.Future[ExitStatus] | None = None

    async def start(self, body: wire.RunCommand) -> None:
        request = self._client.build_request(
            "POST", self._base, json=body.to_wire(), timeout=STREAM
        )
        response = await open_stream(self._client, request, "starting the command")
        try:
            lines = response.aiter_lines()
            first = streams.read_command_event(await anext(lines))
            if isinstance(first, streams.Failed):
                raise first.error
            if not isinstance(first, streams.Started):
                raise ChannelError(f"the server answered a command with {first!r}")
            self.pid, self._id = first.pid, first.command_id
        except BaseException:
            await response.aclose()
            raise
        self._reader = asyncio.ensure_future(self._read(response, lines))
        self._reader.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _read(self, response: httpx.Response, lines: AsyncIterator[str]) -> ExitStatus:
        try:
            async for line in lines:
                match streams.read_command_event(line):
                    case streams.Output(stream, data):
                        self._on_output(stream, data)
                    case streams.Exited(status):
                        return status
                    case streams.Failed(error):
                        raise error
        except httpx.HTTPError as exc:
            raise ChannelError(f"the command's output stream broke: {exc}") from exc
        finally:
            await response.aclose()
        raise ChannelError("the server closed the command's stream before it ended")

    async def started(self) -> None:
        return  # the server answers a start only once the process runs

    async def wait(self) -> ExitStatus:
        assert self._reader is not None
        return await asyncio.shield(self._reader)

    async def send_stdin(self, data: bytes, eof: bool = False) -> None:
        response = await self._client.post(
            f"{self._base}/{self._id}/stdin",
            params={"eof": "true" if eof else "false"},
            content=data,
            timeout=QUICK,
        )
        raise_for(response)

    async def resize(self, cols: int, rows: int) -> None:
        response = await self._client.post(
            f"{self._base}/{self._id}/resize",
            json=wire.TerminalSize(cols, rows).to_wire(),
            timeout=QUICK,
        )
        raise_for(response)

    async def kill(self, signal: int = signals.SIGKILL) -> None:
        response = await self._client.post(
            f"{self._base}/{self._id}/kill", json=wire.Signal(int(signal)).to_wire(), timeout=QUICK
        )
        raise_for(response)


def _retry_after(response: httpx.Response) -> float | None:
    """The seconds a 503 answer asks to wait before the same request (at most 5), or
    None when it asks for no retry."""
    if response.status_code != 503:
        return None
    try:
        return min(5.0, max(0.1, float(response.headers["retry-after"])))
    except (KeyError, ValueError):
        return None


class HttpTransport:
    """Every :class:`~cryobox.client.transport.Transport` operation as an HTTP call."""

    def __init__(
        self, api_url: str, api_key: str, *, client: httpx.AsyncClient | None = None
    ) -> None:
        """``client``: the httpx client to send with (an in-process app's, say, through
        ``httpx.ASGITransport``); its base URL and the key's header are set here."""
        self.api_url = api_url.rstrip("/")
        if client is None:
            client = httpx.AsyncClient(timeout=QUICK)
        client.base_url = httpx.URL(self.api_url)
        client.headers["Authorization"] = f"Bearer {api_key}"
        self._client = client

    async def _call(
        self, method: str, path: str, *, timeout: httpx.Timeout = QUICK, **kwargs: Any
    ) -> httpx.Response:
        """Send the request; one the server answers 503 with ``Retry-After`` (it did
        nothing: the request raced a move of the sandbox between hosts) is sent again
        after that wait, for at most :data:`RETRY_FOR` seconds, when its body can be
        sent twice."""
        deadline = asyncio.get_running_loop().time() + RETRY_FOR
        while True:
            try:
                response = await self._client.request(method, path, timeout=timeout, **kwargs)
            except httpx.HTTPError as exc:
                raise ChannelError(f"{method} {self.api_url}{path}: {exc}") from exc
            wait = _retry_after(response)
            if (
                wait is None
                or not isinstance(kwargs.get("content"), (bytes, str, type(None)))
                or asyncio.get_running_loop().time() + wait > deadline
            ):
                break
            await asyncio.sleep(wait)
        raise_for(response)
        return response

    @staticmethod
    def _sbx(sandbox_id: str, rest: str = "") -> str:
        return f"/sandboxes/{quote(sandbox_id, safe='')}{rest}"

    async def create(self, request: CreateRequest, progress: Progress | None = None) -> SandboxInfo:
        body = request.to_wire()
        if progress:
            progress(f"starting a sandbox on {self.api_url}")
        response = await self._call("POST", "/sandboxes", json=body, timeout=LONG)
        return sandbox_info(response.json())

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return sandbox_info((await self._call("GET", self._sbx(sandbox_id))).json())

    async def list(self, *, all: bool = False) -> builtins.list[SandboxInfo]:
        response = await self._call("GET", "/sandboxes", params={"all": str(all).lower()})
        return [sandbox_info(item) for item in response.json()]

    async def kill(self, sandbox_id: str) -> None:
        await self._call("DELETE", self._sbx(sandbox_id), timeout=LONG)

    async def pause(self, sandbox_id: str, memory: bool = True) -> None:
        params = None if memory else {"memory": "false"}
        await self._call("POST", self._sbx(sandbox_id, "/pause"), params=params, timeout=LONG)

    async def resume(self, sandbox_id: str, progress: Progress | None = None) -> SandboxInfo:
        response = await self._call("POST", self._sbx(sandbox_id, "/resume"), timeout=LONG)
        return sandbox_info(response.json())

    async def capture(
        self,
        sandbox_id: str,
        purpose: SnapshotPurpose,
        name: str | None,
        memory: bool = True,
        overwrite: bool = False,
    ) -> SnapshotInfo:
        if purpose is SnapshotPurpose.CHECKPOINT:
            path, body = "/checkpoints", wire.Capture(name)
        elif purpose is SnapshotPurpose.SNAPSHOT:
            path, body = "/snapshots", wire.Capture(name, memory, overwrite)
        else:
            raise InvalidArgument(f"a {purpose.value} snapshot is not taken over HTTP")
        response = await self._call(
            "POST", self._sbx(sandbox_id, path), json=body.to_wire(), timeout=LONG
        )
        return snapshot_info(response.json())

    async def save_template(
        self, sandbox_id: str, name: str, ports: Sequence[int] = ()
    ) -> SnapshotInfo:
        body = wire.SaveTemplate(name, list(ports))
        response = await self._call(
            "POST", self._sbx(sandbox_id, "/template"), json=body.to_wire(), timeout=LONG
        )
        return snapshot_info(response.json())

    async def rollback(self, sandbox_id: str, ref: str) -> None:
        await self._call(
            "POST",
            self._sbx(sandbox_id, "/rollback"),
            json=wire.Rollback(ref).to_wire(),
            timeout=LONG,
        )

    async def fork(
        self, sandbox_id: str, count: int, timeout: float | None = None
    ) -> builtins.list[SandboxInfo]:
        response = await self._call(
            "POST",
            self._sbx(sandbox_id, "/forks"),
            json=wire.Fork(count, timeout).to_wire(),
            timeout=LONG,
        )
        return [sandbox_info(item) for item in response.json()]

    async def set_timeout(self, sandbox_id: str, seconds: float) -> None:
        await self._call(
            "POST", self._sbx(sandbox_id, "/timeout"), json=wire.SetTimeout(seconds).to_wire()
        )

    async def expose_port(self, sandbox_id: str, guest_port: int) -> int:
        response = await self._call(
            "POST", self._sbx(sandbox_id, "/ports"), json=wire.ExposePort(guest_port).to_wire()
        )
        return int(response.json()["host_port"])

    async def update_network(self, sandbox_id: str, network: NetworkJson) -> NetworkJson:
        response = await self._call(
            "PUT",
            self._sbx(sandbox_id, "/network"),
            json=wire.UpdateNetwork(network).to_wire(),
        )
        kept: NetworkJson = response.json()["network"]
        return kept

    async def logs(self, sandbox_id: str) -> str:
        return (await self._call("GET", self._sbx(sandbox_id, "/logs"))).text

    async def ping(self, sandbox_id: str) -> None:
        await self._call("POST", self._sbx(sandbox_id, "/ping"))

    async def lineage(self) -> builtins.list[LineageNode]:
        response = await self._call("GET", "/lineage")
        try:
            return [LineageNode.from_json(node) for node in response.json()]
        except (ValueError, TypeError, AttributeError) as exc:
            raise ProtocolError(f"GET /lineage answered what is no lineage: {exc}") from None

    async def start_command(
        self, sandbox_id: str, request: CommandRequest, on_output: OutputSink
    ) -> HttpCommand:
        body = wire.RunCommand(
            cmd=request.shell if request.shell is not None else list(request.argv or ()),
            env=request.env,
            cwd=request.cwd,
            user=request.user,
            timeout=request.timeout,
            stdin=request.stdin,
            pty=None if request.pty is None else wire.TerminalSize(*request.pty),
        )
        command = HttpCommand(self._client, self._sbx(sandbox_id, "/commands"), on_output)
        await command.start(body)
        return command

    def read_file(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        return self._download(self._sbx(sandbox_id, "/files"), path)

    async def _download(self, url: str, path: str) -> AsyncIterator[bytes]:
        """The body of a GET of ``url`` for ``path``, streamed."""
        request = self._client.build_request("GET", url, params={"path": path}, timeout=STREAM)
        response = await open_stream(self._client, request, f"reading {path}")
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise ChannelError(f"reading {path}: {exc}") from exc
        finally:
            await response.aclose()

    async def write_file(
        self, sandbox_id: str, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes], mode: int
    ) -> None:
        await self._call(
            "PUT",
            self._sbx(sandbox_id, "/files"),
            params={"path": path, "mode": mode},
            content=each_chunk(chunks),
            timeout=STREAM,
        )

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[EntryInfo]:
        response = await self._call(
            "GET", self._sbx(sandbox_id, "/files/list"), params={"path": path}
        )
        return [EntryInfo.from_json(item) for item in response.json()]

    async def stat(self, sandbox_id: str, path: str) -> EntryInfo:
        response = await self._call(
            "GET", self._sbx(sandbox_id, "/files/stat"), params={"path": path}
        )
        return EntryInfo.from_json(response.json())

    async def mkdir(self, sandbox_id: str, path: str, parents: bool) -> None:
        await self._call(
            "POST",
            self._sbx(sandbox_id, "/files/mkdir"),
            json=wire.MakeDir(path, parents).to_wire(),
        )

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._call(
            "DELETE",
            self._sbx(sandbox_id, "/files"),
            params={"path": path, "recursive": str(recursive).lower()},
        )

    async def watch(
        self, sandbox_id: str, path: str, recursive: bool, on_event: WatchSink
    ) -> HttpWatch:
        watch = HttpWatch(self._client, on_event)
        params = {"path": path, "recursive": str(recursive).lower()}
        await watch.start(self._sbx(sandbox_id, "/files/watch"), params)
        return watch

    async def snapshots(self) -> builtins.list[SnapshotInfo]:
        return [snapshot_info(item) for item in (await self._call("GET", "/snapshots")).json()]

    async def checkpoints(self, sandbox_id: str) -> builtins.list[SnapshotInfo]:
        """Asked of the sandbox's own host (the route is forwarded there): its
        automatic checkpoints are only there."""
        answer = await self._call("GET", f"/sandboxes/{sandbox_id}/checkpoints")
        return [snapshot_info(item) for item in answer.json()]

    async def delete_snapshot(self, ref: str, *, cascade: bool = False) -> builtins.list[str]:
        response = await self._call(
            "DELETE",
            f"/snapshots/{quote(ref, safe='')}",
            params={"cascade": "true"} if cascade else None,
        )
        return [str(i) for i in response.json()["deleted"]]

    async def build_template(
        self,
        name: str,
        setup: Sequence[str],
        *,
        cpus: int = config.DEFAULT_CPUS,
        memory_mib: int = config.DEFAULT_MEMORY_MIB,
        disk_gib: int = config.DEFAULT_DISK_GIB,
        progress: Progress | None = None,
        image: str | None = None,
    ) -> SnapshotInfo:
        if progress:
            progress(f"building template {name} on {self.api_url}")
        if image is not None:
            return await self._build_from_image(
                name, setup, image, cpus=cpus, memory_mib=memory_mib, disk_gib=disk_gib
            )
        body = wire.BuildTemplate(name, list(setup), cpus, memory_mib, disk_gib)
        response = await self._call("POST", "/templates", json=body.to_wire(), timeout=LONG)
        return snapshot_info(response.json())

    async def _build_from_image(
        self,
        name: str,
        setup: Sequence[str],
        image: str,
        *,
        cpus: int,
        memory_mib: int,
        disk_gib: int,
    ) -> SnapshotInfo:
        """Upload the image archive as the request's body; the server imports it."""
        transport, path = container_image(image)
        if path.is_dir():
            raise InvalidArgument(
                f"image={image!r}: a folder cannot be sent to a server: make an archive of "
                f"it first (skopeo copy {transport}:{path} oci-archive:FILE)"
            )

        async def body() -> AsyncIterator[bytes]:
            with open(path, "rb") as handle:
                while block := await asyncio.to_thread(handle.read, 1 << 20):
                    yield block

        response = await self._call(
            "POST",
            f"/templates/{quote(name, safe='')}/image",
            params={
                "transport": transport,
                "cpus": cpus,
                "memory_mib": memory_mib,
                "disk_gib": disk_gib,
                "setup": list(setup),
            },
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Length": str(path.stat().st_size),
            },
            content=body(),
            timeout=LONG,
        )
        return snapshot_info(response.json())

    async def templates(self) -> builtins.list[TemplateInfo]:
        return [template_info(item) for item in (await self._call("GET", "/templates")).json()]

    async def delete_template(self, name: str) -> None:
        await self._call("DELETE", f"/templates/{quote(name, safe='')}", timeout=LONG)

    async def collect_garbage(self) -> builtins.list[str]:
        raise InvalidArgument("garbage collection runs on the server itself; it is not an API call")

    async def disconnect(self, sandbox_id: str) -> None:
        """Nothing is held per sandbox over HTTP (each call is its own request)."""

    @staticmethod
    def _vol(name: str, rest: str = "") -> str:
        return f"/volumes/{quote(name, safe='')}{rest}"

    async def create_volume(
        self, name: str, size_gib: int | None, from_snapshot: str | None = None
    ) -> VolumeInfo:
        body = wire.CreateVolume(name=name, size_gib=size_gib, from_snapshot=from_snapshot)
        response = await self._call("POST", "/volumes", json=body.to_wire(), timeout=LONG)
        return volume_info(response.json())

    async def snapshot_volume(self, name: str, snapshot_name: str | None) -> SnapshotInfo:
        body = wire.VolumeSnapshot(name=snapshot_name).to_wire()
        response = await self._call("POST", self._vol(name, "/snapshots"), json=body, timeout=LONG)
        return snapshot_info(response.json())

    async def get_volume(self, name: str) -> VolumeInfo:
        return volume_info((await self._call("GET", self._vol(name))).json())

    async def volumes(self) -> builtins.list[VolumeInfo]:
        return [volume_info(item) for item in (await self._call("GET", "/volumes")).json()]

    async def delete_volume(self, name: str) -> None:
        await self._call("DELETE", self._vol(name))

    def read_volume_file(self, name: str, path: str) -> AsyncIterator[bytes]:
        return self._download(self._vol(name, "/files"), path)

    async def write_volume_file(
        self, name: str, path: str, chunks: Iterable[bytes] | AsyncIterable[bytes]
    ) -> None:
        await self._call(
            "PUT",
            self._vol(name, "/files"),
            params={"path": path},
            content=each_chunk(chunks),
            timeout=STREAM,
        )

    async def list_volume(self, name: str, path: str) -> builtins.list[EntryInfo]:
        response = await self._call("GET", self._vol(name, "/files/list"), params={"path": path})
        return [EntryInfo.from_json(item) for item in response.json()]

    async def checkpoint_process(
        self, sandbox_id: str, request: wire.ProcessCheckpoint
    ) -> ProcessCheckpointInfo:
        response = await self._call(
            "POST",
            self._sbx(sandbox_id, "/processes/checkpoints"),
            json=request.to_wire(),
            timeout=LONG,
        )
        return process_checkpoint_info(response.json())

    async def restore_process(self, ref: str, sandbox_id: str) -> int:
        response = await self._call(
            "POST",
            self._sbx(sandbox_id, "/processes/restore"),
            json=wire.ProcessRestore(ref).to_wire(),
            timeout=LONG,
        )
        return int(response.json()["pid"])

    async def process_checkpoints(self) -> builtins.list[ProcessCheckpointInfo]:
        response = await self._call("GET", "/process-checkpoints")
        return [process_checkpoint_info(item) for item in response.json()]

    async def delete_process_checkpoint(self, ref: str) -> None:
        await self._call("DELETE", f"/process-checkpoints/{quote(ref, safe='')}")

    async def usage(self, sandbox_id: str | None = None) -> wire.UsageReport | wire.SandboxUsage:
        """The tenant's usage so far, priced; or one sandbox's (``sandbox_id``)."""
        params = {"sandbox_id": sandbox_id} if sandbox_id else {}
        value = (await self._call("GET", "/usage", params=params)).json()
        try:
            if not isinstance(value, dict):
                raise ValueError(f"{type(value).__name__}, not an object")
            if sandbox_id:
                return wire.SandboxUsage.from_json(value)
            return wire.UsageReport.from_json(value)
        except ValueError as exc:
            raise ProtocolError(f"GET /usage answered what is no usage: {exc}") from None

    async def close(self) -> None:
        await self._client.aclose()
