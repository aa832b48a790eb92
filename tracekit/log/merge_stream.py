"""A server's run merged chunk by chunk into a parts folder, in memory bounded by its
requests and steps, never by its tokens (docs/adapters.md, "Merging a long server run").

`tracekit.log.merge` merges whole process logs. Here each process's parts are read twice:

1. **Skeletons.** Each process's parts are read one at a time, keeping of each only what
   the clock fits and the request join need (`keep_for`): the paired stamps (counters
   ``serve.sent/added/out/recv/handler``), the engine core's forward windows and steps, a
   worker's windows, every process's requests, GC pauses and vocabularies (no emission:
   the merged run's first tokens come from the engine core's parts as recorded). A
   worker's rows are per step: kept whole. Fits, the join, labels and meta are then
   computed by the one-file merge's own code (`tracekit.log.merge.plan_server`) on these
   skeleton logs. What only the plan read is then let go (`for_writing`): the processes'
   request ids and request rows, the engine core's stamps, the engine ids the join looked up;
   the freed heap goes back to the OS after each process and after the plan
   (`give_back_freed_memory`: what was freed lies in holes between what lives on).
2. **Rows.** Each API server's parts are read again, one at a time, and turned into the
   merged run's rows by the one-file merge's row builders (its segments, GC pauses, OS
   intervals and chunks written, on the core's clock), each spooled to the merged part
   whose time range holds it.
3. **Parts.** For each engine core part, in order: the part as recorded, its requests
   renamed to the client's names, the merged vocabularies, and the spooled rows of its
   time range (`tracekit.log.merged_tables`), written as a part of the output folder.

A merged part ``k`` holds the rows whose time (a segment's or OS interval's start, a
chunk's write, a delivery's build) on the core's clock lies in ``[flush_{k-1}, flush_k)``,
the core parts' flush times (the first part also takes what came before, the last what came
after). Reading the folder whole gives the one-file merge's log (`merge_server`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.errors import LogError
from tracekit.formats import json_safe
from tracekit.fsio import atomic_write
from tracekit.log.archive import read_npz
from tracekit.log.flush import TABLES, FlushedRows, column_index, empty_rows, to_table
from tracekit.log.merge import (
    MergePlan,
    client_rows,
    delivery_rows,
    event_loop_thread,
    gc_rows,
    os_rows,
    plan_server,
    segment_rows,
    sse_windows,
)
from tracekit.log.merged_tables import merged_rows
from tracekit.log.parts import (
    PARTS_SUFFIX,
    POINTER_MEMBER,
    append_index,
    merge_parts_kept,
    parse_flushed,
    part_number,
    part_paths,
    pointed_parts,
    read_index,
    read_meta,
    read_part,
    retained_start,
    write_final,
    write_part,
    write_pointer,
)
from tracekit.log.processes import ProcessLog, check_process_log, process_entries
from tracekit.log.rawlog import (
    OS_SEGMENT_END,
    OS_SEGMENT_START,
    Counters,
    Emissions,
    Evictions,
    GcPauses,
    OsSamples,
    RawLog,
    Requests,
    Segments,
    Steps,
)
from tracekit.log.reader import load
from tracekit.log.serve_contract import ADDED, CORE, FRONTEND, HANDLER, OUT, RECV, SENT

#: The counters the fits and the join read (`tracekit.log.clocks`, `request_identity`).
PAIRED_COUNTERS = (SENT, ADDED, OUT, RECV, HANDLER)
#: The engine core's windows the fits read and the tensor-parallel rule carves.
CORE_WINDOWS = ("prefill", "decode", "verify")


@dataclass
class Source:
    """One process as the merge reads it: its parts folder and the parts its skeleton was
    read from (a process recorded as one file has none: its `whole` log is used)."""

    parts_dir: str | None
    paths: list[str]
    whole: RawLog | None
    thread_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_segments: int = 0
    flush_ticks: dict[str, int] = field(default_factory=dict)  # per part read, its flush
    first_steps: dict[str, int | None] = field(default_factory=dict)  # and its first step


def keep_for(role: str, src: Source) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The filter of a process's parsed parts for its skeleton (see the module docstring);
    it counts, as it goes, an API server's segments per thread into `src`."""

    def keep(part: dict[str, Any]) -> dict[str, Any]:
        src.flush_ticks[part["where"]] = part["flush_tick"]
        src.first_steps[part["where"]] = part["first_step"]
        t_ = dict(part["tables"])
        labels, names = part["labels"], part["counter_names"]
        if "counters" in t_:
            ids = [i for i, n in enumerate(names) if n in PAIRED_COUNTERS]
            c = t_["counters"]
            t_["counters"] = c[np.isin(c[:, column_index("counters", "name")], ids)]
        sg = t_.pop("segments", None)
        if sg is not None and role == FRONTEND:
            th = sg[:, column_index("segments", "thread")]
            n = max(len(src.thread_counts), int(th.max()) + 1 if len(th) else 0)
            src.thread_counts = np.bincount(th, minlength=n) + np.pad(
                src.thread_counts, (0, n - len(src.thread_counts))
            )
            src.num_segments += len(sg)
        elif sg is not None and role == CORE:
            ids = [i for i, x in enumerate(labels) if x in CORE_WINDOWS]
            t_["segments"] = sg[np.isin(sg[:, column_index("segments", "label")], ids)]
        elif sg is not None:
            t_["segments"] = sg  # a worker's windows: per step, every one needed
        # no emissions: the merged run's first tokens are its engine core's parts' own (the
        # plan's, from the first emissions, were never written: 12 MB of the first pass's
        # peak at 60 minutes of a busy server)
        keepers: tuple[str, ...] = ("steps", "requests", "counters", "gc_pauses", "segments")
        if role not in (CORE, FRONTEND):  # a worker's OS samples: the TP rule reads them
            keepers += ("os_samples",)
        return {**part, "tables": {k: v for k, v in t_.items() if k in keepers}}

    return keep


