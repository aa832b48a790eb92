"""A long run's gap and TTFT records (`tracekit gaps`, `tracekit ttft` of the whole run),
read in slices, in bounded memory (docs/reports.md, "Reading a long run in slices").

The run is cut into slices as `analyze` cuts it (`tracekit.analysis.stream`): each slice is
partitioned with the whole run's baselines and owns the gaps whose later emission, and the
TTFTs whose first token, lies in it. Each slice writes its own records (`gap_records`,
`ttft_records` of its log, with the whole run's request names and step numbers) as JSON
lines to a temporary folder, beside each line's request; a slice's records come in the
whole run's order within it (gaps by request, then time; TTFTs by request). A request's
gaps lie in consecutive slices, so a merge of the slices by (request, slice order)
(`Listing.lines`) gives the whole run's records in its order. The table's longest gaps
(slowest TTFTs) are kept as each slice is written: of each slice its `top` first by
(length, place in the whole run's order), so ties fall as the whole run orders them.
Memory: one slice's partition and a block of its records, plus per request its name.
Every field equals the whole run's but a gap's or TTFT's per-label parts, which equal it
to float rounding (a slice's prefix sums over the timeline start at the slice).
"""

from __future__ import annotations

import heapq
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.gaps import gap_records, requests_named, with_labels
from tracekit.analysis.stream import (
    DEFAULT_SLICE_EMISSIONS,
    SliceRead,
    SliceTask,
    index_pass,
    slice_partition,
    slice_tasks,
)
from tracekit.analysis.stream_ttft import TTFT_LABEL_GROUPS, TtftFold, ordered
from tracekit.analysis.ttft_records import ttft_records
from tracekit.attribution.itl import FIT_ALL_CAPTURED
from tracekit.attribution.ttft import TtftFigures, ttft_partition
from tracekit.errors import LogError
from tracekit.labels import partition_labels
from tracekit.log.flush import TABLES
from tracekit.log.rawlog import RawLog
from tracekit.log.request_names import RequestNames
from tracekit.log.slices import SlicedRun

__all__ = ["Listing", "gap_listing_sliced", "ttft_listing_sliced"]

_EM_REQ = TABLES["emissions"].index("request")
#: records made (and written) at once: a block of a slice's rows, not the slice's
_BLOCK_ROWS = 20_000
#: request indices read back at once while merging
_READ_ROWS = 1 << 16


@dataclass
class _Piece:
    """One slice's records on disk: JSON lines and, per line, its request (int64)."""

    stem: str
    rows: int


