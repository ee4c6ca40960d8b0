"""The E2B-compatible API as an extension of ``cryobox server`` (see
:class:`cryobox.server.extensions.Extension`): its routes under ``/e2b``, E2B's error
shape, its per-sandbox access tokens, and which of its requests name a sandbox."""

from __future__ import annotations

import functools
import hmac
import re
import urllib.parse
from collections.abc import Mapping

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import Scope

from cryobox.errors import CryoboxError
from cryobox.server.extensions import Extension
from cryobox.server.host_routes import Admission, with_header, with_path_prefix
from cryobox.server.hub import Hub

from . import rest
from .envd import Envd, EnvdRpc, envd_router, signed_files_router
from .records import E2bRecords
from .volumes import volumes_router

PREFIX = "/e2b/"
#: E2B's control-plane paths that name a sandbox.
_SANDBOX_PATH = re.compile(r"^/e2b(?:/v2)?/sandboxes/([A-Za-z0-9_.-]+)(?:/|$)")
#: Routes that read their bodies in bounded chunks: file uploads and envd's RPC streams.
STREAMING = re.compile(
    r"^(/e2b/files$|/files$|/e2b/process\.Process/|/e2b/filesystem\.Filesystem/"
    r"|/e2b/volumecontent/[^/]+/file$)"
)


def install(app: FastAPI, hub: Hub) -> None:
    """E2B's control plane (:mod:`.rest`), in-sandbox API (:mod:`.envd`) and volumes
    (:mod:`.volumes`)."""
    records = E2bRecords(hub.db)
    envd = Envd(hub, records)
    app.include_router(rest.e2b_router(hub, records, envd.forget))
    app.include_router(envd_router(envd))
    app.include_router(signed_files_router(envd))
    app.include_router(volumes_router(hub))
    app.add_middleware(EnvdRpc, envd=envd)

    def auto_resumes(sandbox_id: str) -> bool:  # a request to its port wakes it, as E2B's
        record = records.get(sandbox_id)
        return record is not None and record.auto_resume

    hub.traffic_wakes.append(auto_resumes)
    hub.traffic_rules.append(functools.partial(traffic_rule, records))


#: The header E2B's private sandbox URLs need (``allowPublicTraffic=false``).
TRAFFIC_TOKEN = "e2b-traffic-access-token"


def traffic_rule(
    records: E2bRecords, sandbox_id: str, port: int, headers: Mapping[str, str]
) -> Admission | None:
    """E2B's rules for a request by host name to one of its sandboxes: its traffic token
    when it was made private (compared in constant time), its host mask."""
    record = records.get(sandbox_id)
    if record is None:
        return None  # not made through E2B's API: cryobox's own rules
    if record.private_traffic:
        given = headers.get(TRAFFIC_TOKEN, "")
        if not hmac.compare_digest(given.encode(), record.traffic_token.encode()):
            return Admission(
                allowed=False,
                reason=f"{sandbox_id} is private: send its traffic token in {TRAFFIC_TOKEN}",
            )
    mask = record.mask_request_host.replace("${PORT}", str(port))
    return Admission(host=mask or None)


def error_response(exc: CryoboxError, status: int) -> JSONResponse:
    return rest.error_body(rest.status_of_e2b(exc, status), exc)


def invalid_request(exc: RequestValidationError) -> JSONResponse:
    """E2B's error shape, every field's problem in its message."""
    fields = "; ".join(
        f"{'.'.join(str(part) for part in item.get('loc', ()))}: {item.get('msg')}"
        for item in exc.errors()
    )
    return JSONResponse({"code": 400, "message": fields}, status_code=400)


def may_use(hub: Hub, sandbox_id: str, headers: Mapping[str, str]) -> bool:
    """Whether the request carries the sandbox's E2B access token."""
    token = headers.get("x-access-token")
    return E2bRecords(hub.db).by_token(sandbox_id, token) is not None


def target(path: str, headers: Mapping[str, str]) -> str | None:
    """``/e2b/sandboxes/ID...`` and ``/e2b/v2/sandboxes/ID...``, and envd's calls under
    ``/e2b/`` with an ``E2b-Sandbox-Id`` header."""
    found = _SANDBOX_PATH.match(path)
    if found:
        return found.group(1)
    if path.startswith(PREFIX):
        return headers.get("e2b-sandbox-id") or None
    return None


#: The port E2B's SDK names a sandbox's envd by (``49983-ID.DOMAIN``).
ENVD_PORT = 49983
_ENVD_HOST = re.compile(rf"{ENVD_PORT}-(sbx-[0-9a-f]{{12}})")


def host_alias(label: str, scope: Scope) -> Scope | None:
    """E2B's own host names under the server's ``--domain``, as its SDKs build them from
    ``E2B_DOMAIN`` alone (no ``E2B_API_URL``/``E2B_SANDBOX_URL``): ``api.DOMAIN`` is the
    control plane and ``49983-ID.DOMAIN`` that sandbox's envd, both served under
    ``/e2b``; the sandbox is the one the name gives, whatever header came with it. A
    signed file URL (``/files?signature=...``) stays at the root, where it is served."""
    if label == "api":
        return with_path_prefix(scope, PREFIX.rstrip("/"))
    found = _ENVD_HOST.fullmatch(label)
    if found is None:
        return None
    scope = with_header(scope, "e2b-sandbox-id", found.group(1))
    query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if scope["path"] == "/files" and "signature" in query:
        return scope
    return with_path_prefix(scope, PREFIX.rstrip("/"))


def extension() -> Extension:
    """What ``cryobox server`` installs to serve the official ``e2b`` SDK."""
    return Extension(
        name="e2b",
        prefix=PREFIX,
        install=install,
        error_response=error_response,
        invalid_request=invalid_request,
        may_use=may_use,
        target=target,
        streaming=STREAMING,
        creates=(f"{PREFIX}sandboxes", f"{PREFIX}v2/sandboxes"),
        create_key=lambda headers: headers.get("x-api-key"),  # E2B's only (rest.e2b_tenant)
        host_alias=host_alias,
    )