def _role_of(parts_dir: str) -> str:
    config = read_meta(parts_dir).get("config", {})
    ident = config.get("process") if isinstance(config, dict) else None
    return str(ident.get("role", "?")) if isinstance(ident, dict) else "?"


#: What `load` says of a cleanly stopped process's log (its warnings, or its `LogError`),
#: read part by part: `tracekit.analysis.stream_check.check_run`'s.
Check = Callable[[str], tuple[str, ...]]


def skeleton_logs(
    directory: str, *, max_inflate_mb: float | None = None, check: Check | None = None
) -> tuple[list[ProcessLog], list[Source]]:
    """Every process of `directory` as a skeleton log (see the module docstring), with
    where its rows are read again. A process recorded as one file (no parts) is read
    whole. `check`: a cleanly stopped process's log is validated as the one-file merge's
    `load` validates it, its warnings those `load` gives (a killed one's parts are read as
    they are, as there)."""
    out, sources = [], []
    for path, parts_dir, recovered in process_entries(directory):
        if parts_dir is None:
            parts_dir = _pointed(path, max_inflate_mb)
        if parts_dir is None:
            log = load(path, max_inflate_mb=max_inflate_mb)
            out.append(check_process_log(path, log, recovered))
            sources.append(Source(None, [], log))
            continue
        said = None  # checked first, its memory handed back before the skeleton is read
        if not recovered and check is not None:  # (what both read raises the same error)
            said = check(path)
            give_back_freed_memory()
        src = Source(parts_dir, [], None)
        log, src.paths = merge_parts_kept(
            parts_dir, keep_for(_role_of(parts_dir), src), max_inflate_mb=max_inflate_mb
        )
        if not recovered:
            log = log.with_path(path)
            if said is not None:
                log = replace(log, warnings=said)
        out.append(check_process_log(path, log, recovered))
        sources.append(src)
        give_back_freed_memory()  # the parts read, parsed and checked: holes between its rows
    return out, sources


