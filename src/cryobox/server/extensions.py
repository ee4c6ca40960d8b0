"""Another API served beside cryobox's own, under a path prefix of its own.

The E2B-compatible API (:mod:`cryobox.e2b.extension`) is one. The server knows only
this shape: an extension brings its routes and middleware, the error body its clients
parse, the credentials it accepts besides a tenant's key, and which of its requests
name a sandbox (so that they are forwarded to the sandbox's host). ``cryobox server``
installs the extensions it is given; the server's modules import none of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import Scope

from cryobox.errors import CryoboxError

if TYPE_CHECKING:
    from .hub import Hub


@dataclass(frozen=True)
class Extension:
    """An API mounted under ``prefix`` (which starts and ends with ``/``)."""

    name: str
    prefix: str
    #: Adds the extension's routes and middleware to the app (inside forwarding and the
    #: body limit: a request for another host's sandbox never reaches them).
    install: Callable[[FastAPI, Hub], None]
    #: The body of a cryobox error on one of its routes, given the status cryobox's own
    #: API would answer.
    error_response: Callable[[CryoboxError, int], JSONResponse]
    #: The body of a request that failed validation on one of its routes.
    invalid_request: Callable[[RequestValidationError], JSONResponse]
    #: Whether headers carry a credential of the extension's own that reaches a sandbox
    #: (tenant keys are checked by the hub itself).
    may_use: Callable[[Hub, str, Mapping[str, str]], bool]
    #: The sandbox one of its requests names (path and lower-cased headers), if any.
    target: Callable[[str, Mapping[str, str]], str | None]
    #: Paths whose bodies its routes read in bounded chunks themselves (left alone by
    #: the body limit).
    streaming: re.Pattern[str] | None = None
    #: Its paths that create a sandbox (a POST): placed on a host of the fleet first, for
    #: the tenant of the key its routes read (``create_key``: from the headers).
    creates: tuple[str, ...] = ()
    create_key: Callable[[Mapping[str, str]], str | None] | None = None
    #: Host names under the server's ``--domain`` that stand for its own paths (E2B's
    #: ``api.DOMAIN`` and ``49983-ID.DOMAIN``): given a name's first label and the
    #: request, the request rewritten onto its paths, or None when the name is not its.
    host_alias: Callable[[str, Scope], Scope | None] | None = None

    def owns(self, path: str) -> bool:
        """Whether ``path`` is one of the extension's."""
        return path.startswith(self.prefix)
