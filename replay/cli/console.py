"""All terminal output of the CLI goes through this module.

Data (tables, reports, `--json`) goes to stdout, so `replay show RUN --json | jq` works;
status, progress, warnings and errors go to stderr. Colors only on a terminal (rich
decides; NO_COLOR is honored). Messages are printed without rich markup, so paths and
option names with brackets print as they are, and without wrapping, so an error stays on
one line however narrow the terminal.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, NoReturn, Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from replay.errors import EXIT_BAD_INPUT, UserError

# No file is bound: rich looks up sys.stdout / sys.stderr at each print, so output that
# tests capture (and redirections made after import) are followed.
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def print_table(
    rows: Iterable[Sequence[Any]],
    columns: Sequence[str] | None = None,
    title: str | None = None,
    justify: Sequence[str] | None = None,
) -> None:
    """A table on stdout. Cells are shown with str(), never interpreted as markup."""
    rows = [list(r) for r in rows]
    names = list(columns) if columns is not None else [""] * max((len(r) for r in rows), default=0)
    table = Table(title=title, box=box.ROUNDED, show_header=columns is not None, title_justify="left", title_style="bold")
    for i, name in enumerate(names):
        table.add_column(name, justify=(justify[i] if justify else "left"), overflow="fold")
    for row in rows:
        table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in row))
    out.print(table)


def styled(text: str, style: str) -> Text:
    """A table cell or line with a style (e.g. "green"); the text is never parsed as markup."""
    return Text(text, style=style)


def print_text(text: str = "", style: str | None = None) -> None:
    """A line of data on stdout."""
    out.print(Text(text, style=style or ""), soft_wrap=True)


def print_json(obj: Any) -> None:
    """Machine output: one JSON object on stdout, no colors. NaN/inf are not allowed in
    JSON, so callers must encode them (e.g. as strings)."""
    sys.stdout.write(json.dumps(obj, allow_nan=False, sort_keys=False) + "\n")
    sys.stdout.flush()


def _line(prefix: str, style: str, msg: str) -> None:
    from traces.storage.ondemand import in_url_terms  # a remote run's local copy named by its URL

    err.print(Text.assemble((prefix, style), " ".join(in_url_terms(str(msg)).splitlines())), soft_wrap=True)


def status(msg: str) -> None:
    """Progress and what is happening, on stderr."""
    _line("", "", msg)


def warn(msg: str) -> None:
    """One line on stderr: something is off, but the command goes on."""
    _line("warning: ", "bold yellow", msg)


def error(msg: str) -> None:
    """One line on stderr: what is wrong and what to do."""
    _line("error: ", "bold red", msg)


def fail(msg: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Stops the command: `main` prints `error: msg` on stderr and exits with `code`."""
    raise UserError(msg, code)


def local_output(option: str, value) -> None:
    """What a command writes beside its report (a plot, a bundle, a batch, an unpacked folder) is
    written locally: a URL there is refused in one line, before any work (runs are read from a
    bucket; these outputs are small, and copying one up is the user's one command)."""
    from traces.storage import is_url, shown

    if value is not None and is_url(value):
        fail(f"{option} {shown(value)}: this is written to local disk, not to object storage; give a local path "
             "(and copy it to the bucket afterwards)")


def progress(description: str):
    """A rich progress bar on stderr for long work; use as a context manager."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn(description), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=err, transient=False,
    )
