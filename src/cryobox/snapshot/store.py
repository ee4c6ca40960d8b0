"""Where saved snapshots live on this host, and the names that point at them.

``snapshots/ID/`` holds each saved snapshot, checkpoint or template snapshot;
``snapshots/.tmp-ID/`` is one being written (never read, removed by :func:`sweep`).
``templates/NAME.json`` names the snapshot a template starts from.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from cryobox import config
from cryobox.errors import InvalidArgument, SnapshotError, SnapshotNotFound
from cryobox.snapshot import manifest as mf
from cryobox.snapshot.manifest import Manifest
from cryobox.util import write_json_atomic

TEMP_PREFIX = ".tmp-"


def snapshots_dir() -> Path:
    path = config.state_dir() / "snapshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


def templates_dir() -> Path:
    path = config.state_dir() / "templates"
    path.mkdir(parents=True, exist_ok=True)
    return path


def temp_folder(snapshot_id: str) -> Path:
    folder = snapshots_dir() / f"{TEMP_PREFIX}{snapshot_id}"
    folder.mkdir()
    return folder


def all_snapshots() -> list[tuple[Path, Manifest]]:
    """Every complete snapshot, oldest first."""
    found = []
    for folder in snapshots_dir().iterdir():
        if folder.name.startswith("."):
            continue
        with contextlib.suppress(SnapshotError):
            found.append((folder, mf.load(folder)))
    found.sort(key=lambda pair: pair[1].created_at)
    return found


def find(ref: str) -> tuple[Path, Manifest]:
    """A snapshot by id or by name (the newest of that name).

    :raises SnapshotNotFound:
    """
    if ref and "/" not in ref and not ref.startswith("."):
        folder = snapshots_dir() / ref
        if (folder / mf.MANIFEST).exists():
            return folder, mf.load(folder)
    named = [pair for pair in all_snapshots() if pair[1].name == ref]
    if not named:
        raise SnapshotNotFound(ref)
    return named[-1]


def dependents(snapshot_id: str) -> list[str]:
    """Snapshots whose disk chain goes through this one's disk."""
    disk = str(snapshots_dir() / snapshot_id / mf.DISK)
    return [m.id for _, m in all_snapshots() if m.id != snapshot_id and disk in m.disk_chain]


def delete(ref: str, *, sandbox_disks: list[str] | None = None) -> None:
    """Delete a snapshot unless another snapshot or a sandbox still builds on its disk.

    :raises InvalidArgument: naming what depends on it.
    """
    folder, manifest = find(ref)
    users = dependents(manifest.id)
    disk = str(folder / mf.DISK)
    users += [f"sandbox disk {d}" for d in (sandbox_disks or []) if d == disk]
    if users:
        raise InvalidArgument(
            f"snapshot {manifest.id} is the base of {', '.join(users)}; delete those first"
        )
    shutil.rmtree(folder)


def sweep() -> None:
    """Remove folders of snapshots whose writer died before finishing them."""
    for folder in snapshots_dir().glob(f"{TEMP_PREFIX}*"):
        with contextlib.suppress(OSError):
            if time.time() - folder.stat().st_mtime > 600:
                shutil.rmtree(folder)


def set_template(name: str, snapshot_id: str, info: dict[str, Any]) -> None:
    write_json_atomic(
        templates_dir() / f"{name}.json", {"name": name, "snapshot": snapshot_id, **info}
    )


def template(name: str) -> dict[str, Any] | None:
    """The template record, or None if no template has that name."""
    if not name or "/" in name or name.startswith("."):
        return None
    try:
        value: dict[str, Any] = json.loads((templates_dir() / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return value


def list_templates() -> list[dict[str, Any]]:
    found = []
    for path in sorted(templates_dir().glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return found
