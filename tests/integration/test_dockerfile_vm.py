"""Templates built from a Dockerfile, on real VMs: every supported instruction shows in
the template's sandboxes (files, owners, env, user, workdir, a running CMD reached on
its EXPOSEd port), a rebuild reruns only what follows a change, a template builds on
another, and what cannot be built is refused; embedded through the SDK, and over HTTP
through the CLI."""

from __future__ import annotations

import contextlib
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from api_server import CLI, ApiServer
from cryobox import Sandbox
from cryobox.errors import CryoboxError, InvalidArgument
from waiting import until

pytestmark = pytest.mark.vm

DOCKERFILE = """\
FROM cryobox
ARG GREETING=hello
ENV APP_HOME=/srv/app MODE=prod
ENV PATH=/opt/tools:$PATH
WORKDIR $APP_HOME
COPY app/ ./
COPY --chown=nobody:nogroup data.txt /srv/data/
COPY --chown=1000:1000 data.txt /srv/numeric/
ADD bundle.tar.gz /opt/bundle
RUN echo "$GREETING from $MODE" > greeting.txt && id -un > built-by
USER nobody
EXPOSE 8000
CMD ["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0"]
"""


def make_context(folder: Path) -> Path:
    (folder / "app").mkdir(parents=True)
    (folder / "app" / "main.py").write_text("print('served')\n")
    (folder / "data.txt").write_text("data v1\n")
    inner = folder / "inside.txt"
    inner.write_text("from the archive\n")
    with tarfile.open(folder / "bundle.tar.gz", "w:gz") as tar:
        tar.add(inner, arcname="inside.txt")
    inner.unlink()
    (folder / "Dockerfile").write_text(DOCKERFILE)
    return folder


@pytest.fixture
def cleanup() -> Iterator[list[str]]:
    """Template names to remove after the test, with the build cache's snapshots."""
    names: list[str] = []
    yield names
    for name in reversed(names):
        with contextlib.suppress(CryoboxError):
            Sandbox.delete_template(name)
    cached = [s for s in Sandbox.snapshots() if (s.name or "").startswith("dockerfile-")]
    for snap in sorted(cached, key=lambda s: s.created_at, reverse=True):
        with contextlib.suppress(CryoboxError):
            Sandbox.delete_snapshot(snap.id)