def _pointed(path: str, max_inflate_mb: float | None) -> str | None:
    """The parts folder a clean stop's pointer file names (None: a one-file log)."""
    arrays, _ = read_npz(path, lambda names: [n for n in names if n == POINTER_MEMBER],
                         max_inflate_mb=max_inflate_mb)  # fmt: skip
    return pointed_parts(path, arrays) if POINTER_MEMBER in arrays else None


def chunks(src: Source, max_inflate_mb: float | None = None) -> Iterator[RawLog]:
    """A process's rows again, one part at a time, each a log of the rows the row builders
    read (`_rows_log`): times from the process's start, requests indexed as in its whole
    log."""
    if src.whole is not None:
        yield src.whole
        return
    assert src.parts_dir is not None
    meta = read_meta(src.parts_dir)
    for path in src.paths:
        yield _rows_log(meta, parse_flushed(read_part(path, max_inflate_mb=max_inflate_mb), path))


def _rows_log(meta: dict[str, Any], part: dict[str, Any]) -> RawLog:
    """One part's segments, emissions (an API server's chunks written) and OS samples, in
    seconds from its process's start, with its labels: what `segment_rows`, `client_rows`,
    `sse_windows` and `os_rows` read. Nothing per request: the part as `merge_flushed`
    reads it would name every request named before it (a list as long as the run so far,
    per part)."""
    t0, scale = int(meta["t0_tick"]), float(meta.get("seconds_per_tick", 1e-9))

    def secs(ticks: np.ndarray) -> np.ndarray:
        return (ticks - t0).astype(np.float64) * scale

    def table(cls: Any, k: str) -> Any:
        rows = part["tables"].get(k)
        empty = empty_rows(k)
        return to_table(cls, k, empty if rows is None else rows.astype(empty.dtype), secs)

    return RawLog(
        steps=Steps.empty(), segments=table(Segments, "segments"), gc_pauses=GcPauses.empty(),
        emissions=table(Emissions, "emissions"), evictions=Evictions.empty(),
        requests=Requests.empty(), os_samples=table(OsSamples, "os_samples"),
        labels=tuple(part["labels"]),
    )  # fmt: skip


class Spool:
    """Rows bound for each merged part, on disk until their part is written (a file of
    float64 rows per table and part, appended to; never a pickle)."""

    def __init__(self, directory: str, edges_s: np.ndarray) -> None:
        self.directory = directory
        self.edges_s = edges_s  # the core parts' flush times, seconds
        self.counts: dict[str, int] = {}

    def add(self, table: str, rows: np.ndarray, t_s: np.ndarray) -> None:
        """Spool `rows` (of merged table `table`) by their times `t_s` on the core's clock."""
        if not len(rows):
            return
        n = len(self.edges_s)
        at = np.minimum(np.searchsorted(self.edges_s, t_s, side="right"), n - 1)
        for j in np.unique(at).tolist():
            with open(os.path.join(self.directory, f"{table}-{j}.f64"), "ab") as fh:
                fh.write(np.ascontiguousarray(rows[at == j], dtype=np.float64).tobytes())
        self.counts[table] = self.counts.get(table, 0) + len(rows)

    def take(self, table: str, j: int) -> np.ndarray | None:
        """The rows spooled for part `j` (removed from the spool), flat; None: none."""
        path = os.path.join(self.directory, f"{table}-{j}.f64")
        if not os.path.exists(path):
            return None
        with open(path, "rb") as fh:  # rows of float64, as `add` wrote them
            rows = np.frombuffer(fh.read(), dtype=np.float64).copy()
        os.remove(path)
        return rows


@dataclass(frozen=True)
class PartRule:
    """A cause rule applied part by part as the merge writes (the tensor-parallel one,
    `tracekit.analysis.server_parts`): labels it adds, meta it adds, and `carve`, the
    part's engine segments in (seconds, steps as recorded), the segments to store."""

    labels: list[str]
    meta: dict[str, Any]
    carve: Callable[[Segments], Segments]


