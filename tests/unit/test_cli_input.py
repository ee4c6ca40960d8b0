"""`exec -it` and `shell` refuse at once when stdin is not a terminal (issue 37): fed
from a pipe, a terminal session never saw its end and the CLI waited forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "cryobox.cli.main"]


@pytest.mark.parametrize(
    "argv",
    [["exec", "-it", "sbx-000000000000", "--", "python3"], ["shell", "sbx-000000000000"]],
)
def test_a_terminal_session_refuses_piped_input_at_once(argv: list[str]) -> None:
    done = subprocess.run(
        [*CLI, *argv], input="print(6*7)\n", capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "the input is not a terminal" in done.stderr


def test_a_table_on_a_narrow_terminal_keeps_ids_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    from cryobox.cli import output

    narrow = Console(width=60, force_terminal=True, record=True, color_system=None)
    monkeypatch.setattr(output, "out", narrow)
    rows = [("sbx-0123456789ab", "running", "default", "a long template origin", "2 vCPU")]
    output.print_rows(("ID", "STATE", "TEMPLATE", "ORIGIN", "SHAPE"), rows)
    assert "sbx-0123456789ab" in narrow.export_text()


def test_a_negative_number_is_a_value_refused_by_name(tmp_path: Path) -> None:
    """``set-timeout ID -1`` once answered "No such option: -1"."""
    env = {**os.environ, "CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(tmp_path)}
    made = subprocess.run(
        [*CLI, "create", "--template", "base"], env=env, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    sandbox_id = made.stdout.strip().splitlines()[-1]
    try:
        paused = subprocess.run([*CLI, "pause", sandbox_id], env=env, capture_output=True)
        assert paused.returncode == 0, paused.stderr
        for seconds in ("-1", "0", "nan"):
            done = subprocess.run(
                [*CLI, "set-timeout", sandbox_id, seconds], env=env, capture_output=True, text=True
            )
            assert done.returncode == 1
            assert (
                "seconds=" in done.stderr
                and "must be a positive, finite number of seconds" in done.stderr
            ), done.stderr
            assert "No such option" not in done.stderr
        state = subprocess.run(
            [*CLI, "info", sandbox_id, "--json"], env=env, capture_output=True, text=True
        )
        assert '"state": "paused"' in state.stdout  # refused before anything resumed it
        extended = subprocess.run(
            [*CLI, "set-timeout", sandbox_id, "600"], env=env, capture_output=True, text=True
        )
        assert extended.returncode == 0, extended.stderr
    finally:
        subprocess.run([*CLI, "kill", sandbox_id], env=env, capture_output=True, check=False)


def test_piped_output_is_never_wrapped_at_80_columns(tmp_path: Path) -> None:
    """An error (and a tree) read by a script or a log came cut into 80-column lines."""
    env = {**os.environ, "CRYOBOX_VMM": "fake", "CRYOBOX_STATE_DIR": str(tmp_path)}
    long_id = "sbx-" + "0" * 120
    done = subprocess.run([*CLI, "kill", long_id], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: no sandbox with id '{long_id}'"


def test_a_usage_error_piped_is_one_plain_line_naming_the_arguments() -> None:
    """Piped, typer's own errors were a box cut at 80 columns, and its usage line read
    ``{sandbox_id}:TEXT {seconds}:FLOAT`` (issue 37)."""
    long_value = "x" * 120
    done = subprocess.run(
        [*CLI, "create", "--cpus", long_value], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert f"Error: Invalid value for '--cpus': '{long_value}' is not a valid int." in (
        done.stderr.splitlines()
    )
    assert "╭" not in done.stderr
    missing = subprocess.run([*CLI, "set-timeout"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert "set-timeout [OPTIONS] SANDBOX_ID SECONDS\n" in missing.stderr
    assert "Error: Missing argument" in missing.stderr


def test_image_info_piped_is_tab_separated_as_every_listing() -> None:
    """It printed a box-drawn table into a pipe, where every other listing gives lines
    of tab-separated fields."""
    from cryobox.image.build import image_key

    done = subprocess.run([*CLI, "image", "info"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "FIELD\tVALUE" and f"id\t{image_key()['id']}" in lines
    assert not any(box in done.stdout for box in "│┌└")


def test_the_tree_keeps_ended_copies_under_the_sandbox_they_were_forked_from(
    tmp_path: Path,
) -> None:
    """Once every copy of a fork ended, its fork snapshot went, and the copies were
    drawn at the top of `cryobox tree`, as if they had come from nowhere."""
    env = {
        **os.environ,
        "CRYOBOX_VMM": "fake",
        "CRYOBOX_STATE_DIR": str(tmp_path),
        "CRYOBOX_POOL_SIZE": "0",
        "COLUMNS": "200",
    }

    def cli(*argv: str) -> str:
        done = subprocess.run([*CLI, *argv], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    parent = cli("create", "--template", "base").strip().splitlines()[-1]
    try:
        copies = cli("fork", parent, "-n", "2").split()
        cli("kill", *copies)
        lines = cli("tree").splitlines()
    finally:
        cli("kill", parent)
    top = next(i for i, line in enumerate(lines) if parent in line)
    under = [line for line in lines if any(c in line for c in copies)]
    assert len(under) == 2
    for line in under:
        assert lines.index(line) > top and line.startswith("    ") and "forked, from" in line
