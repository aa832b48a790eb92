"""One run's what-if read in slices, in memory bounded by a slice, not by the run
(docs/reports.md, "Reading a long run in slices"; docs/whatif.md).

The result is `tracekit.analysis.whatif.whatif`'s on the whole run: every removal by both
models, each percentile exactly, each `removed_ms` to float rounding (it adds up in
another order). Each slice of the run (`tracekit.analysis.stream`'s: its own gaps
partitioned with the whole run's graph baseline) gives, per removal and model, the values
of the gaps and the TTFTs it owns; they are counted in `GroupQuantiles` (a sparse
histogram per removal and model), in two passes over the slices, as `stream` finds the
ITL percentiles: the first counts the values' histogram buckets, the second keeps the
values of the buckets that hold the wanted ranks.

What a slice cannot see for itself, it is handed:

- **First order** needs nothing but the slice's own partitions: a gap (a TTFT) loses its
  parts in the removal's labels (and others' re-prefill when `preempt` goes). A slice's
  partitions have been the whole run's bit for bit on every run tested (demo runs with
  and without OS evidence, with compensated prefix sums; a 10-minute busy server's TTFT
  rows compared one by one, its and an hour's outputs byte for byte); a run where the
  last bit differed would move a percentile by that bit.
- **Second order** needs the whole run's replayed timeline `R(x)`: the removable rate of an
  instant depends on every window over it (a window recorded in another slice's parts, a
  GC pause), and a step's readmission prefill share on each request's first eviction
  anywhere before it. `R` is built part by part in time order
  (`tracekit.analysis.stream_replay`: each stretch carries across its edge the last
  bound, `R` there, the covers' running sums and the windows still open), each removal's
  exactly as the whole-run what-if computes it (`whatif.replayed`, with the graph
  baseline fitted on the whole run), and cut to each slice's span: from the earliest
  emission its log holds, or its own first tokens' earliest arrival, to where its own gaps
  end, with the bounds around them, so `R` at every instant a slice asks for is the whole
  run's, bit for bit. The cuts wait in a temporary file between the two passes. A
  victim's evicted gap is split at the step ends inside it, which the slice's own steps
  hold; a TTFT's eviction and wait windows lie between its arrival and its first token,
  in the slice's own parts. Where a removal takes the OS's time (its share is the whole
  run's timeline's) or a part holds a window that began before the parts already
  replayed, `R` comes from the log without its emissions read whole instead (memory by
  steps and segments: `replays_of`).
- **The victim-policy line** (`victim_policy`, where the log records recompute evictions
  with their causes) counts each candidate's emitted tokens between a decision and its
  own readmission or the start, and each request's first and last emission: a log that
  keeps, per request and stretch between two such instants, its first and last emission
  with the stretch's tokens gives every such count as the whole log does
  (`reduced_logs`, from the log without its emissions and segments).
- **Which removals** a run has comes from the index pass's labels (ITL and TTFT): every
  removal of them is computed in the slices, and those with time in some gap or TTFT are
  reported (as the whole-run `removals`); if the slices' labels are not the index's,
  `NotSliceable`.

Held for the whole run: the index pass's (per request a few integers and its name, per
step a few numbers), the histograms, and `R` back to the earliest instant a slice still to
come asks for. A window (`--window`, `--around`) keeps its own reader
(`tracekit.analysis.workers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.quantiles import GroupQuantiles, group_counts, group_kept
from tracekit.analysis.stream import (
    DEFAULT_SLICE_EMISSIONS,
    NEVER,
    TTFT_LABEL_GROUPS,
    Index,
    SliceTask,
    index_pass,
    ordered,
    slice_partition,
    slice_tasks,
    whole_baselines,
)
from tracekit.analysis.stream_replay import LateWindow, replay_cuts, replay_stretches
from tracekit.analysis.victim_policy import VictimPolicy, has_decisions, victim_policy
from tracekit.analysis.whatif import (
    FIRST,
    ITL_QS,
    SECOND,
    TTFT_QS,
    Prediction,
    Removal,
    WhatIf,
    figures_from,
    first_order_gaps,
    first_order_ttfts,
    labels_with_time,
    pick_removal,
    removals_of,
    replayed,
    second_order_gaps,
    second_order_ttfts,
)
from tracekit.attribution.itl import FIT_ALL_CAPTURED
from tracekit.attribution.timeline import PreparedRun
from tracekit.attribution.ttft import ttft_partition
from tracekit.labels import is_os_label, partition_labels
from tracekit.log.flush import TABLES, UNKNOWN_TICK
from tracekit.log.parts import merge_flushed
from tracekit.log.rawlog import MODE_RECOMPUTE, Emissions, RawLog
from tracekit.log.slices import NotSliceable, SlicedRun

__all__ = ["NotSliceable", "whatif_of_index", "whatif_sliced"]

#: every table of a run's log but its emissions: what `R` and the TTFTs' states read
_NOT_EMISSIONS = frozenset(TABLES) - {"emissions"}
Replay = tuple[np.ndarray, np.ndarray]  # (bounds_s, R_s): `whatif.replayed`


@dataclass(frozen=True)
class WhatIfTask:
    """One slice's what-if work (picklable, as `SliceTask`): the slice, the removals, each
    removal's replayed timeline cut to the slice's span and, in pass 2, the histogram keys
    to keep (of its gaps' values, then of its TTFTs'). Value group 0 is the gaps (TTFTs) as
    measured; removal k's first order is group 1 + 2k, its second order 2 + 2k."""

    slice: SliceTask
    removals: tuple[Removal, ...]
    replays: tuple[Replay, ...]
    keep_keys: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class WhatIfPart:
    """What a slice gives back: pass 1, its values' histogram counts (gaps, then TTFTs),
    each group's number of gaps and removed time, its labels with time, its partition's
    labels and warnings; pass 2, its values in the kept buckets."""

    counts: tuple[np.ndarray, np.ndarray] | None = None
    ttft_counts: tuple[np.ndarray, np.ndarray] | None = None
    num: list[int] = field(default_factory=list)
    removed_ms: list[float] = field(default_factory=list)
    has: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)
    warnings: tuple[str, ...] = ()
    kept: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    ttft_kept: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


