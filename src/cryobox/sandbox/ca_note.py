"""What extra CAs a sandbox's guest was given, noted on the host.

The service gives a guest the host's extra CA certificates (:mod:`cryobox.service.egress`)
and notes their SHA-256 in the sandbox's folder (:data:`GIVEN`). A memory snapshot keeps a
copy beside its files (:data:`SAVED`: this host's note, not stored, not verified, read
before the guest stops), so that a start from it that would give the same ones knows the
guest has them without asking it: a guest's first request after a restore costs tens of
milliseconds under TCG, its code translated anew. A note only spares work: one that cannot
be written is logged, never a failed create or snapshot.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryobox.util import write_atomic

#: In a sandbox's folder.
GIVEN = "guest-ca"
#: Beside a memory snapshot's files.
SAVED = ".guest-ca"
log = logging.getLogger(__name__)


def write_note(path: Path, marker: bytes) -> None:
    """Write the note (atomically, not synced: lost in a crash, the work is done again)."""
    try:
        write_atomic(path, marker, durable=False)
    except OSError as exc:
        log.warning("the note of the guest's CAs was not kept at %s: %s", path, exc)
