"""The index pass of a long run spread over processes or a cluster (`analyze -j N` or
`--ray` on one run: docs/reports.md, "Reading a long run in slices").

`tracekit.analysis.stream.index_pass` reads every part in order in one process, carrying
per request its last emission and per evicted request its pending debt from part to part.
Here each part is read where the slices are (`part_facts`, a task per stretch of parts):
what depends on that part alone is computed there (its steps' figures from it and the part
before it, its GC pauses, the gaps between two of its own emissions, its order facts), and
what crosses parts is left small: each request's first and last emission in it, and the
rows the eviction figures may need. The driver then folds the parts in order
(`index_pass_spread`): the gap that ends at each request's first emission in a part (from
its last one before), the book of `SlicedRun.index`, the pending evictions. The `Index` is
the one `index_pass` gives, value for value (`tests/analysis/test_sliced.py`).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.analysis.evictions import RECOMPUTE_LABEL
from tracekit.analysis.quantiles import ExactQuantiles
from tracekit.analysis.stream import (
    Index,
    device_rows,
    span_of,
    sparse_part,
    step_figures,
    step_mini,
)
from tracekit.labels import OS_LABELS, RECOMPUTE_CLASS
from tracekit.log.flush import READMIT, TABLES
from tracekit.log.parts import DamagedPart, missing_part_warning, unreadable_part_warning
from tracekit.log.slices import IndexBook, NotSliceable, PartOrder, SlicedRun, order_of

_ST = {c: TABLES["steps"].index(c) for c in TABLES["steps"]}
_EM = {c: TABLES["emissions"].index(c) for c in TABLES["emissions"]}
_RQ = {c: TABLES["requests"].index(c) for c in TABLES["requests"]}
_NEVER_TICK = np.iinfo(np.int64).min
#: parts a task reads (a stretch: its first part's previous one is read again, and the
#: folder listed once)
PARTS_PER_TASK = 16


@dataclass
class StepFacts:
    """One part's steps, as `index_pass` adds them up."""

    graph_size: np.ndarray
    num_decode: np.ndarray
    num_preempted: int
    computed_tokens: int
    max_decode: int
    first_step_tick: int
    decode_net: np.ndarray  # their GC-free decode time (TTFT partition's, ITL's)
    decode_net_itl: np.ndarray
    labels: set[str]  # the partitions' labels these steps bring
    ttft_labels: set[str]
    has_os: bool


#: the quantiles of a per-part index that counts no gap (made once: each holds 8 MiB)
_UNUSED = ExactQuantiles()


@dataclass
class PartFacts:
    """One part, as far as it can be known without the parts before it."""

    order: PartOrder
    steps: StepFacts | None
    gc: np.ndarray | None
    arrivals: np.ndarray  # (request, arrival tick) rows
    span: tuple[int, int] | None
    tokens: int
    inner: np.ndarray  # the gaps between two of its own emissions (ms)
    inner_worst: tuple[float, float]  # their longest and where the first such ends (s)
    sparse: dict[str, Any]  # the part with only the rows the eviction figures may read
    num_admissions: int  # its admission rows
    device_windows: int  # its device windows' rows


@dataclass(frozen=True)
class IndexTask:
    """Parts ``[lo, hi)`` of the folder, read where the task runs (picklable)."""

    parts_dir: str
    max_inflate_mb: float | None
    lo: int
    hi: int
    #: of parts ``[max(lo - 1, 0), hi + 1)`` as listed (`SlicedRun`'s `parts`): a part's
    #: steps are read with the parts beside it (`stream.step_mini`)
    paths: tuple[str, ...] = ()


def part_facts(task: IndexTask) -> list[PartFacts | None]:
    """Each part of the task's stretch, read and reduced to its `PartFacts`; None for one
    that cannot be read (and nothing after it): the driver reads it again, in order, and
    says why as `SlicedRun.index` does."""
    run = SlicedRun(task.parts_dir, max_inflate_mb=task.max_inflate_mb,
                    parts=(max(task.lo - 1, 0), task.paths))  # fmt: skip
    out: list[PartFacts | None] = []
    for i in range(task.lo, task.hi):
        try:
            part = run.read(i)
        except Exception:  # noqa: BLE001 - said by the driver, which reads it again
            out.append(None)
            break
        out.append(_facts(run, i, part))
    return out


def _rows(tables: dict[str, np.ndarray], name: str) -> int:
    a = tables.get(name)
    return 0 if a is None else len(a)


