"""`tracekit gaps` and `tracekit ttft` of a whole long one-process run, read in slices
(`tracekit.analysis.stream_listing`): the records spilled slice by slice to a temporary
folder, then written in the whole run's order, as the whole-run reader writes them
(docs/reports.md, "Reading a long run in slices").

Part of the `cli` stage: it imports nothing from `tracekit.cli`, which imports it.
"""

from __future__ import annotations

import io
import itertools
import math
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import click

from tracekit.cli_output import write_records
from tracekit.errors import UsageError, one_line

#: records turned into CSV or a Parquet row group at once
BLOCK_RECORDS = 50_000


def gaps_in_slices(
    run: str, fmt: str, min_ms: float | None, request_id: str | None, top: int,
    output: str | None, warn: Callable[[str, list[str]], None], **limits: Any,
) -> bool:  # fmt: skip
    """`tracekit gaps RUN` (engine boundary, no window) of a run read in slices; False
    where it is read whole (one slice, a merged run, a folder that must be read whole)."""
    # deferred: loaded per command
    from tracekit.analysis import workers
    from tracekit.analysis.stream import NotSliceable
    from tracekit.analysis.stream_listing import gap_listing_sliced
    from tracekit.render import text

    found = workers.sliced_parts(run)
    if found is None:
        return False
    with tempfile.TemporaryDirectory(prefix="tracekit-gaps-") as folder:
        try:
            lst = gap_listing_sliced(found[0], folder, min_ms=min_ms, request_id=request_id,
                                     top=top, path=found[1], max_emissions=workers.slice_budget(),
                                     max_inflate_mb=limits.get("max_inflate_mb"),
                                     records=fmt in ("jsonl", "csv", "parquet"))  # fmt: skip
        except NotSliceable:
            return False
        warn(lst.path, lst.warnings)
        if not lst.count:
            has = math.isfinite(lst.longest_ms)  # -inf: the index pass saw no gap
            longest = f"{lst.longest_ms:.1f} ms" if has else "none: no gaps"
            what = f" of request {request_id!r}" if request_id is not None else ""
            above = f" at least {min_ms:g} ms long" if min_ms is not None else ""
            click.echo(f"tracekit: {run}: no gap{what}{above} (the run's longest gap: "
                       f"{longest})", err=True)  # fmt: skip
        table = lambda: text.longest_gaps_table(lst.longest, lst.count) + "\n"  # noqa: E731
        _write(lst.lines, lst.records, lst.count, fmt, output, table if lst.count else str)
    return True


def ttft_in_slices(
    run: str, fmt: str, min_ms: float | None, request_id: str | None, top: int,
    output: str | None, warn: Callable[[str, list[str]], None], **limits: Any,
) -> bool:  # fmt: skip
    """`tracekit ttft RUN` (engine boundary, no window) of a run read in slices; False
    where it is read whole."""
    # deferred: loaded per command
    from tracekit.analysis import workers
    from tracekit.analysis.stream import NotSliceable
    from tracekit.analysis.stream_listing import ttft_listing_sliced
    from tracekit.render import text

    found = workers.sliced_parts(run)
    if found is None:
        return False
    with tempfile.TemporaryDirectory(prefix="tracekit-ttft-") as folder:
        try:
            lst = ttft_listing_sliced(found[0], folder, min_ms=min_ms, request_id=request_id,
                                      top=top, path=found[1], max_emissions=workers.slice_budget(),
                                      max_inflate_mb=limits.get("max_inflate_mb"))  # fmt: skip
        except NotSliceable:
            return False
        figs = lst.ttft_figures()
        if figs is None:  # no request had a first token: the whole-run reader says so
            return False
        warn(lst.path, lst.warnings)
        warn(lst.path, [f"TTFT: {n}" for n in figs.notes])

        def table() -> str:
            return text.ttft_requests(run, figs, lst.longest, top) + "\n"

        _write(lst.lines, lst.records, lst.count, fmt, output, table)
    return True


def _write(
    lines: Callable[[], Iterator[str]], records: Callable[[], Iterator[dict[str, Any]]],
    count: int, fmt: str, output: str | None, table: Callable[[], str],
) -> None:  # fmt: skip
    """The records as `write_records` writes them, streamed: JSON lines as spilled; CSV in
    blocks under the columns the whole run's table has (every record's fields, in the order
    they first appear); the table as given."""
    if fmt not in ("jsonl", "csv", "parquet") or not count:
        return write_records([], fmt, output, table)
    if fmt == "parquet":
        return _parquet(records, output)
    fh = open(output, "w", encoding="utf-8") if output else None  # noqa: SIM115
    put = fh.write if fh is not None else sys.stdout.write
    try:
        if fmt == "jsonl":
            for block in _batched(lines(), 10_000):
                put("".join(block))
        else:
            _csv(records, put)
    finally:
        if fh is not None:
            fh.close()
    if output:
        click.echo(f"wrote {one_line(output)}", err=True)
    else:
        sys.stdout.flush()


def _csv(records: Callable[[], Iterator[dict[str, Any]]], put: Callable[[str], Any]) -> None:
    """`pd.json_normalize(records).to_csv()` in blocks: a first pass finds the columns."""
    import pandas as pd  # deferred: pandas only for this format

    cols: dict[str, None] = {}  # as json_normalize flattens a record: scalars, then dicts'
    for rec in records():
        for k, v in rec.items():
            if not isinstance(v, dict):
                cols.setdefault(k)
        for k, v in rec.items():
            if isinstance(v, dict):
                for k2 in v:
                    cols.setdefault(f"{k}.{k2}")
    for n, block in enumerate(_batched(records(), BLOCK_RECORDS)):
        buf = io.StringIO()
        df = pd.json_normalize(block, sep=".").reindex(columns=list(cols))
        df.to_csv(buf, index=False, header=n == 0)
        put(buf.getvalue())


def _parquet(records: Callable[[], Iterator[dict[str, Any]]], output: str | None) -> None:
    """`pd.json_normalize(records).to_parquet()` in row groups: a first pass finds each
    column's type over every block (a block without a column, or with its values all
    null, takes the type the others give it), the second writes the blocks."""
    import pandas as pd  # deferred: pandas and pyarrow only for this format
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not output:
        raise UsageError("--format parquet needs -o/--output FILE (parquet files are binary)")
    schemas = [
        pa.Table.from_pandas(pd.json_normalize(block, sep="."), preserve_index=False).schema
        for block in _batched(records(), BLOCK_RECORDS)
    ]
    schemas = [sc.remove_metadata() for sc in schemas]
    schema = pa.unify_schemas(schemas, promote_options="permissive")
    with pq.ParquetWriter(output, schema) as writer:
        for block in _batched(records(), BLOCK_RECORDS):
            df = pd.json_normalize(block, sep=".")
            got = pa.Table.from_pandas(df, preserve_index=False)
            cols = [got.column(f.name).cast(f.type) if f.name in df.columns
                    else pa.nulls(len(df), f.type) for f in schema]  # fmt: skip
            writer.write_table(pa.Table.from_arrays(cols, schema=schema))
    click.echo(f"wrote {one_line(output)}", err=True)


def _batched(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while block := list(itertools.islice(it, n)):
        yield block
