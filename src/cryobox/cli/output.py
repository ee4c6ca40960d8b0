"""How every ``cryobox`` command prints: results on stdout, messages and errors on
stderr, tables on a terminal and tab-separated lines when piped."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import typer
import typer._click.types as _click_types
import typer.core as _typer_core
import typer.models as _typer_models
from rich.console import Console
from rich.markup import escape

from cryobox.errors import CryoboxError


def _console(stderr: bool) -> Console:
    """A terminal's width on a terminal; piped, lines are never wrapped (a script or a
    log reading an error or a tree gets each line whole, not cut at 80 columns)."""
    made = Console(stderr=stderr)
    return made if made.is_terminal else Console(stderr=stderr, width=1_000_000)


console = _console(stderr=True)
out = _console(stderr=False)


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
    from rich.table import Table  # 17 ms a start that prints no table does not pay

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


#: Typer's own words for a value's type are Python's (``<int>``, ``<str>``); the help
#: shows the shell's instead, as click always did. Only the plain types are renamed:
#: ranges, choices, paths with rules and a metavar of one's own keep typer's text.
_TYPE_WORDS: dict[type[Any], str] = {
    _click_types.StringParamType: "TEXT",
    _click_types.IntParamType: "INTEGER",
    _click_types.FloatParamType: "FLOAT",
    _typer_models.TyperPath: "PATH",
}


def _type_in_words(original: Any) -> Any:
    def get_metavar(self: Any, param: Any, ctx: Any) -> str | None:
        word = _TYPE_WORDS.get(type(self))
        return word if word is not None else original(self, param=param, ctx=ctx)

    return get_metavar


for _cls in _TYPE_WORDS:
    _cls.get_metavar = _type_in_words(_cls.get_metavar)


def _argument_metavar(self: Any, ctx: Any, *, usage: bool = False) -> str:
    """An argument as click writes it in a usage line: its name in capitals, bracketed
    when optional, ``...`` after one that takes many (``SANDBOX_ID SECONDS``, where
    typer 0.28 writes ``{sandbox_id}:TEXT {seconds}:FLOAT``)."""
    if self.metavar is not None:
        return str(self.metavar)
    name = (self.name or "").upper()
    if usage and not self.required:
        name = f"[{name}]"
    return name + ("..." if self.nargs != 1 else "")


_typer_core.TyperArgument.make_metavar = _argument_metavar  # type: ignore[method-assign]
_typer_main = _typer_core._main


def _main_with_plain_piped_errors(*args: Any, **kwargs: Any) -> Any:
    """typer's entry, but a usage error (a missing argument, a bad option) printed as
    click prints it when stderr is not a terminal: ``Error: ...`` on one line, not a
    box cut at 80 columns that a script or a log has to unpick."""
    if not sys.stderr.isatty():
        kwargs["rich_markup_mode"] = None
    return _typer_main(*args, **kwargs)


_typer_core._main = _main_with_plain_piped_errors
