"""The official ``e2b`` SDK (pinned in the dev dependencies), unchanged, against a real
``cryobox server`` and real VMs: only ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and
``E2B_API_KEY`` point it here. Each test is a scenario a user of E2B would run, and
asserts what that user would check."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_server import ApiServer
from cryobox.sandbox import registry
from waiting import until

pytestmark = pytest.mark.vm

e2b = pytest.importorskip("e2b")


@pytest.fixture(autouse=True)
def pointed_at_cryobox(api_server: ApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_API_URL", f"{api_server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{api_server.url}/e2b")
    monkeypatch.setenv("E2B_API_KEY", api_server.key)
    monkeypatch.delenv("E2B_DEBUG", raising=False)


@pytest.fixture(scope="module")
def sbx(api_server: ApiServer) -> Iterator[Any]:
    """One sandbox for the read-mostly scenarios, made the E2B way."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("E2B_API_URL", f"{api_server.url}/e2b")
        patch.setenv("E2B_SANDBOX_URL", f"{api_server.url}/e2b")
        patch.setenv("E2B_API_KEY", api_server.key)
        sandbox = e2b.Sandbox.create(
            envs={"FROM_CREATE": "everywhere"}, metadata={"suite": "compat"}
        )
        yield sandbox
        sandbox.kill()


def test_commands_run_stream_and_fail_like_e2b(sbx: Any) -> None:
    result = sbx.commands.run("echo $FROM_CREATE; whoami; pwd")
    assert result.exit_code == 0
    assert result.stdout.split() == ["everywhere", "user", "/home/user"]
    seen: list[str] = []
    streamed = sbx.commands.run(
        "echo one; sleep 1; echo two; echo err >&2", on_stdout=seen.append, on_stderr=seen.append
    )
    assert streamed.stdout == "one\ntwo\n" and streamed.stderr == "err\n"
    assert seen[0] == "one\n" and "two\n" in seen
    with pytest.raises(e2b.CommandExitException) as failed:
        sbx.commands.run("echo bad >&2; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stderr == "bad\n"
    assert sbx.commands.run("echo $A", envs={"A": "scoped"}).stdout == "scoped\n"
    assert sbx.commands.run("echo ${A:-unset}").stdout == "unset\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    with pytest.raises(e2b.TimeoutException):
        sbx.commands.run("sleep 30", timeout=2)


def test_create_envs_go_sealed_with_the_sandbox_never_into_the_database(
    sbx: Any, api_server: ApiServer
) -> None:
    with sqlite3.connect(api_server.database) as db:
        rows = db.execute("SELECT sandbox_id, envs FROM e2b_sandboxes").fetchall()
    assert rows and all(envs == "{}" for _, envs in rows), rows
    spec = registry.find(sbx.sandbox_id).spec_file.read_text()
    assert "everywhere" not in spec and "envs_sealed" in spec


def test_background_handles_stdin_kill_and_list(sbx: Any) -> None:
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "fed through the handle\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "fed through the handle\n"
    sleeper = sbx.commands.run("sleep 300", background=True, timeout=0)
    assert sleeper.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(e2b.CommandExitException):
        sleeper.wait()
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]


def test_a_command_whose_sandbox_is_killed_ends_saying_so_like_e2b() -> None:
    """The command's stream is dropped, as E2B's edge drops it when the sandbox dies;
    the SDK asks whether the sandbox still runs and says it was killed."""
    sandbox = e2b.Sandbox.create()
    during = sandbox.commands.run("sleep 60", background=True)
    sandbox.kill()
    with pytest.raises(e2b.TimeoutException, match="sandbox was killed or reached its end"):
        during.wait()


