"""How every ``cryobox`` command prints: results on stdout, messages and errors on
stderr, tables on a terminal and tab-separated lines when piped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
import typer.core as _typer_core
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cryobox.errors import CryoboxError

console = Console(stderr=True)
out = Console()


def say_error(error: object) -> None:
    """One red ``error:`` line; the message itself is printed as it is (brackets in a
    path or a label are text, never markup)."""
    console.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)


def fail(error: Exception) -> None:
    say_error(error)
    raise typer.Exit(1)


def print_rows(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A table on a terminal; tab-separated lines, whole values, when piped (a tab or a
    line break inside a value becomes a space, so a row stays one line)."""
    if not out.is_terminal:
        for row in (header, *rows):
            print("\t".join(" ".join(cell.split("\t")).replace("\n", " ") for cell in row))
        return
    table = Table()
    for index, name in enumerate(header):
        if index == 0:  # the id: whole on any width, so that it can be copied
            widest = max((len(row[0]) for row in rows), default=0)
            table.add_column(escape(name), no_wrap=True, min_width=max(widest, len(name)))
        else:
            table.add_column(escape(name))
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    out.print(table)


@contextmanager
def errors_reported() -> Iterator[None]:
    """Turn cryobox errors into one readable line and exit code 1."""
    try:
        yield
    except CryoboxError as exc:
        fail(exc)


#: Typer's own words for a value's type are Python's (``<int>``, ``<list[str]>``); the
#: help shows the shell's instead, as click always did. Only plain types are renamed:
#: anything else (choices, ranges, paths, a metavar of its own) keeps typer's text.
_TYPE_WORDS = {"int": "INTEGER", "str": "TEXT", "float": "FLOAT", "Path": "PATH"}
_ORIGINAL = {
    cls: cls.display_type_rich for cls in (_typer_core.TyperOption, _typer_core.TyperArgument)
}


def _type_in_words(param: Any, ctx: Any) -> str | None:
    """``INTEGER``, ``TEXT``, ``FLOAT`` (``...`` when repeatable); nothing for a flag."""
    if getattr(param, "is_flag", False):
        return None
    original = _ORIGINAL.get(type(param))
    desc = param.type_descriptor
    plain = not (desc.is_choice or desc.is_ranged or desc.is_tuple or desc.is_datetime)
    bare = param.bare_type()
    if bare.startswith("list[") and bare.endswith("]"):
        bare = bare[5:-1]
    if param.metavar is not None or not plain or bare not in _TYPE_WORDS:
        return original(param, ctx) if original is not None else None
    return _TYPE_WORDS[bare] + ("..." if param.nargs != 1 else "")


for _cls in _ORIGINAL:
    _cls.display_type_rich = _type_in_words  # type: ignore[method-assign,assignment]
