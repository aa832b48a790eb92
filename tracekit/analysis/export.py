"""Runs as a Parquet dataset that any engine reads without tracekit (pandas, pyarrow, DuckDB,
Ray Data, Spark): `tracekit export RUNS... -o DATASET/ --partition-by rung,replica`.

Layout (hive-partitioned by the config keys the user names; one file per run and table):

    DATASET/_tracekit_dataset.json       what wrote it, partition keys, labels, runs
    DATASET/gaps/KEY=VALUE/.../RUN.parquet   one row per gap
    DATASET/runs/KEY=VALUE/.../RUN.parquet   one row per run: every per-run figure

`gaps` columns: `run`, `request` (the request's id), `t0_s`, `t1_s` (the two emissions,
seconds from engine start), `gap_ms`, `step0`, `step1`, `primary` (primary cause or
`clean`), and one `part_LABEL_ms` per label (they sum to `gap_ms`).

`runs` columns: `run`, `path`, and every figure of `tracekit.analysis.figures.RunAnalysis`
flattened: scalars as they are (`itl_p99`, `tok_per_s`, ...), per-label and per-cause maps
as `tail_share_LABEL`, `all_share_LABEL`, `tail_count_CAUSE`, `evicted_context_ms_LABEL`,
`gc_counts_GEN`, `graph_baseline_...`; the histogram as `hist_count_LO_HI` plus
`hist_json` (counts by primary cause); `gen2_startup_ms`/`gen2_serving_ms` and `labels`
as lists; `config_json` (the run's config) and `warnings`.

Exported with `--window`/`--around` (docs/reports.md, "Windows"): `gaps` holds the gaps
that end in each run's window, each partitioned as in the whole run; `runs` holds the
figures `tracekit analyze --window` gives (per gap of the window, per run of the whole
run) and `window_from_s`, `window_to_s` (null: open) and `window_how`.

A long one-process run (more emissions than one slice: docs/reports.md, "Reading a long
run in slices") is exported in slices: its gaps file is written block by block (a row
group each) with the whole run's rows in the whole run's order, parts to float rounding
(`tracekit.analysis.stream_export`); its runs row is `analyze`'s of it read in slices.

Every file of a table has the same columns in the same order: labels an engine adds
(`part_schedule_ms`, `tail_share_schedule`) appear in every file, 0 where a run has none
(a label with no time owns 0 ms and a 0 share). The partition key columns come from the
directory names only (readers add them), never from inside the files.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.allocator import keep_freed_memory
from tracekit.analysis.compare import config_value
from tracekit.analysis.figures import analyze
from tracekit.analysis.run import is_run_dir, open_run
from tracekit.analysis.stream import NotSliceable
from tracekit.analysis.stream_export import GapRows, SpilledGaps, sliced_config, spill_gaps_sliced
from tracekit.analysis.stream_window import analyze_window
from tracekit.analysis.window import Window, WindowOptions, select_gaps
from tracekit.analysis.workers import slice_budget, sliced_parts, sliced_window
from tracekit.attribution.itl import partition
from tracekit.errors import TracekitError
from tracekit.log.archive import read_npz

#: Written at the dataset's root (readers skip files starting with "_").
DATASET_META = "_tracekit_dataset.json"
DATASET_FORMAT = "tracekit.dataset"
DATASET_VERSION = 1
GAPS_DIR = "gaps"
RUNS_DIR = "runs"
#: A run without the partition key is filed under the hive convention's null value
#: (pyarrow and Spark read it back as null).
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"

_SAFE_VALUE = re.compile(r"^[A-Za-z0-9._+-]+$")
#: A label kept as it is in a column name: letters and digits, single `_` between them.
_PLAIN_COLUMN = re.compile(r"[A-Za-z0-9]+(?:_[A-Za-z0-9]+)*")
#: Longest escaped partition value (a directory name holds 255 bytes; `KEY=` comes first).
MAX_PARTITION_VALUE_BYTES = 200


class DatasetError(TracekitError):
    """A dataset that cannot be written or read (names the path and what is wrong)."""


# -- one run -> rows ----------------------------------------------------------------------


def column_name(text: str) -> str:
    """A label or cause as a column-name fragment: letters, digits and `_` only, one to one
    (two labels never share a column, so the parts still sum to `gap_ms`). A plain name
    (`preempt`, `wait_kv_blocks`) is itself; any other (`a-b`, `a.b`, `é`, `a__b`, ``)
    is ``__`` followed by each of its UTF-8 bytes: a letter or digit as it is, any other
    byte as ``_`` and two hex digits (`a-b` -> `__a_2db`, `a.b` -> `__a_2eb`). A plain
    name never holds ``__``, so the two forms never meet."""
    if _PLAIN_COLUMN.fullmatch(text):
        return text
    out = ["__"]
    for b in text.encode("utf-8", "surrogatepass"):
        c = chr(b)
        out.append(c if c.isascii() and c.isalnum() else f"_{b:02x}")
    return "".join(out)


def partition_value(config: Mapping[str, Any], key: str) -> str:
    """The directory value of `key` for a run: strings as they are, other values as compact
    JSON, URI-escaped where not plain (`%2F` for `/`); missing: the hive null."""

    v = config_value(config, key)
    if v is None:
        return NULL_PARTITION
    text = v if isinstance(v, str) else json.dumps(v, sort_keys=True, separators=(",", ":"))
    if text and _SAFE_VALUE.match(text) and text != NULL_PARTITION:
        out = text
    else:  # non-ASCII as its UTF-8 bytes, %XX (readers decode it back)
        out = urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")
    if not out:
        return NULL_PARTITION
    if len(out) > MAX_PARTITION_VALUE_BYTES:
        raise DatasetError(
            f"--partition-by {key}: the value {text[:40]!r}... is {len(out)} bytes as a "
            f"directory name (at most {MAX_PARTITION_VALUE_BYTES}): partition by a shorter key"
        )
    return out


def run_row(analysis: Any, run_id: str) -> dict[str, Any]:
    """Every figure of one `RunAnalysis` as one flat row (see the module docstring)."""
    d = analysis.to_dict()
    row: dict[str, Any] = {"run": run_id, "path": str(d.pop("path"))}
    row["config_json"] = json.dumps(d.pop("config"), sort_keys=True)
    d.pop("rung", None)  # both are in config_json (and usually a partition key)
    d.pop("seed", None)
    row["labels"] = list(d.pop("labels"))
    row["warnings"] = [str(w) for w in d.pop("warnings")]
    window = d.pop("window", None)  # exported with --window/--around: which part of the run
    if window is not None:
        row["window_from_s"], row["window_to_s"] = window["from_s"], window["to_s"]
        row["window_how"] = str(window["how"])
    hist = d.pop("hist")
    for b in hist:
        hi = "inf" if b["hi_ms"] is None or not math.isfinite(b["hi_ms"]) else f"{b['hi_ms']:g}"
        row[f"hist_count_{b['lo_ms']:g}_{hi}"] = int(b["count"])
    row["hist_json"] = json.dumps(hist, sort_keys=True)
    _flatten(d, "", row)
    return row


def _flatten(d: Mapping[str, Any], prefix: str, row: dict[str, Any]) -> None:
    """Nested figures (`ttft`'s shares, a server run's `client` block) as columns
    ``name_key_subkey``; a top-level list of numbers stays a list column, a nested list is
    JSON (so every file of the dataset has the same column types)."""
    for name, v in d.items():
        key = f"{prefix}{column_name(str(name))}" if prefix else str(name)
        if isinstance(v, Mapping):
            _flatten(v, key + "_", row)
        elif isinstance(v, list) and not prefix:  # a figure's values: a list of numbers
            row[key] = [float(x) for x in v]
        elif isinstance(v, list):  # inside a nested block: one JSON column, same in every run
            row[key] = json.dumps(v, sort_keys=True, default=str)
        else:
            row[key] = _scalar(v)


def _scalar(v: Any) -> Any:
    """Ints stay ints, bools bools, floats floats; a figure without a value (a run without
    gaps has no p99) is None: a null in Parquet, which SQL engines skip in max() and
    median() (a NaN would sort above every number there)."""
    if v is None or isinstance(v, (bool, int)):
        return v
    return float(v) if math.isfinite(float(v)) else None


def gap_columns(
    log: Any, part: Any, run_id: str, labels: Sequence[str] | None = None
) -> dict[str, np.ndarray]:
    """One run's gaps as columns (see the module docstring); `labels`: the run's, where
    `part` may have fewer (a window of a long run: 0 ms for a label it lacks)."""
    ids = log.request_names()
    id_arr = np.asarray(ids, dtype=object)
    n = len(part)
    cols: dict[str, Any] = {
        "run": np.full(n, run_id, dtype=object),
        "request": id_arr[part.request] if n else np.zeros(0, dtype=object),
        "t0_s": part.t0_s,
        "t1_s": part.t1_s,
        "gap_ms": part.gap_ms,
        "step0": part.step0.astype(np.int64),
        "step1": part.step1.astype(np.int64),
        "primary": part.primary_names().astype(object) if n else np.zeros(0, dtype=object),
    }
    for lb in part.labels if labels is None else labels:
        col = part.column(lb) if lb in part.labels else np.zeros(n)
        cols[f"part_{column_name(lb)}_ms"] = np.ascontiguousarray(col)
    return cols


def block_columns(rows: GapRows, spill: SpilledGaps, run_id: str) -> dict[str, Any]:
    """A block of a long run's gaps (`SpilledGaps.blocks`) as the columns `gap_columns`
    gives the whole run: `primary` dictionary-encoded with the whole run's dictionary."""
    import pyarrow as pa  # deferred: pyarrow loads when a table is written

    n = len(rows)
    cols: dict[str, Any] = {
        "run": np.full(n, run_id, dtype=object),
        "request": rows.request,
        "t0_s": rows.t0_s,
        "t1_s": rows.t1_s,
        "gap_ms": rows.gap_ms,
        "step0": rows.step0,
        "step1": rows.step1,
        "primary": pa.DictionaryArray.from_arrays(
            pa.array(rows.primary, type=pa.int32()), pa.array(spill.primaries, type=pa.string())
        ),
    }
    for j, lb in enumerate(spill.labels):
        cols[f"part_{column_name(lb)}_ms"] = np.ascontiguousarray(rows.parts_ms[:, j])
    return cols


