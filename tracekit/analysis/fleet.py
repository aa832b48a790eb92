"""Fleet rollups: `tracekit fleet DATASET/ --by KEY` (or over raw logs).

Per group of runs (one value of KEY):

- **across runs**: the median and [min-max] of every numeric per-run figure of the runs
  table (`tracekit.analysis.export`), over the runs with a finite value. Exact.
- **pooled**: percentiles 50, 90, 99, 99.9 and the max of *all* gaps of the group's runs
  (numpy's linear percentiles), the group's tail (gaps at or above its pooled p99) and
  each label's share of the tail's time, and tail gaps by primary cause.

Pooled percentiles are exact while the group's gaps fit in the memory budget (8 bytes a
gap). Beyond it they come from a mergeable quantile summary (`QuantileSketch`): each data
file contributes a summary of its sorted gaps, summaries merge in file order, and every
answer carries a proven bound on its rank error (how many positions the returned gap may
sit from the exact percentile's position in the sorted gaps), printed beside it. The tail
is then the gaps at or above the sketch's p99, and its shares are summed exactly.

Runs are still the unit of evidence (design.md): the across-runs figures are what a fix is
judged by; pooled percentiles answer "what did our users see, all runs together".

The work is per data file (one per run in a dataset `tracekit export` wrote) in two passes
(gaps, then tail sums), each file a function call here or a Ray task; results combine in
file order either way, so both paths give the same numbers to the last bit.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracekit.analysis.compare import config_value
from tracekit.analysis.export import DATASET_META, GAPS_DIR, RUNS_DIR, DatasetError, export
from tracekit.errors import LogError
from tracekit.log.archive import describe_non_regular, open_regular

#: Pooled percentiles: (name, q), numpy's linear percentiles.
POOLED = (("itl_p50", 50.0), ("itl_p90", 90.0), ("itl_p99", 99.0), ("itl_p999", 99.9))
TAIL_Q = 99.0
#: Default memory budget for exact pooled percentiles: this many bytes of gaps in memory.
MEMORY_BUDGET_BYTES = 1 << 30
#: Default size of a merged quantile summary (points); a bigger one has a smaller rank error.
SKETCH_POINTS = 100_000
MISSING = "(none)"
#: Data files per task (a Ray task, or one step here): fewer, larger results to combine.
FILES_PER_TASK = 32

#: `mapper(fn, arg_tuples)`: the results of `fn(*a)`, in order (a list or an iterator).
Mapper = Callable[[Callable[..., Any], Sequence[tuple]], Iterable[Any]]


def _local_map(fn: Callable[..., Any], args: Sequence[tuple]) -> list[Any]:
    return [fn(*a) for a in args]


# -- the mergeable quantile summary -------------------------------------------------------


@dataclass(frozen=True)
class QuantileSketch:
    """A mergeable summary of a multiset of gaps with rank bounds per kept value.

    Each kept value `values[i]` occupies some position (0-based, in the sorted multiset of
    all `count` gaps summarised) within ``[rank_lo[i], rank_hi[i]]``. A summary of one
    sorted array keeps every k-th value with its exact position; merging two summaries
    bounds each value's position in the union by its own bounds plus the bounds of its
    neighbours in the other summary (the merge of Greenwald-Khanna style summaries);
    thinning keeps evenly spaced values with their bounds unchanged. Queries return a kept
    value and how far its position can be from the asked one: a proven bound, not an
    estimate."""

    values: np.ndarray  # sorted ascending
    rank_lo: np.ndarray  # int64
    rank_hi: np.ndarray  # int64
    count: int

    @classmethod
    def of(cls, gaps_ms: np.ndarray, points: int = SKETCH_POINTS) -> QuantileSketch:
        v = np.sort(np.asarray(gaps_ms, dtype=np.float64))
        n = len(v)
        if n == 0:
            z = np.zeros(0, dtype=np.int64)
            return cls(np.zeros(0), z, z, 0)
        k = max(1, -(-n // points))  # every k-th value: at most `points` of them
        idx = np.arange(k - 1, n, k)
        idx = np.union1d(np.union1d(idx, [0]), [n - 1])  # min and max always kept
        return cls(v[idx], idx.astype(np.int64), idx.astype(np.int64), n)

    def merge(self, other: QuantileSketch, points: int = SKETCH_POINTS) -> QuantileSketch:
        if other.count == 0:
            return self
        if self.count == 0:
            return other
        lo_a, hi_a = _bounds_in(self, other)
        lo_b, hi_b = _bounds_in(other, self)
        v = np.concatenate([self.values, other.values])
        lo = np.concatenate([lo_a, lo_b])
        hi = np.concatenate([hi_a, hi_b])
        o = np.lexsort((hi, lo, v))
        merged = QuantileSketch(v[o], lo[o], hi[o], self.count + other.count)
        return merged.thin(points) if len(merged.values) > 2 * points else merged

    def thin(self, points: int) -> QuantileSketch:
        """Keep about `points` evenly spaced values (first and last always)."""
        if len(self.values) <= points:
            return self
        keep = np.unique(np.linspace(0, len(self.values) - 1, points).round().astype(np.int64))
        return QuantileSketch(self.values[keep], self.rank_lo[keep], self.rank_hi[keep], self.count)

    def quantile(self, q: float) -> tuple[float, int]:
        """(value, rank error): a gap whose position in the sorted gaps is within `rank
        error` positions of q/100 * (count - 1), the position numpy's percentile reads."""
        if self.count == 0:
            return math.nan, 0
        h = q / 100.0 * (self.count - 1)
        err = np.maximum(self.rank_hi - h, h - self.rank_lo)
        i = int(np.argmin(err))
        return float(self.values[i]), int(math.ceil(max(0.0, float(err[i]))))

    @property
    def max(self) -> float:
        return float(self.values[-1]) if self.count else math.nan