def run_whatif_slice(task: WhatIfTask) -> WhatIfPart:
    """Partition one slice and compute every removal's values of its own gaps and TTFTs
    (each group's counted, or its kept values taken, before the next one's are computed)."""
    log, prep, p = slice_partition(task.slice)[:3]
    tp = ttft_partition(log, run=prep)
    t_from, t_to = task.slice.t_from_s, task.slice.t_to_s
    tp = tp.take((tp.first_token_s >= t_from) & (tp.first_token_s < t_to))
    if len(tp) and not (tp.ttft_ms.min() >= 0.0):  # also NaN: not a figure counted here
        raise NotSliceable("a TTFT that is not a non-negative time")
    out = WhatIfPart(num=[len(p.gap_ms)], removed_ms=[0.0])
    pieces = [_piece(task, 0, 0, p.gap_ms)]
    t_pieces = [_piece(task, 1, 0, tp.ttft_ms)]
    for k, (r, (bounds, cum)) in enumerate(zip(task.removals, task.replays, strict=True)):
        for g, (gap, lost) in ((1 + 2 * k, first_order_gaps(p, r)),
                               (2 + 2 * k, second_order_gaps(log, p, r, bounds, cum))):  # fmt: skip
            pieces.append(_piece(task, 0, g, gap))
            out.num.append(len(gap))
            out.removed_ms.append(float(lost.sum()))
        t_pieces.append(_piece(task, 1, 1 + 2 * k, first_order_ttfts(tp, r)))
        t_pieces.append(_piece(task, 1, 2 + 2 * k, second_order_ttfts(log, tp, r, bounds, cum)))
    joined = tuple(np.concatenate(x) for x in zip(*pieces, strict=True))
    t_joined = tuple(np.concatenate(x) for x in zip(*t_pieces, strict=True))
    if task.keep_keys is not None:  # pass 2: the values of the wanted buckets
        return WhatIfPart(kept=joined, ttft_kept=t_joined)  # type: ignore[arg-type]
    out.counts, out.ttft_counts = joined, t_joined  # type: ignore[assignment]
    out.has = labels_with_time(p.labels, p.parts_ms) | labels_with_time(tp.labels, tp.parts_ms)
    out.labels = set(p.labels)
    out.warnings = tuple(p.warnings)
    return out


