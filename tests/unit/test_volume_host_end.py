"""The host end of a volume mount, without a VM: what a hostile guest's paths reach, the
size limit, and the HELLO/SYNC handshake that redoes a request cut short."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryobox import config
from cryobox.errors import InvalidArgument
from cryobox.server.database import MIGRATIONS, SqliteDatabase
from cryobox.volume import archive, catalog, read_disk
from cryobox.volume.files import VolumeFiles, usage
from cryobox.volume.mounts import VolumeMount, plan
from cryobox.volume.serve import VolumeEnd, do
from cryobox.volume.wire import (
    ANSWER,
    ATTRIBUTES,
    HELLO_SEQ,
    MAX_DATA,
    NONCE_BYTES,
    ON_DISK,
    READ_DATA_OFFSET,
    READ_DISK_BYTES,
    READ_HEADER,
    READ_ON_DISK,
    READ_SLOT_BYTES,
    REQUEST,
    VolumeOp,
    sync_frame,
)
from waiting import until


@pytest.fixture
def files(tmp_path: Path) -> Iterator[VolumeFiles]:
    root = tmp_path / "volume"
    root.mkdir()
    (tmp_path / "secret").write_text("host only")
    made = VolumeFiles(root, 1 << 20)
    yield made
    made.close()


def test_paths_never_leave_the_volume(files: VolumeFiles, tmp_path: Path) -> None:
    files.symlink("out", "../secret")  # the guest may store any link...
    files.symlink("abs", "/etc")
    files.mkdir("d", 0o755)
    for path in ("../secret", "out", "abs/passwd", "d/../../secret", "/etc/passwd"):
        with pytest.raises(OSError) as caught:
            files.read(path, 0, 100)  # ...and the host never follows one
        assert caught.value.errno in (errno.EXDEV, errno.ELOOP, errno.ENOENT), path
    with pytest.raises(OSError):
        files.create("abs/new", 0, 0o644)  # nor creates through one
    with pytest.raises(OSError):
        files.chmod("out", 0o777)
    assert not (tmp_path / "new").exists()
    assert files.readlink("out") == b"../secret"
    assert (tmp_path / "secret").stat().st_mode & 0o777 != 0o777


def test_modes_are_kept_without_set_uid_and_the_owner_can_always_read(
    files: VolumeFiles,
) -> None:
    old = os.umask(0o077)  # a host umask never narrows what the guest asked for
    try:
        files.create("f", 0, 0o4755)
        files.mkdir("d", 0o1777)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(files.root / "f").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(files.root / "d").st_mode) == 0o1777
    files.chmod("f", 0o000)
    assert stat.S_IMODE(os.stat(files.root / "f").st_mode) == 0o600
    mode = ATTRIBUTES.unpack(files.getattr("f"))[0]
    assert stat.S_ISREG(mode)


def test_the_size_limit_refuses_what_passes_it(files: VolumeFiles) -> None:
    files.create("a", 0, 0o644)
    files.write("a", 0, b"x" * (512 << 10))
    with pytest.raises(OSError) as caught:
        files.write("a", 512 << 10, b"y" * (600 << 10))
    assert caught.value.errno == errno.ENOSPC
    files.unlink("a")  # the estimate is measured again near the limit: space comes back
    files.create("b", 0, 0o644)
    assert files.write("b", 0, b"z" * (900 << 10)) == 900 << 10


def _stop(end: VolumeEnd) -> None:
    """Stop a host end from another thread (it joins its own), waiting at most 10 s."""
    stopper = threading.Thread(target=end.stop)
    stopper.start()
    stopper.join(10)


def _request(op: VolumeOp, seq: int, path: bytes, a: int = 0, b: int = 0, flags: int = 0) -> bytes:
    head = REQUEST.pack(REQUEST.size - 4 + len(path), seq, op, flags, a, b, len(path), 0, 0)
    return head + path


def _answer(sock: socket.socket) -> tuple[int, int, bytes]:
    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            assert chunk, "the host end hung up"
            data += chunk
        return data

    length, seq, error, _ = ANSWER.unpack(exactly(ANSWER.size))
    return seq, error, exactly(length - (ANSWER.size - 4))


def test_a_new_host_end_resynchronises_and_serves(files: VolumeFiles, tmp_path: Path) -> None:
    (files.root / "hello.txt").write_bytes(b"volume bytes")
    path = tmp_path / "port.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    end = VolumeEnd(path, VolumeFiles(files.root, 1 << 20))
    end.start()
    try:
        for _round in range(2):  # the VM replaced (a restore): the end connects again
            guest, _ = listener.accept()
            seq, error, nonce = _answer(guest)
            assert seq == HELLO_SEQ and error == 0 and len(nonce) == NONCE_BYTES
            # A request cut short before the SYNC, then garbage: both dropped.
            guest.sendall(_request(VolumeOp.UNLINK, 7, b"hello.txt")[:20] + b"\xff" * 33)
            guest.sendall(sync_frame(nonce))
            guest.sendall(_request(VolumeOp.READ, 8, b"hello.txt", 0, 100))
            assert _answer(guest) == (8, 0, b"volume bytes")
            guest.sendall(_request(VolumeOp.GETATTR, 9, b"missing"))
            assert _answer(guest)[:2] == (9, -errno.ENOENT)
            guest.close()
        # A frame too big ends the connection, never the host end.
        guest, _ = listener.accept()
        nonce = _answer(guest)[2]
        guest.sendall(sync_frame(nonce) + REQUEST.pack(1 << 30, 1, 2, 0, 0, 0, 0, 0, 0))
        guest.close()
        guest, _ = listener.accept()
        assert _answer(guest)[0] == HELLO_SEQ
        guest.close()
    finally:
        _stop(end)
        listener.close()
    assert (files.root / "hello.txt").exists()


def test_a_host_end_stopped_while_a_change_waits_never_makes_it_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change waits while a volume snapshot holds the volume. A stop then gave up on
    the thread after 5 s and closed the volume's descriptors under it: their numbers,
    taken by the next file this process opened (another sandbox's volume, in a fork's
    shared supervisor), were where the waiting change was made when it went on."""
    root, other = tmp_path / "volume", tmp_path / "another"
    root.mkdir()
    other.mkdir()
    lock = tmp_path / "lock"
    path = tmp_path / "port.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    waits = threading.Event()
    flock = fcntl.flock
    main = threading.current_thread()

    def noted(fd: int, operation: int) -> None:
        if operation != fcntl.LOCK_UN and threading.current_thread() is not main:
            waits.set()  # the end's thread, at the volume's gate or lock
        flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", noted)
    end = VolumeEnd(path, VolumeFiles(root, 1 << 20, lock=lock))
    end.start()
    taken: list[int] = []
    try:
        guest, _ = listener.accept()
        guest.sendall(sync_frame(_answer(guest)[2]))
        with archive.frozen(lock):
            guest.sendall(_request(VolumeOp.MKDIR, 5, b"made", 0o755))
            assert waits.wait(10), "the change never came to the volume's lock"
            end.stop()  # gives up on the thread after 5 s (its socket shut: no answer)
            taken = [os.open(other, os.O_PATH | os.O_DIRECTORY) for _ in range(4)]
        until(lambda: (root / "made").is_dir(), "the change made in its volume", 10)
        guest.close()
    finally:
        _stop(end)
        listener.close()
        for fd in taken:
            os.close(fd)
    assert (root / "made").is_dir()
    assert list(other.iterdir()) == []


