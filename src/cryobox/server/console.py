"""The web console: static files served by ``cryobox server`` at ``/``.

The page (``console/index.html``, ``app.js``, ``app.css``) is plain HTML, CSS and a
JavaScript module with no build step; the terminal uses xterm.js, pinned in
``console/package-lock.json`` at the repository's root and copied into
``console/vendor/`` by ``make setup``. The page signs in with an API key kept in the
browser's session storage and sent as a header on every call (no cookies, so no
cross-site request can act for the user), follows ``/events``, and talks to the same
API as the SDK. Every string that comes from a guest or a user is shown as text
(``textContent``, never markup).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

FILES = Path(__file__).parent / "console"
#: What every page answer carries: nothing but this origin's files and API may load,
#: no page may frame it.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self' ws: wss:; frame-ancestors 'none'; "
        "base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


class _Files(StaticFiles):
    """The console's files, each with the page's security headers (index.html is
    reachable under /console/ too)."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(SECURITY_HEADERS)
        return response


def install_console(app: FastAPI) -> None:
    """Serve the console: ``/`` is its page, ``/console/...`` its files."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(FILES / "index.html", headers=SECURITY_HEADERS)

    app.mount("/console", _Files(directory=FILES), name="console")