def _piece(task: WhatIfTask, which: int, g: int, values: np.ndarray) -> tuple[np.ndarray, ...]:
    """Group `g`'s values of a slice (`which`: 0 its gaps, 1 its TTFTs): counted (pass 1)
    or their kept buckets' (pass 2)."""
    groups = np.full(len(values), g, dtype=np.int64)
    if task.keep_keys is not None:
        return group_kept(groups, values, task.keep_keys[which])
    return group_counts(groups, values)


def replays_of(skeleton: RawLog, excess: np.ndarray, cands: list[Removal]) -> list[Replay]:
    """Each removal's replayed timeline (`whatif.replayed`), equal arrays held once: the
    bounds of every removal without OS time are the same (every window's ends; one removing
    OS time adds the OS samples' ticks), and removals with no window time (a TTFT-only
    cause) or the same windows (a family of one present cause) share `R`."""
    out: list[Replay] = []
    for r in cands:
        bounds, cum = replayed(skeleton, excess, r.itl_labels)
        bounds = next((b for b, _ in out if np.array_equal(b, bounds)), bounds)
        cum = next((c for _, c in out if np.array_equal(c, cum)), cum)
        out.append((bounds, cum))
    return out


def cut_replay(rep: Replay, lo_s: float, hi_s: float) -> Replay:
    """`rep` from the bound at or before `lo_s` to the one at or after `hi_s`: `R` between
    them interpolates as on the whole array (`np.interp` takes the same two bounds)."""
    bounds, cum = rep
    n = len(bounds)
    k0 = min(max(int(np.searchsorted(bounds, lo_s, "right")) - 1, 0), n - 1)
    k1 = max(min(int(np.searchsorted(bounds, hi_s, "left")) + 1, n), k0 + 1)
    return bounds[k0:k1], cum[k0:k1]


def whatif_sliced(
    parts_dir: str,
    names: Iterable[str] | None = None,
    *,
    path: str,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    mapper: Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]] | None = None,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> WhatIf:
    """`tracekit.analysis.whatif.whatif` of a run's parts folder (every removal, or those
    named), read in slices of at most `max_emissions` emissions (the module's docstring).
    `mapper(fn, items)`: runs the slices (a process pool's or Ray's map, in order); the
    result is the same. Raises `NotSliceable` for a run the whole-run reader must read."""
    say = progress or (lambda _msg: None)
    run = SlicedRun(parts_dir, max_inflate_mb=max_inflate_mb)
    ix = index_pass(run, FIT_ALL_CAPTURED, say)
    return whatif_of_index(run, ix, names, path=path, max_emissions=max_emissions,
                           mapper=mapper, progress=say)  # fmt: skip


