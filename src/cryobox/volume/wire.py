"""The frames between a guest's volume mount (``guest/volume.c``) and its host end.

One request by path, one answer; both little-endian. Keep in step with volume.c.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator


class VolumeOp(enum.IntEnum):
    SYNC = 1
    GETATTR = 2
    READDIR = 3
    READ = 4
    WRITE = 5
    CREATE = 6
    OPEN = 7
    TRUNCATE = 8
    UNLINK = 9
    MKDIR = 10
    RMDIR = 11
    RENAME = 12
    SYMLINK = 13
    READLINK = 14
    CHMOD = 15
    UTIMENS = 16
    STATFS = 17
    FSYNC = 18
    LINK = 19


#: length (of what follows it), seq, op, flags, a, b, path length, path2 length, pad.
REQUEST = struct.Struct("<IIIIQQHHI")
#: length (of what follows it), seq, error (0 or -errno), pad.
ANSWER = struct.Struct("<IIiI")
#: mode, nlink, size, blocks, atime, mtime, ctime (ns).
ATTRIBUTES = struct.Struct("<QQQQqqq")
#: blocks, free blocks, files, free files (blocks of 4 KiB).
STATFS = struct.Struct("<QQQQ")
#: Each entry of a READDIR answer: mode, name length (then the name).
DIRENT = struct.Struct("<IH")
#: The seq of the host's HELLO (its body: a nonce the guest's SYNC repeats).
HELLO_SEQ = 0xFFFFFFFF
NONCE_BYTES = 16
#: The most a WRITE carries and a READ asks for (the guest's max_write: 1 MiB).
MAX_DATA = 1 << 20
MAX_PATH = 4095
#: The largest request the host accepts; a bigger one ends the connection.
MAX_REQUEST = REQUEST.size + 2 * MAX_PATH + MAX_DATA
#: An answer's body at most (a READDIR of a big folder): the guest's buffer.
MAX_ANSWER = 16 << 20
#: A READ's flag: answer through the read disk (below) rather than in the answer frame.
READ_ON_DISK = 1
#: An answer's pad field when its bytes are on the read disk (its body: their length).
ON_DISK = 1

#: The read disk: a raw disk every machine has (read-only for the guest), a slot per
#: mount, each a header then up to MAX_DATA bytes. The host writes a READ's bytes into
#: its slot, then the header naming the connection's nonce, the request's seq and the
#: length; the guest reads the slot with O_DIRECT and takes the bytes only when all
#: three match (a restored machine's read disk is a new, empty file).
READ_DISK_BYTES = 8 << 20
READ_SLOT_BYTES = 2 << 20
READ_DATA_OFFSET = 4096
#: The serial number the guest finds it by (``/sys/block/*/serial``).
READ_DISK_SERIAL = "cryobox-volumes"
#: nonce, seq, pad, length.
READ_HEADER = struct.Struct("<16sIIQ")
#: Time values the guest sends for "leave as is" (UTIME_OMIT).
OMIT_NS = -(1 << 63)
BLOCK = 4096


def sync_frame(nonce: bytes) -> bytes:
    """The exact bytes of the guest's SYNC answering a HELLO with ``nonce``."""
    return REQUEST.pack(REQUEST.size - 4 + len(nonce), 0, VolumeOp.SYNC, 0, 0, 0, 0, 0, 0) + nonce


def hello_frame(nonce: bytes) -> bytes:
    return ANSWER.pack(ANSWER.size - 4 + len(nonce), HELLO_SEQ, 0, 0) + nonce


def answer_frame(seq: int, error: int, body: bytes = b"", pad: int = 0) -> bytes:
    return ANSWER.pack(ANSWER.size - 4 + len(body), seq, error, pad) + body


def dir_entries(raw: bytes) -> Iterator[tuple[int, str]]:
    """The (mode, name) pairs of a READDIR answer."""
    at = 0
    while at < len(raw):
        mode, length = DIRENT.unpack_from(raw, at)
        at += DIRENT.size
        yield mode, raw[at : at + length].decode(errors="surrogateescape")
        at += length
