"""How every ``cryobox`` command prints: results on stdout, messages and errors on
stderr, tables on a terminal and tab-separated lines when piped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
import typer.core as _typer_core
from rich.console import Console
from rich.table import Table

from cryobox.errors import CryoboxError

console = Console(stderr=True)
out = Console()


def fail(error: Exception) -> None:
    console.print(f"[red]error:[/red] {error}", highlight=False, markup=True)
    raise typer.Exit(1)


def print_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on a terminal; tab-separated lines, whole values, when piped."""
    if not out.is_terminal:
        for row in (header, *rows):
            print("\t".join(row))
        return
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    out.print(table)


@contextmanager
def errors_reported() -> Iterator[None]:
    """Turn cryobox errors into one readable line and exit code 1."""
    try:
        yield
    except CryoboxError as exc:
        fail(exc)


#: Typer's own words for a value's type are Python's (``<int>``, ``<list[str]>``); the
#: help shows the shell's instead, as click always did.
_TYPE_WORDS = {"int": "INTEGER", "str": "TEXT", "float": "FLOAT", "Path": "PATH"}


def _type_in_words(param: Any, ctx: Any) -> str | None:
    """``INTEGER``, ``TEXT``, ``PATH``...; nothing for a flag (``--all``)."""
    if getattr(param, "is_flag", False):
        return None
    if param.metavar is not None:
        return str(param.metavar)
    bare = _typer_core._TyperParameter.display_type(param, ctx).strip("<>")
    if bare.startswith("list[") and bare.endswith("]"):
        bare = bare[5:-1]
    words = "|".join(_TYPE_WORDS.get(part, part.upper()) for part in bare.split("|"))
    return words + ("..." if param.nargs != 1 else "")


_typer_core.TyperOption.display_type_rich = _type_in_words  # type: ignore[method-assign,assignment]
_typer_core.TyperArgument.display_type_rich = _type_in_words  # type: ignore[method-assign,assignment]