def test_files_like_e2b(sbx: Any) -> None:
    info = sbx.files.write("project/src/main.py", "print('hi')\n")  # parents are made
    assert info.path == "/home/user/project/src/main.py"
    assert sbx.files.read("project/src/main.py") == "print('hi')\n"
    payload = bytes(range(256)) * 1000
    sbx.files.write("/tmp/blob.bin", payload)
    assert bytes(sbx.files.read("/tmp/blob.bin", format="bytes")) == payload
    assert sbx.commands.run("python3 project/src/main.py").stdout == "hi\n"
    assert sbx.files.exists("project/src") and not sbx.files.exists("nope")
    assert sbx.files.make_dir("project/docs") is True
    assert sbx.files.make_dir("project/docs") is False  # already there
    names = [e.name for e in sbx.files.list("project")]
    assert names == ["docs", "src"]
    deep = [e.path for e in sbx.files.list("project", depth=2)]
    assert "/home/user/project/src/main.py" in deep
    stat = sbx.files.get_info("project/src/main.py")
    assert stat.type == e2b.FileType.FILE and stat.size == 12 and stat.owner == "user"
    moved = sbx.files.rename("project/src/main.py", "project/src/app.py")
    assert moved.path == "/home/user/project/src/app.py"
    sbx.files.remove("project")
    assert not sbx.files.exists("project")
    sbx.files.remove("project")  # removing what is gone succeeds
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.read("project/src/app.py")


def test_info_timeout_and_list_by_metadata(sbx: Any, api_server: ApiServer) -> None:
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"suite": "compat"}
    sbx.set_timeout(900)
    assert (sbx.get_info().end_at.timestamp() - time.time()) > 800
    listed = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "compat"})).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
    none = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "other"})).next_items()
    assert none == []
    assert sbx.is_running()


def test_pause_then_connect_keeps_every_process_running() -> None:
    sandbox = e2b.Sandbox.create()
    try:
        counter = sandbox.commands.run(
            # written to a new name and renamed, so a read never sees a half-written count
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; "
            "mv /tmp/count.new /tmp/count; sleep 0.2; done",
            background=True,
            timeout=0,
        )
        time.sleep(1)
        assert sandbox.pause() is True
        assert not sandbox.is_running()
        with pytest.raises(e2b.SandboxException):
            sandbox.commands.run("true")
        back = e2b.Sandbox.connect(sandbox.sandbox_id)
        assert back.is_running()
        first = int(back.files.read("/tmp/count"))
        time.sleep(1)
        assert int(back.files.read("/tmp/count")) > first  # the same loop, still counting
        assert counter.pid in [p.pid for p in back.commands.list()]
        # A command started before the pause can be connected to (E2B's suite does):
        # its output stayed with the channel the pause ended, so the handle gets its
        # end once it is gone, saying its exit status was not kept.
        handle = back.commands.connect(counter.pid)
        assert handle.pid == counter.pid
        back.commands.kill(counter.pid)
        with pytest.raises(e2b.CommandExitException) as ended:
            handle.wait()
        assert "not kept across the pause" in (ended.value.error or "")
    finally:
        sandbox.kill()
    assert e2b.Sandbox.kill(sandbox.sandbox_id) is False  # already gone


def _boot_id(sandbox: Any) -> str:
    return str(sandbox.files.read("/proc/sys/kernel/random/boot_id")).strip()


