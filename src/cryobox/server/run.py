"""Start ``cryobox server``: the service, the database, the app, on uvicorn."""

from __future__ import annotations

import logging
import os
import socket
import urllib.parse
from collections.abc import Sequence

import uvicorn

from cryobox import config
from cryobox.service import open_service
from cryobox.store import lazy_ram
from cryobox.store.objects import store_url

from . import host_routes, slow_clients, stack_dump
from .app import create_app
from .databases import connect
from .extensions import Extension
from .hub import Hub
from .meter import Prices
from .response_cut import QuietCuts
from .slow_clients import HeaderDeadlineProtocol

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve(
    host: str = "127.0.0.1",
    port: int = 8080,
    database: str | None = None,
    *,
    url: str | None = None,
    advertise_url: str | None = None,
    tick: float = 1.0,
    storage_interval: float = 60.0,
    collect_interval: float = 3600.0,
    extensions: Sequence[Extension] = (),
    domain: str | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM. Stopping pauses and kills nothing: the sandboxes
    run on under their supervisors, and the next server takes them over.

    With a PostgreSQL ``url`` shared by several hosts, ``advertise_url`` is where the
    other hosts reach this one (default ``http://HOST:PORT``; give it when listening on
    all addresses or behind NAT). ``extensions`` are served beside cryobox's own API
    (``cryobox server`` passes the E2B-compatible one). With ``domain``, sandboxes'
    ports are served by host name, ``PORT-ID.DOMAIN`` (:mod:`.host_routes`); with a
    certificate and its key, everything is served over TLS."""
    os.umask(0o077)  # its database and everything it writes hold tenants' secrets
    config.check_settings()  # a bad host setting stops the server here, not each create
    slow_clients.check_settings()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stack_dump.on_usr1_dump_threads()
    advertised = advertise_url or os.environ.get("CRYOBOX_ADVERTISE_URL") or ""
    if not advertised:
        shown = host if host not in ("0.0.0.0", "::", "") else socket.getfqdn()
        advertised = f"http://{shown}:{port}"
    db = connect(database, url)
    if db.engine == "postgresql" and urllib.parse.urlsplit(advertised).hostname in LOOPBACK:
        log.warning(
            "advertising %s: other hosts on %s cannot reach this one there; "
            "give --advertise-url when more than one host shares the database",
            advertised,
            db.where,
        )
    service = open_service()
    lazy_ram.keep_spare_for(store_url())  # (its first start from the store waits for none)
    hub = Hub(
        service,
        db,
        host=host,
        prices=Prices.from_env(),
        advertise_url=advertised,
    )
    hub.domain = host_routes.check_domain(domain or os.environ.get("CRYOBOX_DOMAIN") or None)
    hub.hosts.register()  # refused here, before listening, if another server is this host
    app = create_app(
        hub,
        tick=tick,
        storage_interval=storage_interval,
        collect_interval=collect_interval,
        extensions=extensions,
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=5,
            http=HeaderDeadlineProtocol,  # closes connections whose headers are late
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
        )
    )
    logging.getLogger("uvicorn.error").addFilter(QuietCuts())  # (after its logging setup)
    server.run()