# -- writing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportedRun:
    """What exporting one run wrote (returned from worker processes or Ray tasks)."""

    run: str
    path: str
    gaps_file: str  # relative to the dataset root
    runs_file: str
    gaps: int
    gap_columns: tuple[str, ...]
    run_columns: tuple[str, ...]


def run_ids(paths: Sequence[str]) -> list[str]:
    """A unique id per run: its file name without `.npz`; a repeat (`x/a.npz` and
    `y/a.npz`) gets `-2`, `-3`, ..., never an id another run has (`a-2.npz`), nor one that
    differs from another only by case (one file on a case-insensitive filesystem)."""
    stems = []
    for p in paths:
        stem = os.path.basename(os.path.normpath(p))
        stem = stem[: -len(".npz")] if stem.endswith(".npz") else stem
        stems.append(stem or "run")
    taken = {st.casefold() for st in stems}
    seen: set[str] = set()
    out = []
    for stem in stems:
        rid, k = stem, 1
        if rid.casefold() in seen:
            while rid.casefold() in taken:
                k += 1
                rid = f"{stem}-{k}"
            taken.add(rid.casefold())
        seen.add(rid.casefold())
        out.append(rid)
    return out


def export_one(
    path: str,
    run_id: str,
    root: str,
    keys: Sequence[str],
    limits: Mapping[str, Any] | None = None,
    view: WindowOptions | None = None,
) -> ExportedRun:
    """Load, partition and analyse one run; write its gaps and runs files under `root`.
    `limits`: `load`'s bounds on reading the log (``max_inflate_mb``, ...). `view`: the
    window to export (docs/reports.md, "Windows"): its gaps, and the run's figures of it."""

    keep_freed_memory()
    long = sliced_parts(path) if view is None or view.is_whole_run else None
    if long is not None:  # a long run: in slices, in bounded memory (the same rows)
        done = _export_sliced(path, long, run_id, root, keys, limits or {})
        if done is not None:
            return done
    wr = sliced_window(path, view, **dict(limits or {})) if view is not None else None
    win: Window | None = None
    if wr is not None:  # a window of a long run: the parts it needs (the same rows)
        log, whole, win = wr.log, wr.part, wr.window
    else:
        log = open_run(path, **dict(limits or {}))
        whole = partition(log)
        win = view.resolve(log, whole) if view is not None else None
    part = select_gaps(whole, win)
    _no_clean_cause(path, part.causes)
    analysis = analyze_window(wr) if wr is not None else analyze(log, whole, window=win)
    gaps_rel, runs_rel = _files_of(analysis.config, keys, run_id)
    gcols = gap_columns(log, part, run_id, analysis.labels)
    row = run_row(analysis, run_id)
    _no_key_columns(keys, gcols, row)
    _write(os.path.join(root, gaps_rel), _table(gcols))
    _write(os.path.join(root, runs_rel), _table({k: [v] for k, v in row.items()}))
    return ExportedRun(
        run=run_id,
        path=path,
        gaps_file=gaps_rel,
        runs_file=runs_rel,
        gaps=len(part),
        gap_columns=tuple(gcols),
        run_columns=tuple(row),
    )