def whatif_of_index(
    run: SlicedRun,
    ix: Index,
    names: Iterable[str] | None = None,
    *,
    path: str,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    mapper: Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> WhatIf:
    """`whatif_sliced` of a run whose index pass is made (`index_pass` with the ITL
    baseline's default fit, as `analyze_sliced`'s: a caller that reads the run for more
    than its what-if hands its index to each reader)."""
    say = progress or (lambda _msg: None)
    itl_labels = tuple(partition_labels(ix.labels))
    ttft_labels = ordered(ix.ttft_labels, TTFT_LABEL_GROUPS)
    every = removals_of(itl_labels, ttft_labels)
    cands = every if names is None else [pick_removal(every, n) for n in names]
    light = merge_flushed(run.meta, ix.sparse, path=run.parts_dir, retained=run.retained(0),
                          final=run.final, warnings=list(run.warnings))  # fmt: skip
    slices = slice_tasks(run, ix, max_emissions, math.inf)
    give_back_freed_memory()  # the index pass's parts, between what it keeps
    spans = _spans(run, ix, slices)
    each = mapper or _in_process
    sets = list(dict.fromkeys(r.itl_labels for r in cands))
    stream = not (ix.has_os and any(is_os_label(lb) for st in sets for lb in st))

    def tasks(keep: tuple[np.ndarray, np.ndarray] | None) -> Iterable[WhatIfTask]:
        cuts = _replays(run, ix, (slices, spans), sets, stream)
        made = (WhatIfTask(t, tuple(cands), tuple(reps[sets.index(r.itl_labels)] for r in cands),
                           keep)
                for t, reps in zip(slices, cuts, strict=True))  # fmt: skip
        return made  # made as they are taken (`slice_mapper`): each holds its cut of `R`

    while True:  # the first pass again from the log without emissions, where a window
        q, tq = GroupQuantiles(ITL_QS), GroupQuantiles(TTFT_QS)  # came late (`LateWindow`)
        total = _Totals(num=np.zeros(1 + 2 * len(cands), np.int64),
                        removed=[0.0] * (2 * len(cands)))  # fmt: skip
        try:
            for j, part in enumerate(each(run_whatif_slice, tasks(None))):  # type: ignore[arg-type]
                assert part.counts is not None and part.ttft_counts is not None
                q.add_counts(*part.counts)
                tq.add_counts(*part.ttft_counts)
                total.add(part)
                give_back_freed_memory()  # the slice's partition, before the next one's
                say(f"what-if: slice {j + 1} of {len(slices)}")
            break
        except LateWindow:
            if not stream:
                raise
            stream = False
    q.wanted()
    tq.wanted()
    keep = (q.keep_keys, tq.keep_keys)
    try:
        for j, part in enumerate(each(run_whatif_slice, tasks(keep))):  # type: ignore[arg-type]
            assert part.kept is not None and part.ttft_kept is not None
            q.add_kept(*part.kept)
            tq.add_kept(*part.ttft_kept)
            give_back_freed_memory()
            say(f"what-if percentiles: slice {j + 1} of {len(slices)}")
    except LateWindow:  # read the same way as the first pass, unless the folder changed
        raise NotSliceable("a part changed between the what-if's two reads") from None
    if tuple(partition_labels(total.labels)) != itl_labels:
        raise NotSliceable("the slices' partition labels are not the index pass's")
    shown = removals_of(itl_labels, ttft_labels, total.has) if names is None else cands
    preds = []
    for r in shown:
        k = cands.index(r)
        for model, g in ((FIRST, 1 + 2 * k), (SECOND, 2 + 2 * k)):
            figs = figures_from(q.percentiles(g), tq.percentiles(g))
            preds.append(Prediction(r, model, figs, total.removed[g - 1], int(total.num[g])))
    return WhatIf(
        path=path,
        config=dict(light.config),
        measured=figures_from(q.percentiles(0), tq.percentiles(0)),
        num_gaps=int(total.num[0]),
        predictions=tuple(preds),
        warnings=tuple(light.warnings) + tuple(dict.fromkeys(total.warnings)),
        victim_policy=_policy(run, ix, light),
    )


def _spans(run: SlicedRun, ix: Index, slices: list[SliceTask]) -> list[tuple[float, float]]:
    """Each slice's span, where its gaps' and TTFTs' second order reads `R`: from its
    earliest emission, or its own first tokens' earliest arrival if earlier, to where its
    gaps end."""
    lo = np.array([run.cut_s(t.c) for t in slices])
    n = len(ix.first_tick)
    arrival = ix.arrival_tick[:n]
    has = (ix.first_tick != NEVER) & (arrival != UNKNOWN_TICK)
    first_s, arrival_s = run.secs(ix.first_tick[has]), run.secs(arrival[has])
    starts = np.array([t.t_from_s for t in slices])
    which = np.searchsorted(starts, first_s, "right") - 1
    ok = (which >= 0) & np.isfinite(arrival_s)
    np.minimum.at(lo, which[ok], arrival_s[ok])
    return [(float(a), float(t.t_to_s)) for a, t in zip(lo, slices, strict=True)]


def _replays(
    run: SlicedRun,
    ix: Index,
    slices: tuple[list[SliceTask], list[tuple[float, float]]],
    sets: list[tuple[str, ...]],
    stream: bool,
) -> Iterator[list[Replay]]:
    """Each slice's replayed timelines (one per ITL label set in `sets`), cut to its span,
    as the slices ask for them: built part by part (`stream_replay`, `stream`, which the
    caller asks only where no set removes OS time: every set's bounds are then the windows'
    ends; raises `LateWindow` where a window was recorded late), else from the whole run's
    log without emissions (`replays_of`), each set on its own bounds (a set removing OS
    time adds the OS samples' ticks to them). Made anew for each of the two passes: kept
    between them, the cuts were a temporary file of ~14 GB for a day of a busy server (each
    cut reaches back to its slice's first tokens' arrival: minutes of `R` for every
    slice)."""
    tasks, spans = slices
    if stream:
        evictions = merge_flushed(run.meta, ix.sparse, path=run.parts_dir,
                                  retained=run.retained(0)).evictions  # fmt: skip
        excess = whole_baselines(run, ix)[0].eager_excess_frac
        made = replay_stretches(run, _stretches(tasks), excess, evictions, sets)
        for bounds, cums in replay_cuts(spans, made, len(sets)):
            yield [(bounds, c) for c in cums]
        return
    skeleton = skeleton_of(run)
    excess = PreparedRun(skeleton).corrected().baseline(FIT_ALL_CAPTURED).eager_excess_frac
    whole = replays_of(skeleton, excess, [Removal("", "cause", s, ()) for s in sets])
    del skeleton
    for lo, hi in spans:
        yield [cut_replay(w, lo, hi) for w in whole]


def _stretches(tasks: list[SliceTask]) -> list[tuple[int, int]]:
    """The slices' own parts ``[a, b)``: each from where the one before ends."""
    ends = [t.b for t in tasks]
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _policy(run: SlicedRun, ix: Index, light: RawLog) -> VictimPolicy | None:
    """The victim-policy line, where the log records a recompute decision (`light`: the
    run's eviction rows): from the log without its emissions and segments, and one more
    read of the emissions (`reduced_logs`)."""
    if not has_decisions(light):
        return None
    tables = _NOT_EMISSIONS - {"segments"}
    skeleton = run.log_of(0, len(run.parts), tables=tables, final=True)
    _, policy_log = reduced_logs(run, skeleton, ix.first_tick)
    return victim_policy(policy_log) if policy_log is not None else None


@dataclass
class _Totals:
    """The slices' pass-1 figures added up, in slice order."""

    num: np.ndarray
    removed: list[float]
    has: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)

    def add(self, part: WhatIfPart) -> None:
        self.num += np.array(part.num, dtype=np.int64)
        self.removed = [a + b for a, b in zip(self.removed, part.removed_ms[1:], strict=True)]
        self.has |= part.has
        self.labels |= part.labels
        self.warnings += part.warnings