@dataclass(frozen=True)
class MergedParts:
    """What `merge_to_parts` wrote: the pointer, the folder, and counts for a summary."""

    out: str
    parts_dir: str
    meta: dict[str, Any]
    warnings: list[str]
    num_parts: int
    num_steps: int
    num_emissions: int
    num_client_emissions: int
    num_requests: int


def plan_parts(
    directory: str,
    *,
    engine: int | None = None,
    max_inflate_mb: float | None = None,
    check: Check | None = None,
) -> tuple[MergePlan, list[ProcessLog], list[Source]]:
    """The merge's plan from skeleton logs, the skeletons, and where to read each again."""
    procs, sources = skeleton_logs(directory, max_inflate_mb=max_inflate_mb, check=check)
    plan = plan_server(procs, path=directory, engine=engine)
    if _source_of(plan.core, procs, sources).parts_dir is None:
        raise LogError(
            plan.core.path, "engine_core", "recorded as one file, not parts: merge it into one "
            "file (-o RUN.npz)",
        )  # fmt: skip
    return plan, procs, sources


def for_writing(plan: MergePlan, procs: list[ProcessLog]) -> tuple[MergePlan, list[ProcessLog]]:
    """The plan and skeletons less what only the plan read (the fits, the join): every
    engine core's and API server's request ids and request rows, the
    engine core's stamps, an API server's but those the deliveries pair (``serve.recv``),
    the engine ids the join looked up (`CoreIndex.added`); an engine core whose run this
    is not keeps nothing. A worker's rows are all read again: kept. The processes keep
    their order (`_source_of` pairs them with their sources)."""
    slim = {id(p): _slim(p, plan.core) for p in procs}
    out = [slim[id(p)] for p in procs]
    return replace(
        plan, core=slim[id(plan.core)], others=[slim[id(p)] for p in plan.others],
        core_index=replace(plan.core_index, added={}),
    ), out  # fmt: skip


def _slim(p: ProcessLog, core: ProcessLog) -> ProcessLog:
    if p.role not in (CORE, FRONTEND):
        return p
    lg = p.log
    ct = lg.counters
    keep = [i for i, n in enumerate(lg.counter_names) if n == RECV and p.role == FRONTEND]
    sel = np.isin(ct.name, keep)
    counters = Counters.from_columns(**{k: v[sel] for k, v in ct.columns().items()})
    lg = replace(lg, request_ids=(), requests=Requests.empty(), counters=counters)
    if p.role == CORE and p is not core:  # another data-parallel rank's: nothing read again
        lg = replace(lg, steps=Steps.empty(), segments=Segments.empty())
    return replace(p, log=lg)


def _source_of(p: ProcessLog, procs: list[ProcessLog], sources: list[Source]) -> Source:
    """Where process `p` (one of `procs`, by identity) is read again."""
    return sources[next(i for i, q in enumerate(procs) if q is p)]


