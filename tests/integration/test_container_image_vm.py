"""Templates from container images, on real VMs: an OCI archive made here with umoci, of
a root file system with no Python and no C library (busybox only, static), becomes a
template whose sandboxes have its files (a later layer's whiteout honoured), its
environment, user and folder, its command running and serving on its exposed port, and
pause, resume and fork like any other; the CLI builds one from a docker-archive over
HTTP (the archive uploaded); what cannot be imported is refused by name, leaving
nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from api_server import CLI, ApiServer
from cryobox import Sandbox
from cryobox.errors import CryoboxError, InvalidArgument
from cryobox.guest import protocol as p
from cryobox.guest import requests
from cryobox.guest.requests import DiskCopy
from cryobox.image.build import images_dir

from .guest_http import fetch_until_up

pytestmark = pytest.mark.vm

INDEX = "served by busybox httpd\n"


def umoci(*args: str) -> None:
    subprocess.run(["umoci", *args], check=True, capture_output=True)


def make_archive(folder: Path, command: list[str] | None = None) -> Path:
    """An OCI archive of two layers: busybox with its applets, two accounts and some
    files; then one file deleted (a whiteout) and one added. Its configuration: an
    environment, a working folder, the user ``app``, busybox's httpd as its command on
    exposed port 8080."""
    folder.mkdir(parents=True, exist_ok=True)
    layout = f"{folder}/layout:app"
    bundle = folder / "bundle"
    umoci("init", "--layout", str(folder / "layout"))
    umoci("new", "--image", layout)
    umoci("unpack", "--image", layout, str(bundle))
    root = bundle / "rootfs"
    for name in ("bin", "etc", "srv/www"):
        (root / name).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox")
    assert busybox is not None
    shutil.copyfile(busybox, root / "bin/busybox")
    (root / "bin/busybox").chmod(0o755)
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        if not (root / "bin" / applet).exists():
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/srv:/bin/sh\n"
    )
    (root / "etc/group").write_text("root:x:0:\napp:x:1000:\n")
    (root / "srv/www/index.html").write_text(INDEX)
    (root / "srv/doomed.txt").write_text("deleted by the second layer\n")
    umoci("repack", "--image", layout, str(bundle))
    shutil.rmtree(bundle)
    umoci("unpack", "--image", layout, str(bundle))
    (bundle / "rootfs/srv/doomed.txt").unlink()
    (bundle / "rootfs/srv/two.txt").write_text("from the second layer\n")
    umoci("repack", "--image", layout, str(bundle))
    shutil.rmtree(bundle)
    config = ["--config.env", "GREETING=hi", "--config.env", "PATH=/bin"]
    config += ["--config.workingdir", "/srv", "--config.user", "app"]
    config += ["--config.exposedports", "8080/tcp"]
    for word in command or ["/bin/httpd", "-f", "-p", "8080", "-h", "/srv/www"]:
        config += ["--config.cmd", word]
    umoci("config", "--image", layout, *config)
    archive = folder / "app.tar"
    subprocess.run(
        [
            "skopeo",
            "--insecure-policy",
            "copy",
            "--quiet",
            f"oci:{layout}",
            f"oci-archive:{archive}",
        ],
        check=True,
        capture_output=True,
    )
    return archive


def imported_images() -> set[Path]:
    return {
        path.parent
        for path in images_dir().glob("*/image.json")
        if "container" in json.loads(path.read_text())
    }


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Template names to remove after the test, and the images imported meanwhile."""
    before = imported_images()
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(CryoboxError):
            Sandbox.delete_template(name)
    for path in imported_images() - before:
        shutil.rmtree(path, ignore_errors=True)