def _in_process(fn: Callable[[Any], Any], items: list[Any]) -> Iterator[Any]:
    return (fn(x) for x in items)


def skeleton_of(run: SlicedRun) -> RawLog:
    """The run's log without its emissions (after the index pass)."""
    return run.log_of(0, len(run.parts), tables=_NOT_EMISSIONS, final=True)


def run_victim_policy(run: SlicedRun, ix: Index) -> VictimPolicy | None:
    """The whole run's victim-policy line (`victim_policy`), read as `whatif_sliced` reads
    it (after an index pass): a window's what-if states it for the run, as the whole-run
    reader does. None where the log records no recompute decision."""
    light = merge_flushed(run.meta, ix.sparse, path=run.parts_dir, retained=run.retained(0))
    return _policy(run, ix, light)


_EM = {c: TABLES["emissions"].index(c) for c in ("request", "t_tick", "num_tokens")}


def reduced_logs(
    run: SlicedRun, skeleton: RawLog, first_tick: np.ndarray
) -> tuple[RawLog, RawLog | None]:
    """The log without emissions (`skeleton_of`) with the few emissions that the TTFT
    partition reads, and (None where the log has no recompute decision with its cause)
    with those `victim_policy` reads; from one more read of the emissions.

    The TTFT partition reads, of the emissions, each request's first (`first_tick`, from
    the index pass) and each victim's first after its readmission: the first log holds
    exactly these. The policy counts a request's emitted tokens, and whether it emitted,
    strictly between two of its instants (the decisions, the recompute readmissions), and
    each request's first and last emission: the second log holds, per request and *cell*
    (the stretch strictly between two consecutive such instants, or one of them), the
    cell's first emission with all but the last's tokens and its last with its own (memory
    by requests and the decisions in their lifetime, as the policy itself takes)."""
    ev = skeleton.evictions
    readmit = np.where(np.isnan(ev.t_readmit_s), np.inf, ev.t_readmit_s)
    nxt = np.full(len(ev), np.nan)
    pending = np.flatnonzero(np.isfinite(readmit))
    cuts = None
    if has_decisions(skeleton):
        back = readmit[(ev.mode == MODE_RECOMPUTE) & np.isfinite(readmit)]
        cuts = np.unique(np.concatenate([ev.t_evict_s, back]))
    state = np.zeros((6, 0))  # request, cell, first t, last t, tokens, last's tokens
    for i in range(len(run.parts)):
        em = run.read(i)["tables"].get("emissions")
        if em is None or not len(em):
            continue
        r, t = em[:, _EM["request"]], run.secs(em[:, _EM["t_tick"]])
        pending = _next_after(r, t, ev.request, readmit, pending, nxt)
        if cuts is not None:
            state = _cells(np.concatenate([state, _cell_rows(cuts, r, t, em)], axis=1))
    first = np.full(len(skeleton.requests), np.nan)
    known = np.flatnonzero(first_tick[: len(first)] != NEVER)
    first[known] = run.secs(first_tick[known])
    has_first = np.isfinite(first)
    got = np.isfinite(nxt)
    r_ttft = np.concatenate([np.flatnonzero(has_first), ev.request[got]])
    t_ttft = np.concatenate([first[has_first], nxt[got]])
    ttft_log = _with_emissions(skeleton, r_ttft, t_ttft, np.ones(len(r_ttft), np.int64), first)
    if cuts is None:
        return ttft_log, None
    req, _, t0, t1, tot, last = state
    two = t1 > t0
    rows = np.concatenate([req, req[two]]).astype(np.int64)
    tok = np.concatenate([np.where(two, tot - last, tot), last[two]]).astype(np.int64)
    return ttft_log, _with_emissions(skeleton, rows, np.concatenate([t0, t1[two]]), tok, first)


