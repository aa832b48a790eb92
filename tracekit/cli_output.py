"""How the reading commands write their records (`--format`, `-o`): a table, JSON lines,
CSV or Parquet, to a file or to stdout, saying on stderr what was written.

Part of the `cli` stage: it imports nothing from `tracekit.cli`, which imports it.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import click

from tracekit.errors import UsageError, one_line


def write_records(
    records: list[dict[str, Any]], fmt: str, output: str | None, table: Callable[[], str]
) -> None:
    """`records` as --format asks: parquet (-o FILE), jsonl, csv, or `table()`."""
    if fmt == "parquet":
        return write_parquet(records, output, "parquet files")
    if fmt == "jsonl":
        body = "".join(json.dumps(r) + "\n" for r in records)
    elif fmt == "csv":
        import pandas as pd  # deferred: pandas only for this format

        buf = io.StringIO()
        pd.json_normalize(records, sep=".").to_csv(buf, index=False)
        body = buf.getvalue()
    else:
        body = table()
    emit(body, output)


def write_parquet(records: list[dict[str, Any]], output: str | None, what: str) -> None:
    """`records` as one Parquet file (nested fields flattened with dots) at `output`."""
    if not output:
        raise UsageError(f"--format parquet needs -o/--output FILE ({what} are binary)")
    import pandas as pd  # deferred: pandas only for this format

    pd.json_normalize(records, sep=".").to_parquet(output, index=False)
    click.echo(f"wrote {one_line(output)}", err=True)


def emit(body: str, output: str | None) -> None:
    """`body` to the file `output` (saying so on stderr), else to stdout."""
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(body)
        click.echo(f"wrote {one_line(output)}", err=True)
    else:
        click.echo(body, nl=False)


def open_in_browser(path: str) -> None:
    """`report --open`: the file in a browser, or its file:// URL where none is here."""
    import webbrowser  # deferred: only with --open

    url = pathlib.Path(os.path.abspath(path)).as_uri()
    try:
        ok = webbrowser.open(url)
    except webbrowser.Error:
        ok = False
    if ok:
        click.echo(f"opened {url}", err=True)
    else:
        click.echo(f"no browser available here; open {url}", err=True)