def _no_clean_cause(path: str, causes: Iterable[str]) -> None:
    if "clean" in causes:  # `primary` says `clean` for a gap without a cause
        raise DatasetError(
            f"{path}: a label maps to the cause 'clean', the name the gaps table gives a gap "
            "without a cause: rename that label when recording"
        )


def _files_of(config: Mapping[str, Any], keys: Sequence[str], run_id: str) -> tuple[str, str]:
    """A run's gaps and runs files, relative to the dataset's root."""
    hive = [f"{k}={partition_value(config, k)}" for k in keys]
    fname = f"{urllib.parse.quote(run_id, safe='')}.parquet"
    return os.path.join(GAPS_DIR, *hive, fname), os.path.join(RUNS_DIR, *hive, fname)


def _no_key_columns(keys: Sequence[str], gap_cols: Iterable[str], row: Mapping[str, Any]) -> None:
    gap_cols = set(gap_cols)
    for k in keys:  # partition keys live in the directory names only: never a column's
        if k in gap_cols or k in row:
            raise DatasetError(
                f"--partition-by {k}: a column of the {'gaps' if k in gap_cols else 'runs'} "
                "table has this name (readers would see two columns of one name): partition "
                "by a config key that is not a figure"
            )


def _export_sliced(
    path: str, long: tuple[str, str], run_id: str, root: str, keys: Sequence[str],
    limits: Mapping[str, Any],
) -> ExportedRun | None:  # fmt: skip
    """`export_one` of a long run read in slices (see the module docstring): its gaps
    spilled beside the dataset (a dot folder, removed after), then written in blocks.
    None where the run must be read whole."""
    parts_dir, shown = long
    os.makedirs(root, exist_ok=True)
    spill_dir = tempfile.mkdtemp(prefix=".tracekit-spill-", dir=root)
    try:
        try:
            spill = spill_gaps_sliced(parts_dir, spill_dir, path=shown,
                                      max_emissions=slice_budget(),
                                      max_inflate_mb=limits.get("max_inflate_mb"))  # fmt: skip
        except NotSliceable:  # damaged, or written before parts said their first step
            return None
        assert spill.analysis is not None
        _no_clean_cause(path, spill.causes)
        gaps_rel, runs_rel = _files_of(spill.analysis.config, keys, run_id)
        row = run_row(spill.analysis, run_id)
        gcols = list(block_columns(spill.empty(), spill, run_id))
        _no_key_columns(keys, gcols, row)
        blocks = spill.blocks() if spill.rows else iter([spill.empty()])
        _write_blocks(os.path.join(root, gaps_rel),
                      (_table(block_columns(b, spill, run_id)) for b in blocks))  # fmt: skip
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
    _write(os.path.join(root, runs_rel), _table({k: [v] for k, v in row.items()}))
    return ExportedRun(run=run_id, path=path, gaps_file=gaps_rel, runs_file=runs_rel,
                       gaps=spill.rows, gap_columns=tuple(gcols),
                       run_columns=tuple(row))  # fmt: skip


