"""Reading a Dockerfile into a template build's steps: forms, variables, what is copied
where, cache keys, and what is refused by name."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from cryobox.client.dockerfile import defaults_json, instructions, plan, substitute
from cryobox.errors import InvalidArgument


@pytest.fixture
def context(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("print('hi')\n")
    (tmp_path / "app" / "lib").mkdir()
    (tmp_path / "app" / "lib" / "util.py").write_text("X = 1\n")
    (tmp_path / "requirements.txt").write_text("six\n")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").write_text("b")
    return tmp_path


EVERYTHING = """\
# syntax comment
ARG BASE=cryobox
FROM ${BASE}
ARG GREETING=hello
ENV APP_HOME=/srv/app \\
    MODE="fast mode"
WORKDIR $APP_HOME
COPY requirements.txt ./
COPY app/ ./
RUN echo "$GREETING" > greeting && \\
    pip --version
RUN ["/bin/true", "exec form"]
USER nobody
EXPOSE 8000 9000/tcp
ENTRYPOINT ["python3", "-m", "http.server"]
CMD ["8000"]
"""


def test_every_supported_instruction_becomes_steps_and_defaults(context: Path) -> None:
    read = plan(EVERYTHING, context, {"GREETING": "hi there"})
    assert read.base == "cryobox"
    assert [step.kind for step in read.steps] == ["mkdir", "copy", "copy", "run", "run"]
    mkdir, requirements, app, shell, exec_form = read.steps
    assert mkdir.target == "/srv/app"
    assert requirements.files == ((context / "requirements.txt", "/srv/app/requirements.txt"),)
    assert {guest for _host, guest in app.files} == {
        "/srv/app/main.py",
        "/srv/app/lib",
        "/srv/app/lib/util.py",
    }
    assert shell.shell == 'echo "$GREETING" > greeting && pip --version'
    # A RUN has the ARGs in its environment; the template's sandboxes only ENV's.
    assert dict(shell.settings.env) == {
        "APP_HOME": "/srv/app",
        "MODE": "fast mode",
        "GREETING": "hi there",
    }
    assert (shell.settings.user, shell.settings.workdir) == (None, "/srv/app")
    assert exec_form.argv == ("/bin/true", "exec form")
    assert read.settings.user == "nobody"
    assert json.loads(defaults_json(read)) == {
        "env": {"APP_HOME": "/srv/app", "MODE": "fast mode"},
        "user": "nobody",
        "workdir": "/srv/app",
    }
    assert read.ports == (8000, 9000)
    assert read.command == ("python3", "-m", "http.server", "8000")
    assert read.unused_args == ()


def test_a_template_base_lends_what_the_dockerfile_does_not_set(context: Path) -> None:
    read = plan("FROM mybase\nENV B=2\n", context)
    inherited = {"env": {"A": "1", "B": "1"}, "user": "nobody", "workdir": "/w"}
    assert json.loads(defaults_json(read, inherited)) == {
        "env": {"A": "1", "B": "2"},
        "user": "nobody",
        "workdir": "/w",
    }
    assert json.loads(defaults_json(read)) == {"env": {"B": "2"}}


def test_cache_keys_change_from_the_changed_step_on(context: Path) -> None:
    first = [step.key for step in plan(EVERYTHING, context).steps]
    assert len(set(first)) == len(first)
    assert [step.key for step in plan(EVERYTHING, context).steps] == first
    (context / "app" / "lib" / "util.py").write_text("X = 2\n")
    second = [step.key for step in plan(EVERYTHING, context).steps]
    assert second[:2] == first[:2] and all(
        a != b for a, b in zip(first[2:], second[2:], strict=True)
    )
    # A build argument is in the environment of every step after its ARG.
    third = [step.key for step in plan(EVERYTHING, context, {"GREETING": "yo"}).steps]
    assert all(a != b for a, b in zip(second, third, strict=True))


def test_variables_are_replaced_as_docker_does() -> None:
    found = {"A": "1", "EMPTY": ""}
    assert substitute("$A-${A}-${B:-two}-${A:+set}-${B:+x}-\\$A", found) == "1-1-two-set--$A"
    assert substitute("${EMPTY:-fallback}", found) == "fallback"


def test_continued_lines_and_comments() -> None:
    [run] = instructions("RUN a \\\n# skipped\n  && b\n")
    assert (run.keyword, run.arguments, run.line) == ("RUN", "a && b", 1)


def test_files_land_where_docker_puts_them(context: Path) -> None:
    [one] = plan("FROM cryobox\nCOPY a.txt /opt/x\n", context).steps
    assert [guest for _h, guest in one.files] == ["/opt/x"]
    [into] = plan("FROM cryobox\nCOPY *.txt /opt/\n", context).steps
    assert [guest for _h, guest in into.files] == [
        "/opt/a.txt",
        "/opt/b.txt",
        "/opt/requirements.txt",
    ]
    [relative] = plan("FROM cryobox\nWORKDIR /w\nCOPY a.txt sub/\n", context).steps[1:]
    assert [guest for _h, guest in relative.files] == ["/w/sub/a.txt"]


def test_add_unpacks_a_local_archive(context: Path) -> None:
    (context / "bundle.tar.gz").write_bytes(b"not really")
    [add] = plan("FROM cryobox\nADD bundle.tar.gz /opt/b\n", context).steps
    assert add.archive == context / "bundle.tar.gz" and add.target == "/opt/b"


@pytest.mark.parametrize(
    ("dockerfile", "named"),
    [
        ("FROM cryobox\nHEALTHCHECK CMD true\n", "line 2: HEALTHCHECK is not supported"),
        ("FROM cryobox\nVOLUME /data\n", "VOLUME is not supported"),
        ("FROM cryobox\nFROM cryobox\n", "multi-stage"),
        ("FROM cryobox AS build\n", "FROM ... AS"),
        ("FROM debian:12\n", "debian:12: not a template"),
        ("RUN true\n", "comes before FROM"),
        ("ENV A=1\n", "comes before FROM"),
        ("", "no FROM"),
        ("FROM cryobox\nCOPY ../secret /x\n", "outside the build context"),
        ("FROM cryobox\nCOPY missing.txt /x\n", "missing.txt: no such file"),
        ("FROM cryobox\nCOPY --from=build /a /b\n", "--from is not supported"),
        ("FROM cryobox\nADD https://example.com/x /x\n", "from a URL"),
        ("FROM cryobox\nRUN --mount=type=cache true\n", "--mount is not supported"),
        ("FROM cryobox\nUSER 1000\n", "a user's name"),
        ("FROM cryobox\nEXPOSE 53/udp\n", "TCP port numbers only"),
        ("FROM cryobox\nCOPY a.txt b.txt /x\n", "several sources need a folder"),
        ("FROM cryobox\nRUN true \\\n", "ends with"),
        ("FROM cryobox\nENV foo-bar some value\n", "line 2: ENV 'foo-bar': not a variable name"),
    ],
)
def test_what_cryobox_cannot_build_is_refused_by_name(
    context: Path, dockerfile: str, named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named.replace("(", r"\(").replace(".", r"\.")):
        plan(dockerfile, context)


def test_a_symlink_out_of_the_context_is_refused(context: Path, tmp_path: Path) -> None:
    outside = tmp_path.parent / "outside-secret"
    outside.write_text("secret")
    (context / "link").symlink_to(outside)
    with pytest.raises(InvalidArgument, match="leads outside the build context"):
        plan("FROM cryobox\nCOPY link /x\n", context)


def test_unused_build_args_are_reported(context: Path) -> None:
    assert plan("FROM cryobox\n", context, {"NOPE": "1"}).unused_args == ("NOPE",)


def test_the_readmes_dockerfile_is_read_as_it_says(tmp_path: Path) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("```dockerfile\n", 1)[1].split("```", 1)[0]
    (tmp_path / "requirements.txt").write_text("six\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("")
    (tmp_path / "vendor.tar.gz").write_bytes(b"")
    read = plan(block, tmp_path)
    assert [step.kind for step in read.steps] == ["mkdir", "copy", "copy", "run"]
    assert (read.settings.user, read.settings.workdir, read.ports) == (
        "nobody",
        "/srv/app",
        (8000,),
    )
    assert read.command == ("python3", "-m", "http.server", "8000")


def test_path_and_quotes_read_as_docker_reads_them(context: Path) -> None:
    read = plan(
        'FROM cryobox\nENV PATH=/opt/venv/bin:$PATH\nENV GREETING "hello there"\nRUN true\n',
        context,
    )
    env = dict(read.steps[0].settings.env)
    assert (
        env["PATH"] == "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    )
    assert env["GREETING"] == "hello there"
    with pytest.raises(InvalidArgument, match=r"line 2: ENV cannot be read"):
        plan("FROM cryobox\nENV MSG it's here\n", context)


def test_a_glob_does_not_cross_folders(context: Path) -> None:
    (context / "sub").mkdir()
    (context / "sub" / "c.txt").write_text("c")
    [copy] = plan("FROM cryobox\nCOPY *.txt /opt/\n", context).steps
    assert "/opt/c.txt" not in [guest for _h, guest in copy.files]
    [deep] = plan("FROM cryobox\nCOPY sub/*.txt /opt/\n", context).steps
    assert [guest for _h, guest in deep.files] == ["/opt/c.txt"]


def test_dockerignore_leaves_files_out_and_takes_exceptions(context: Path) -> None:
    (context / ".git").mkdir()
    (context / ".git" / "config").write_text("secret")
    (context / ".env").write_text("TOKEN=1")
    (context / "app" / "keep.log").write_text("kept")
    (context / "app" / "drop.log").write_text("dropped")
    (context / ".dockerignore").write_text("# comment\n.git\n.env\n**/*.log\n!app/keep.log\n")
    [copy] = plan("FROM cryobox\nCOPY . /srv/\n", context).steps
    copied = {guest for _h, guest in copy.files}
    assert "/srv/app/main.py" in copied and "/srv/app/keep.log" in copied
    assert not {"/srv/.git", "/srv/.git/config", "/srv/.env", "/srv/app/drop.log"} & copied
    with pytest.raises(InvalidArgument, match=r"\.env: no such file"):
        plan("FROM cryobox\nCOPY .env /x\n", context)


def test_files_changed_during_the_build_are_refused(context: Path) -> None:
    from cryobox.client.template_build import _archive

    [copy] = plan("FROM cryobox\nCOPY app/ /srv/\n", context).steps
    _archive(copy, context).unlink()  # unchanged: archived
    (context / "app" / "main.py").write_text("print('changed')\n")
    before = set(Path(tempfile.gettempdir()).glob("cryobox-copy-*.tar"))
    with pytest.raises(InvalidArgument, match="changed during the build"):
        _archive(copy, context)
    assert set(Path(tempfile.gettempdir()).glob("cryobox-copy-*.tar")) <= before  # removed


def test_a_folder_swapped_for_a_link_is_not_followed(context: Path, tmp_path: Path) -> None:
    from cryobox.client.template_build import _archive

    outside = tmp_path.parent / f"outside-{tmp_path.name}"
    outside.mkdir()
    (outside / "util.py").write_text("X = 1\n")  # the same bytes as the context's
    [copy] = plan("FROM cryobox\nCOPY app/ /srv/\n", context).steps
    lib = context / "app" / "lib"
    (lib / "util.py").unlink()
    lib.rmdir()
    lib.symlink_to(outside)
    with pytest.raises(InvalidArgument, match="leads outside the build context"):
        _archive(copy, context)
