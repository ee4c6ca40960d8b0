"""Every code block of the README and docs/ is run by tests/integration/test_readme_vm.py
or says why not (issue 37 item 7): checked here without a VM, so that a new block
without a marker fails at once."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from markdown_blocks import DATA, DOCUMENTS, RUNNABLE, Block, blocks, script


def _all() -> list[Block]:
    return [block for document in DOCUMENTS for block in blocks(document)]


def test_every_block_of_a_command_language_runs_or_says_why() -> None:
    found = _all()
    assert len(found) > 20, "the README and docs/ have more blocks than were found"
    for block in found:
        if block.language in RUNNABLE and not block.runs:
            assert block.not_run and len(block.not_run) > 20, (block.where, block.not_run)
        assert block.language in RUNNABLE + DATA, (block.where, block.language)
    running = [block.where for block in found if block.runs]
    assert len(running) >= 10, running  # the tours, not only their first lines


def test_a_failure_inside_a_runnable_shell_block_cannot_go_unnoticed() -> None:
    """Under ``set -e`` only the last command of an ``&&`` or ``||`` list stops the
    script, and ``export X=$(...)`` never fails: a block uses ``;`` and new lines."""
    for block in _all():
        if not block.runs or block.language == "python":
            continue
        for number, line in enumerate(block.code.splitlines(), start=1):
            code = re.sub(r"'[^']*'", "''", line.split(" # ")[0])  # not in a quoted argument
            assert "&&" not in code and "||" not in code, (block.where, number, line)
            assert not re.search(r"\bexport \w+=\$\(", code), (block.where, number, line)


@pytest.mark.parametrize("document", DOCUMENTS, ids=[d.name for d in DOCUMENTS])
def test_each_document_is_a_valid_bash_script(document: Path) -> None:
    checked = subprocess.run(
        ["bash", "-n", "-c", script(document)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stderr


def test_a_marker_must_sit_right_above_a_block(tmp_path: Path) -> None:
    stray = tmp_path / "stray.md"
    stray.write_text("<!-- not run: a reason long enough to count -->\n\ntext\n")
    with pytest.raises(ValueError, match="not right above a code block"):
        blocks(stray)
    unclosed = tmp_path / "unclosed.md"
    unclosed.write_text("```sh\necho never closed\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks(unclosed)


def test_a_partly_run_block_leaves_out_only_what_it_names(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- run: all but `make test`, the command that runs this check -->\n"
        "```sh\nmake demo\nmake test   # all of it\n```\n\n```python\nprint(6 * 7)\n```\n"
        "- in a list:\n\n  ```bash\n  echo indented\n  ```\n"
    )
    first, second = blocks(doc)[:2]
    assert first.script() == "make demo\n"
    assert second.script().startswith(".venv/bin/python - <<'CRYOBOX_README_BLOCK'\nprint(6 * 7)")
    (indented,) = blocks(doc)[2:]
    assert (indented.language, indented.code, indented.runs) == ("bash", "echo indented\n", True)