def test_lifecycle_on_timeout_pause_and_auto_resume() -> None:
    """E2B's lifecycle: a timeout pauses the whole machine (the same boot, the same
    process) when asked; ``auto_resume`` wakes it on its next envd request, without it
    only ``connect`` does; a filesystem-only pause is refused by name."""
    states = e2b.SandboxState
    booted: dict[str, str] = {}
    made: list[Any] = []
    try:
        # Made last to first, the process started at once: each is paused by its own
        # timeout (30 s) only after the test has read what it needs (TCG is slow).
        for lifecycle in (
            {"on_timeout": {"action": "pause", "keep_memory": None}},
            {"on_timeout": "pause", "auto_resume": True},
            {"on_timeout": "pause"},
        ):
            sandbox = e2b.Sandbox.create(timeout=30, lifecycle=lifecycle, request_timeout=300)
            made.insert(0, sandbox)
            booted[sandbox.sandbox_id] = _boot_id(sandbox)
        paused, waking, forced = made
        paused.commands.run("sleep 4321", background=True, timeout=0)
        forced.set_timeout(0)  # E2B's way to force the timeout's pause now
        until(
            lambda: all(s.get_info().state == states.PAUSED for s in made),
            "three timeout pauses",
            timeout=240,
            every=0.5,
        )
        assert not paused.is_running()  # no auto_resume: the request does not wake it
        assert paused.get_info().state == states.PAUSED
        assert paused.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        assert waking.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        # auto_resume: its next envd request wakes it, the same machine.
        assert _boot_id(waking) == booted[waking.sandbox_id]
        assert waking.get_info().state == states.RUNNING
        for sandbox in (paused, forced):
            back = sandbox.connect()
            assert back.get_info().state == states.RUNNING
            assert _boot_id(back) == booted[sandbox.sandbox_id]  # restored, not rebooted
        assert "4321" in paused.commands.run("pgrep -a sleep || true").stdout
    finally:
        for sandbox in made:
            sandbox.kill()


def test_filesystem_only_pauses_keep_files_and_boot_again() -> None:
    """E2B's ``pause(keep_memory=False)`` and a filesystem-only timeout pause keep the
    files and boot the sandbox again on ``connect`` (a new boot id)."""
    asked = e2b.Sandbox.create(timeout=600, request_timeout=300)
    timed = e2b.Sandbox.create(
        timeout=30,
        lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}},
        request_timeout=300,
    )
    try:
        booted = {}
        for sandbox in (asked, timed):
            sandbox.files.write("/home/user/marker.txt", sandbox.sandbox_id)
            booted[sandbox.sandbox_id] = _boot_id(sandbox)
        assert asked.pause(keep_memory=False)
        until(
            lambda: timed.get_info().state == e2b.SandboxState.PAUSED,
            "the filesystem-only timeout pause",
            timeout=120,
            every=0.5,
        )
        for sandbox in (asked, timed):
            back = sandbox.connect()
            assert back.files.read("/home/user/marker.txt") == sandbox.sandbox_id
            assert _boot_id(back) != booted[sandbox.sandbox_id]  # booted again
    finally:
        asked.kill()
        timed.kill()


def test_another_tenants_key_cannot_reach_the_sandbox(sbx: Any, api_server: ApiServer) -> None:
    other = api_server.tenant("e2b-intruder")
    with pytest.raises(e2b.SandboxNotFoundException):
        e2b.Sandbox.connect(sbx.sandbox_id, api_key=other)
    assert e2b.Sandbox.kill(sbx.sandbox_id, api_key=other) is False
    listed = e2b.Sandbox.list(api_key=other).next_items()
    assert sbx.sandbox_id not in [s.sandbox_id for s in listed]
    assert sbx.is_running()


def test_watch_dir_reports_changes(sbx: Any) -> None:
    sbx.files.make_dir("watched/deeper")
    handle = sbx.files.watch_dir("watched", recursive=True, include_entry=True)
    sbx.files.write("watched/new.txt", "first")
    sbx.files.write("watched/new.txt", "second")
    sbx.commands.run("touch watched/deeper/inner.txt && rm watched/new.txt")
    seen = [(event.type, event.name) for event in handle.get_new_events()]
    handle.stop()
    kinds = e2b.FilesystemEventType
    assert (kinds.CREATE, "new.txt") in seen and seen.count((kinds.WRITE, "new.txt")) >= 2
    assert (kinds.CREATE, "deeper/inner.txt") in seen and (kinds.REMOVE, "new.txt") in seen
    assert not any(".cryobox-" in name for _, name in seen)  # upload temporaries hidden
    with pytest.raises(e2b.FileNotFoundException):
        sbx.files.watch_dir("no-such-folder")


