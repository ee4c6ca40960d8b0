"""How much a container image's layers unpack to, counted before anything is unpacked.

A layer is a compressed tar archive: a few megabytes can hold terabytes of zeros or
millions of empty files (a decompression bomb). An image comes from a user, maybe over
HTTP from a tenant, so its layers are read first as a stream, their members' sizes and
number added up, and the import is refused once either passes its bound
(``CRYOBOX_MAX_IMAGE_UNPACKED_GIB``, default 32; at most 4 million entries). The work
is bounded too: the reading stops at the member that passes the bound, so a bomb costs
at most about the bound's worth of decompression.
"""

from __future__ import annotations

import gzip
import json
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import zstandard

from cryobox import config
from cryobox.errors import ImageError, InvalidArgument

#: The most a container image's layers may unpack to, in GiB.
MAX_UNPACKED_GIB = 32.0
#: The most files, folders and links they may hold, all layers together.
MAX_ENTRIES = 4_000_000


def max_unpacked_bytes() -> int:
    return int(config.env_number("CRYOBOX_MAX_IMAGE_UNPACKED_GIB", MAX_UNPACKED_GIB) * (1 << 30))


@dataclass(frozen=True)
class Unpacked:
    """What an image's layers hold, all of them together (whiteouts not subtracted)."""

    bytes: int
    entries: int


def check(layout: Path, *, limit: int | None = None, entries: int = MAX_ENTRIES) -> Unpacked:
    """Count what the one image in OCI layout ``layout`` unpacks to.

    :raises InvalidArgument: once its layers pass ``limit`` bytes or ``entries`` entries,
        naming the bound; or for a layer that is not a tar archive.
    """
    limit = max_unpacked_bytes() if limit is None else limit
    total = Unpacked(0, 0)
    for media_type, blob in _layers(layout):
        with _opened(media_type, blob) as stream:
            try:
                with tarfile.open(fileobj=stream, mode="r|") as archive:
                    for member in archive:
                        total = Unpacked(total.bytes + max(member.size, 0), total.entries + 1)
                        if total.bytes > limit:
                            raise InvalidArgument(
                                f"the image's layers unpack to more than {limit / (1 << 30):g} "
                                "GiB (CRYOBOX_MAX_IMAGE_UNPACKED_GIB)"
                            )
                        if total.entries > entries:
                            raise InvalidArgument(
                                f"the image's layers hold more than {entries} files"
                            )
            except (tarfile.TarError, OSError, EOFError, zstandard.ZstdError) as exc:
                raise InvalidArgument(f"a layer of the image is not a tar archive: {exc}") from exc
    return total


def blob_path(layout: Path, digest: str) -> Path:
    """The file of blob ``digest`` (``sha256:HEX``) in OCI layout ``layout``.

    :raises ImageError: for a digest that is not an algorithm and hex digits.
    """
    algorithm, _, hexdigest = digest.partition(":")
    if not hexdigest.isalnum() or not algorithm.isalnum():
        raise ImageError(f"the image names a blob {digest!r}")
    return layout / "blobs" / algorithm / hexdigest


def json_blob(layout: Path, digest: str) -> dict[str, Any]:
    """A JSON object blob of ``layout`` (a manifest, a configuration).

    :raises ImageError: when it is not a JSON object; OSError or ValueError when unreadable.
    """
    value = json.loads(blob_path(layout, digest).read_text())
    if not isinstance(value, dict):
        raise ImageError(f"the image's blob {digest} is not a JSON object")
    return value


def image_manifest(layout: Path) -> dict[str, Any]:
    """The manifest of the one image in ``layout`` (the first its index names).

    :raises ImageError, OSError, ValueError, KeyError, IndexError, TypeError: unreadable.
    """
    index = json.loads((layout / "index.json").read_text())
    return json_blob(layout, index["manifests"][0]["digest"])


def _layers(layout: Path) -> list[tuple[str, Path]]:
    """Each layer's media type and blob file, bottom first."""
    try:
        manifest = image_manifest(layout)
        return [
            (str(layer["mediaType"]), blob_path(layout, layer["digest"]))
            for layer in manifest["layers"]
        ]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ImageError(f"cannot read the image's manifest: {exc!r}") from exc


@contextmanager
def _opened(media_type: str, blob: Path) -> Iterator[IO[bytes]]:
    """The layer's tar stream, decompressed as its media type says."""
    with open(blob, "rb") as raw:
        if media_type.endswith(("+gzip", ".gzip")):
            with gzip.GzipFile(fileobj=raw) as unzipped:
                yield cast(IO[bytes], unzipped)
        elif media_type.endswith(("+zstd", ".zstd")):
            with zstandard.ZstdDecompressor().stream_reader(raw) as unzstd:
                yield unzstd
        else:
            yield raw
