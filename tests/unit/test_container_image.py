"""Container images as guest images, without a VM: what an image's configuration
becomes, which references are taken, what is added to its root file system, and that
an archive that cannot be read is refused by name, leaving nothing behind (skopeo
itself reads it). A server's upload is bounded and removed whatever happens."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cryobox.arguments import container_image
from cryobox.errors import ImageError, InvalidArgument
from cryobox.image.build import Image, images_dir
from cryobox.image.oci import ImageConfig, _prepare, import_image, imported_images, remove_image
from cryobox.server import uploads


def test_an_images_configuration_becomes_what_its_sandboxes_run_with() -> None:
    config = ImageConfig.from_oci(
        {
            "Env": ["PATH=/usr/bin:/bin", "OPTS=a=b", "EMPTY=", "=nameless"],
            "User": "app:app",
            "WorkingDir": "",
            "Entrypoint": ["/entry.sh"],
            "Cmd": ["serve", "--port", "80"],
            "ExposedPorts": {"80/tcp": {}, "53/udp": {}, "8080": {}, "80": {}, "70000": {}},
        }
    )
    assert config.env == {"PATH": "/usr/bin:/bin", "OPTS": "a=b", "EMPTY": ""}
    assert config.user == "app:app" and config.workdir is None
    assert config.command == ("/entry.sh", "serve", "--port", "80")  # as a runtime starts it
    assert config.ports == (80, 8080)  # TCP ports only, once each
    assert ImageConfig.from_json(config.to_json()) == config
    assert ImageConfig.from_oci({}).command == () and ImageConfig.from_oci({}).env == {}
    for bad, said in (
        ({"Env": "PATH=/bin"}, "Env is not a list of strings"),
        ({"Cmd": ["sh", 1]}, "Cmd is not a list of strings"),
        ({"ExposedPorts": ["80/tcp"]}, "ExposedPorts is not an object"),
        ({"WorkingDir": "srv"}, "WorkingDir 'srv' is not an absolute path"),
        ({"User": 1000}, "User 1000 is not a string"),
    ):
        with pytest.raises(InvalidArgument, match=said):
            ImageConfig.from_oci(bad)


def test_only_images_on_this_machine_are_taken_each_refused_by_name(tmp_path: Path) -> None:
    archive = tmp_path / "app.tar"
    archive.write_bytes(b"x")
    assert container_image(f"oci-archive:{archive}") == ("oci-archive", archive)
    assert container_image(f"oci:{tmp_path}") == ("oci", tmp_path)
    for bad, said in (
        ("docker://debian:12", "give oci-archive:FILE"),
        ("app.tar", "give oci-archive:FILE"),
        ("oci-archive:", "give oci-archive:FILE"),
        (f"oci-archive:{tmp_path / 'nope.tar'}", "no such file"),
        (f"oci:{tmp_path / 'nope'}", "no such folder"),
        (42, "must be a string"),
    ):
        with pytest.raises(InvalidArgument, match=said):
            container_image(bad)


def test_a_boot_gets_what_it_needs_and_the_image_keeps_what_it_has(tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    (runtime / "bin").mkdir(parents=True)
    (runtime / "bin" / "python3").write_text("#!")
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "passwd").write_text("app:x:1000:1000::/home/app:/bin/sh")  # no newline
    (tree / "etc" / "hostname").write_text("mine\n")
    _prepare(tree, runtime)
    assert (tree / "etc/passwd").read_text() == (
        "app:x:1000:1000::/home/app:/bin/sh\nroot:x:0:0:root:/root:/bin/sh\n"
    )
    assert (tree / "etc/group").read_text() == "root:x:0:\n"
    assert (tree / "etc/hostname").read_text() == "mine\n"  # the image's own, kept
    assert stat.S_IMODE((tree / "tmp").stat().st_mode) == 0o1777
    for folder in ("dev", "proc", "sys", "run", "root"):
        assert (tree / folder).is_dir(), folder
    assert (tree / ".cryobox/bin/python3").read_text() == "#!"

    again = tmp_path / "again"
    (again / "etc").mkdir(parents=True)
    (again / "etc" / "passwd").write_text("root:x:0:0:admin:/root:/bin/ash\n")
    (again / ".cryobox").mkdir()
    with pytest.raises(InvalidArgument, match=r"has its own /\.cryobox"):
        _prepare(again, runtime)
    assert (again / "etc/passwd").read_text() == "root:x:0:0:admin:/root:/bin/ash\n"


def test_an_images_links_never_lead_the_import_out_of_its_tree(tmp_path: Path) -> None:
    """The image's files may be links to anywhere on the host: none is followed."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    host = tmp_path / "host"
    host.mkdir()
    precious = host / "precious"
    precious.write_text("the host's own\n")
    tree = tmp_path / "tree"
    (tree / "etc").mkdir(parents=True)
    (tree / "etc" / "passwd").symlink_to(precious)
    (tree / "etc" / "machine-id").symlink_to(host / "made-by-cryobox")
    with pytest.raises(InvalidArgument, match="/etc/passwd cannot be read"):
        _prepare(tree, runtime)
    assert precious.read_text() == "the host's own\n"

    (tree / "etc" / "passwd").unlink()
    (tree / "etc" / ".group.cryobox").symlink_to(precious)  # where the new group goes
    _prepare(tree, runtime)
    assert precious.read_text() == "the host's own\n"
    assert not (host / "made-by-cryobox").exists()  # a dangling link is left as it is
    assert (tree / "etc/group").read_text() == "root:x:0:\n"

    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "etc").symlink_to(host)
    with pytest.raises(InvalidArgument, match="/etc is not a folder"):
        _prepare(linked, runtime)
    assert sorted(p.name for p in host.iterdir()) == ["precious"]