def _facts(run: SlicedRun, i: int, part: dict[str, Any]) -> PartFacts:
    t = part["tables"]
    order = order_of(run.paths[i], part)
    steps = None
    st = t.get("steps")
    if st is not None and len(st):
        steps = _step_facts(run, i, part, st)
    gc = t.get("gc_pauses")
    rq = t.get("requests")
    arrivals = (np.stack([rq[:, _RQ["request"]], rq[:, _RQ["arrival_tick"]]], axis=1)
                if rq is not None and len(rq) else np.zeros((0, 2), np.int64))  # fmt: skip
    spanned = Index(gaps=_UNUSED, extra=_UNUSED)  # its span only: no 8 MiB histograms a part
    span_of(spanned, t)
    em = t.get("emissions")
    inner, worst, tokens = np.zeros(0), (-math.inf, math.inf), 0
    if em is not None and len(em):
        tokens = int(em[:, _EM["num_tokens"]].sum())
        inner, worst = _inner_gaps(run, em)
    return PartFacts(
        order, steps, gc.copy() if gc is not None and len(gc) else None, arrivals,
        spanned.span_ticks, tokens, inner, worst, _reduced(part), _rows(t, "admissions"),
        device_rows(part),
    )  # fmt: skip


def _step_facts(run: SlicedRun, i: int, part: dict[str, Any], st: np.ndarray) -> StepFacts:
    """The part's steps' counts and figures (from it and the parts beside it,
    `stream.step_mini`), as `index_pass` adds them up."""
    ix = Index(gaps=_UNUSED, extra=_UNUSED)  # step_figures' own fields only
    step_figures(ix, *step_mini(run, i), len(st))
    nd = st[:, _ST["num_decode"]]
    return StepFacts(
        st[:, _ST["graph_size"]].copy(), nd.copy(), int(st[:, _ST["num_preempted"]].sum()),
        int(st[:, _ST["num_prefill_tokens"]].sum()) + int(nd.sum()), int(nd.max()),
        int(st[:, _ST["t0_tick"]].min()), ix.decode_net[0], ix.decode_net_itl[0], ix.labels,
        ix.ttft_labels, ix.has_os,
    )  # fmt: skip


def _inner_gaps(run: SlicedRun, em: np.ndarray) -> tuple[np.ndarray, tuple[float, float]]:
    """The gaps between two emissions of one request in this part (ms, as
    `stream.gap_lengths` computes them), and the longest and where the first such ends."""
    o = np.argsort(em[:, _EM["t_tick"]], kind="stable")
    o = o[np.argsort(em[o, _EM["request"]], kind="stable")]  # by request, then time
    r, tk = em[o, _EM["request"]], em[o, _EM["t_tick"]]
    head = np.ones(len(r), dtype=bool)
    head[1:] = r[1:] != r[:-1]
    t1 = run.secs(tk[~head])
    prev = np.concatenate([[0], tk[:-1]])[~head]
    gap = (t1 - run.secs(prev)) * 1e3
    worst = (-math.inf, math.inf)
    if len(gap):
        top = gap.max()
        worst = (float(top), float(t1[gap == top].min()))
    return gap, worst


def _reduced(part: dict[str, Any]) -> dict[str, Any]:
    """The part with the rows `stream._sparse_part` may read: its eviction tables and
    counters, its `recompute` segments, and of the emissions every row of a request
    readmitted in it and each other request's first row (a debt pending from an earlier
    part ends at it, unless it is not after the readmission: then the driver reads the
    part)."""
    t = part["tables"]
    keep = {k: t[k] for k in ("events", "preemptions", "evictors", "counters") if k in t}
    sg = t.get("segments")
    if sg is not None and len(sg) and RECOMPUTE_LABEL in part["labels"]:
        mine = sg[:, 1] == part["labels"].index(RECOMPUTE_LABEL)
        mine[0] = True  # one row at least: `sparse_part` keeps its (maybe empty) selection
        keep["segments"] = sg[mine]
    em = t.get("emissions")
    if em is not None and len(em):
        ev = t.get("events")
        back = ev[ev[:, 1] == READMIT, 0] if ev is not None and len(ev) else np.zeros(0)
        mine = np.isin(em[:, _EM["request"]], back)
        mine[_first_rows(em)] = True
        keep["emissions"] = em[mine]  # in the part's own row order
    return {**{k: v for k, v in part.items() if k != "tables"}, "tables": keep}


def _first_rows(em: np.ndarray) -> np.ndarray:
    """Each request's first emission row in the part (its earliest tick, the first row of
    equal ones), as row indices."""
    o = np.argsort(em[:, _EM["t_tick"]], kind="stable")
    o = o[np.argsort(em[o, _EM["request"]], kind="stable")]
    r = em[o, _EM["request"]]
    head = np.ones(len(r), dtype=bool)
    head[1:] = r[1:] != r[:-1]
    return o[head]


