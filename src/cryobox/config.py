"""Where cryobox keeps things, and its defaults. Overridable by environment variables.

- ``CRYOBOX_CACHE_DIR``: built guest images (expensive, keyed by content), default
  the user's cache directory.
- ``CRYOBOX_STATE_DIR``: running sandboxes (disks, memory files, sockets, logs),
  default the user's data directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

DEFAULT_CPUS = 2
DEFAULT_MEMORY_MIB = 1024
DEFAULT_DISK_GIB = 4
#: Seconds a sandbox lives unless extended; the countdown restarts on extension.
DEFAULT_TIMEOUT = 300.0
MAX_CPUS = 64
MIN_MEMORY_MIB = 128
MAX_MEMORY_MIB = 64 * 1024
#: The image's filesystem is 2 GiB; a larger disk is grown into at boot.
MIN_DISK_GIB = 2
MAX_DISK_GIB = 1024


def cache_dir() -> Path:
    path = Path(os.environ.get("CRYOBOX_CACHE_DIR") or platformdirs.user_cache_dir("cryobox"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_dir() -> Path:
    path = Path(os.environ.get("CRYOBOX_STATE_DIR") or platformdirs.user_data_dir("cryobox"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sandboxes_dir() -> Path:
    path = state_dir() / "sandboxes"
    path.mkdir(parents=True, exist_ok=True)
    return path