def test_mount_plans_keep_slots_and_refuse_what_cannot_work() -> None:
    recorded = (VolumeMount(1, "/data", "old"),)
    table = plan(recorded, {"/data": "new:ro", "/cache": "c"})
    assert table == (VolumeMount(0, "/cache", "c"), VolumeMount(1, "/data", "new", True))
    for bad in ("/", "data", "/proc/x", "/a/../b", "/run"):
        with pytest.raises(InvalidArgument):
            plan((), {bad: "v"})
    with pytest.raises(InvalidArgument, match="nest"):
        plan((), {"/a": "v", "/a/b": "w"})
    with pytest.raises(InvalidArgument, match="at most 4"):
        plan((), {f"/v{i}": "v" for i in range(5)})
    # A running machine's guest keeps its read-only mount: asked read-write, refused
    # (its writes would fail); read-only again, or a machine that boots, is fine.
    saved = (VolumeMount(0, "/results", "results", True),)
    with pytest.raises(InvalidArgument, match="'/results' is mounted read-only"):
        plan(saved, {"/results": "results"}, mounted=True)
    assert plan(saved, {"/results": "other:ro"}, mounted=True)[0].volume == "other"
    assert not plan(saved, {"/results": "results"})[0].read_only


def test_a_database_from_before_volumes_keeps_its_owners(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    raw = sqlite3.connect(path)
    for script in MIGRATIONS[:4]:
        raw.executescript(script)
    raw.execute("PRAGMA user_version=4")
    raw.execute("INSERT INTO tenants VALUES ('tn-1', 'a', 0, 1, 1, 1, 1)")
    raw.execute("INSERT INTO owned VALUES ('template', 'tn-1.t', 'tn-1', 0)")
    raw.commit()
    raw.close()
    db = SqliteDatabase(path)
    assert db.version == len(MIGRATIONS)
    db.execute("INSERT INTO owned VALUES ('volume', 'tn-1.v', 'tn-1', 0)")
    kinds = {r["kind"] for r in db.rows("SELECT kind FROM owned", ())}
    assert kinds == {"template", "volume"}


def test_holes_names_and_links_count_against_the_limit(files: VolumeFiles) -> None:
    """A guest cannot pass the limit by truncating files large then writing into the
    holes, nor by making names, links and link targets (found by a review)."""
    written = 0
    with pytest.raises(OSError) as caught:
        for i in range(20):
            files.create(f"f{i}", 0, 0o644)
            files.truncate(f"f{i}", (1 << 20) - 1)  # a hole: takes no block
            files.write(f"f{i}", 0, b"x" * (256 << 10))
            written += 256 << 10
    assert caught.value.errno == errno.ENOSPC
    assert written <= 1 << 20
    with pytest.raises(OSError) as caught:
        for i in range(1000):
            files.symlink(f"link{i}", "t" * 4000)
    assert caught.value.errno == errno.ENOSPC
    used = usage(files.root)
    assert used is not None and used <= (1 << 20) + 64 * 4096


def test_offsets_past_any_file_are_refused(files: VolumeFiles) -> None:
    files.create("f", 0, 0o644)
    header = (0, 1, VolumeOp.READ, 0, 1 << 63, 10, 1, 0, 0)
    assert do(files, header, b"f") == (-errno.EINVAL, b"")


def test_folders_nested_thousands_deep_are_walked_packed_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "state"))
    record = catalog.create("deep", 1)
    files = record.files()
    try:
        path = ""
        for _ in range(1500):  # past Python's recursion limit
            path = f"{path}/d" if path else "d"
            files.mkdir(path, 0o755)
        files.create(f"{path}/leaf", 0, 0o644)
        files.write(f"{path}/leaf", 0, b"bottom")
        files.create("a", 0, 0o644)
        files.write("a", 0, b"twice")
        files.link("a", "b")  # a second name: stored whole under each
    finally:
        files.close()
    used = usage(record.data())  # walked whole
    assert used is not None and used > 1500 * 4096
    packed = tmp_path / "v.tar"
    try:
        archive.pack(record.data(), packed, 1 << 30)
        restored = catalog.create("copy", 1, fill=lambda into: archive.unpack(packed, into))
        leaf = restored.data() / Path(*(["d"] * 1500)) / "leaf"
        assert leaf.read_bytes() == b"bottom"
        assert (restored.data() / "b").read_bytes() == b"twice"
        catalog.delete("deep")
        catalog.delete("copy")
        assert list(config.volumes_dir().iterdir()) == []
    finally:  # never left for pytest's own cleanup, whose rmtree recursion cannot remove it
        catalog.remove_tree(config.volumes_dir())