def test_a_container_image_runs_as_a_sandbox_that_pauses_resumes_and_forks(
    tmp_path: Path, cleanup: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = make_archive(tmp_path)
    cleanup.append("oci-app")
    steps: list[str] = []
    Sandbox.build_template("oci-app", image=f"oci-archive:{archive}", progress=steps.append)
    assert "unpacking its layers" in steps and "saving the machine" in steps
    sbx = Sandbox.create("oci-app")
    try:
        # The image's configuration: every command's defaults.
        who = sbx.commands.run('pwd; id -un; echo "$GREETING $PATH"')
        assert who.stdout.split("\n")[:3] == ["/srv", "app", "hi /bin"]
        # Its layers, the second one's deletion honoured; no Python, no C library of
        # its own: the agent is cryobox's.
        assert sbx.files.read_text("/srv/two.txt") == "from the second layer\n"
        assert not sbx.files.exists("/srv/doomed.txt")
        for missing in ("/usr/bin/python3", "/lib64/ld-linux-x86-64.so.2", "/etc/os-release"):
            assert not sbx.files.exists(missing), missing
        # Its command, started at the build as its user, serves on its exposed port.
        assert 8080 in sbx.ports
        assert fetch_until_up(f"http://127.0.0.1:{sbx.ports[8080]}/index.html")[1] == INDEX.encode()
        served = sbx.commands.run("ps -o user,args | grep '[h]ttpd'", user="root").stdout
        assert served.split()[:2] == ["app", "/bin/httpd"], served
        pid = sbx.commands.run("pidof httpd").stdout.strip()
        sbx.files.write("/tmp/note.txt", "before the pause\n")
        # Megabytes go through the transfer disk, copied by the Python cryobox carries
        # in: with its xxhash, each slot's digest is XXH64, both ways.
        digests: list[tuple[str, str]] = []
        answered = requests._disk_copy

        def noted(answer: dict[str, Any], op: str, least: int, most: int) -> DiskCopy:
            copied = answered(answer, op, least, most)
            digests.append((op, copied.digest))
            return copied

        monkeypatch.setattr(requests, "_disk_copy", noted)
        data = os.urandom(3 << 20)
        sbx.files.write("/tmp/big.bin", data)
        assert sbx.files.read("/tmp/big.bin") == data
        assert digests == [("write", p.DIGEST_XXH64), ("read", p.DIGEST_XXH64)]
        monkeypatch.undo()

        sbx.pause()
        sbx = Sandbox.resume(sbx.id)
        assert sbx.commands.run("pidof httpd").stdout.strip() == pid  # the same process
        assert sbx.files.read_text("/tmp/note.txt") == "before the pause\n"

        boot = sbx.files.read_text("/proc/sys/kernel/random/boot_id")
        forks = sbx.fork(2)
        try:
            boots = {boot}
            for fork in forks:
                assert fork.files.read_text("/tmp/note.txt") == "before the pause\n"
                assert fork.commands.run("pidof httpd").stdout.strip() == pid
                url = f"http://127.0.0.1:{fork.ports[8080]}/index.html"
                assert fetch_until_up(url)[1] == INDEX.encode()
                boots.add(fork.files.read_text("/proc/sys/kernel/random/boot_id"))
            assert len(boots) == 3  # each copy its own identity
        finally:
            for fork in forks:
                fork.kill()
    finally:
        sbx.kill()

    # The imported image is listed, kept while its template boots from it, then removed.
    listed = subprocess.run([*CLI, "image", "ls"], capture_output=True, text=True, check=True)
    (row,) = [line.split("\t") for line in listed.stdout.splitlines() if "app.tar" in line]
    image_id = row[0]
    kept = subprocess.run([*CLI, "image", "rm", image_id], capture_output=True, text=True)
    assert kept.returncode != 0 and "still used by template oci-app" in kept.stderr
    Sandbox.delete_template("oci-app")
    removed = subprocess.run([*CLI, "image", "rm", image_id], capture_output=True, text=True)
    assert removed.returncode == 0, removed.stderr
    assert not (images_dir() / image_id).exists()
    listed = subprocess.run([*CLI, "image", "ls"], capture_output=True, text=True, check=True)
    assert image_id not in listed.stdout


def test_the_cli_builds_from_a_docker_archive_over_http(
    tmp_path: Path, api_server: ApiServer, cleanup: list[str]
) -> None:
    oci = make_archive(tmp_path)
    archive = tmp_path / "app-docker.tar"
    subprocess.run(
        [
            "skopeo",
            "--insecure-policy",
            "copy",
            "--quiet",
            f"oci-archive:{oci}",
            f"docker-archive:{archive}:app:latest",
        ],
        check=True,
        capture_output=True,
    )
    env = api_server.client_env()
    built = subprocess.run(
        [
            *CLI,
            "template",
            "build",
            "oci-http",
            "--image",
            f"docker-archive:{archive}",
            "--setup",
            "id -un > /tmp/built-by",  # as the image's user, as a RUN after its USER
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr
    assert "template oci-http: snapshot snap-" in built.stdout
    try:
        ran = subprocess.run(
            [
                *CLI,
                "run",
                "--template",
                "oci-http",
                "--",
                "sh",
                "-c",
                "cat two.txt /tmp/built-by; id -un",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout == "from the second layer\napp\napp\n"
    finally:
        subprocess.run(
            [*CLI, "template", "rm", "oci-http"], env=env, capture_output=True, timeout=120
        )


def test_what_cannot_be_imported_is_refused_by_name_and_leaves_nothing(
    tmp_path: Path, cleanup: list[str]
) -> None:
    before = {s.id for s in Sandbox.list()}
    with pytest.raises(InvalidArgument, match=r"give oci-archive:FILE"):
        Sandbox.build_template("oci-bad", image="docker://busybox")
    with pytest.raises(InvalidArgument, match=r"no such file"):
        Sandbox.build_template("oci-bad", image=f"oci-archive:{tmp_path / 'nope.tar'}")
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not an image" * 1000)
    with pytest.raises(InvalidArgument, match=r"garbage.tar: cannot be read"):
        Sandbox.build_template("oci-bad", image=f"oci-archive:{garbage}")
    assert not list(images_dir().glob(".import-*"))
    # A command that ends at once: refused with its output, no template, no sandbox.
    quits = make_archive(tmp_path / "quits", ["/bin/sh", "-c", "echo cannot start; exit 3"])
    cleanup.append("oci-bad")
    with pytest.raises(
        InvalidArgument, match=r"(?s)the image's command .* ended at once.*cannot start"
    ):
        Sandbox.build_template("oci-bad", image=f"oci-archive:{quits}")
    assert "oci-bad" not in {t.name for t in Sandbox.templates()}
    assert {s.id for s in Sandbox.list()} == before