@dataclass
class Listing:
    """A run's records spilled slice by slice (see the module's docstring)."""

    folder: str
    kind: str  # "gaps" or "ttft"
    top: int
    path: str = ""  # the run as the whole-run reader names it
    #: per request, as the whole run names it (compactly)
    names: RequestNames = field(default_factory=RequestNames)
    pieces: list[_Piece] = field(default_factory=list)
    count: int = 0  # the records written
    #: the table's `top` records: (key, record), key the record's place in the table
    best: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the run's (`RawLog.warnings`)
    longest_ms: float = -math.inf  # the run's longest gap
    #: every slice's own TTFTs, folded as they come (`TtftFold`: a day's ~3 M rows whole
    #: were ~700 MB)
    ttft: TtftFold = field(default_factory=TtftFold)
    #: the whole run's partition labels, in its order: every record's ``parts`` keys
    #: (`tracekit.analysis.gaps.with_labels`)
    labels: tuple[str, ...] = ()

    @property
    def longest(self) -> list[dict[str, Any]]:
        """The table's records, in its order (the `top` longest gaps, slowest TTFTs)."""
        return [rec for _, rec in self.best]

    def ttft_figures(self) -> TtftFigures | None:
        """The whole run's TTFT figures (`ttft_figures` of its rows; None: no slice gave a
        TTFT row); the fold's temporary file closed."""
        try:
            return self.ttft.figures(None)
        finally:
            self.ttft.close()

    def lines(self) -> Iterator[str]:
        """Every record as a JSON line (newline-terminated), in the whole run's order: the
        slices merged by request, a request's records slice after slice."""
        streams = [_keyed_lines(pc) for pc in self.pieces]
        for _, line in heapq.merge(*streams, key=lambda kv: kv[0]):
            yield line

    def records(self) -> Iterator[dict[str, Any]]:
        """`lines`, parsed (JSON keeps every float exactly)."""
        return (json.loads(line) for line in self.lines())

    def start_piece(self, stem: str) -> None:
        """A new slice's piece, empty until its records are written."""
        for ext in (".jsonl", ".req"):
            open(stem + ext, "wb").close()
        self.pieces.append(_Piece(stem, 0))

    def write(self, rows: list[dict[str, Any]], req: np.ndarray) -> None:
        """Append one block of a slice's records (in order) to its piece."""
        pc = self.pieces[-1]
        with open(pc.stem + ".jsonl", "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        with open(pc.stem + ".req", "ab") as fh:
            np.ascontiguousarray(req, dtype=np.int64).tofile(fh)
        pc.rows += len(rows)
        self.count += len(rows)

    def keep_best(self, cands: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        """Keep the table's `top` records of those kept and `cands` (0: every one)."""
        self.best = sorted(self.best + cands, key=lambda kv: kv[0])
        if self.top > 0:
            del self.best[self.top :]


def _keyed_lines(pc: _Piece) -> Iterator[tuple[int, str]]:
    """A piece's (request, line) pairs, read back a block at a time."""
    with open(pc.stem + ".jsonl", encoding="utf-8") as fh, open(pc.stem + ".req", "rb") as rq:
        while len(req := np.fromfile(rq, dtype=np.int64, count=_READ_ROWS)):
            for r in req.tolist():
                yield r, fh.readline()


def _open(parts_dir: str, folder: str, kind: str, top: int, path: str | None,
          max_inflate_mb: float | None, say: Callable[[str], None],
          max_emissions: int) -> tuple[Listing, SlicedRun, list[SliceTask]]:  # fmt: skip
    """The run's index pass and slices, and an empty listing of them."""
    run = SlicedRun(parts_dir, max_inflate_mb=max_inflate_mb)
    ix = index_pass(run, FIT_ALL_CAPTURED, say)
    tasks = slice_tasks(run, ix, max_emissions, math.inf)  # no tail: records only
    n = len(run.parts)
    tail_log = run.log_of(n - 1, n, tables=frozenset(), final=True)
    out = Listing(folder, kind, top, path or parts_dir, warnings=list(tail_log.warnings))
    out.longest_ms = float(ix.worst[0])
    out.labels = (tuple(partition_labels(ix.labels)) if kind == "gaps" else
                  ordered(ix.ttft_labels, TTFT_LABEL_GROUPS))  # fmt: skip
    return out, run, tasks


def _named(out: Listing, task: SliceTask, read: SliceRead) -> RawLog:
    """The slice's log with the whole run's request names: those named before its first
    part (``(removed N)`` in its names) were named by an earlier slice's parts."""
    start = read.names.removed
    ids = read.names
    if not len(out.names) and task.retained is not None:  # the run's first parts removed
        out.names = RequestNames(task.retained.num_requests)
    # none before the first slice: its parts name them all
    assert len(out.names) >= start or not out.pieces
    if len(ids) > len(out.names):
        out.names.extend(ids[len(out.names) :])
    return replace(read.log, request_ids=out.names.picked(read.numbers))


def _step(s: Any, off: int) -> Any:
    return s + off if isinstance(s, int) and s >= 0 else s


def _renumber(rec: dict[str, Any], off: int, step_keys: tuple[str, ...]) -> None:
    """A record's steps (and its eviction pieces' deciding steps) as the whole run numbers
    them (a slice's log numbers steps from its first part's first)."""
    for k in step_keys:
        rec[k] = _step(rec[k], off)
    for piece in rec.get("preempt_causes", []) + rec.get("recompute_causes", []):
        piece["step"] = _step(piece["step"], off)


def _wanted_slices(run: SlicedRun, tasks: list[SliceTask], max_emissions: int,
                   rows: np.ndarray | None) -> list[int]:  # fmt: skip
    """The slices to read: all, or (`rows`: the requests asked for) those owning a part
    where one of them emits."""
    if rows is None:
        return list(range(len(tasks)))
    hit = np.zeros(len(run.parts), dtype=bool)
    for i in range(len(run.parts)):
        em = run.read(i)["tables"].get("emissions")
        if em is not None and len(em):
            hit[i] = bool(np.isin(em[:, _EM_REQ], rows).any())
    bounds = run.bounds(max_emissions)
    return [j for j, (_, a, b) in enumerate(bounds) if hit[a:b].any()]


def _all_names(run: SlicedRun) -> RawLog:
    """A log of the run's last part named as the whole run names its requests (one read of
    the parts' names, kept compactly: what `--request` is matched against)."""
    names = RequestNames(run.parts[0].request_ids_start)
    for i in range(len(run.parts)):
        names.extend(run.read(i)["request_ids"])
    n = len(run.parts)
    log = run.log_of(n - 1, n, tables=frozenset(), final=True)
    return replace(log, request_ids=names)


def _names_of(log: RawLog) -> RequestNames:
    assert isinstance(log.request_ids, RequestNames)  # `_all_names`'
    return log.request_ids


def gap_listing_sliced(
    parts_dir: str,
    folder: str,
    *,
    min_ms: float | None = None,
    request_id: str | None = None,
    top: int = 20,
    path: str | None = None,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
    records: bool = True,
) -> Listing:
    """`gap_records` of the whole run in `parts_dir` (`min_ms`, `request_id` as there),
    read in slices and spilled to `folder` (empty; the caller removes it). `records`
    False: only the table's (`Listing.longest`) and their count, none spilled (a day of a
    busy server has ~900 M gaps: as JSON lines, more than its disk, and hours of
    records made for a table of `top`). Raises `NotSliceable` for a folder that must be
    read whole, `LogError` for a request the run does not have."""
    say = progress or (lambda _msg: None)
    out, run, tasks = _open(parts_dir, folder, "gaps", top, path, max_inflate_mb, say,
                            max_emissions)  # fmt: skip
    wanted = None
    if request_id is not None:  # matched against the whole run's names, as read whole
        named = replace(_all_names(run), path=out.path)
        out.names = _names_of(named)  # the slices skipped named some of them
        wanted = requests_named(named, request_id)
    first_step = run.parts[0].first_step
    for j in _wanted_slices(run, tasks, max_emissions, wanted):
        task = tasks[j]
        read = slice_partition(task)
        log, p = _named(out, task, read), read.p
        req = read.numbers[p.request]  # as the run numbers them
        sel = np.ones(len(p), dtype=bool)
        if min_ms is not None:
            sel &= p.gap_ms >= min_ms
        if wanted is not None:
            sel &= np.isin(req, wanted)
        rows = np.flatnonzero(sel)
        off = run.parts[task.c].first_step - first_step
        # the table's candidates: the slice's `top` longest, ties in the run's order
        order = np.lexsort((rows, req[rows], -p.gap_ms[rows]))
        cand = set(rows[order[: top if top > 0 else len(order)]].tolist())
        made = rows  # the records made: every one, or the table's candidates only
        if records:
            out.start_piece(os.path.join(folder, f"slice-{j:06d}"))
        else:
            made = np.array(sorted(cand), dtype=np.int64)
            out.count += len(rows)
        for k in range(0, len(made), _BLOCK_ROWS):
            block = made[k : k + _BLOCK_ROWS]
            recs = with_labels(gap_records(log, p, index=block), out.labels)
            best = []
            for i, rec in zip(block.tolist(), recs, strict=True):
                _renumber(rec, off, ("step0", "step1"))
                if i in cand:
                    best.append(((-rec["gap_ms"], int(req[i]), j, i), rec))
            if records:
                out.write(recs, req[block])
            out.keep_best(best)
        del read, log, p  # before the next slice's is read (else two slices' logs at once)
        give_back_freed_memory()  # (kept by the analysis's allocator, `tracekit.allocator`)
        say(f"slice {j + 1} of {len(tasks)}")
    return out


def ttft_listing_sliced(
    parts_dir: str,
    folder: str,
    *,
    min_ms: float | None = None,
    request_id: str | None = None,
    top: int = 10,
    path: str | None = None,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> Listing:
    """`ttft_records` of the whole run in `parts_dir` (`min_ms`, `request_id` as there),
    read in slices and spilled to `folder`, with every slice's TTFT rows folded
    (`Listing.ttft_figures`: the run's TTFT figures). Raises `NotSliceable`, `LogError`
    as `gap_listing_sliced`."""
    say = progress or (lambda _msg: None)
    out, run, tasks = _open(parts_dir, folder, "ttft", top, path, max_inflate_mb, say,
                            max_emissions)  # fmt: skip
    wanted = None
    if request_id is not None:
        out.names = _names_of(_all_names(run))
        ids = out.names
        if request_id not in ids:
            raise LogError(out.path, "request", f"no request with id {request_id!r} in this run")
        wanted = np.array([ids.index(request_id)], dtype=np.int64)
    first_step = run.parts[0].first_step
    for j, task in enumerate(tasks):  # every slice: the table's figures are the run's
        read = slice_partition(task)
        log = _named(out, task, read)
        tp = ttft_partition(log, run=read.prep)
        tp = tp.take((tp.first_token_s >= task.t_from_s) & (tp.first_token_s < task.t_to_s))
        tp = tp.take(np.argsort(tp.request, kind="stable"))
        req = read.numbers[tp.request]  # as the run numbers them
        out.ttft.add(tp)
        sel = np.ones(len(tp), dtype=bool)
        if min_ms is not None:
            sel &= tp.ttft_ms >= min_ms
        if wanted is not None:
            sel &= np.isin(req, wanted)
        mine, req = tp.take(sel), req[sel]
        out.start_piece(os.path.join(folder, f"slice-{j:06d}"))
        off = run.parts[task.c].first_step - first_step
        recs = with_labels(ttft_records(log, mine), out.labels)
        for rec in recs:
            _renumber(rec, off, ())
        if recs:
            out.write(recs, req)
        order = np.lexsort((req, -mine.ttft_ms))
        keep = order[: top if top > 0 else len(order)].tolist()
        out.keep_best([((-recs[i]["ttft_ms"], int(req[i])), recs[i]) for i in keep])
        del read, log  # before the next slice's is read (else two slices' logs at once)
        give_back_freed_memory()  # (kept by the analysis's allocator, `tracekit.allocator`)
        say(f"slice {j + 1} of {len(tasks)}")
    return out