def _absent_keys(paths: Sequence[str], keys: Sequence[str], limits: Mapping[str, Any]) -> list[str]:
    """The keys no run's config has. Reads each log's config only (its `config` member)."""

    absent = list(keys)
    for p in paths:
        cfg = _config_of(p, limits)
        absent = [k for k in absent if config_value(cfg, k) is None]
        if not absent:
            break
    return absent


def _config_of(path: str, limits: Mapping[str, Any]) -> Mapping[str, Any]:
    """A log's config: its `config` member alone where it has one (v1), else the opened
    run's (the published layout keeps it elsewhere; a run directory is opened whole)."""

    long = sliced_parts(path)
    if long is not None:  # a long run: its config alone, never its rows
        return sliced_config(long[0], limits.get("max_inflate_mb"))
    if is_run_dir(path):
        return open_run(path, **dict(limits)).config
    z, _ = read_npz(path, lambda names: [n for n in names if n == "config"],
                    max_inflate_mb=limits.get("max_inflate_mb"))  # fmt: skip
    if "config" in z:
        try:
            cfg = json.loads(str(z["config"]))
        except (ValueError, RecursionError):
            cfg = None
        if isinstance(cfg, dict):
            return cfg
    return open_run(path, **dict(limits)).config


def _table(cols: Mapping[str, Any]):
    import pyarrow as pa  # deferred: pyarrow loads when a table is written

    arrays = {}
    for k, v in cols.items():
        if isinstance(v, pa.Array):  # built as it is to be written
            arrays[k] = v
        elif isinstance(v, np.ndarray) and v.dtype != object:
            arrays[k] = pa.array(v)
        elif k in ("run", "primary"):
            arrays[k] = pa.array(list(v), type=pa.string()).dictionary_encode()
        elif k in ("request", "path", "config_json", "hist_json"):
            arrays[k] = pa.array(list(v), type=pa.string())
        elif k in _STRING_LISTS:
            arrays[k] = pa.array(list(v), type=pa.list_(pa.string()))
        elif len(v) and isinstance(v[0], list):  # gen2 pause lists: ms
            arrays[k] = pa.array(list(v), type=pa.list_(pa.float64()))
        elif all(x is None for x in v):  # a figure without a value: a float figure
            arrays[k] = pa.array(list(v), type=pa.float64())
        else:
            arrays[k] = pa.array(list(v))
    return pa.table(arrays)


