"""``cryobox snapshot push|pull|evict|export|import``, ``cryobox store check|usage``,
``cryobox gc`` and ``cryobox key rotate``: the chunk store, acted on from this host.

They run embedded (on this host's state folder and ``CRYOBOX_STORE``), for the tenant
``--tenant`` (default ``local``, the tenant of embedded use; a server's tenants by id).
``cryobox snapshot SANDBOX NAME`` without a subcommand still takes a snapshot.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from typer.core import TyperGroup

from cryobox.config import LOCAL_TENANT

if TYPE_CHECKING:  # loaded by the commands that use them: `cryobox --help` stays quick
    from cryobox.service.persist import Persistence
    from cryobox.service.service import SandboxService

from .output import console, errors_reported, out, print_rows

T = TypeVar("T")
TenantOption = Annotated[
    str, typer.Option("--tenant", help="Whose store: `local` (embedded use) or a tenant id.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]


class TakeByDefault(TyperGroup):
    """``cryobox snapshot SANDBOX NAME`` means ``cryobox snapshot take SANDBOX NAME``."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["take", *args]
        return super().resolve_command(ctx, args)


snapshot_app = typer.Typer(
    cls=TakeByDefault,
    no_args_is_help=True,
    help="Take a snapshot (`cryobox snapshot SANDBOX NAME`), or move one to and from the store.",
)
store_app = typer.Typer(no_args_is_help=True, help="The chunk store: checks and usage.")
key_app = typer.Typer(no_args_is_help=True, help="The store's per-tenant keys.")


def _run(tenant: str, work: Callable[[SandboxService, Persistence], Awaitable[T]]) -> T:
    """``work`` done with this host's service and its store access on behalf of ``tenant``."""
    from cryobox.service import open_service

    async def main() -> T:
        service = open_service()
        try:
            return await work(service, service.persist.of(tenant))
        finally:
            await service.close()

    return asyncio.run(main())


@snapshot_app.command("push")
def push(ref: str, tenant: TenantOption = LOCAL_TENANT) -> None:
    """Store a snapshot in the chunk store now (resumes an upload cut short)."""
    with errors_reported(), console.status(f"storing {ref}") as status:

        def shown(done: int, total: int) -> None:
            status.update(f"storing {ref}: {done / max(total, 1):.0%} of {total / 1e6:.0f} MB")

        state = _run(tenant, lambda _s, p: p.push(ref, progress=shown))
    out.print(f"stored {ref} ({state.get('stored_bytes', 0) / 1e6:.1f} MB in the store)")


@snapshot_app.command("pull")
def pull(ref: str, tenant: TenantOption = LOCAL_TENANT) -> None:
    """Bring a stored snapshot (and the layers it builds on) onto this host."""
    with errors_reported(), console.status(f"pulling {ref}") as status:

        def shown(done: int, total: int) -> None:
            status.update(f"pulling {ref}: {done / max(total, 1):.0%} of {total / 1e6:.0f} MB")

        manifest = _run(tenant, lambda _s, p: p.pull(ref, progress=shown))
    out.print(manifest.id)


@snapshot_app.command("evict")
def evict(ref: str, tenant: TenantOption = LOCAL_TENANT) -> None:
    """Delete a stored snapshot's local files; it is pulled back when used."""
    with errors_reported():
        manifest = _run(tenant, lambda _s, p: p.evict(ref))
    out.print(f"evicted {manifest.id} (kept in the store)")


@snapshot_app.command("export")
def export(ref: str, file: Path, tenant: TenantOption = LOCAL_TENANT) -> None:
    """Pack a snapshot and the disk layers it builds on into one file (encrypted)."""
    with errors_reported(), console.status(f"exporting {ref}"):
        size = _run(tenant, lambda _s, p: p.export(ref, file))
    out.print(f"exported {ref} to {file} ({size / 1e6:.1f} MB)")


@snapshot_app.command("import")
def import_(
    file: Path,
    name: Annotated[str, typer.Option("--name", help="The imported snapshot's name.")],
    tenant: TenantOption = LOCAL_TENANT,
) -> None:
    """Check an exported file and bring its snapshot onto this host as NAME."""
    with errors_reported(), console.status(f"importing {file}"):
        manifest = _run(tenant, lambda _s, p: p.import_(file, name))
    out.print(manifest.id)


@store_app.command("check")
def check(
    tenant: TenantOption = LOCAL_TENANT,
    quick: Annotated[
        bool, typer.Option("--quick", help="Only check that every chunk exists.")
    ] = False,
) -> None:
    """Verify every stored snapshot and every chunk it names (exit 1 on a problem)."""
    with errors_reported(), console.status("checking the store"):
        result = _run(tenant, lambda _s, p: asyncio.to_thread(p.check, deep=not quick))
    for problem in result.problems:
        console.print(f"[red]problem:[/red] {problem}", highlight=False)
    out.print(
        f"{result.snapshots} snapshots, {result.chunks} chunks, {len(result.problems)} problems"
    )
    if result.problems:
        raise typer.Exit(1)


@store_app.command("usage")
def store_usage(tenant: TenantOption = LOCAL_TENANT, as_json: JsonOption = False) -> None:
    """Bytes in the store per snapshot (unique and shared) and in all."""
    with errors_reported():
        usage = _run(tenant, lambda _s, p: asyncio.to_thread(p.usage))
    if as_json:
        out.print_json(json.dumps(asdict(usage)))
        return
    rows = [
        (
            u.id,
            u.name or u.sandbox or "-",
            f"{u.unique_bytes / 1e6:.1f}",
            f"{u.shared_bytes / 1e6:.1f}",
        )
        for u in usage.snapshots
    ]
    print_rows(("SNAPSHOT", "NAME", "UNIQUE MB", "SHARED MB"), rows)
    out.print(f"tenant {usage.tenant}: {usage.stored_bytes / 1e6:.1f} MB stored")


def gc(
    tenant: TenantOption = LOCAL_TENANT,
    grace: Annotated[
        float, typer.Option("--grace", help="Leave unreferenced chunks younger than this (s).")
    ] = 600.0,
) -> None:
    """Collect: unused checkpoints, snapshots past their retention, unreferenced chunks."""

    from cryobox.store.retention import Policy

    async def work(service: SandboxService, persist: Persistence) -> tuple[list[str], Any]:
        collected = await service.catalog.collect_garbage()
        policy = Policy.from_env()
        return collected, await asyncio.to_thread(persist.collect, policy, grace=grace)

    with errors_reported(), console.status("collecting"):
        collected, report = _run(tenant, work)
    for snapshot_id in [*collected, *report.expired]:
        out.print(f"deleted {snapshot_id}")
    for snapshot_id, why in report.kept.items():
        console.print(f"kept {snapshot_id} past its retention: needed by {why}", highlight=False)
    if report.skipped:
        console.print(f"chunks not swept: {report.skipped}", highlight=False)
    out.print(f"{report.chunks_deleted} chunks deleted ({report.bytes_freed / 1e6:.1f} MB freed)")


@key_app.command("rotate")
def rotate(tenant: TenantOption = LOCAL_TENANT) -> None:
    """Make a new key-encryption key and re-wrap the tenant's data key with it."""
    with errors_reported():
        kek = _run(tenant, lambda _s, p: asyncio.to_thread(p.rotate_key))
    out.print(f"tenant {tenant}: data key re-wrapped with {kek}")
