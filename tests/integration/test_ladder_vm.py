"""The ladder: the core checks a user relies on (commands, files, ports, pause and
resume, checkpoint and rollback) on each kind of sandbox there is, each embedded and
over HTTP.

A sandbox is cold-booted (template ``base``), restored from a memory snapshot (the
default template), or a fork of a running sandbox. Each comes from one factory that
kills what it made; the logs of every VM a failed test started are printed (conftest).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from api_server import ApiServer
from cryobox import Sandbox

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm

KINDS = ("booted", "restored", "forked")
WAYS = ("embedded", "http")


Remote = dict[str, Any]


@pytest.fixture
def make_sandbox(api_server: ApiServer) -> Iterator[Callable[[str, Remote], Sandbox]]:
    """``make_sandbox(kind, remote)``: a running sandbox with guest port 8000 forwarded,
    made through ``remote`` (a server's ``api_url`` and ``api_key``, or embedded: {})."""
    made: list[Sandbox] = []

    def make(kind: str, remote: Remote) -> Sandbox:
        template = "base" if kind == "booted" else "default"
        first = Sandbox.create(template, ports=[8000], **remote)
        made.append(first)
        if kind != "forked":
            return first
        first.files.write("/root/from-parent", "the parent wrote this")
        (copy,) = first.fork(1)
        made.append(copy)
        return copy

    yield make  # (their logs on failure: conftest's vm_logs_on_failure)
    for sbx in reversed(made):  # a fork's copies before their parent
        with contextlib.suppress(Exception):
            sbx.kill()


def core_checks(sbx: Sandbox, remote: Remote) -> None:
    """What a user checks first, in the order an agent would meet it."""
    # commands: output, exit codes, the environment
    done = sbx.commands.run("echo hello; echo oops >&2; exit 3")
    assert (done.exit_code, done.stdout, done.stderr) == (3, "hello\n", "oops\n")
    assert sbx.commands.run(["uname", "-s"]).stdout.strip() == "Linux"
    # files: bytes in, the same bytes out, listed
    payload = secrets.token_bytes(200_000)
    sbx.files.mkdir("/root/work")
    sbx.files.write("/root/work/blob.bin", payload)
    assert sbx.files.read("/root/work/blob.bin") == payload
    assert "blob.bin" in [entry.name for entry in sbx.files.list("/root/work")]
    # ports: a server in the guest, reached from the host
    sbx.files.write("/root/index.html", f"served by {sbx.id}")
    sbx.commands.run("cd /root && python3 -m http.server 8000 >/dev/null 2>&1", background=True)
    url = f"http://127.0.0.1:{sbx.ports[8000]}/index.html"
    assert fetch_until_up(url)[1] == f"served by {sbx.id}".encode()
    # pause and resume: processes keep running, files stay
    sleeper = sbx.commands.run("sleep 100000", background=True)
    sbx.pause()
    assert sbx.info().state == "paused"
    sbx = Sandbox.resume(sbx.id, **remote)
    assert sbx.info().state == "running"
    assert sbx.commands.run(f"kill -0 {sleeper.pid}").exit_code == 0
    assert sbx.files.read("/root/work/blob.bin") == payload
    assert fetch_until_up(f"http://127.0.0.1:{sbx.ports[8000]}/index.html")[1].startswith(b"served")
    # checkpoint and rollback: the files and the processes of that moment
    sbx.files.write("/root/work/state", "before")
    mark = sbx.checkpoint()
    sbx.files.write("/root/work/state", "after")
    sbx.files.write("/root/work/later", "written after the checkpoint")
    sbx.commands.run(f"kill {sleeper.pid}")
    sbx.rollback(mark)
    assert sbx.files.read_text("/root/work/state") == "before"
    assert not sbx.files.exists("/root/work/later")
    assert sbx.commands.run(f"kill -0 {sleeper.pid}").exit_code == 0


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kind", KINDS)
def test_the_core_checks_hold_on_every_kind_of_sandbox(
    kind: str, way: str, make_sandbox: Callable[[str, Remote], Sandbox], api_server: ApiServer
) -> None:
    remote = {"api_url": api_server.url, "api_key": api_server.key} if way == "http" else {}
    sbx = make_sandbox(kind, remote)
    if kind == "forked":
        assert sbx.files.read_text("/root/from-parent") == "the parent wrote this"
    core_checks(sbx, remote)