def _answer_with_pad(sock: socket.socket) -> tuple[int, int, int, bytes]:
    head = b""
    while len(head) < ANSWER.size:
        chunk = sock.recv(ANSWER.size - len(head))
        assert chunk, "the host end hung up"
        head += chunk
    length, seq, error, pad = ANSWER.unpack(head)
    body = b""
    while len(body) < length - (ANSWER.size - 4):
        body += sock.recv(length - (ANSWER.size - 4) - len(body))
    return seq, error, pad, body


def test_reads_reach_the_guest_through_the_read_disk(files: VolumeFiles, tmp_path: Path) -> None:
    """A READ asked on the disk lands in the mount's slot behind a header naming this
    connection's nonce and the request's seq (what the guest checks); a new machine
    start gets a new, empty disk; without a usable disk the bytes come in the frame."""
    content = os.urandom(MAX_DATA + 5000)
    (files.root / "big").write_bytes(content)
    disk = tmp_path / "reads.raw"
    read_disk.fresh(disk)
    path = tmp_path / "port.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)
    slot = 2
    base = slot * READ_SLOT_BYTES
    end = VolumeEnd(path, VolumeFiles(files.root, 10 << 20), read_disk=(disk, slot))
    end.start()
    try:
        guest, _ = listener.accept()
        nonce = _answer(guest)[2]
        guest.sendall(sync_frame(nonce))
        guest.sendall(_request(VolumeOp.READ, 5, b"big", 3, 1 << 30, flags=READ_ON_DISK))
        seq, error, pad, body = _answer_with_pad(guest)
        assert (seq, error, pad) == (5, 0, ON_DISK)
        length = int.from_bytes(body, "little")
        assert length == MAX_DATA  # at most what one READ carries
        on_disk = disk.read_bytes()
        assert len(on_disk) == READ_DISK_BYTES
        assert READ_HEADER.unpack_from(on_disk, base) == (nonce, 5, 0, length)
        start = base + READ_DATA_OFFSET
        assert on_disk[start : start + length] == content[3 : 3 + length]
        assert on_disk[:base] == bytes(base)  # other mounts' slots untouched
        # An error is an error, in the frame.
        guest.sendall(_request(VolumeOp.READ, 6, b"missing", 0, 10, flags=READ_ON_DISK))
        assert _answer_with_pad(guest)[:3] == (6, -errno.ENOENT, 0)
        # The machine restarted: a new, empty disk (a new inode, made before the new
        # machine listens), a new nonce.
        read_disk.fresh(disk)
        guest.close()
        assert disk.read_bytes() == bytes(READ_DISK_BYTES)
        guest, _ = listener.accept()
        nonce2 = _answer(guest)[2]
        assert nonce2 != nonce
        guest.sendall(sync_frame(nonce2))
        guest.sendall(_request(VolumeOp.READ, 5, b"big", 0, 10, flags=READ_ON_DISK))
        assert _answer_with_pad(guest)[:3] == (5, 0, ON_DISK)
        assert READ_HEADER.unpack_from(disk.read_bytes(), base) == (nonce2, 5, 0, 10)
        # A disk that is not one cryobox made (the wrong size): the frame carries it.
        disk.unlink()
        disk.write_bytes(b"\0" * 4096)
        guest.close()
        guest, _ = listener.accept()
        nonce3 = _answer(guest)[2]
        guest.sendall(sync_frame(nonce3))
        guest.sendall(_request(VolumeOp.READ, 9, b"big", 0, 10, flags=READ_ON_DISK))
        assert _answer_with_pad(guest) == (9, 0, 0, content[:10])
        assert disk.read_bytes() == b"\0" * 4096
        guest.close()
    finally:
        _stop(end)
        listener.close()
