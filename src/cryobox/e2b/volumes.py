"""E2B's volumes on cryobox's named volumes: its control API (``/e2b/volumes``, the
tenant's key) and its content API (``/e2b/volumecontent/{id}/...``, the volume's bearer
token), with the semantics of its specification (``spec/openapi-volumecontent.yml``).

A volume's E2B id is its name (names are unique per tenant). Its token is a MAC of the
tenant and the name with this host's key: it opens that volume's content and nothing
else, and a deleted then re-made volume of the same name takes the same token (E2B
offers no way to revoke one either). Files belong to nobody on a cryobox volume: uid and
gid are answered 0 and accepted without effect (cryobox's files belong to whoever looks
in the guest).

The E2B SDK finds the content API at ``E2B_VOLUME_API_URL`` (set it to the same
``http://HOST:PORT/e2b`` as ``E2B_API_URL``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hmac
import os
import posixpath
import stat
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from cryobox.errors import AuthenticationError, InvalidArgument, VolumeNotFound
from cryobox.server.hub import Hub
from cryobox.server.tenants import Tenant
from cryobox.service.volumes import inside
from cryobox.snapshot import keys
from cryobox.util import rechunked
from cryobox.volume.files import VolumeFiles
from cryobox.volume.wire import ATTRIBUTES, MAX_DATA, dir_entries

from .rest import ContentError, Me

_KINDS = {stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink", stat.S_IFREG: "file"}
#: How deep a listing may recurse (E2B's ``depth``).
MAX_DEPTH = 16


class NewVolume(BaseModel):
    name: str


class Metadata(BaseModel):
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


def token_of(tenant_id: str, name: str) -> str:
    mac = keys.mac({"purpose": "e2b-volume", "tenant": tenant_id, "volume": name})
    return f"{tenant_id}.{mac}"


def _iso(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat()


def _relative(path: str) -> str:
    """The service's reading of a volume path, refused in E2B's words."""
    try:
        return inside(path.strip())
    except InvalidArgument as exc:
        raise ContentError(400, str(exc)) from exc


def entry(files: VolumeFiles, relative: str) -> dict[str, Any]:
    """E2B's VolumeEntryStat of one path. :raises OSError:"""
    mode, _nlink, size, _blocks, atime, mtime, ctime = ATTRIBUTES.unpack(files.getattr(relative))
    found: dict[str, Any] = {
        "name": posixpath.basename(relative) or "/",
        "type": _KINDS.get(stat.S_IFMT(mode), "unknown"),
        "path": "/" + relative,
        "size": size,
        "mode": stat.S_IMODE(mode),
        "uid": 0,
        "gid": 0,
        "atime": _iso(atime),
        "mtime": _iso(mtime),
        "ctime": _iso(ctime),
    }
    if stat.S_ISLNK(mode):
        found["target"] = os.fsdecode(files.readlink(relative))
    return found


def _missing(path: str) -> ContentError:
    return ContentError(404, f"Path {path} not found")


def authorized(
    request: Request, volume_id: str, authorization: Annotated[str | None, Header()] = None
) -> str:
    """The host's name of the volume whose token the request carries."""
    hub: Hub = request.app.state.hub
    token = (authorization or "").removeprefix("Bearer ").strip()
    tenant_id, _, _ = token.partition(".")
    if not tenant_id or not hmac.compare_digest(token, token_of(tenant_id, volume_id)):
        raise AuthenticationError("a valid volume token is required (Authorization: Bearer)")
    internal = f"{tenant_id}.{volume_id}"
    if not hub.tenants.owns(tenant_id, "volume", internal):
        raise VolumeNotFound(volume_id)
    return internal


VolumeName = Annotated[str, Depends(authorized)]
PathQ = Annotated[str, Query(min_length=1, max_length=4096)]


