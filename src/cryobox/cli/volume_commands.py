"""``cryobox volume``: named volumes (``create``, ``ls``, ``rm``, ``cp``, ``du``).

Through the SDK, so they act on this host's volumes, or a server's with
``CRYOBOX_API_URL``. ``cp`` copies a file between this machine and a volume, mounted or
not: ``cryobox volume cp results:/out/report.csv .`` or ``cryobox volume cp data.csv
results:/in/``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from cryobox.client import Volume
from cryobox.errors import InvalidArgument

from .output import errors_reported, out, print_rows

volume_app = typer.Typer(
    no_args_is_help=True,
    help="Named volumes: files that outlive sandboxes, shared live between them.",
)

#: What ``cp`` reads and writes at once.
PIECE = 1 << 20


def _size(value: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024  # type: ignore[assignment]
    return str(value)


@volume_app.command("create")
def create(
    name: str,
    size_gib: Annotated[
        int | None, typer.Option("--size-gib", help="The most its files may hold (default 10).")
    ] = None,
) -> None:
    """Make an empty volume."""
    with errors_reported():
        volume = Volume.create(name, size_gib=size_gib)
        out.print(f"volume {volume.name}: {volume.info().size_gib} GiB")


@volume_app.command("snapshot")
def snapshot(
    name: str,
    snapshot_name: Annotated[
        str | None, typer.Option("--name", help="A name to find the snapshot by.")
    ] = None,
) -> None:
    """Save a volume's files at this instant (into the store too); prints the snapshot id."""
    with errors_reported():
        saved = Volume.get(name).snapshot(snapshot_name)
        out.print(saved.id)


@volume_app.command("restore")
def restore(
    snapshot: str,
    name: str,
    size_gib: Annotated[
        int | None, typer.Option("--size-gib", help="Default: the saved volume's.")
    ] = None,
) -> None:
    """Make volume NAME from a volume snapshot (its id or name)."""
    with errors_reported():
        Volume.create(name, size_gib=size_gib, from_snapshot=snapshot)
        out.print(f"volume {name} restored from {snapshot}")


@volume_app.command("ls")
def ls(as_json: Annotated[bool, typer.Option("--json", help="As JSON.")] = False) -> None:
    """List volumes: size, use, and the sandboxes that mount each."""
    with errors_reported():
        volumes = Volume.list()
        if as_json:
            print(json.dumps([v.__dict__ for v in volumes], indent=2, default=list))
            return
        now = time.time()
        print_rows(
            ("NAME", "SIZE", "USED", "AGE", "MOUNTED BY"),
            [
                (
                    v.name,
                    f"{v.size_gib}GiB",
                    _size(v.used_bytes),
                    f"{now - v.created_at:.0f}s",
                    ",".join(v.mounted_by) or "-",
                )
                for v in volumes
            ],
        )


@volume_app.command("du")
def du(name: str) -> None:
    """Bytes a volume's files take, against its size."""
    with errors_reported():
        info = Volume.get(name).info()
        out.print(f"{name}: {_size(info.used_bytes)} of {info.size_gib} GiB")


@volume_app.command("rm")
def rm(names: list[str]) -> None:
    """Delete volumes and their files (refused while a sandbox mounts one, paused ones too)."""
    with errors_reported():
        for name in names:
            Volume.delete(name)
            out.print(f"removed volume {name}")


def _in_volume(spec: str) -> tuple[str, str] | None:
    """``NAME:/path`` as (name, path); None for a path on this machine."""
    name, colon, path = spec.partition(":")
    if not colon or "/" in name or not name:
        return None
    return name, path or "/"


@volume_app.command("cp")
def cp(source: str, target: str) -> None:
    """Copy one file between this machine and a volume (``NAME:/path``, either side)."""
    with errors_reported():
        src, dst = _in_volume(source), _in_volume(target)
        if (src is None) == (dst is None):
            raise InvalidArgument(
                "cp copies between this machine and a volume: one side is NAME:/path"
            )
        if dst is not None:
            name, path = dst
            local = Path(source)
            if path.endswith("/"):
                path += local.name
            with local.open("rb") as file:
                Volume.get(name).write_file(path, iter(lambda: file.read(PIECE), b""))
            out.print(f"{source} -> {name}:{path}")
            return
        assert src is not None
        name, path = src
        local = Path(target)
        if local.is_dir():
            local = local / os.path.basename(path)
        local.write_bytes(Volume.get(name).read_file(path))
        out.print(f"{name}:{path} -> {local}")
