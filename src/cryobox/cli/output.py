"""How every ``cryobox`` command prints: results on stdout, messages and errors on
stderr, tables on a terminal and tab-separated lines when piped."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import typer
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