def _next_after(
    r: np.ndarray, t: np.ndarray, ev_req: np.ndarray, readmit: np.ndarray, pending: np.ndarray,
    nxt: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Of the `pending` evictions (readmitted, no emission of their victim after it yet),
    those whose victim emits in this part after its readmission: their first such emission
    into `nxt`. The rest, still pending."""
    if not len(pending):
        return pending
    o = np.lexsort((t, r))
    rs, ts = r[o], t[o]
    lo = np.searchsorted(rs, ev_req[pending], "left")
    hi = np.searchsorted(rs, ev_req[pending], "right")
    left = []
    for e, a, b in zip(pending.tolist(), lo.tolist(), hi.tolist(), strict=True):
        k = a + int(np.searchsorted(ts[a:b], readmit[e], "right"))
        if k < b:
            nxt[e] = ts[k]
        else:
            left.append(e)
    return np.array(left, dtype=np.int64)


def _cell_rows(cuts: np.ndarray, r: np.ndarray, t: np.ndarray, em: np.ndarray) -> np.ndarray:
    """A part's emissions as `_cells` rows: each its own cell's first and last."""
    at = np.searchsorted(cuts, t, "left")
    on = (at < len(cuts)) & (cuts[np.minimum(at, len(cuts) - 1)] == t) if len(cuts) else at < 0
    n = em[:, _EM["num_tokens"]].astype(np.float64)
    return np.stack([r, 2 * at + on, t, t, n, n]).astype(np.float64)


def _with_emissions(
    skeleton: RawLog, r: np.ndarray, t: np.ndarray, tokens: np.ndarray, first: np.ndarray
) -> RawLog:
    o = np.lexsort((t, r))
    emissions = Emissions(request=r[o], t_s=t[o], step=np.full(len(o), -1, np.int64),
                          num_tokens=tokens[o])  # fmt: skip
    return replace(skeleton, emissions=emissions,
                   requests=replace(skeleton.requests, first_token_s=first))  # fmt: skip


def _cells(state: np.ndarray) -> np.ndarray:
    """`reduced_logs`'s policy rows merged by (request, cell): the first of the first
    times, the last time and its tokens, the tokens summed."""
    req, cell, t0, t1, tot, last = state
    o = np.lexsort((t1, cell, req))
    req, cell, t0, t1, tot, last = (x[o] for x in (req, cell, t0, t1, tot, last))
    head = np.ones(len(req), dtype=bool)
    head[1:] = (req[1:] != req[:-1]) | (cell[1:] != cell[:-1])
    at = np.flatnonzero(head)
    if not len(at):
        return state
    tail = np.append(at[1:], len(req)) - 1
    return np.stack([req[at], cell[at], np.minimum.reduceat(t0, at), t1[tail],
                     np.add.reduceat(tot, at), last[tail]])  # fmt: skip
