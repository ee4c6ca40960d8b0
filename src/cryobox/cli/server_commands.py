"""``cryobox server``, ``cryobox tenant ...``, ``cryobox host ...`` and ``cryobox usage``.

``server``, ``tenant`` and ``host`` act on this host (the tenant and host commands edit
the server's database directly: run them where a server runs, or anywhere that reaches
the fleet's PostgreSQL); ``usage`` asks a server over HTTP (``CRYOBOX_API_URL`` and
``CRYOBOX_API_KEY``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Annotated

import typer

from cryobox.errors import AuthenticationError, InvalidArgument

from .output import errors_reported, out, print_rows

tenant_app = typer.Typer(no_args_is_help=True, help="Tenants of `cryobox server` and their keys.")
host_app = typer.Typer(
    no_args_is_help=True, help="The hosts of a fleet (servers on one database) and their state."
)

DatabaseOption = Annotated[
    str | None,
    typer.Option(
        "--database", help="The server's SQLite file (default $CRYOBOX_STATE_DIR/server.db)."
    ),
]
DatabaseUrlOption = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="CRYOBOX_DATABASE_URL",
        help="PostgreSQL shared by several hosts (postgresql://USER@HOST:PORT/NAME), "
        "instead of --database.",
    ),
]


def server(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port to listen on.")] = 8080,
    database: DatabaseOption = None,
    database_url: DatabaseUrlOption = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            "--advertise-url",
            envvar="CRYOBOX_ADVERTISE_URL",
            help="Where other hosts on the same database reach this one "
            "(default http://HOST:PORT).",
        ),
    ] = None,
    tick: Annotated[
        float, typer.Option("--tick", help="Seconds between idle and state checks.")
    ] = 1.0,
    storage_interval: Annotated[
        float, typer.Option("--storage-interval", help="Seconds between saved-state metering.")
    ] = 60.0,
    collect_interval: Annotated[
        float,
        typer.Option(
            "--collect-interval",
            help="Seconds between retention and chunk-store collections (0: never).",
        ),
    ] = 3600.0,
    domain: Annotated[
        str | None,
        typer.Option(
            "--domain",
            envvar="CRYOBOX_DOMAIN",
            help="Serve each sandbox's ports by host name, PORT-ID.DOMAIN (point a "
            "wildcard DNS name here; 'localhost:PORT' on one machine). Anyone who reaches "
            "the server and knows a sandbox's id reaches its ports.",
        ),
    ] = None,
    ssl_certfile: Annotated[
        str | None, typer.Option("--ssl-certfile", help="Serve over TLS with this certificate.")
    ] = None,
    ssl_keyfile: Annotated[
        str | None, typer.Option("--ssl-keyfile", help="The certificate's private key.")
    ] = None,
) -> None:
    """Serve the HTTP API (docs at /docs). Stopping it leaves every sandbox running."""
    from cryobox.e2b.extension import extension as e2b
    from cryobox.server import serve

    with errors_reported():  # a database it cannot use is one line, not a traceback
        serve(
            host,
            port,
            database,
            url=database_url,
            advertise_url=advertise_url,
            tick=tick,
            storage_interval=storage_interval,
            collect_interval=collect_interval,
            extensions=[e2b()],  # the official e2b SDK's API, under /e2b
            domain=domain,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
        )


def _database(database: str | None, url: str | None):  # type: ignore[no-untyped-def]
    from cryobox.server import connect

    os.umask(0o077)  # the database's journal files are as private as the database
    if database and (url or os.environ.get("CRYOBOX_DATABASE_URL")):
        raise InvalidArgument("give --database (SQLite) or --database-url, not both")
    return connect(database, url)


def _tenants(database: str | None, url: str | None):  # type: ignore[no-untyped-def]
    from cryobox.server.tenants import Tenants

    return Tenants(_database(database, url))


@tenant_app.command("create")
def tenant_create(
    name: str,
    database: DatabaseOption = None,
    database_url: DatabaseUrlOption = None,
    max_sandboxes: Annotated[int, typer.Option(help="Sandboxes running at once.")] = 20,
    max_vcpus: Annotated[int, typer.Option(help="vCPUs of running sandboxes.")] = 40,
    max_memory_mib: Annotated[int, typer.Option(help="MiB of running sandboxes.")] = 40960,
    max_stored_gib: Annotated[int, typer.Option(help="GiB of saved state.")] = 100,
    e2b_key: Annotated[
        bool,
        typer.Option("--e2b-key", help="A key in E2B's shape (e2b_ and hex), as its JS SDK wants."),
    ] = False,
    hosts: Annotated[
        str,
        typer.Option(
            "--hosts",
            help="Place its sandboxes only on hosts with this label (CRYOBOX_HOST_LABELS); "
            "default: the shared pool of hosts without a label.",
        ),
    ] = "",
) -> None:
    """Create a tenant; its API key is the last line printed (shown only now)."""
    from cryobox.server.tenants import Quota

    with errors_reported():
        quota = Quota(max_sandboxes, max_vcpus, max_memory_mib, max_stored_gib * 1024**3)
        tenant, key = _tenants(database, database_url).create(
            name, quota, e2b_key=e2b_key, hosts=hosts
        )
        out.print(f"tenant {tenant.name} ({tenant.id}) created; its API key:", highlight=False)
        print(key)


@tenant_app.command("ls")
def tenant_ls(database: DatabaseOption = None, database_url: DatabaseUrlOption = None) -> None:
    """List tenants with their quotas."""
    with errors_reported():
        tenants = _tenants(database, database_url)
        rows = [
            (
                t.id,
                t.name,
                str(t.quota.max_sandboxes),
                str(t.quota.max_vcpus),
                f"{t.quota.max_memory_mib}MiB",
                f"{t.quota.max_stored_bytes / 1024**3:g}GiB",
                str(tenants.key_count(t)),
                t.hosts or "-",
            )
            for t in tenants.all()
        ]
        print_rows(
            (
                "ID",
                "NAME",
                "MAX SANDBOXES",
                "MAX VCPUS",
                "MAX MEMORY",
                "MAX STORED",
                "KEYS",
                "HOSTS",
            ),
            rows,
        )


@host_app.command("ls")
def host_ls(database: DatabaseOption = None, database_url: DatabaseUrlOption = None) -> None:
    """List the fleet's hosts: state, labels, what they run against their limits."""
    import time

    from cryobox.server.hosts import STALE_AFTER
    from cryobox.server.placement import loads

    with errors_reported():
        now = time.time()
        rows = []
        for load in loads(_database(database, database_url), now - 900):
            host = load.host
            gone = now - host.seen_at >= STALE_AFTER
            rows.append(
                (
                    host.id,
                    host.url or "-",
                    f"{host.state} (gone)" if gone else host.state,
                    ",".join(host.labels) or "-",
                    str(load.sandboxes),
                    f"{load.vcpus}/{host.max_vcpus or '-'}",
                    f"{load.memory_mib}/{host.max_memory_mib or '-'}MiB",
                    f"{host.mem_available_mib}MiB",
                    f"{host.disk_free_bytes / 1024**3:.1f}GiB",
                    " ".join(
                        host.platform[key]
                        for key in ("name", "version", "accelerator")
                        if key in host.platform
                    )
                    or "-",
                    f"{now - host.seen_at:.0f}s ago",
                )
            )
        print_rows(
            (
                "ID",
                "URL",
                "STATE",
                "LABELS",
                "SANDBOXES",
                "VCPUS",
                "MEMORY",
                "RAM AVAILABLE",
                "DISK FREE",
                "VMM",
                "SEEN",
            ),
            rows,
        )