def volumes_router(hub: Hub) -> APIRouter:
    router = APIRouter(prefix="/e2b", include_in_schema=False)

    def info(tenant: Tenant, name: str) -> dict[str, Any]:
        return {"volumeID": name, "name": name, "token": token_of(tenant.id, name)}

    # -- control: the tenant's key

    @router.post("/volumes", status_code=201)
    async def create(body: NewVolume, me: Me) -> dict[str, Any]:
        await hub.volumes.create(me, body.name, None, hub.stored_bytes(me))
        return info(me, body.name)

    @router.get("/volumes")
    async def listing(me: Me) -> list[dict[str, Any]]:
        return [{"volumeID": v.name, "name": v.name} for v in await hub.volumes.list(me)]

    @router.get("/volumes/{volume_id}")
    async def get(volume_id: str, me: Me) -> dict[str, Any]:
        await hub.volumes.get(me, volume_id)
        return info(me, volume_id)

    @router.delete("/volumes/{volume_id}", status_code=204)
    async def destroy(volume_id: str, me: Me) -> Response:
        await hub.volumes.delete(me, volume_id)
        return Response(status_code=204)

    # -- content: the volume's token

    @router.get("/volumecontent/{volume_id}/path")
    def stat_path(volume: VolumeName, path: PathQ) -> dict[str, Any]:
        with opened(hub, volume, path) as files:
            return entry(files, _relative(path))

    @router.patch("/volumecontent/{volume_id}/path")
    def update_metadata(volume: VolumeName, path: PathQ, body: Metadata) -> dict[str, Any]:
        with opened(hub, volume, path) as files:
            relative = _relative(path)
            if body.mode is not None:
                files.chmod(relative, body.mode)
            return entry(files, relative)

    @router.delete("/volumecontent/{volume_id}/path", status_code=204)
    def remove(volume: VolumeName, path: PathQ) -> Response:
        with opened(hub, volume, path) as files:
            relative = _relative(path)
            if not relative:
                raise _missing(path)
            _remove_tree(files, relative)
        return Response(status_code=204)

    @router.get("/volumecontent/{volume_id}/dir")
    def list_dir(volume: VolumeName, path: PathQ, depth: int = 1) -> list[dict[str, Any]]:
        with opened(hub, volume, path) as files:
            relative = _relative(path)
            if entry(files, relative)["type"] != "directory":
                raise _missing(path)
            return _listing(files, relative, max(1, min(depth, MAX_DEPTH)))

    @router.post("/volumecontent/{volume_id}/dir", status_code=201)
    def make_dir(
        volume: VolumeName, path: PathQ, mode: int | None = None, force: bool = False
    ) -> dict[str, Any]:
        """``force``: made with its missing parents, and an existing folder is no error."""
        with opened(hub, volume, path) as files:
            relative = _relative(path)
            kind = _kind(files, relative)
            if kind == "directory" and force:
                return entry(files, relative)
            if kind is not None:
                raise ContentError(409, f"Path {path} already exists")
            parts = relative.split("/")
            for depth in range(1 if force else len(parts), len(parts) + 1):
                partial = "/".join(parts[:depth])
                if _kind(files, partial) is None:
                    files.mkdir(partial, 0o755 if mode is None else mode)
            return entry(files, relative)

    @router.get("/volumecontent/{volume_id}/file")
    def read_file(volume: VolumeName, path: PathQ) -> StreamingResponse:
        relative = _relative(path)
        with opened(hub, volume, path) as files:
            if entry(files, relative)["type"] != "file":
                raise _missing(path)

        def body() -> Iterator[bytes]:
            with opened(hub, volume, path) as files:
                offset = 0
                while piece := files.read(relative, offset, MAX_DATA):
                    offset += len(piece)
                    yield piece

        return StreamingResponse(body(), media_type="application/octet-stream")

    @router.put("/volumecontent/{volume_id}/file", status_code=201)
    async def write_file(
        volume: VolumeName,
        path: PathQ,
        request: Request,
        mode: int | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        """``force``: an existing file is replaced (else 409)."""
        relative = _relative(path)

        def begin() -> None:
            kind = _kind(files, relative) if relative else "directory"
            if kind not in (None, "file"):
                raise ContentError(409, f"Path {path} is a directory")
            if kind == "file" and not force:
                raise ContentError(409, f"Path {path} already exists")
            files.create(relative, os.O_TRUNC, 0o644 if mode is None else mode)

        with opened(hub, volume, path) as files:  # file work in threads: never the loop's
            await asyncio.to_thread(begin)
            offset = 0
            async for piece in rechunked(request.stream(), MAX_DATA):
                await asyncio.to_thread(files.write, relative, offset, piece)
                offset += len(piece)
            return await asyncio.to_thread(entry, files, relative)

    return router


@contextlib.contextmanager
def opened(hub: Hub, volume: str, path: str) -> Iterator[VolumeFiles]:
    """The volume's files for one request; a file error as E2B answers it."""
    files = hub.service.volumes.open_files(volume)
    try:
        yield files
    except FileNotFoundError as exc:
        raise _missing(path) from exc
    except (FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
        raise ContentError(409, f"Path {path}: {exc.strerror}") from exc
    except OSError as exc:
        raise ContentError(400, f"Path {path}: {exc.strerror or exc}") from exc
    finally:
        files.close()


def _kind(files: VolumeFiles, relative: str) -> str | None:
    try:
        return str(entry(files, relative)["type"])
    except FileNotFoundError:
        return None


def _listing(files: VolumeFiles, relative: str, depth: int) -> list[dict[str, Any]]:
    found = []
    for mode, name in dir_entries(files.readdir(relative)):
        child = f"{relative}/{name}" if relative else name
        try:
            found.append(entry(files, child))
        except FileNotFoundError:
            continue  # gone meanwhile
        if depth > 1 and stat.S_ISDIR(mode):
            found += _listing(files, child, depth - 1)
    return sorted(found, key=lambda e: e["path"])


def _remove_tree(files: VolumeFiles, relative: str) -> None:
    mode = ATTRIBUTES.unpack(files.getattr(relative))[0]
    if not stat.S_ISDIR(mode):
        files.unlink(relative)
        return
    for _mode, name in dir_entries(files.readdir(relative)):
        _remove_tree(files, f"{relative}/{name}")
    files.rmdir(relative)