def fetched(url: str) -> bytes | None:
    """The page's bytes, or None while the connection is refused or cut (the first
    connection through a just-restored guest's forwarded port is sometimes dropped)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            body: bytes = answer.read()
            return body
    except OSError:
        return None


def build(name: str, context: Path, **options: object) -> list[str]:
    steps: list[str] = []
    Sandbox.build_template(
        name,
        dockerfile=context / "Dockerfile",
        context=context,
        progress=steps.append,
        **options,  # type: ignore[arg-type]
    )
    return [step for step in steps if not step.startswith(" ")]


def test_a_dockerfile_template_has_its_files_defaults_port_and_running_command(
    tmp_path: Path, cleanup: list[str]
) -> None:
    context = make_context(tmp_path / "ctx")
    cleanup.append("df-app")
    steps = build("df-app", context, build_args={"GREETING": "hi"})
    assert steps[0] == "booting the image" and "step 6/6: RUN echo" in steps[6]
    with Sandbox.create(template="df-app") as sbx:
        who = sbx.commands.run('pwd; id -un; echo "$MODE $APP_HOME"')
        assert who.stdout.split("\n")[:3] == ["/srv/app", "nobody", "prod /srv/app"]
        assert sbx.files.read_text("/srv/app/main.py") == "print('served')\n"
        assert sbx.files.read_text("/srv/app/greeting.txt") == "hi from prod\n"
        assert sbx.files.read_text("/srv/app/built-by") == "root\n"  # USER came after
        owner = sbx.commands.run(["stat", "-c", "%U:%G", "/srv/data/data.txt"], user="root")
        assert owner.stdout.strip() == "nobody:nogroup"
        numeric = sbx.commands.run(["stat", "-c", "%u:%g", "/srv/numeric/data.txt"], user="root")
        assert numeric.stdout.strip() == "1000:1000"
        path = sbx.commands.run('echo "$PATH"').stdout.strip()
        assert path.startswith("/opt/tools:") and ":/usr/bin:" in path
        assert sbx.files.read_text("/opt/bundle/inside.txt") == "from the archive\n"
        # The CMD was saved running: it serves the workdir on the EXPOSEd port.
        assert 8000 in sbx.ports
        url = f"http://127.0.0.1:{sbx.ports[8000]}/main.py"
        until(lambda: fetched(url) == b"print('served')\n", "the CMD's answer on its port", 60)
        served_by = sbx.commands.run(["ps", "-o", "user=", "-C", "python3"], user="root")
        assert "nobody" in served_by.stdout
        # A command's own choices still win.
        mine = sbx.commands.run("pwd; id -un", cwd="/tmp", user="root", env={"MODE": "x"})
        assert mine.stdout.split() == ["/tmp", "root"]

    # A change to one file: the steps before it come from the cache.
    (context / "data.txt").write_text("data v2\n")
    again = build("df-app", context, build_args={"GREETING": "hi"})
    assert again[0] == "steps 1-2 of 6: cached"
    assert [s.split(":")[0] for s in again[1:5]] == ["step 3/6", "step 4/6", "step 5/6", "step 6/6"]
    # Nothing changed: every step cached, the template saved again.
    assert build("df-app", context, build_args={"GREETING": "hi"})[0] == "steps 1-6 of 6: cached"

    # A template built on it keeps its defaults and its running command.
    child = tmp_path / "child"
    child.mkdir()
    (child / "Dockerfile").write_text(
        "FROM df-app\nENV EXTRA=more\nRUN echo $MODE-$EXTRA > /tmp/mark\n"
    )
    cleanup.append("df-child")
    build("df-child", child)
    with Sandbox.create(template="df-child") as sbx:
        assert sbx.files.read_text("/tmp/mark") == "prod-more\n"
        env = sbx.commands.run('echo "$MODE $EXTRA $(id -un) $(pwd)"')
        assert env.stdout == "prod more nobody /srv/app\n"
        assert sbx.commands.run(["pgrep", "-f", "http.server"]).exit_code == 0
        assert sbx.files.read_text("/srv/data/data.txt") == "data v2\n"


def test_what_cannot_be_built_is_refused_and_leaves_nothing_running(
    tmp_path: Path, cleanup: list[str]
) -> None:
    before = {s.id for s in Sandbox.list()}
    (tmp_path / "Dockerfile").write_text("FROM cryobox\nHEALTHCHECK CMD true\n")
    with pytest.raises(InvalidArgument, match=r"line 2: HEALTHCHECK is not supported"):
        build("df-bad", tmp_path)
    (tmp_path / "Dockerfile").write_text("FROM cryobox\nRUN echo doomed; exit 7\n")
    with pytest.raises(
        InvalidArgument, match=r"(?s)line 2: RUN echo doomed.*exited with 7.*doomed"
    ):
        build("df-bad", tmp_path)
    (tmp_path / "Dockerfile").write_text('FROM cryobox\nCMD ["false"]\n')
    with pytest.raises(InvalidArgument, match=r"the command false ended at once"):
        build("df-bad", tmp_path)
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "Dockerfile").write_text("FROM cryobox\nCOPY --chown=nosuchuser a.txt /a\n")
    with pytest.raises(InvalidArgument, match=r"line 2: .*no user nosuchuser in the guest"):
        build("df-bad", tmp_path)
    assert "df-bad" not in {t.name for t in Sandbox.templates()}
    assert {s.id for s in Sandbox.list()} == before


def test_the_cli_builds_a_dockerfile_template_over_http(
    tmp_path: Path, api_server: ApiServer
) -> None:
    (tmp_path / "hello.txt").write_text("over http\n")
    (tmp_path / "Dockerfile").write_text(
        "FROM cryobox\nCOPY hello.txt /opt/\nENV WHERE=server\nWORKDIR /opt\n"
    )
    env = api_server.client_env()
    built = subprocess.run(
        [*CLI, "template", "build", "df-http", "-f", str(tmp_path / "Dockerfile"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert built.returncode == 0, built.stderr
    assert "step 1/2: COPY hello.txt /opt/" in built.stdout
    assert "template df-http: snapshot snap-" in built.stdout
    try:
        ran = subprocess.run(
            [
                *CLI,
                "run",
                "--template",
                "df-http",
                "--",
                "sh",
                "-c",
                'cat hello.txt; echo "$WHERE"',
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout == "over http\nserver\n"
    finally:
        subprocess.run([*CLI, "template", "rm", "df-http"], env=env, timeout=120, check=False)