def _spool_others(
    plan: MergePlan,
    procs: list[ProcessLog],
    sources: list[Source],
    spool: Spool,
    max_inflate_mb: float | None,
) -> None:
    """Every other process's rows, on the core's clock, into the spool, each with its row
    in the one-file merge's tables (`tracekit.log.merge._merged_rows`' order)."""
    seg_at = 0
    ce_at = os_at = dl_at = 0
    for k, (p, fit) in enumerate(zip(plan.others, plan.fits, strict=True), start=1):
        src = _source_of(p, procs, sources)
        lab, gc_label = plan.labels.of[k - 1], plan.labels.gc[k - 1]
        n_gc = len(p.log.gc_pauses)
        if p.role != FRONTEND:  # a worker's rows are all in its skeleton
            _spool(spool, "proc_segments", segment_rows(k, p.log.segments, lab, fit), seg_at)
            seg_at += len(p.log.segments)
        else:
            n_seg = src.num_segments if src.whole is None else len(src.whole.segments)
            counts = src.thread_counts if src.whole is None else np.bincount(
                src.whole.segments.thread
            )  # fmt: skip
            at = _spool_frontend(k, fit, plan, src, spool, (seg_at, ce_at, os_at),
                                 event_loop_thread(counts), max_inflate_mb)  # fmt: skip
            seg_at, ce_at, os_at = seg_at + n_seg, at[0], at[1]
            dl = delivery_rows(k, p.log, fit, plan.core, plan.core_index)
            dl[:, 0] += _first_step(_source_of(plan.core, procs, sources))  # as recorded
            dl_at = _spool(spool, "deliveries", dl, dl_at)
        if n_gc:
            _spool(spool, "proc_segments", gc_rows(k, p.log.gc_pauses, gc_label, fit), seg_at)
            seg_at += n_gc


def _first_step(core: Source) -> int:
    """The step an engine core read from a later part (its first parts removed by
    retention) is numbered from: its rows name steps as recorded (`Retained`)."""
    first = core.paths[0] if core.paths else None
    if first is None or part_number(first) == 1:
        return 0
    return core.first_steps.get(first) or 0


def _spool(spool: Spool, table: str, rows: np.ndarray, at: int) -> int:
    """Spool `rows` (a merged table's rows, less their ``row``) numbered from `at`; the
    next row's number. A row's time: a segment's start, else its second column (an OS
    interval's start, a chunk's write, a delivery's build)."""
    if not len(rows):
        return at
    t_s = rows[:, 2] if table == "proc_segments" else rows[:, 1]
    spool.add(table, np.column_stack([rows, np.arange(at, at + len(rows))]), t_s)
    return at + len(rows)


def _spool_frontend(
    k: int,
    fit: Any,
    plan: MergePlan,
    src: Source,
    spool: Spool,
    at: tuple[int, int, int],
    thread: int,
    max_inflate_mb: float | None,
) -> tuple[int, int]:
    """An API server's segments, chunks written and OS intervals, part by part: a chunk's
    ready time from the ``sse_write`` windows of its part and the parts beside it, its OS
    intervals continued from the part before (`OsCarry`). Returns the next chunk and OS
    rows' numbers."""
    seg_at, ce_at, os_at = at
    lab, ridx = plan.labels.of[k - 1], plan.ident.index[k - 1]
    carry = OsCarry(thread)
    window: list[RawLog] = []
    it = chunks(src, max_inflate_mb)
    nxt = next(it, None)
    while nxt is not None:
        cur, nxt = nxt, next(it, None)
        window = [*window[-1:], cur]
        sse = _sse_of([*window, *([nxt] if nxt is not None else [])])
        seg_at = _spool(spool, "proc_segments", segment_rows(k, cur.segments, lab, fit), seg_at)
        ce_at = _spool(spool, "client_emissions", client_rows(k, cur, fit, ridx, sse), ce_at)
        os_at = _spool(spool, "proc_os", os_rows(k, carry.next(cur), fit, thread), os_at)
    return ce_at, os_at


def _sse_of(logs: list[RawLog]) -> tuple[np.ndarray, np.ndarray]:
    ends, starts = zip(*(sse_windows(lg) for lg in logs), strict=True)
    e, s = np.concatenate(ends), np.concatenate(starts)
    order = np.argsort(e, kind="stable")
    return e[order], s[order]