def _bounds_in(a: QuantileSketch, b: QuantileSketch) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on the position of each of `a`'s values in the union of both multisets: its
    position among `a`'s gaps plus how many of `b`'s gaps can lie before it (at least one
    more than the position of `b`'s largest kept value below it; at most the position of
    `b`'s smallest kept value above it, or all of `b`)."""
    pred = np.searchsorted(b.values, a.values, side="left") - 1
    succ = np.searchsorted(b.values, a.values, side="right")
    below = np.where(pred >= 0, b.rank_lo[np.maximum(pred, 0)] + 1, 0)
    has_succ = succ < len(b.values)
    above = np.where(has_succ, b.rank_hi[np.minimum(succ, len(b.values) - 1)], b.count)
    return a.rank_lo + below, a.rank_hi + above


# -- reading a dataset --------------------------------------------------------------------


@dataclass(frozen=True)
class GroupRollup:
    """One group's rollup (see the module docstring)."""

    key: str
    runs: tuple[str, ...]
    gaps: int
    figures: Mapping[str, tuple[float, float, float, int]]  # median, min, max, runs
    method: str  # "exact" or "sketch"
    pooled: Mapping[str, tuple[float, int]]  # name -> (ms, rank error in gaps)
    tail_threshold_ms: float
    tail_gaps: int
    tail_share: Mapping[str, float]
    tail_count: Mapping[str, int]

    def to_dict(self, by: str) -> dict[str, Any]:
        def f(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "by": by,
            "group": self.key,
            "runs": len(self.runs),
            "gaps": self.gaps,
            "figures": {
                k: {"median": f(m), "min": f(lo), "max": f(hi), "runs": n}
                for k, (m, lo, hi, n) in self.figures.items()
            },
            "pooled": {
                "method": self.method,
                **{k: {"ms": f(v), "rank_error": e} for k, (v, e) in self.pooled.items()},
            },
            "pooled_tail": {
                "threshold_ms": f(self.tail_threshold_ms),
                "gaps": self.tail_gaps,
                "share": dict(self.tail_share),
                "count": dict(self.tail_count),
            },
            "run_ids": list(self.runs),
        }


@dataclass(frozen=True)
class FleetRollup:
    by: str
    labels: tuple[str, ...]
    groups: tuple[GroupRollup, ...]
    memory_budget_bytes: int
    sketch_points: int
    notes: tuple[str, ...] = field(default=())

    def to_records(self) -> list[dict[str, Any]]:
        return [g.to_dict(self.by) for g in self.groups]


def _files(root: str, table: str) -> list[str]:
    base = os.path.join(root, table)
    if not os.path.isdir(base):
        raise DatasetError(f"{root}: no {table}/ folder (not a dataset `tracekit export` wrote)")
    out = []
    for d, dirs, names in os.walk(base):
        dirs[:] = sorted(x for x in dirs if not x.startswith((".", "_")))
        out += [os.path.join(d, n) for n in names if n.endswith(".parquet")]
    for f in out:  # a FIFO or device is refused before pyarrow opens it (and waits)
        try:
            mode = os.stat(f).st_mode
        except OSError as e:
            raise DatasetError(f"{f}: cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(mode):
            raise DatasetError(f"{f}: is {describe_non_regular(mode)}, not a regular file")
    if not out:
        raise DatasetError(f"{base}: no .parquet files")
    return sorted(out)


def _runs_table(root: str):
    """The runs table as a pandas frame, in the export's run order, with the hive keys."""
    import pyarrow.dataset as ds  # deferred: pyarrow/pandas load when a dataset is read

    files = _files(root, RUNS_DIR)
    try:
        t = ds.dataset(files, format="parquet", partitioning="hive",
                       partition_base_dir=os.path.join(root, RUNS_DIR)).to_table()  # fmt: skip
    except Exception as e:
        raise DatasetError(f"{root}/{RUNS_DIR}: unreadable ({str(e).splitlines()[0]})") from None
    _check_runs_schema(t.schema, f"{root}/{RUNS_DIR}")
    df = t.to_pandas()
    dup = df["run"][df["run"].duplicated()]
    if len(dup):
        raise DatasetError(
            f"{root}/{RUNS_DIR}: run {str(dup.iloc[0])[:80]!r} appears in more than one row "
            "(each run is one row of the runs table)"
        )
    if "gaps" in df.columns and len(df) and int(df["gaps"].min()) < 0:
        raise DatasetError(f"{root}/{RUNS_DIR}: column 'gaps' holds a negative count")
    order = _meta_order(root)
    if order:
        pos = {r: i for i, r in enumerate(order)}
        df = df.assign(_o=[pos.get(r, len(pos)) for r in df["run"]]).sort_values(
            ["_o", "run"], kind="stable"
        )
        df = df.drop(columns="_o")
    else:
        df = df.sort_values("run", kind="stable")
    return df.reset_index(drop=True)


def _is_string(t: Any) -> bool:
    import pyarrow as pa  # deferred: pyarrow/pandas load when a dataset is read

    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _check_runs_schema(schema: Any, where: str) -> None:
    """The runs table's columns the rollup trusts: `run` strings, `gaps` integers."""
    import pyarrow as pa  # deferred: pyarrow/pandas load when a dataset is read

    if "run" not in schema.names:
        raise DatasetError(f"{where}: no 'run' column")
    if not _is_string(schema.field("run").type):
        raise DatasetError(f"{where}: column 'run' is {schema.field('run').type}, not strings")
    if "gaps" in schema.names and not pa.types.is_integer(schema.field("gaps").type):
        raise DatasetError(
            f"{where}: column 'gaps' is {schema.field('gaps').type}, not an integer count"
        )


def _check_gaps_schema(path: str, columns: Sequence[str]) -> None:
    """A gaps file holds the columns the rollup reads, of the types `export` writes:
    `run` and `primary` strings, `gap_ms` and every `part_LABEL_ms` floats. Read from the
    file's footer, before any row."""
    import pyarrow as pa  # deferred: pyarrow/pandas load when a dataset is read
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as e:
        raise DatasetError(f"{path}: unreadable gaps file ({str(e).splitlines()[0]})") from None
    for c in columns:
        if c not in schema.names:
            raise DatasetError(f"{path}: no column {c!r} (every gaps file of a dataset has it)")
        t = schema.field(c).type
        ok = _is_string(t) if c in ("run", "primary") else pa.types.is_floating(t)
        if not ok:
            want = "strings" if c in ("run", "primary") else "floats (ms)"
            raise DatasetError(f"{path}: column {c!r} is {t}, not {want}")


def _meta(root: str) -> dict[str, Any]:
    """The dataset's `_tracekit_dataset.json` ({} if absent or unreadable: the tables are
    what is trusted). A FIFO is refused, never waited on; at most 64 MB are read."""
    path = os.path.join(root, DATASET_META)
    if not os.path.lexists(path):
        return {}
    try:
        with open_regular(path) as fh:
            meta = json.loads(fh.read(64 << 20))
    except LogError:
        raise
    except (OSError, ValueError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _meta_order(root: str) -> list[str]:
    runs = _meta(root).get("runs")
    if not isinstance(runs, list):
        return []
    return [str(r["run"]) for r in runs if isinstance(r, dict) and "run" in r]


def _partition_keys(root: str) -> list[str]:
    keys = _meta(root).get("partition_by")
    return [str(k) for k in keys] if isinstance(keys, list) else []


def _group_of_run(df: Any, by: str) -> list[str]:
    """Each run's group text: the config value (as `tracekit compare` groups), else the
    column `by` of the runs table (a figure or a hive key), else MISSING."""

    out = []
    for i in range(len(df)):
        v: Any = None
        if "config_json" in df.columns:
            try:
                v = config_value(json.loads(df["config_json"].iloc[i]), by)
            except (TypeError, ValueError):
                v = None
        if v is None and by in df.columns:
            x = df[by].iloc[i]
            v = None if x is None or (isinstance(x, float) and math.isnan(x)) else x
            if isinstance(v, np.generic):
                v = v.item()
        if v is None:
            out.append(MISSING)
        elif isinstance(v, str):
            out.append(v)
        else:
            out.append(json.dumps(v, sort_keys=True, separators=(",", ":")))
    return out


#: a windowed export's runs columns that say where each run's window lies: not figures
WINDOW_COLUMNS = frozenset({"window_from_s", "window_to_s", "window_how"})


def _figure_columns(df: Any, skip: set[str]) -> list[str]:
    import pandas as pd  # deferred: pyarrow/pandas load when a dataset is read

    cols = []
    for c in df.columns:
        if c in skip or c == "run" or c in WINDOW_COLUMNS:  # where, not what was measured
            continue
        dt = df[c].dtype
        if pd.api.types.is_bool_dtype(dt) or not pd.api.types.is_numeric_dtype(dt):
            continue
        cols.append(c)
    return cols


def _spread(values: np.ndarray) -> tuple[float, float, float, int]:
    a = np.asarray(values, dtype=np.float64)
    a = a[np.isfinite(a)]
    if not len(a):
        return math.nan, math.nan, math.nan, 0
    return float(np.median(a)), float(a.min()), float(a.max()), int(len(a))


# -- per-file work (a function call here, or a Ray task) ----------------------------------


#: Rows a gaps file is read in at a time (a long run's file is never read whole)
BATCH_ROWS = 1 << 18


def _gap_batches(path: str, columns: Sequence[str]) -> Iterator[Any]:
    """A gaps file's `columns`, `BATCH_ROWS` rows at a time (tables, in row order). A null in
    any of them is refused (a gaps file `tracekit export` writes has none), counted over
    the whole file, before the batch that holds it is handed on."""
    import pyarrow as pa  # deferred: pyarrow/pandas load when a dataset is read
    import pyarrow.parquet as pq

    _check_gaps_schema(path, columns)
    nulls = dict.fromkeys(columns, 0)
    try:
        f = pq.ParquetFile(path, read_dictionary=[c for c in ("run", "primary") if c in columns])
        batches = f.iter_batches(batch_size=BATCH_ROWS, columns=list(columns))
    except Exception as e:
        raise DatasetError(f"{path}: unreadable gaps file ({str(e).splitlines()[0]})") from None
    while True:
        try:
            b = next(batches)
        except StopIteration:
            break
        except Exception as e:
            raise DatasetError(f"{path}: unreadable gaps file ({str(e).splitlines()[0]})") from None
        t = pa.Table.from_batches([b])
        for c in columns:
            nulls[c] += t.column(c).null_count
        if not any(nulls.values()):
            yield t
    for c in columns:  # every gap has a run, a length, parts and a primary cause (`clean`)
        n = nulls[c]
        if n:
            raise DatasetError(
                f"{path}: column {c!r} has {n} null value{'s' if n != 1 else ''} "
                "(a gaps file `tracekit export` writes has none)"
            )


def _codes(col: Any) -> tuple[np.ndarray, list[str]]:
    """A string column as (integer code per row, the distinct strings): no Python string
    per row (a run's gaps file has one run id and a handful of primary causes)."""
    import pyarrow as pa  # deferred: pyarrow/pandas load when a dataset is read

    if not pa.types.is_dictionary(col.type):
        col = col.dictionary_encode()
    if isinstance(col, pa.ChunkedArray):
        col = col.unify_dictionaries()
        names = col.chunk(0).dictionary.to_pylist() if col.num_chunks else []
        codes = [c.indices.to_numpy(zero_copy_only=False) for c in col.chunks]
        return (np.concatenate(codes) if codes else np.zeros(0, np.int64)), names
    return col.indices.to_numpy(zero_copy_only=False), col.dictionary.to_pylist()


def _rows_by_group(t: Any, run_group: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Row indices of a gaps table per group (in row order), by its `run` column."""
    if not t.num_rows:
        return {}
    codes, names = _codes(t.column("run"))
    groups = [run_group.get(str(r)) for r in names]
    if len(set(groups)) == 1 and groups[0] is not None:  # one run (or one group) a file
        return {groups[0]: np.arange(t.num_rows)}
    out: dict[str, list[np.ndarray]] = {}
    for j, g in enumerate(groups):  # runs the rollup does not group are skipped
        if g is not None:
            out.setdefault(g, []).append(np.flatnonzero(codes == j))
    return {g: np.sort(np.concatenate(ix)) for g, ix in out.items()}


def pass_gaps(files: Sequence[str], run_group: Mapping[str, str], exact: frozenset[str],
              points: int):  # fmt: skip
    """A batch of files' gaps per group, in file order: one array for an exact group, one
    merged summary otherwise (each file's summary of its group's gaps: read in batches,
    the gap lengths alone are held, 8 bytes a gap)."""
    arrays: dict[str, list[np.ndarray]] = {}
    sketches: dict[str, QuantileSketch] = {}
    for path in files:
        mine: dict[str, list[np.ndarray]] = {}
        for t in _gap_batches(path, ["run", "gap_ms"]):
            gap = t.column("gap_ms").to_numpy()
            for g, rows in _rows_by_group(t, run_group).items():
                mine.setdefault(g, []).append(gap[rows])
        for g, pieces in mine.items():  # the file's rows of each group, in row order
            if g in exact:
                arrays.setdefault(g, []).append(np.concatenate(pieces))
            else:
                sk = QuantileSketch.of(np.concatenate(pieces), points)
                sketches[g] = sketches[g].merge(sk, points) if g in sketches else sk
    out: dict[str, Any] = {g: np.concatenate(a) for g, a in arrays.items()}
    out.update(sketches)
    return out


def pass_tail(files: Sequence[str], run_group: Mapping[str, str],
              threshold: Mapping[str, float], labels: Sequence[str]):  # fmt: skip
    """A batch of files' tail sums per group, added in file order: (tail gaps, their total
    ms, ms per label, count by primary cause). A file is read in batches; of each group
    only its tail rows are kept until the file's end, then summed as one array (so the
    sums are those of the whole file read at once, to the last bit)."""
    out: dict[str, tuple[int, float, list[float], dict[str, int]]] = {}
    cols = ["run", "gap_ms", "primary"] + [f"part_{lb}_ms" for lb in labels]
    for path in files:
        kept: dict[str, list[list[np.ndarray]]] = {}  # group -> per column, its tail pieces
        causes: dict[str, dict[str, int]] = {}
        for t in _gap_batches(path, cols):
            gap = t.column("gap_ms").to_numpy()
            prim, prim_names = _codes(t.column("primary"))
            parts = [t.column(f"part_{lb}_ms").to_numpy() for lb in labels]
            for g, rows in _rows_by_group(t, run_group).items():
                sel = rows[gap[rows] >= threshold[g]]
                pieces = kept.setdefault(g, [[] for _ in range(1 + len(labels))])
                for j, col in enumerate([gap, *parts]):
                    pieces[j].append(col[sel])
                counts = np.bincount(prim[sel], minlength=len(prim_names))
                by = causes.setdefault(g, {})
                for c, v in zip(prim_names, counts.tolist(), strict=True):
                    if v:
                        by[str(c)] = by.get(str(c), 0) + v
        for g, pieces in kept.items():
            tail_gap = np.concatenate(pieces[0])
            k, ms, by_label, by_cause = out.get(g, (0, 0.0, [0.0] * len(labels), {}))
            for c, v in causes[g].items():
                by_cause[c] = by_cause.get(c, 0) + v
            out[g] = (
                k + len(tail_gap),
                ms + float(tail_gap.sum()),
                [
                    a + float(np.concatenate(p).sum())
                    for a, p in zip(by_label, pieces[1:], strict=True)
                ],  # fmt: skip
                by_cause,
            )
    return out


# -- the rollup ---------------------------------------------------------------------------


def _exact_groups(
    df: Any, group_of: Sequence[str], groups: Sequence[str], memory_budget_bytes: int
) -> set[str]:
    """The groups whose gaps are pooled exactly: in order, while their gaps (8 bytes each)
    fit the memory budget; the others get a sketch."""
    # exact where the group's gaps fit the budget (groups in order, until it is spent)
    n_gaps = df.groupby(np.asarray(group_of), sort=False)["gaps"].sum() if "gaps" in df else None
    exact: set[str] = set()
    spent = 0
    for g in groups:
        need = 8 * int(n_gaps[g]) if n_gaps is not None else memory_budget_bytes + 1
        if spent + need <= memory_budget_bytes:
            exact.add(g)
            spent += need
    return exact


def _pool_gaps(
    mapper: Mapper,
    batches: list[list[str]],
    run_group: Mapping[str, str],
    exact: set[str],
    groups: Sequence[str],
    sketch_points: int,
) -> tuple[dict[str, dict[str, tuple[float, int]]], dict[str, float], dict[str, int]]:
    """The first pass: each group's pooled ITL percentiles (exact, or from the merged
    sketch with its rank error), its tail threshold (the pooled p99) and its gap count."""
    exact_f = frozenset(exact)
    # combined as each batch's result arrives (in batch order), then dropped
    arrays: dict[str, list[np.ndarray]] = {g: [] for g in exact}
    sketches: dict[str, QuantileSketch] = {}
    for res in mapper(pass_gaps, [(b, run_group, exact_f, sketch_points) for b in batches]):
        for g, piece in res.items():
            if g in exact:
                arrays[g].append(piece)
            else:
                sketches[g] = sketches[g].merge(piece, sketch_points) if g in sketches else piece
        del res
    pooled: dict[str, dict[str, tuple[float, int]]] = {}
    threshold: dict[str, float] = {}
    counts: dict[str, int] = {}
    for g in groups:
        if g in exact:
            gaps = np.concatenate(arrays.pop(g)) if arrays[g] else np.zeros(0)
            n = len(gaps)
            qs = np.percentile(gaps, [q for _, q in POOLED]) if n else [math.nan] * len(POOLED)
            pooled[g] = {name: (float(v), 0) for (name, _), v in zip(POOLED, qs, strict=True)}
            pooled[g]["itl_max"] = (float(gaps.max()) if n else math.nan, 0)
            del gaps
        else:
            sk = sketches.pop(g, QuantileSketch.of(np.zeros(0)))
            n = sk.count
            pooled[g] = {name: sk.quantile(q) for name, q in POOLED}
            pooled[g]["itl_max"] = (sk.max, 0)
        threshold[g] = pooled[g]["itl_p99"][0]
        counts[g] = n
    return pooled, threshold, counts


def _tail_totals(
    mapper: Mapper,
    batches: list[list[str]],
    run_group: Mapping[str, str],
    threshold: Mapping[str, float],
    labels: list[str],
) -> dict[str, tuple[int, float, list[float], dict[str, int]]]:
    """The second pass: per group, the gaps at or above its threshold, their total ms, the
    ms by label and the count by primary cause, summed in batch order."""
    tail: dict[str, tuple[int, float, list[float], dict[str, int]]] = {}
    for res in mapper(pass_tail, [(b, run_group, threshold, labels) for b in batches]):
        for g, (k, ms, lab, cause) in res.items():
            n_tail, tail_ms, by_label, by_cause = tail.get(g, (0, 0.0, [0.0] * len(labels), {}))
            for c, v in cause.items():
                by_cause[c] = by_cause.get(c, 0) + v
            tail[g] = (
                n_tail + k,
                tail_ms + ms,
                [a + b for a, b in zip(by_label, lab, strict=True)],
                by_cause,
            )
    return tail


def rollup(
    root: str,
    by: str,
    *,
    memory_budget_bytes: int = MEMORY_BUDGET_BYTES,
    sketch_points: int = SKETCH_POINTS,
    mapper: Mapper | None = None,
) -> FleetRollup:
    """Roll up the dataset at `root` by `by`. `mapper(fn, arg_tuples)` runs the per-file
    passes (in order; Ray tasks or here)."""
    mapper = mapper or _local_map
    if not os.path.isdir(root):
        raise DatasetError(f"{root}: not a folder (a dataset written by `tracekit export`)")
    df = _runs_table(root)
    keys = set(_partition_keys(root))
    group_of = _group_of_run(df, by)
    if all(g == MISSING for g in group_of) and by not in df.columns:
        raise DatasetError(
            f"--by {by}: no run has this config key or runs-table column (config keys of the "
            f"first run: {', '.join(sorted(json.loads(df['config_json'].iloc[0])))})"
            if len(df) and "config_json" in df.columns
            else f"--by {by}: no run has this config key or runs-table column"
        )
    run_group = dict(zip(df["run"].tolist(), group_of, strict=True))
    groups = list(dict.fromkeys(group_of))
    figures = _figure_columns(df, keys | {by})
    files = _files(root, GAPS_DIR)
    labels = _labels(files[0])

    exact = _exact_groups(df, group_of, groups, memory_budget_bytes)
    # files in fixed batches (one task each): the same batches here and on Ray, so the
    # same merges in the same order and the same numbers
    batches = [files[i : i + FILES_PER_TASK] for i in range(0, len(files), FILES_PER_TASK)]
    pooled, threshold, counts = _pool_gaps(mapper, batches, run_group, exact, groups, sketch_points)
    tail = _tail_totals(mapper, batches, run_group, threshold, labels)
    out = []
    group_arr = np.asarray(group_of)
    for g in groups:
        members = df[group_arr == g]
        n_tail, tail_ms, by_label, by_cause = tail.get(g, (0, 0.0, [0.0] * len(labels), {}))
        share = {lb: (v / tail_ms if tail_ms > 0 else 0.0) for lb, v in zip(labels, by_label,
                                                                          strict=True)}  # fmt: skip
        out.append(
            GroupRollup(
                key=g,
                runs=tuple(members["run"].tolist()),
                gaps=counts[g],
                figures={c: _spread(members[c].to_numpy()) for c in figures},
                method="exact" if g in exact else "sketch",
                pooled=pooled[g],
                tail_threshold_ms=threshold[g],
                tail_gaps=n_tail,
                tail_share=share,
                tail_count=dict(sorted(by_cause.items())),
            )
        )
    return FleetRollup(
        by=by,
        labels=tuple(labels),
        groups=tuple(out),
        memory_budget_bytes=memory_budget_bytes,
        sketch_points=sketch_points,
    )


def _labels(gaps_file: str) -> list[str]:
    import pyarrow.parquet as pq  # deferred: pyarrow/pandas load when a dataset is read

    try:
        names = pq.read_schema(gaps_file).names
    except Exception as e:
        raise DatasetError(
            f"{gaps_file}: unreadable gaps file ({str(e).splitlines()[0]})"
        ) from None
    return [c[len("part_") : -len("_ms")] for c in names if c.startswith("part_") and
            c.endswith("_ms")]  # fmt: skip


def rollup_logs(
    paths: Sequence[str],
    by: str,
    *,
    export_mapper: Mapper | None = None,
    **kwargs: Any,
) -> FleetRollup:
    """The same rollup over raw logs: they are exported to a temporary dataset first (so
    both inputs give the same numbers by construction), which is removed afterwards."""

    limits = kwargs.pop("limits", None)
    view = kwargs.pop("view", None)  # each run's window (docs/reports.md, "Windows")
    with tempfile.TemporaryDirectory(prefix="tracekit-fleet-") as tmp:
        root = os.path.join(tmp, "dataset")
        export(paths, root, (), mapper=export_mapper, limits=limits, view=view)
        return rollup(root, by, **kwargs)