def test_a_pty_takes_keys_resizes_reconnects_and_dies_like_e2b(sbx: Any) -> None:
    """E2B's terminals map onto cryobox's: input typed in, a resize the shell sees,
    a second connection that gets the output, and kill."""
    seen, also = bytearray(), bytearray()
    ended: list[BaseException] = []

    def follow(handle: Any, into: bytearray) -> threading.Thread:
        def wait() -> None:
            try:
                handle.wait(on_pty=into.extend)
            except e2b.CommandExitException as exc:  # how a killed terminal ends
                ended.append(exc)

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        return thread

    terminal = sbx.pty.create(e2b.PtySize(rows=24, cols=80), envs={"WHO": "e2b"})
    waiting = follow(terminal, seen)
    sbx.pty.send_stdin(terminal.pid, b"stty size; echo hi-$WHO-$((2+3))\n")
    until(lambda: b"hi-e2b-5" in seen and b"24 80" in seen, "the terminal's answer")
    sbx.pty.resize(terminal.pid, e2b.PtySize(rows=30, cols=100))
    again = follow(sbx.pty.connect(terminal.pid), also)
    sbx.pty.send_stdin(terminal.pid, b"stty size\n")
    until(lambda: b"30 100" in seen and b"30 100" in also, "the new size, on both connections")
    assert sbx.pty.kill(terminal.pid)
    waiting.join(30)
    again.join(30)
    assert not waiting.is_alive() and not again.is_alive()
    assert len(ended) == 2 and all(exc.exit_code == -1 for exc in ended)  # type: ignore[attr-defined]
    with pytest.raises(e2b.SandboxException, match="no terminal"):
        handle = sbx.commands.run("sleep 30", background=True)
        try:
            sbx.pty.resize(handle.pid, e2b.PtySize(rows=10, cols=10))
        finally:
            handle.kill()


def test_file_metadata_is_kept_as_envd_keeps_it(sbx: Any) -> None:
    """``user.e2b.*`` extended attributes on the guest file: written with the file,
    shown by get_info and list, kept by a rename, gone when the file is replaced."""
    info = sbx.files.write("meta/a.txt", "one", metadata={"Author": "ada", "stage": "draft"})
    assert info.metadata == {"author": "ada", "stage": "draft"}  # keys lowercased
    assert sbx.files.get_info("meta/a.txt").metadata == {"author": "ada", "stage": "draft"}
    [listed] = [e for e in sbx.files.list("meta") if e.name == "a.txt"]
    assert listed.metadata == {"author": "ada", "stage": "draft"}
    stored = sbx.commands.run(
        'getfattr -d meta/a.txt 2>/dev/null || python3 -c "import os;'
        " print(os.getxattr('meta/a.txt', 'user.e2b.author'))\""
    )
    assert "ada" in stored.stdout
    assert sbx.files.rename("meta/a.txt", "meta/b.txt").metadata == {
        "author": "ada",
        "stage": "draft",
    }
    assert sbx.files.write("meta/b.txt", "two").metadata is None
    assert sbx.files.get_info("meta/b.txt").metadata is None


def test_metrics_are_sampled_in_the_guest_and_kept_as_a_series(sbx: Any) -> None:
    first = sbx.get_metrics()
    assert first, "no sample"
    sample = first[-1]
    assert sample.cpu_count == 2 and 0 <= sample.cpu_used_pct <= 100
    assert 0 < sample.mem_used < sample.mem_total <= 1024 * 1024 * 1024
    assert 0 < sample.disk_used < sample.disk_total
    second = sbx.get_metrics()
    assert len(second) == len(first) + 1  # one more sample, the earlier ones kept
    long_ago = sample.timestamp - datetime.timedelta(hours=2)
    assert sbx.get_metrics(start=long_ago, end=long_ago + datetime.timedelta(minutes=5)) == []


