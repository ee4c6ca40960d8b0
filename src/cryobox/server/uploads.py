"""Files a request uploads whole before the server acts on them (a container image
archive for a template build): written to a private folder of the state directory as
they arrive, bounded, and removed when the request is done, whatever happens."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

from cryobox import config
from cryobox.errors import InvalidArgument

#: The largest image archive a server takes, in GiB (``CRYOBOX_MAX_IMAGE_GIB``).
MAX_IMAGE_GIB = 16.0


def max_image_bytes() -> int:
    return int(config.env_number("CRYOBOX_MAX_IMAGE_GIB", MAX_IMAGE_GIB) * (1 << 30))


@contextlib.asynccontextmanager
async def received(body: AsyncIterable[bytes], limit: int, suffix: str) -> AsyncIterator[Path]:
    """The request ``body`` in a file of its own while the block runs.

    :raises InvalidArgument: when the body is larger than ``limit`` bytes (naming it).
    """
    folder = config.state_dir() / "uploads"
    folder.mkdir(mode=0o700, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=folder, suffix=suffix)
    path = Path(name)
    try:
        size = 0
        with os.fdopen(handle, "wb") as file:
            async for data in body:
                size += len(data)
                if size > limit:
                    raise InvalidArgument(
                        f"the upload is larger than {limit >> 20} MiB (CRYOBOX_MAX_IMAGE_GIB)"
                    )
                file.write(data)
        yield path
    finally:
        path.unlink(missing_ok=True)


__all__ = ["MAX_IMAGE_GIB", "max_image_bytes", "received"]
