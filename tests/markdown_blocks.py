"""The code blocks of the README and docs/, and how each is run by
``tests/integration/test_readme_vm.py``.

A fenced block in ``python``, ``sh`` or ``bash`` is run unless the line just above it
says why not::

    <!-- not run: needs a proxy and its CA file of your own -->

and one that runs only in part says what it leaves out (lines starting with that text)::

    <!-- run: all but `make test`, the command that runs this check -->

Blocks in other languages (``json``, ``ini``, ``dockerfile``, a diagram) are data, not
commands. The blocks of one document run in order as one bash script, as if typed into
one terminal: a variable or a server one block starts is there for the next.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
RUNNABLE = ("python", "sh", "bash")
#: Languages of blocks that are data or pictures, never run.
DATA = ("", "json", "ini", "dockerfile", "toml", "yaml", "text")
_NOT_RUN = re.compile(r"<!-- not run: (?P<why>.+?) -->")
_RUN_BUT = re.compile(r"<!-- run: all but `(?P<left_out>[^`]+)`, (?P<why>.+?) -->")
_FENCE = re.compile(r"^(?P<indent> *)```(?P<language>[A-Za-z0-9_+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    #: Why the block is not run (a placeholder, a command that never ends...), or None.
    not_run: str | None = None
    #: Lines starting with this are left out of the run (the rest runs).
    left_out: str | None = None

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUNNABLE and self.not_run is None

    def script(self) -> str:
        """This block as bash lines (a Python block through the project's interpreter)."""
        code = self.code
        if self.left_out is not None:
            kept = [line for line in code.splitlines() if not line.startswith(self.left_out)]
            code = "\n".join(kept) + "\n"
        if self.language == "python":
            return f".venv/bin/python - <<'CRYOBOX_README_BLOCK'\n{code}CRYOBOX_README_BLOCK\n"
        return code


def blocks(document: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the marker above it if any.

    :raises ValueError: on a fence left open, or a marker above no block.
    """
    lines = document.read_text().splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = _NOT_RUN.fullmatch(line.strip()) or _RUN_BUT.fullmatch(line.strip())
        if marker is not None and not (index + 1 < len(lines) and _FENCE.match(lines[index + 1])):
            raise ValueError(f"{document}:{index + 1}: a marker not right above a code block")
        opening = _FENCE.match(line)
        if opening is None:
            index += 1
            continue
        indent = len(opening["indent"])
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{document}:{index + 1}: a code block is never closed")
        above = lines[index - 1].strip() if index else ""
        not_run = _NOT_RUN.fullmatch(above)
        run_but = _RUN_BUT.fullmatch(above)
        found.append(
            Block(
                document,
                index + 1,
                opening["language"],
                "".join(f"{text[indent:]}\n" for text in lines[index + 1 : end]),
                not_run=not_run["why"] if not_run else None,
                left_out=run_but["left_out"] if run_but else None,
            )
        )
        index = end + 1
    return found


def script(document: Path) -> str:
    """The document's runnable blocks as one bash script that stops at the first failure
    and says, on stderr, which block it is in."""
    parts = ["set -eo pipefail\n"]
    for block in blocks(document):
        if block.runs:
            parts.append(f"echo '===== {block.where} ({block.language})' >&2\n")
            parts.append(block.script())
    return "".join(parts)