class OsCarry:
    """An API server's event loop samples, part after part: each part's log with the last
    sample before it and, ahead of that, as many segment starts (or ends) at its time as
    the loop's nesting before it, unusable as intervals (no CPU time): the intervals and
    nesting `side_thread_intervals` finds are then those of the whole log."""

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.last: OsSamples | None = None  # the previous parts' last sample
        self.depth = 0  # nesting before it

    def next(self, lg: RawLog) -> RawLog:
        os_ = lg.os_samples
        sel = np.flatnonzero(os_.thread == self.thread)
        sel = sel[np.argsort(os_.t_s[sel], kind="stable")]
        mine = _take(os_, sel)
        head = self._head()
        kind = mine.kind
        step = (kind == OS_SEGMENT_START).astype(np.int64) - (kind == OS_SEGMENT_END)
        if len(sel):
            before = self.depth + (0 if self.last is None else _step_of(self.last))
            self.depth = before + int(step[:-1].sum())
            self.last = _take(mine, np.array([len(sel) - 1]))
        out = mine if head is None else _concat(head, mine)
        return replace(lg, os_samples=out)

    def _head(self) -> OsSamples | None:
        if self.last is None:
            return None
        d = self.depth
        n = abs(d)
        kind = OS_SEGMENT_START if d > 0 else OS_SEGMENT_END
        t = float(self.last.t_s[0])
        pad = OsSamples.from_columns(
            thread=np.full(n, self.thread), kind=np.full(n, kind), t_s=np.full(n, t),
            cpu_ns=np.full(n, -1), runqueue_ns=np.full(n, -1),
            num_voluntary_switches=np.full(n, -1), num_involuntary_switches=np.full(n, -1),
            num_major_faults=np.full(n, -1),
        )  # fmt: skip
        return _concat(pad, self.last)


def _step_of(one: OsSamples) -> int:
    k = int(one.kind[0])
    return 1 if k == OS_SEGMENT_START else -1 if k == OS_SEGMENT_END else 0


def _take(t: OsSamples, idx: np.ndarray) -> OsSamples:
    return OsSamples.from_columns(**{k: v[idx] for k, v in t.columns().items()})


def _concat(a: OsSamples, b: OsSamples) -> OsSamples:
    ca, cb = a.columns(), b.columns()
    return OsSamples.from_columns(**{k: np.concatenate([ca[k], cb[k]]) for k in ca})


# -- writing ---------------------------------------------------------------------------


def _client_requests(plan: MergePlan, lo: int, hi: int) -> np.ndarray:
    rq = plan.ident.requests
    return merged_rows(
        "client_requests", request=np.arange(lo, hi), arrival_s=rq.arrival_s[lo:hi],
        handler_s=rq.handler_s[lo:hi], engine_s=rq.engine_s[lo:hi],
    )  # fmt: skip


def _coverage_rows(plan: MergePlan) -> np.ndarray:
    c = plan.coverage
    return merged_rows("proc_coverage", process=c.process, t_start_s=c.t_start_s,
                       t_end_s=c.t_end_s, is_clean_stop=c.is_clean_stop)  # fmt: skip


def _write_parts(
    plan: MergePlan,
    core_src: Source,
    spool: Spool,
    parts_dir: str,
    rule: PartRule | None,
    max_inflate_mb: float | None,
) -> tuple[int, int]:
    """The merged parts, one per engine core part (see the module docstring). Returns the
    engine emissions and steps written."""
    names = plan.ident.names
    labels = np.array([*plan.labels.labels, *(rule.labels if rule else [])], dtype=str)
    meta = read_meta(core_src.parts_dir or "")
    t0, scale = int(meta["t0_tick"]), float(meta.get("seconds_per_tick", 1e-9))
    n_em = n_steps = 0
    last = len(core_src.paths) - 1
    for j, path in enumerate(core_src.paths):
        arrays = dict(read_part(path, max_inflate_mb=max_inflate_mb))
        start = int(arrays["request_ids_start"])
        hi = start + len(np.asarray(arrays["request_ids"]).reshape(-1))
        hi_named = len(names) if j == last else hi  # the requests only an API server saw
        arrays["request_ids"] = np.array(names[start:hi_named], dtype=str)
        arrays["labels"] = labels
        for table in ("proc_segments", "client_emissions", "deliveries", "proc_os"):
            rows = spool.take(table, j)
            if rows is not None:
                arrays[table] = rows
        arrays["client_requests"] = _client_requests(plan, start, hi_named)
        if j == last:
            arrays["proc_coverage"] = _coverage_rows(plan)
        if rule is not None:
            sg = np.asarray(arrays["segments"]).reshape(-1, len(TABLES["segments"]))
            seg = to_table(Segments, "segments", sg, lambda t: (t - t0).astype(np.float64) * scale)
            carved = rule.carve(seg)
            arrays["tp_segments"] = merged_rows(
                "tp_segments", **{c: v for c, v in carved.columns().items()}
            )
            arrays["segments"] = np.zeros(0, dtype=np.int64)
        flushed = FlushedRows(arrays)
        n_em += len(flushed.table("emissions"))
        n_steps += len(flushed.table("steps"))
        written = write_part(parts_dir, part_number(path), flushed, fsync=False)
        append_index(parts_dir, written, flushed)
    return n_em, n_steps


