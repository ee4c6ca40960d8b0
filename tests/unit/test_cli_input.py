"""`exec -it` and `shell` refuse at once when stdin is not a terminal (issue 37): fed
from a pipe, a terminal session never saw its end and the CLI waited forever."""

from __future__ import annotations

import subprocess
import sys

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