@host_app.command("drain")
def host_drain(
    host: str, database: DatabaseOption = None, database_url: DatabaseUrlOption = None
) -> None:
    """Stop placing sandboxes on HOST, and pause each one it runs into the store: it wakes
    on another host at its next use (see `host activate`)."""
    from cryobox.server.hosts import set_state

    with errors_reported():
        set_state(_database(database, database_url), host, "draining")
        out.print(
            f"host {host} draining: new sandboxes go to other hosts; it pauses those it "
            "runs, and each wakes elsewhere at its next use"
        )


@host_app.command("undrain")
@host_app.command("activate")
def host_activate(
    host: str, database: DatabaseOption = None, database_url: DatabaseUrlOption = None
) -> None:
    """Place new sandboxes on HOST again."""
    from cryobox.server.hosts import set_state

    with errors_reported():
        set_state(_database(database, database_url), host, "active")
        out.print(f"host {host} active")


@tenant_app.command("key-rotate")
def tenant_key_rotate(
    name: str,
    database: DatabaseOption = None,
    database_url: DatabaseUrlOption = None,
    e2b_key: Annotated[
        bool, typer.Option("--e2b-key", help="The new key in E2B's shape (e2b_ and hex).")
    ] = False,
) -> None:
    """Replace the tenant's keys with a new one (the last line); old keys stop at once."""
    with errors_reported():
        key = _tenants(database, database_url).rotate_key(name, e2b_key=e2b_key)
        out.print(f"new API key of {name} (the old ones no longer work):")
        print(key)


@tenant_app.command("rm")
def tenant_rm(
    name: str, database: DatabaseOption = None, database_url: DatabaseUrlOption = None
) -> None:
    """Remove a tenant and its keys (once it has no sandboxes left)."""
    with errors_reported():
        tenant = _tenants(database, database_url).remove(name)
        out.print(f"removed tenant {tenant.name}")


def usage(
    sandbox_id: Annotated[str | None, typer.Argument(help="One sandbox only.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="The whole report as JSON.")] = False,
) -> None:
    """Compute and saved-state usage so far, and what it costs (asks the server)."""
    from cryobox.client.http_transport import HttpTransport
    from cryobox.wire import SandboxUsage, UsageReport

    with errors_reported():
        url, key = os.environ.get("CRYOBOX_API_URL"), os.environ.get("CRYOBOX_API_KEY")
        if not url or not key:
            raise AuthenticationError(
                "usage is metered by a server: set CRYOBOX_API_URL and CRYOBOX_API_KEY"
            )

        async def fetch() -> UsageReport | SandboxUsage:
            transport = HttpTransport(url, key)
            try:
                return await transport.usage(sandbox_id)
            finally:
                await transport.close()

        report = asyncio.run(fetch())
        if as_json or not isinstance(report, UsageReport):
            print(json.dumps(dataclasses.asdict(report), indent=2))
            return
        cost = report.cost_usd
        print_rows(
            ("VCPU-S", "GIB-S", "STORED", "GB-MONTHS", "COMPUTE $", "STORAGE $", "TOTAL $"),
            [
                (
                    f"{report.vcpu_seconds:.1f}",
                    f"{report.gib_seconds:.1f}",
                    f"{report.stored_bytes / 1e6:.1f}MB",
                    f"{report.stored_gb_months:.6f}",
                    f"{cost.compute:.6f}",
                    f"{cost.storage:.6f}",
                    f"{cost.total:.6f}",
                )
            ],
        )