def test_signed_file_urls_work_until_they_expire_or_are_altered(sbx: Any) -> None:
    """``download_url``/``upload_url``: plain HTTP with no headers, the sandbox found by
    the signature alone; an altered or expired URL is a 401."""
    sbx.files.write("signed.txt", "signed content")
    url = sbx.download_url("signed.txt", "user", 120)
    assert httpx.get(url).text == "signed content"
    altered = url.replace("signed.txt", "other.txt")
    refused = httpx.get(altered)
    assert refused.status_code == 401 and "not valid" in refused.json()["message"]
    expired = httpx.get(sbx.download_url("signed.txt", "user", use_signature_expiration=-5))
    assert expired.json() == {"code": 401, "message": "signature is already expired"}
    upload = sbx.upload_url("uploaded.txt", "user")
    sent = httpx.post(upload, files={"file": ("uploaded.txt", b"sent by url")})
    assert sent.status_code == 200, sent.text
    assert sbx.files.read("uploaded.txt") == "sent by url"
    # A form field with no file name is the file's text, as envd takes it (E2B's JS
    # suite posts one); the answer is envd's entry, with no metadata when there is none.
    field = httpx.post(sbx.upload_url("field.txt", "user"), files={"file": (None, b"a text field")})
    assert field.json() == [{"name": "field.txt", "path": "/home/user/field.txt", "type": "file"}]
    assert sbx.files.read("field.txt") == "a text field"
    # A read signature does not write.
    wrong = httpx.post(url, files={"file": ("signed.txt", b"overwritten")})
    assert wrong.status_code == 401 and sbx.files.read("signed.txt") == "signed content"


#: A web server for the guest, with the standard library only: a 5 MB answer, a digest
#: of what is posted, and a WebSocket that echoes text frames (handshake by hand).
GUEST_SERVER = r"""
import base64, hashlib, http.server, sys

BIG = bytes(range(256)) * 20480
MAGIC = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.websocket()
        self.answer(200, BIG if self.path.startswith("/big") else self.headers["Host"].encode())

    def do_POST(self):
        data = self.rfile.read(int(self.headers["Content-Length"]))
        self.answer(200, hashlib.sha256(data).hexdigest().encode())

    def websocket(self):
        key = self.headers["Sec-WebSocket-Key"] + MAGIC
        accept = base64.b64encode(hashlib.sha1(key.encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            if len(head) < 2 or head[0] & 0x0F == 8:
                return
            size = head[1] & 0x7F
            if size == 126:
                size = int.from_bytes(self.rfile.read(2), "big")
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(size)))
            reply = b"echo " + data
            self.wfile.write(bytes([0x81, len(reply)]) + reply)
            self.wfile.flush()

http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
"""


