"""A container image's layers are counted before they are unpacked: a decompression
bomb (a small layer that unpacks to far more, in bytes or in files) is refused by name,
and reading it stops at the bound (cryobox.image.layers)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import zstandard

from cryobox.errors import InvalidArgument
from cryobox.image import layers

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
TAR = "application/vnd.oci.image.layer.v1.tar"


def _tar(files: dict[str, int]) -> bytes:
    """A tar archive of files of zeros, by name and size."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for name, size in files.items():
            member = tarfile.TarInfo(name)
            member.size = size
            archive.addfile(member, io.BytesIO(bytes(size)))
    return out.getvalue()


def _blob(layout: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


def _layout(tmp_path: Path, layer_blobs: list[tuple[str, bytes]]) -> Path:
    layout = tmp_path / "layout"
    layout.mkdir()
    manifest = {
        "schemaVersion": 2,
        "config": {"digest": _blob(layout, b"{}"), "mediaType": "application/json"},
        "layers": [
            {"mediaType": kind, "digest": _blob(layout, data)} for kind, data in layer_blobs
        ],
    }
    index = {"manifests": [{"digest": _blob(layout, json.dumps(manifest).encode())}]}
    (layout / "index.json").write_text(json.dumps(index))
    return layout


def test_layers_in_each_compression_are_counted_whole(tmp_path: Path) -> None:
    layout = _layout(
        tmp_path,
        [
            (GZIP, gzip.compress(_tar({"a": 1000, "b": 24}))),
            (ZSTD, zstandard.ZstdCompressor().compress(_tar({"c": 3000}))),
            (TAR, _tar({"d": 0})),
        ],
    )
    assert layers.check(layout, limit=1 << 20) == layers.Unpacked(4024, 4)


def test_a_bomb_is_refused_by_name_before_it_is_read_whole(tmp_path: Path) -> None:
    bomb = gzip.compress(_tar({"zeros": 256 << 20}), compresslevel=9)
    assert len(bomb) < (1 << 20)  # a quarter of a GiB in well under a MiB
    layout = _layout(tmp_path, [(GZIP, bomb)])
    with pytest.raises(
        InvalidArgument,
        match=r"unpack to more than 0.015625 GiB \(CRYOBOX_MAX_IMAGE_UNPACKED_GIB\)",
    ):
        layers.check(layout, limit=16 << 20)  # at the member's header, its data unread


def test_too_many_files_are_refused(tmp_path: Path) -> None:
    layout = _layout(tmp_path, [(GZIP, gzip.compress(_tar({f"f{i}": 0 for i in range(50)})))])
    with pytest.raises(InvalidArgument, match="more than 20 files"):
        layers.check(layout, entries=20)


def test_a_layer_that_is_not_a_tar_archive_is_refused(tmp_path: Path) -> None:
    layout = _layout(tmp_path, [(GZIP, gzip.compress(b"not a tar archive at all" * 100))])
    with pytest.raises(InvalidArgument, match="not a tar archive"):
        layers.check(layout)


def test_the_bound_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRYOBOX_MAX_IMAGE_UNPACKED_GIB", "0.5")
    assert layers.max_unpacked_bytes() == 1 << 29