def test_an_archive_that_cannot_be_read_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An images folder of its own: the VM tests, run beside these, import and remove there.
    monkeypatch.setenv("CRYOBOX_CACHE_DIR", str(tmp_path / "cache"))
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"not an image\n" * 100)
    base = Image(id="base", path=tmp_path / "base", kernel_version="k", manifest={})
    killed = images_dir() / ".import-killed-halfway"  # as an import killed with -9 leaves it
    (killed / "tree").mkdir(parents=True)
    with pytest.raises(InvalidArgument, match=r"garbage.tar: cannot be read \(.+\)"):
        import_image(f"oci-archive:{garbage}", base)
    # Its own work folder gone, and the old one; the images' locks stay.
    assert sorted(p.name for p in images_dir().iterdir()) == [".lock", ".use-lock"]


async def _body(blocks: int) -> AsyncIterator[bytes]:
    for _ in range(blocks):
        await asyncio.sleep(0)
        yield b"x" * 1000


async def test_an_upload_is_bounded_and_removed_whatever_happens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_STATE_DIR", str(tmp_path / "state"))
    async with uploads.received(_body(3), 5000, ".tar") as path:
        assert path.read_bytes() == b"x" * 3000
    assert not path.exists()
    with pytest.raises(InvalidArgument, match="larger than"):
        async with uploads.received(_body(6), 5000, ".tar"):
            pass
    with pytest.raises(RuntimeError):
        async with uploads.received(_body(1), 5000, ".tar"):
            raise RuntimeError("the build failed")
    assert list((tmp_path / "state" / "uploads").iterdir()) == []


def test_only_an_imported_image_that_nothing_uses_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOBOX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(InvalidArgument, match="not an image imported from a container image"):
        remove_image("no-such-image", [])
    fake = images_dir() / "base-0000-test-only"
    fake.mkdir()
    try:
        manifest = {"id": fake.name, "kernel_version": "k", "container": {"config": {}}}
        (fake / "image.json").write_text(json.dumps(manifest))
        assert fake.name in [image.id for image in imported_images()]
        users = [f"template t{i}" for i in range(7)]
        with pytest.raises(InvalidArgument, match=r"still used by template t0, .* and 2 more"):
            remove_image(fake.name, users)
        assert fake.exists()
        remove_image(fake.name, [])
        assert not fake.exists() and not list(images_dir().glob(".removed-*"))
    finally:
        shutil.rmtree(fake, ignore_errors=True)


def test_a_host_without_an_imported_image_says_where_it_came_from() -> None:
    from cryobox.qemu.vmm import QemuVmm

    with pytest.raises(ImageError, match="imported from a container image on another host"):
        QemuVmm().load_image("0123abcd-" + "f" * 64)


def test_a_runtime_tree_of_an_older_recipe_goes_once_the_current_one_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime cryobox copies into an imported image is cached per image and per
    recipe (what it holds); a recipe's change (xxhash was added, say) made a new tree
    and kept the old one for good, 56 MiB each."""
    from cryobox.image import runtime

    monkeypatch.setenv("CRYOBOX_CACHE_DIR", str(tmp_path))
    image = Image(id="0123456789abcdef", path=tmp_path / "image", kernel_version="", manifest={})
    folder = tmp_path / "runtime"
    current = folder / f"{image.id}-{runtime._recipe()}"
    kept = [current, folder / "fedcba9876543210-000000000000", folder / ".runtime-abc"]
    stale = [folder / image.id, folder / f"{image.id}-000000000000", folder / ".stale-x-1"]
    for tree in kept + stale:
        (tree / "bin").mkdir(parents=True)
        (tree / "bin" / "python3").write_text("#!")
    assert runtime.guest_runtime(image) == current
    assert sorted(folder.iterdir()) == sorted(kept)