def test_ports_by_host_name_wake_a_sandbox_like_e2b(api_server: ApiServer) -> None:
    """``get_host(port)``: ``PORT-ID.DOMAIN`` (the server's ``--domain``, here
    ``localhost:PORT``, reached with a Host header as a wildcard DNS name would): the
    guest's server answers, bodies stream both ways past the API's body limit, a
    WebSocket is relayed, and a request wakes an ``auto_resume`` sandbox its pause
    stopped; one without it is refused (502, as E2B's edge answers). A private one
    (``allow_public_traffic=False``) needs its traffic token, and its guest sees the
    masked host name."""
    from websockets.sync.client import connect

    waking = e2b.Sandbox.create(timeout=600, lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = e2b.Sandbox.create(
        timeout=600,
        secure=True,
        network=e2b.SandboxNetworkOpts(
            allow_public_traffic=False, mask_request_host="custom-host.example.com:${PORT}"
        ),
    )
    try:
        for sandbox in (waking, plain):
            sandbox.files.write("/tmp/serve.py", GUEST_SERVER)
            sandbox.commands.run("python3 /tmp/serve.py 8000", background=True, timeout=0)
        host = waking.get_host(8000)
        assert host == f"8000-{waking.sandbox_id}.localhost:{api_server.port}"
        url = api_server.url

        def get(path: str, to: str = host, token: str = "") -> httpx.Response:
            sent = {"Host": to, **({"e2b-traffic-access-token": token} if token else {})}
            return httpx.get(f"{url}{path}", headers=sent, timeout=60)

        until(lambda: get("/").status_code == 200, "the guest's server", timeout=60)
        assert get("/").text == host  # the Host header it was asked with
        big = get("/big?part=1")
        assert big.status_code == 200
        assert big.content == bytes(range(256)) * 20480
        posted = bytes(range(256)) * 12288  # 3 MB, over the API's 1 MiB body limit
        echoed = httpx.post(f"{url}/echo", content=posted, headers={"Host": host}, timeout=60)
        assert echoed.text == hashlib.sha256(posted).hexdigest()
        with connect(
            f"ws://{host}/ws", sock=socket.create_connection(("127.0.0.1", api_server.port))
        ) as ws:
            ws.send("hello")
            assert ws.recv(timeout=30) == "echo hello"

        # Paused: a request by host name wakes the auto_resume one, the same server on.
        assert waking.pause() is True
        assert waking.get_info().state == e2b.SandboxState.PAUSED
        woken = get("/")
        assert woken.status_code == 200 and woken.text == host
        assert waking.get_info().state == e2b.SandboxState.RUNNING

        other, token = plain.get_host(8000), plain.traffic_access_token
        assert token
        until(
            lambda: get("/", other, token).status_code == 200,
            "the other guest's server",
            timeout=60,
        )
        assert get("/", other, token).text == "custom-host.example.com:8000"  # masked
        for wrong in ("", token[:-1] + ("0" if token[-1] != "0" else "1")):
            denied = get("/", other, wrong)
            assert denied.status_code == 403 and "traffic token" in denied.json()["message"]
        assert plain.pause() is True
        assert get("/", other).status_code == 403  # refused before anything wakes
        refused = get("/", other, token)
        assert refused.status_code == 502 and "paused" in refused.json()["message"]
        assert plain.get_info().state == e2b.SandboxState.PAUSED
        unknown = get("/", f"8000-sbx-000000000000.localhost:{api_server.port}")
        assert unknown.status_code == 502  # as E2B's edge answers, which its SDKs read
        assert unknown.json()["message"] == "The sandbox was not found"
    finally:
        waking.kill()
        plain.kill()


def test_what_cryobox_cannot_map_is_refused_by_name(sbx: Any) -> None:
    """A SOCKS5 egress proxy of the user's own (refused by E2B's open-source deployment
    too) and a workload identity token in a transform (E2B's ``iam``): refused by name,
    and the policy in force stays (allow_out/deny_out and transforms work:
    test_network_vm.py)."""
    proxy = {"address": "203.0.113.9:1080"}
    with pytest.raises(e2b.SandboxException, match=r"egressProxy"):
        sbx.update_network({"allow_out": ["203.0.113.9"], "egress_proxy": proxy})
    iam = {"203.0.113.9": [{"transform": {"headers": {"A": "${e2b.identity.tokens.aws}"}}}]}
    with pytest.raises(e2b.SandboxException, match=r"identity"):
        sbx.update_network({"rules": iam})
    assert sbx.get_info().sandbox_id == sbx.sandbox_id
    assert registry.find(sbx.sandbox_id).spec().network == "internet"


def test_async_sandbox_the_same_way() -> None:
    async def scenario() -> tuple[str, list[str], str, list[str]]:
        sandbox = await e2b.AsyncSandbox.create()
        try:
            ran = await sandbox.commands.run("echo async")
            results = await asyncio.gather(*(sandbox.commands.run(f"echo {i}") for i in range(3)))
            events: list[Any] = []
            watch = await sandbox.files.watch_dir("/tmp", on_event=events.append)
            await sandbox.files.write("/tmp/a.txt", "async file")
            read = await sandbox.files.read("/tmp/a.txt")
            for _ in range(50):
                if any(e.name == "a.txt" for e in events):
                    break
                await asyncio.sleep(0.1)
            await watch.stop()
            return ran.stdout, [r.stdout for r in results], read, [e.name for e in events]
        finally:
            await sandbox.kill()

    out, many, read, watched = asyncio.run(scenario())
    assert out == "async\n" and many == ["0\n", "1\n", "2\n"] and read == "async file"
    assert "a.txt" in watched


def test_the_unchanged_e2b_example_runs(api_server: ApiServer) -> None:
    """examples/e2b_unchanged.py imports only e2b; three variables point it here."""
    example = Path(__file__).parents[2] / "examples" / "e2b_unchanged.py"
    assert "import cryobox" not in example.read_text()
    env = {
        **api_server.env,
        "E2B_API_URL": f"{api_server.url}/e2b",
        "E2B_SANDBOX_URL": f"{api_server.url}/e2b",
        "E2B_API_KEY": api_server.key,
    }
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "live: hello from sbx-" in done.stdout and "exit code 0" in done.stdout
    counted = next(line for line in done.stdout.splitlines() if line.startswith("still counting"))
    assert int(counted.split()[-1]) > 0 and "files: ['main.py']" in done.stdout


def test_volumes_the_e2b_way(api_server: ApiServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2B's Volume API (control and content) and ``volume_mounts``, on named volumes."""
    monkeypatch.setenv("E2B_VOLUME_API_URL", f"{api_server.url}/e2b")
    volume = e2b.Volume.create("e2b-results")
    try:
        assert volume.volume_id == "e2b-results" and volume.token
        assert "e2b-results" in [v.name for v in e2b.Volume.list()]
        volume.write_file("/input.txt", "from the e2b sdk")
        with pytest.raises(e2b.VolumeException):
            volume.write_file("/input.txt", "again")  # no force: E2B's 409
        volume.write_file("/input.txt", "replaced", force=True)
        made = volume.make_dir("/deep/er", force=True)
        assert made.type.value == "directory" and made.path == "/deep/er"
        with pytest.raises(e2b.VolumePathNotFoundException):
            volume.make_dir("/missing/parent")  # without force, as E2B: 404
        sbx = e2b.Sandbox.create(volume_mounts={"/mnt/results": volume})
        try:
            out = sbx.commands.run(
                "cat /mnt/results/input.txt; echo made in the sandbox > /mnt/results/deep/er/out"
            )
            assert out.stdout == "replaced"
            mounts = sbx.get_info().volume_mounts
            assert mounts == [{"name": volume.name, "path": "/mnt/results"}]
        finally:
            sbx.kill()
        assert volume.read_file("/deep/er/out", format="text") == "made in the sandbox\n"
        names = sorted(e.path for e in volume.list("/", depth=3))
        assert names == ["/deep", "/deep/er", "/deep/er/out", "/input.txt"]
        info = volume.get_info("/input.txt")
        assert info.size == len("replaced") and info.type.value == "file"
        assert volume.update_metadata("/input.txt", mode=0o600).mode == 0o600
        volume.remove("/deep")
        assert not volume.exists("/deep/er/out")
        with pytest.raises(e2b.VolumePathNotFoundException):
            volume.read_file("/deep/er/out")
        # The token opens this volume only, and another tenant's key sees no volume.
        forged_end = "1" if volume.token.endswith("0") else "0"
        forged = httpx.get(
            f"{api_server.url}/e2b/volumecontent/e2b-results/path",
            params={"path": "/input.txt"},
            # (Its last character changed: one that was "0" already made this pass once.)
            headers={"Authorization": "Bearer " + volume.token[:-1] + forged_end},
        )
        assert forged.status_code == 401
        other = api_server.tenant("e2b-volume-other")
        with pytest.raises(e2b.VolumeNotFoundException):
            e2b.Volume.connect("e2b-results", api_key=other)
    finally:
        e2b.Volume.destroy("e2b-results")
    assert "e2b-results" not in [v.name for v in e2b.Volume.list()]
