"""``cryobox pool``, ``pool set`` and ``pool drain``, and ``cryobox ls --pool``: the warm
pools of this host (see :mod:`cryobox.service.pool`).

They act on this host's state folder, as ``cryobox gc`` does: a pool belongs to the
host whose VMs it keeps warm. The service's modules are loaded by the commands that use
them, so that every other command starts quickly.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from cryobox import config
from cryobox.errors import CryoboxError
from cryobox.util import host_memory_mib

from .output import errors_reported, out, print_rows

pool_app = typer.Typer(
    invoke_without_command=True,
    help="Warm pools: sandboxes restored ahead of time that create() hands out at once.",
)


def member_rows() -> tuple[list[tuple[str, ...]], float]:
    """One row per waiting member, and the host memory they hold together (MiB)."""
    from cryobox.sandbox import registry
    from cryobox.service import pool

    now, total = time.time(), 0.0
    rows: list[tuple[str, ...]] = []
    for member in pool.members():
        memory = None
        try:
            record = registry.find(member.sandbox_id).record()
            memory = host_memory_mib((record.qemu_pid, record.supervisor_pid))
            state = record.state.value
        except (CryoboxError, OSError, ValueError):  # ended while listed
            state = "gone"
        total += memory or 0.0
        rows.append(
            (
                member.sandbox_id,
                member.template,
                state,
                f"{now - member.ready_at:.0f}s",
                f"{memory:.0f}MiB" if memory is not None else "-",
                member.snapshot_id,
            )
        )
    return rows, total


def print_members(as_json: bool = False) -> None:
    rows, total = member_rows()
    if as_json:
        header = ("id", "template", "state", "waiting", "host_memory", "snapshot")
        print(json.dumps([dict(zip(header, row, strict=True)) for row in rows], indent=2))
        return
    print_rows(("ID", "TEMPLATE", "STATE", "WAITING", "HOST MEMORY", "SNAPSHOT"), rows)
    out.print(f"{len(rows)} waiting, holding {total:.0f} MiB of host memory (PSS)")


@pool_app.callback()
def show(ctx: typer.Context) -> None:
    """Pool sizes, waiting members and the memory they hold."""
    if ctx.invoked_subcommand is not None:
        return
    from cryobox.service import pool

    with errors_reported():
        sizes = pool.sizes()
        print_rows(
            ("TEMPLATE", "SIZE", "WAITING"),
            [
                (name, str(size), str(len(pool.members(name))))
                for name, size in sorted(sizes.items())
            ],
        )
        if not sizes:
            out.print("every pool is off (CRYOBOX_POOL_SIZE=0, or sizes set to 0)")
        pid = pool.refill_pid()
        out.print(f"refill: running (pid {pid})" if pid else "refill: idle")
        print_members()


@pool_app.command("set")
def set_size(
    template: Annotated[str, typer.Argument(help="Template name.")],
    size: Annotated[
        int, typer.Argument(help=f"Members to keep waiting (0 to {config.MAX_POOL_SIZE}).")
    ],
) -> None:
    """Keep SIZE sandboxes of TEMPLATE restored and waiting (0 turns its pool off)."""
    from cryobox.service import pool, pool_refill

    with errors_reported():
        pool.set_size(template, size)
        if size == 0:
            ended = pool_refill.end_members(template)  # stops a refill at work: it would fill it
            pool.request_refill()  # the other pools, if any
            out.print(f"pool {template} off; {len(ended)} ended")
        else:
            pool.request_refill()
            out.print(f"pool {template}: {size} (refilling in the background)")


@pool_app.command("drain")
def drain(
    template: Annotated[str | None, typer.Argument(help="Template name (all if omitted).")] = None,
) -> None:
    """End the waiting members now (a later create() refills the pool)."""
    from cryobox.service import pool_refill

    with errors_reported():
        for sandbox_id in pool_refill.end_members(template):
            out.print(f"ended {sandbox_id}")


__all__ = ["pool_app", "print_members"]
