"""``cryobox proc``: process checkpoints (``checkpoint``, ``restore``, ``ls``, ``rm``).

Chosen processes of a sandbox saved by CRIU in the guest, and restored into the same
sandbox or another started from the same template (see
:mod:`cryobox.service.processes`). Through the SDK, so they act on this host's
sandboxes, or a server's with ``CRYOBOX_API_URL``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Annotated

import typer

from cryobox.client import Sandbox
from cryobox.errors import SnapshotNotFound

from .output import errors_reported, out, print_rows

process_app = typer.Typer(
    no_args_is_help=True,
    help="Process checkpoints: save chosen processes (CRIU), restore them in a sandbox.",
)


@process_app.command("checkpoint")
def checkpoint(
    sandbox_id: str,
    pid: int,
    name: Annotated[str | None, typer.Option("--name", help="A name to find it by.")] = None,
    kill: Annotated[
        bool, typer.Option("--kill", help="End the processes once saved (default: they run on).")
    ] = False,
    tcp: Annotated[
        str,
        typer.Option(
            "--tcp",
            help="'close', or 'established': its TCP connections come back when restored "
            "into this same sandbox.",
        ),
    ] = "close",
    with_file: Annotated[
        list[str] | None,
        typer.Option("--with-file", help="A guest path carried with it (repeat the option)."),
    ] = None,
) -> None:
    """Save process PID of a sandbox and those below it; prints the checkpoint id."""
    with errors_reported():
        saved = Sandbox.connect(sandbox_id).processes.checkpoint(
            pid,
            name,
            leave_running=not kill,
            tcp=tcp,  # type: ignore[arg-type]  # checked by the service, named if wrong
            with_files=with_file or (),
        )
        out.print(saved.id)


@process_app.command("restore")
def restore(checkpoint: str, sandbox_id: str) -> None:
    """Restore a process checkpoint (id or name) into a sandbox; prints the root's pid."""
    with errors_reported():
        out.print(Sandbox.connect(sandbox_id).processes.restore(checkpoint))


@process_app.command("ls")
def ls(as_json: Annotated[bool, typer.Option("--json", help="As JSON.")] = False) -> None:
    """List process checkpoints: where taken, pid, command, size."""
    with errors_reported():
        found = Sandbox.process_checkpoints()
        if as_json:
            print(json.dumps([asdict(c) for c in found], indent=2))
            return
        now = time.time()
        print_rows(
            ("ID", "NAME", "SANDBOX", "PID", "COMMAND", "SIZE", "AGE", "WHERE"),
            [
                (
                    c.id,
                    c.name or "-",
                    c.sandbox_id,
                    str(c.pid),
                    c.command[:60],
                    f"{c.size_bytes / 1e6:.1f}MB",
                    f"{now - c.created_at:.0f}s",
                    c.location,
                )
                for c in found
            ],
        )


@process_app.command("rm")
def rm(checkpoint: str) -> None:
    """Delete a process checkpoint (id or name), here and in the store."""
    with errors_reported():
        found = [c.id for c in Sandbox.process_checkpoints() if checkpoint in (c.id, c.name)]
        if not found:
            raise SnapshotNotFound(checkpoint)
        for deleted in Sandbox.delete_snapshot(found[-1]):  # the newest of a name
            out.print(f"deleted {deleted}")