#: List columns of strings in the runs table (other lists hold ms).
_STRING_LISTS = frozenset({"labels", "warnings"})


def _write(path: str, table: Any) -> None:
    import pyarrow.parquet as pq  # deferred: pyarrow loads when a table is written

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _write_blocks(path: str, tables: Iterable[Any]) -> None:
    """One file of `tables` (one schema), appended a row group each: never one table."""
    import pyarrow.parquet as pq  # deferred: pyarrow loads when a table is written

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    writer = None
    try:
        for t in tables:
            if writer is None:
                writer = pq.ParquetWriter(tmp, t.schema, compression="zstd")
            writer.write_table(t)
    finally:
        if writer is not None:
            writer.close()
    os.replace(tmp, path)


def _zeros(field: Any, n: int):
    """A column of `n` zeros of `field`'s type (nulls for a non-numeric type)."""
    import pyarrow as pa  # deferred: pyarrow loads when a table is written

    t = field.type
    if pa.types.is_integer(t):
        return pa.array(np.zeros(n, dtype=np.int64)).cast(t)
    if pa.types.is_floating(t):
        return pa.array(np.zeros(n)).cast(t)
    return pa.nulls(n, type=t)


def _unify(root: str, files: Sequence[str], columns: Sequence[Sequence[str]]) -> list[str]:
    """Give every file of a table the same columns in the same order: the union, in order
    of first appearance (standard labels come first in every run). A column a file lacks
    is a label that run never saw: 0 (ms, share or count). Returns the union."""
    import pyarrow.parquet as pq  # deferred: pyarrow loads when a table is written

    union = list(dict.fromkeys(c for cols in columns for c in cols))
    schemas: dict[str, Any] = {}

    def field(c: str) -> Any:
        f = next(f for f, cols in zip(files, columns, strict=True) if c in cols)
        if f not in schemas:
            schemas[f] = pq.read_schema(os.path.join(root, f))
        return schemas[f].field(c)

    def widened(src: Any) -> Iterator[Any]:  # row group by row group: never a whole file
        for i in range(src.num_row_groups) or [None]:  # a file of no rows has no group
            t = src.read() if i is None else src.read_row_group(i)
            for c in union:
                if c not in t.column_names:
                    fc = field(c)
                    t = t.append_column(fc, _zeros(fc, t.num_rows))
            yield t.select(union)

    for f, cols in zip(files, columns, strict=True):
        if list(cols) == union:
            continue
        with pq.ParquetFile(os.path.join(root, f)) as src:
            _write_blocks(os.path.join(root, f), widened(src))
    return union