def write_merged_parts(
    plan: MergePlan,
    procs: list[ProcessLog],
    sources: list[Source],
    out: str,
    *,
    rule: PartRule | None = None,
    force: bool = False,
    max_inflate_mb: float | None = None,
    verify: Callable[[str], Any] | None = None,
) -> MergedParts:
    """Write the merged run as ``OUT.parts/`` and the pointer `out` (a clean stop's pair),
    built in a temporary folder beside it and renamed into place: an interrupted merge
    leaves no half run under the name. An existing output is replaced only with `force`.
    `verify`: called with the written folder before it is moved into place (raising: the
    run is refused, nothing is written)."""
    _refuse_existing(out, force)
    tmp = tempfile.mkdtemp(prefix=".tracekit-merge-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        written = _write_unverified(plan, procs, sources, out, tmp, rule, max_inflate_mb)
        _move_into_place(tmp, written, force, verify)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def _refuse_existing(out: str, force: bool) -> None:
    for x in (out, out + PARTS_SUFFIX):
        if os.path.lexists(x) and not force:
            raise LogError(x, "output", "already exists; write elsewhere, or pass --force to "
                           "replace it")  # fmt: skip


def _write_unverified(
    plan: MergePlan,
    procs: list[ProcessLog],
    sources: list[Source],
    out: str,
    tmp: str,
    rule: PartRule | None,
    max_inflate_mb: float | None,
) -> MergedParts:
    """The merged parts, meta and final meta written into ``TMP/parts`` (the spool in
    ``TMP/spool``, removed after); what was written."""
    core_src = _source_of(plan.core, procs, sources)
    assert core_src.parts_dir is not None
    meta = read_meta(core_src.parts_dir)
    work, spool_dir = os.path.join(tmp, "parts"), os.path.join(tmp, "spool")
    os.mkdir(work)
    os.mkdir(spool_dir)
    ticks = np.array([core_src.flush_ticks[p] for p in core_src.paths], dtype=np.int64)
    edges = (ticks - int(meta["t0_tick"])).astype(np.float64) * float(
        meta.get("seconds_per_tick", 1e-9)
    )
    spool = Spool(spool_dir, edges)
    _spool_others(plan, procs, sources, spool, max_inflate_mb)
    n_em, n_steps = _write_parts(plan, core_src, spool, work, rule, max_inflate_mb)
    head = {k: v for k, v in meta.items() if k != "warnings"}
    atomic_write(os.path.join(work, "meta.json"),
                 json.dumps(json_safe({**head, "warnings": []})).encode())  # fmt: skip
    core = plan.core.log
    final = {k: v for k, v in plan.meta.items() if k != "warnings"}
    final.update(rule.meta if rule else {})
    final.update(config=core.config, warnings=_own_warnings(work, plan.warnings),
                 extras=core.extras)  # fmt: skip
    write_final(work, final)
    shutil.rmtree(spool_dir)
    return MergedParts(
        out, out + PARTS_SUFFIX, plan.meta, plan.warnings, len(core_src.paths), n_steps, n_em,
        spool.counts.get("client_emissions", 0), len(plan.ident.names),
    )  # fmt: skip


def _move_into_place(
    tmp: str, written: MergedParts, force: bool, verify: Callable[[str], Any] | None
) -> None:
    """Check the folder written in `tmp` (`verify`), then rename it into place and write
    its pointer."""
    work = os.path.join(tmp, "parts")
    give_back_freed_memory()  # what spooling and writing freed, before the check reads
    if verify is not None:
        verify(work)
    _replace(work, written.parts_dir, written.out, force)
    write_pointer(written.out, written.parts_dir)


def _own_warnings(parts_dir: str, warnings: list[str]) -> list[str]:
    """`warnings` less what reading the merged folder says itself: that it starts at a
    later part (an engine core whose first parts retention removed says so too)."""
    paths = part_paths(parts_dir)
    said: list[str] = []
    if paths:
        first = parse_flushed(read_part(paths[0]), paths[0])
        retained_start(parts_dir, paths, [first], said)
    out = list(warnings)
    for w in said:
        if w in out:
            out.remove(w)
    return out


def _replace(work: str, parts_dir: str, out: str, force: bool) -> None:
    """Move the written folder into place (`force`: over a merged run written before,
    which must be a run's parts folder)."""
    if force and os.path.lexists(parts_dir):
        if not os.path.isfile(os.path.join(parts_dir, "meta.json")):
            raise LogError(parts_dir, "output", "exists and is not a run's parts folder: not "
                           "replaced")  # fmt: skip
        shutil.rmtree(parts_dir)
    if force and os.path.lexists(out):
        os.remove(out)
    os.rename(work, parts_dir)


def merge_to_parts(
    directory: str,
    out: str,
    *,
    engine: int | None = None,
    force: bool = False,
    max_inflate_mb: float | None = None,
    rule_of: Callable[[MergePlan], PartRule | None] | None = None,
    check: Check | None = None,
    verify: Callable[[str], Any] | None = None,
) -> MergedParts:
    """Merge the server run in `directory` into the parts folder ``OUT.parts/`` and its
    pointer `out` (see the module docstring); `rule_of`: the cause rule to apply part by
    part, from the plan (`tracekit.analysis.server_parts`); `check`: see `skeleton_logs`;
    `verify`: see `write_merged_parts`."""
    plan, procs, sources = plan_parts(directory, engine=engine, max_inflate_mb=max_inflate_mb,
                                      check=check)  # fmt: skip
    plan, procs = for_writing(plan, procs)
    give_back_freed_memory()  # the join's dictionaries and what `for_writing` let go
    rule = rule_of(plan) if rule_of is not None else None
    _refuse_existing(out, force)
    tmp = tempfile.mkdtemp(prefix=".tracekit-merge-", dir=os.path.dirname(os.path.abspath(out)))
    try:  # (`write_merged_parts`, the plan let go before the written folder is checked)
        written = _write_unverified(plan, procs, sources, out, tmp, rule, max_inflate_mb)
        del plan, procs, sources, rule  # (the rule's carve holds the plan)
        _move_into_place(tmp, written, force, verify)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def server_emissions(directory: str) -> int:
    """The most engine emissions one engine core of `directory` recorded, as its parts'
    index counts them (0 for one recorded as one file, or without an index): what decides
    whether a command reads the run in slices (docs/reports.md, "Reading a long run in
    slices")."""
    most = 0
    for path, parts_dir, _ in process_entries(directory):
        if not os.path.basename(path).startswith(CORE):
            continue
        try:
            folder = parts_dir or _pointed(path, None)
            if folder is not None:
                entries, _ = read_index(folder)
                most = max(most, sum(e.num_emissions for e in entries))
        except (LogError, OSError):
            continue  # the merge says what is wrong with it
    return most