def index_pass_spread(
    run: SlicedRun,
    fit: str,
    progress: Callable[[str], None],
    mapper: Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]],
    *,
    spill: bool = False,
) -> Index:
    """`stream.index_pass` (no `light`, no `extra_qs`) with the parts read by `mapper`'s
    workers; the same `Index` and the same `run.parts`."""
    if not run.paths:
        raise NotSliceable("no parts")
    for i in range(len(run.paths)):
        if not run.follows(i):
            run.end_before(i, missing_part_warning(run.paths, i))
            break
    n = len(run.paths)
    tasks = [IndexTask(run.parts_dir, run.max_inflate_mb, lo, min(lo + PARTS_PER_TASK, n),
                       tuple(run.paths[max(lo - 1, 0) : lo + PARTS_PER_TASK + 1]))
             for lo in range(0, n, PARTS_PER_TASK)]  # fmt: skip
    ix = Index(fit=fit)
    if spill:
        ix.spill = tempfile.TemporaryFile()
    book = IndexBook()
    i = 0
    for facts in mapper(part_facts, tasks):
        for f in facts:
            if f is None:  # unreadable where the task ran: read here, as `index` reads it
                try:
                    f = _facts(run, i, run.read_indexed(i))
                except DamagedPart as e:  # the run ends before it (`SlicedRun.index`)
                    run.end_before(i, unreadable_part_warning(run.paths, i, e.cause))
                    break
            book.add(i, f.order)
            _fold(run, ix, i, f)
            i += 1
        progress(f"index: part {i} of {n}")
        if i < n and i == len(run.paths):  # ended early: the later tasks' facts are not read
            break
    if ix.has_os:
        ix.labels |= set(OS_LABELS) - {RECOMPUTE_CLASS}
        ix.ttft_labels |= set(OS_LABELS)
    run.indexed(book)
    return ix


def _fold(run: SlicedRun, ix: Index, i: int, f: PartFacts) -> None:
    """Part `i`'s facts into the run's index, as `index_pass`'s visit adds the part."""
    s = f.steps
    if s is not None:
        ix.graph_size.append(s.graph_size)
        ix.num_decode.append(s.num_decode)
        ix.num_preempted += s.num_preempted
        ix.computed_tokens += s.computed_tokens
        ix.max_decode = max(ix.max_decode, s.max_decode)
        if ix.first_step_tick is None or s.first_step_tick < ix.first_step_tick:
            ix.first_step_tick = s.first_step_tick
        ix.decode_net.append(s.decode_net)
        ix.decode_net_itl.append(s.decode_net_itl)
        ix.labels |= s.labels
        ix.ttft_labels |= s.ttft_labels
        ix.has_os = ix.has_os or s.has_os
    ix.device_windows += f.device_windows
    if f.gc is not None:
        ix.gc.append(f.gc)
    ix.num_admissions += f.num_admissions
    ix.grow_requests(f.order.num_requests)
    ix.arrival_tick[f.arrivals[:, 0]] = f.arrivals[:, 1]
    ix.sparse.append(_sparse(run, ix, i, f))
    if f.span is not None:
        lo, hi = f.span
        old = ix.span_ticks
        ix.span_ticks = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    u = f.order.requests
    if not len(u):
        return
    ix.tokens += f.tokens
    new = ix.first_part[u] < 0
    ix.first_part[u[new]] = i
    ix.first_tick[u[new]] = np.minimum(ix.first_tick[u[new]], f.order.first_tick[new])
    prev = ix.last_tick[u]
    has = prev != _NEVER_TICK
    t1 = run.secs(f.order.first_tick[has])
    edge = (t1 - run.secs(prev[has])) * 1e3  # the gaps that end at each first emission
    ix.last_tick[u] = f.order.last_tick
    gap = np.concatenate([f.inner, edge])
    ix.gaps.count(gap)
    if ix.spill is not None:
        gap.astype(np.float64).tofile(ix.spill)
    _worst(ix, f.inner_worst, edge, t1)


def _worst(ix: Index, inner: tuple[float, float], edge: np.ndarray, t1: np.ndarray) -> None:
    """The run's longest gap so far, with the part's (its own and its edges'), as
    `index_pass` keeps it: the first to end of equal ones."""
    top, end = inner
    if len(edge):
        e_top = float(edge.max())
        e_end = float(t1[edge == e_top].min())
        if e_top > top or (e_top == top and e_end < end):
            top, end = e_top, e_end
    if top >= ix.worst[0] and (top > ix.worst[0] or end < ix.worst[1]):
        ix.worst = (top, end)


def _sparse(run: SlicedRun, ix: Index, i: int, f: PartFacts) -> dict[str, Any]:
    """`stream._sparse_part` of part `i` from its reduced rows, or from the part read
    again where a pending debt's request emits here no later than its readmission (then
    its first row here is not the first after the readmission)."""
    u, first = f.order.requests, f.order.first_tick
    pending = [(r, tick) for r, tick in ix.pending.items()]
    if pending:
        r = np.array([p[0] for p in pending], dtype=np.int64)
        tick = np.array([p[1] for p in pending], dtype=np.int64)
        at = np.searchsorted(u, r)
        here = (at < len(u)) & (u[np.minimum(at, len(u) - 1)] == r) if len(u) else at < 0
        if here.any() and np.any(first[at[here]] <= tick[here]):
            return sparse_part(ix, run.read(i))
    return sparse_part(ix, f.sparse)