def export(
    paths: Sequence[str],
    root: str,
    keys: Sequence[str] = (),
    *,
    mapper: Callable[[Callable[..., Any], Sequence[tuple]], Iterable[Any]] | None = None,
    limits: Mapping[str, Any] | None = None,
    view: WindowOptions | None = None,
) -> dict[str, Any]:
    """Export runs to a dataset at `root`. `mapper(fn, arg_tuples)` runs `export_one` over
    the runs (in order; a process pool or Ray); default: one by one here. `limits`: `load`'s
    bounds on reading each log. `view`: each run's window (`--window`/`--around`), or
    None for whole runs. Returns the dataset's metadata (also written to
    `root/_tracekit_dataset.json`).

    A run without a partition key is filed under the hive null. A key that *no* run has is
    left out of the layout (and listed as ``partition_by_absent`` in the metadata): a level
    that is null everywhere gives readers no type to infer (pyarrow, pandas and Ray Data
    refuse such a dataset)."""
    if len(set(keys)) != len(keys):
        raise DatasetError(f"--partition-by {','.join(keys)}: a key appears twice")
    for k in keys:
        if (
            not k
            or "/" in k
            or "=" in k
            or "\\" in k
            or k.startswith((".", "_"))
            or not k.isprintable()
            or len(k.encode("utf-8", "surrogatepass")) > 100
            or k in _RESERVED
        ):
            raise DatasetError(f"--partition-by {k[:60]!r}: not usable as a partition key name")
    if os.path.exists(root) and not os.path.isdir(root):
        raise DatasetError(f"{root}: exists and is not a directory")
    meta_path = os.path.join(root, DATASET_META)
    if os.path.isdir(root) and os.listdir(root) and not os.path.exists(meta_path):
        raise DatasetError(f"{root}: not empty and not a tracekit dataset (pick a new folder)")
    if os.path.exists(meta_path):
        raise DatasetError(
            f"{root}: already holds a tracekit dataset (export into a new folder, or delete it)"
        )
    ids = run_ids(paths)
    lim = dict(limits or {})
    created = not os.path.exists(root)
    try:
        absent = _absent_keys(paths, keys, lim) if keys else []
        used = tuple(k for k in keys if k not in absent)
        args = [(p, r, root, used, lim, view) for p, r in zip(paths, ids, strict=True)]
        done = [export_one(*a) for a in args] if mapper is None else list(mapper(export_one, args))
        gap_cols = _unify(root, [d.gaps_file for d in done], [d.gap_columns for d in done])
        _unify(root, [d.runs_file for d in done], [d.run_columns for d in done])
    except BaseException:
        if created:  # a bad log midway: leave no half dataset behind
            shutil.rmtree(root, ignore_errors=True)
        raise
    meta = {
        "format": DATASET_FORMAT,
        "version": DATASET_VERSION,
        "partition_by": list(used),
        "partition_by_absent": list(absent),
        "labels": [c[len("part_") : -len("_ms")] for c in gap_cols if c.startswith("part_")],
        "runs": [{"run": d.run, "path": d.path, "gaps": d.gaps} for d in done],
        "gaps": int(sum(d.gaps for d in done)),
    }
    if view is not None and not view.is_whole_run:  # each run's own: its runs row says which
        meta["window"] = view.to_dict()
    with open(meta_path, "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    return meta


#: Column names a partition key may not take (they are the tables' own columns).
_RESERVED = frozenset({"run", "request", "t0_s", "t1_s", "gap_ms", "primary", "path"})
