"""What to fix first: a run's figures with one cause (or one family of causes) removed
(docs/whatif.md).

Two models, each number tagged with the one it comes from:

- **first order** (`FIRST`): every gap and every TTFT loses the time its partition gave the
  removed labels; the figures are recomputed over all gaps. A removed stall does not move
  anything else.
- **second order** (`SECOND`): the recorded step schedule replayed without the removed
  time, with the same batches: an instant of the engine's timeline goes only where every
  window running then goes (a stall hidden under a longer one stays), a victim's evicted
  gap becomes one gap per step it missed, its readmission prefill and the waits behind
  preempted requests go.

Pure: a `RawLog` and its partitions in, a `WhatIf` out. Only the public attributes of
`Partition` and `TtftPartition` are read. `first_order_reference`,
`replay_removed_reference` and `second_order_reference` are the slow, obvious versions the
tests hold the fast ones to.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracekit.analysis.compare import Spread
from tracekit.analysis.victim_policy import VictimPolicy, victim_policy
from tracekit.analysis.window import Window, select_gaps, select_ttfts
from tracekit.attribution.evictions import PIECE_TOL_MS
from tracekit.attribution.itl import Partition, evicted_windows, segment_causes
from tracekit.attribution.reference import os_taken_reference
from tracekit.attribution.timeline import PreparedRun, has_os_evidence, os_bounds
from tracekit.attribution.ttft import (
    TTFT_STANDARD_LABELS,
    TtftPartition,
    prefill_shares,
    wait_windows,
)
from tracekit.errors import TracekitError
from tracekit.labels import (
    FRONTEND_OS_LABELS,
    NON_CAUSES,
    OS_BLOCKED,
    OS_LABELS,
    OS_RUNQUEUE,
    RECOMPUTE_CLASS,
    STANDARD_LABELS,
    is_os_label,
)
from tracekit.log.rawlog import WAIT_REASONS, RawLog

FIRST = "first"
SECOND = "second"
MODELS = (FIRST, SECOND)

#: The figures a what-if predicts: (name, "itl" | "ttft", percentile; 100 is the max).
FIGURES: tuple[tuple[str, str, float], ...] = (
    ("itl_p50_ms", "itl", 50.0),
    ("itl_p99_ms", "itl", 99.0),
    ("itl_p999_ms", "itl", 99.9),
    ("itl_max_ms", "itl", 100.0),
    ("ttft_p50_ms", "ttft", 50.0),
    ("ttft_p90_ms", "ttft", 90.0),
    ("ttft_p99_ms", "ttft", 99.0),
)
FIGURE_NAMES: tuple[str, ...] = tuple(f[0] for f in FIGURES)

#: Cause families (docs/whatif.md): family -> (ITL labels, TTFT labels). A family is removed
#: as a whole; labels a run lacks are simply absent from it.
_HOST_LABELS: tuple[str, ...] = (
    *("gc", "tok", "graph", "sample", "detokenize", "prepare", "update", "draft"),
    *("sse_write", "api_server"),
)
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "host": (_HOST_LABELS, (*_HOST_LABELS, "wait_tokenizing")),
    "scheduling": (
        ("prefill", "schedule"),
        ("prefill_other", "schedule", "wait_max_num_seqs", "wait_token_budget"),
    ),
    "memory": (("preempt",), ("preempt", "wait_kv_blocks", "wait_preempted_first")),
    # the standard OS labels; a run's API server and rank forms join them (`removals`)
    "os": ((*OS_LABELS, "os"), (*OS_LABELS, *FRONTEND_OS_LABELS, "os")),
}
#: TTFT parts that are a request's own state (not engine time): removing one removes the
#: request's time in that state, and the engine time inside it is not removed again.
_STATE_TTFT = frozenset({"preempt", *(f"wait_{r}" for r in WAIT_REASONS)})
#: TTFT labels never removed by themselves: the request's own prefill, uncovered time, an
#: unsplit request's prefill (own and others' mixed), and others' decoding (the forward pass
#: a batch runs anyway, not a stall a fix removes).
_TTFT_NON_CAUSES = frozenset({"prefill_own", "residual", "prefill", "decode_other"})

ASSUMPTIONS: dict[str, tuple[str, ...]] = {
    FIRST: (
        "a removed stall does not shift later arrivals or schedules: every other gap keeps "
        "its length and the batches stay as recorded",
        "the time the partition gave the cause goes, even where another window overlapped it "
        "(a stall hidden under a longer one counts as removable)",
        "an evicted gap keeps its live remainder as one gap: the victim's tokens that would "
        "have come during its eviction are not added",
    ),
    SECOND: (
        "the recorded steps replay in order with the same batches; an instant goes only "
        "where every window running then goes (a hidden stall stays)",
        "arrivals do not move: a TTFT loses only removable time after its arrival",
        "removing preemption: each victim emits at every step it missed, its readmission "
        "prefill and the waits behind preempted requests go; what a policy that avoids "
        "preemption does instead (holding new requests back) is not predicted",
        "removing the OS: the engine's threads run through the share of each instant the OS "
        "took; a rank's or the API server's OS time is removed by the first order only",
    ),
}


class WhatIfError(TracekitError):
    """A removal that names no cause of the run."""


@dataclass(frozen=True)
class Removal:
    """What is taken out: ITL partition labels and TTFT partition labels."""

    name: str  # the cause, or the family's name
    kind: str  # "cause" | "family"
    itl_labels: tuple[str, ...]
    ttft_labels: tuple[str, ...]


@dataclass(frozen=True)
class Prediction:
    """One removal under one model: the run's figures without it."""

    removal: Removal
    model: str  # FIRST | SECOND
    figures: Mapping[str, float]  # FIGURE_NAMES -> ms
    removed_ms: float  # ITL time taken out, summed over the run's gaps
    num_gaps: int  # gaps the figures are over (second order: victims' split gaps added)

    def change_ms(self, measured: Mapping[str, float]) -> dict[str, float]:
        return {k: self.figures[k] - measured[k] for k in FIGURE_NAMES}


@dataclass(frozen=True)
class WhatIf:
    """Every removal of one run, by both models."""

    path: str
    config: Mapping[str, Any]
    measured: Mapping[str, float]  # FIGURE_NAMES -> ms, the run as recorded
    num_gaps: int
    predictions: tuple[Prediction, ...]
    assumptions: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: dict(ASSUMPTIONS))
    warnings: tuple[str, ...] = ()  # the log's and its partition's, as `analyze` reports them
    #: the recompute tax under the least-computed-victim policy (`victim_policy`), or None
    victim_policy: VictimPolicy | None = None
    #: the window the figures are of (`Window.to_dict`), or None for the whole run
    window: Mapping[str, Any] | None = None

    def get(self, name: str, model: str) -> Prediction | None:
        for p in self.predictions:
            if p.removal.name == name and p.model == model:
                return p
        return None

    def to_records(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per (removal, model), for `--format jsonl`; then, where the
        log records recompute decisions, one of kind ``victim_policy`` (the recompute tax
        under the least-computed victim, as the table's line under the run)."""
        out = []
        for p in self.predictions:
            rec: dict[str, Any] = {
                "run": os.path.basename(self.path),
                "path": self.path,
                "removal": p.removal.name,
                "kind": p.removal.kind,
                "model": p.model,
                "itl_labels": list(p.removal.itl_labels),
                "ttft_labels": list(p.removal.ttft_labels),
                "removed_ms": _finite(p.removed_ms),
                "gaps": p.num_gaps,
            }
            if self.window is not None:
                rec["window"] = dict(self.window)
            change = p.change_ms(self.measured)
            for k in FIGURE_NAMES:
                rec[k] = _finite(p.figures[k])
                rec[f"measured_{k}"] = _finite(self.measured[k])
                rec[f"change_{k}"] = _finite(change[k])
            rec["assumptions"] = list(self.assumptions[p.model])
            out.append(rec)
        if self.victim_policy is not None:  # the line the table prints under the run
            out.append({"run": os.path.basename(self.path), "path": self.path, "removal": None,
                        "kind": "victim_policy", "model": "first",
                        **self.victim_policy.to_record()})  # fmt: skip
        return out


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


# -- removals -----------------------------------------------------------------------------


def removals(part: Partition, tpart: TtftPartition, *, only_present: bool = True) -> list[Removal]:
    """Every cause of the run (ITL causes first, then TTFT-only ones), then every family
    with a label in the run. `only_present`: leave out causes with no time in any gap or
    TTFT (and families made only of those)."""
    has: set[str] | None = None
    if only_present:
        has = labels_with_time(part.labels, part.parts_ms)
        has |= labels_with_time(tpart.labels, tpart.parts_ms)
    return removals_of(part.labels, tpart.labels, has)


def labels_with_time(labels: Sequence[str], parts_ms: np.ndarray) -> set[str]:
    """The labels with time in some row of a partition's `parts_ms`: more than
    `PIECE_TOL_MS` (float rounding leaves a part that should be 0 at +-1e-17 ms, with
    either sign, and a run read in slices adds up in another order than read whole)."""
    if not parts_ms.shape[0]:
        return set()
    on = np.asarray((parts_ms > PIECE_TOL_MS).any(axis=0)).tolist()
    return {lb for lb, v in zip(labels, on, strict=True) if v}


def removals_of(
    itl_labels: Sequence[str], ttft_labels: Sequence[str], has: set[str] | None = None
) -> list[Removal]:
    """`removals` of a run whose ITL and TTFT partitions have these labels, `has` the
    labels with time in some gap or TTFT (None: every label, as `only_present=False`)."""
    itl = [lb for lb in itl_labels if lb not in NON_CAUSES]
    tt = set(ttft_labels)
    if has is None:
        has = set(itl_labels) | tt
    out = []
    for c in itl:
        # the ITL cause `prefill` is others' prefill in a TTFT; an unsplit TTFT's `prefill`
        # (own and others' mixed) is never removed (docs/whatif.md, "What is removed")
        ttl = tuple(x for x in ("prefill_other" if c == "prefill" else c,) if x in tt)
        r = Removal(c, "cause", (c,), ttl)
        if c in has or any(x in has for x in _second_ttft_labels(r)):
            out.append(r)
    for c in ttft_labels:
        if c not in _TTFT_NON_CAUSES and c not in itl and c != "prefill_other" and c in has:
            out.append(Removal(c, "cause", (), (c,)))
    for fam, (fi, ft) in FAMILIES.items():
        il = tuple(lb for lb in fi if lb in itl_labels)
        tl = tuple(lb for lb in ft if lb in tt)
        if fam == "os":  # and the OS's time at each rank or API server the run names
            il += tuple(lb for lb in itl_labels if is_os_label(lb) and lb not in il)
            tl += tuple(lb for lb in ttft_labels if is_os_label(lb) and lb not in tl)
        if any(x in has for x in (*il, *tl)):
            out.append(Removal(fam, "family", il, tl))
    return out


def find_removal(part: Partition, tpart: TtftPartition, name: str) -> Removal:
    """The removal named `name` (a cause or a family), or a one-line error listing them."""
    return pick_removal(removals(part, tpart, only_present=False), name)


def pick_removal(rs: Sequence[Removal], name: str) -> Removal:
    """The removal named `name` among `rs` (a run's `removals_of`, every label), or a
    one-line error listing them."""
    for r in rs:
        if r.name == name:
            return r
    raise WhatIfError(f"no cause or family {name!r} in this run; there are: "
                      + ", ".join(r.name for r in rs))  # fmt: skip


def _second_ttft_labels(r: Removal) -> tuple[str, ...]:
    """Second order: removing preemption also removes the waits behind preempted requests."""
    if "preempt" in r.itl_labels and "wait_preempted_first" not in r.ttft_labels:
        return (*r.ttft_labels, "wait_preempted_first")
    return r.ttft_labels


# -- figures ------------------------------------------------------------------------------


def _figures(gap_ms: np.ndarray, ttft_ms: np.ndarray) -> dict[str, float]:
    itl = np.percentile(gap_ms, ITL_QS).tolist() if len(gap_ms) else [math.nan] * len(ITL_QS)
    return figures_of([float(v) for v in itl], ttft_ms)


#: the ITL figures' percentiles, in `FIGURES` order
ITL_QS: tuple[float, ...] = tuple(q for _, w, q in FIGURES if w == "itl")


def figures_of(itl_pct: Sequence[float], ttft_ms: np.ndarray) -> dict[str, float]:
    """The figures of a run from its ITL percentiles (`ITL_QS`, however they were found)
    and its TTFTs."""
    out: dict[str, float] = dict(zip([n for n, w, _ in FIGURES if w == "itl"], itl_pct,
                                     strict=True))  # fmt: skip
    names = [(n, q) for n, w, q in FIGURES if w == "ttft"]
    if len(ttft_ms):
        vals = np.percentile(ttft_ms, [q for _, q in names])
    else:
        vals = [math.nan] * len(names)
    out.update({n: float(v) for (n, _), v in zip(names, vals, strict=True)})
    return out


#: the TTFT figures' percentiles, in `FIGURES` order
TTFT_QS: tuple[float, ...] = tuple(q for _, w, q in FIGURES if w == "ttft")


def figures_from(itl_pct: Sequence[float], ttft_pct: Sequence[float]) -> dict[str, float]:
    """`figures_of` with the TTFT percentiles (`TTFT_QS`) found elsewhere too."""
    out = dict(zip([n for n, w, _ in FIGURES if w == "itl"], itl_pct, strict=True))
    out.update(zip([n for n, w, _ in FIGURES if w == "ttft"], ttft_pct, strict=True))
    return {n: float(out[n]) for n in FIGURE_NAMES}


def _cols(labels: Sequence[str], want: Iterable[str]) -> list[int]:
    return [labels.index(lb) for lb in want if lb in labels]


def _owned(parts_ms: np.ndarray, labels: Sequence[str], want: Iterable[str]) -> np.ndarray:
    idx = _cols(labels, want)
    out = np.zeros(parts_ms.shape[0])
    for j in idx:  # column by column (the partition stores its parts column-major)
        out += parts_ms[:, j]
    return out


def first_order(part: Partition, tpart: TtftPartition, r: Removal) -> Prediction:
    """docs/whatif.md, "First order": every gap and TTFT less the time it gave `r`, and
    with `preempt` removed, less others' re-prefill in its prefill part too."""
    gap, own = first_order_gaps(part, r)
    ttft = first_order_ttfts(tpart, r)
    return Prediction(r, FIRST, _figures(gap, ttft), float(own.sum()), len(gap))


def first_order_gaps(part: Partition, r: Removal) -> tuple[np.ndarray, np.ndarray]:
    """The first order's gaps (ms) without `r`, and the time each lost."""
    own = _owned(part.parts_ms, part.labels, r.itl_labels)
    if "preempt" in r.itl_labels and "prefill" not in r.itl_labels:
        own = own + part.reprefill_other_ms
    return np.maximum(part.gap_ms - own, 0.0), own


def first_order_ttfts(tpart: TtftPartition, r: Removal) -> np.ndarray:
    """The first order's TTFTs (ms) without `r`."""
    t_own = _owned(tpart.parts_ms, tpart.labels, r.ttft_labels)
    if "preempt" in r.ttft_labels:  # others' re-prefill, where its label is not removed
        holder = np.where(tpart.is_split, "prefill_other" in r.ttft_labels,
                          "prefill" in r.ttft_labels)  # fmt: skip
        t_own = t_own + np.where(holder, 0.0, tpart.reprefill_other_ms)
    return np.maximum(tpart.ttft_ms - t_own, 0.0)


def _percentile_reference(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, written out."""
    if not values:
        return math.nan
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def first_order_reference(part: Partition, tpart: TtftPartition, r: Removal) -> Prediction:
    """`first_order` with plain loops, one gap and one label at a time."""
    gaps, removed = [], 0.0
    for i in range(len(part.gap_ms)):
        own = 0.0
        for j, lb in enumerate(part.labels):
            if lb in r.itl_labels:
                own += float(part.parts_ms[i, j])
        if "preempt" in r.itl_labels and "prefill" not in r.itl_labels:
            own += float(part.reprefill_other_ms[i])  # others' re-prefill: evictions' too
        removed += own
        gaps.append(max(float(part.gap_ms[i]) - own, 0.0))
    ttfts = []
    for i in range(len(tpart.ttft_ms)):
        own = sum(
            float(tpart.parts_ms[i, j]) for j, lb in enumerate(tpart.labels) if lb in r.ttft_labels
        )
        holder = "prefill_other" if np.isfinite(tpart.admit_s[i]) else "prefill"
        if "preempt" in r.ttft_labels and holder not in r.ttft_labels:
            own += float(tpart.reprefill_other_ms[i])
        ttfts.append(max(float(tpart.ttft_ms[i]) - own, 0.0))
    figs = {}
    for name, which, q in FIGURES:
        figs[name] = _percentile_reference(gaps if which == "itl" else ttfts, q)
    return Prediction(r, FIRST, figs, removed, len(gaps))


# -- second order: the replayed timeline ---------------------------------------------------


@dataclass(frozen=True)
class Windows:
    """The windows of the engine's timeline, each with its removable fraction."""

    start_s: np.ndarray
    end_s: np.ndarray
    frac: np.ndarray  # removable fraction under the removal, in [0, 1]
    kind: np.ndarray  # 0 host segment, 1 device segment, 2 GC pause


def _readmit_prefill_share(log: RawLog) -> np.ndarray:
    """Per step: the share of its prefill tokens that re-prefill a request after one of its
    evictions (a victim's recompute on readmission)."""
    pf, ev = log.prefill_chunks, log.evictions
    out = np.zeros(len(log.steps))
    if len(pf) == 0 or len(ev) == 0:
        return out
    first_ev = np.full(len(log.requests), np.inf)
    np.minimum.at(first_ev, ev.request, ev.t_evict_s)
    is_readmit = log.steps.t_start_s[pf.step] >= first_ev[pf.request]
    np.add.at(out, pf.step[is_readmit], prefill_shares(log)[is_readmit])
    return np.minimum(out, 1.0)


def removable_windows(log: RawLog, part: Partition, itl_labels: Sequence[str]) -> Windows:
    """Every segment and GC pause of the log with its removable fraction when `itl_labels`
    are removed (docs/whatif.md, "The removable rate of an instant")."""
    return windows_of(log, part.baseline.eager_excess_frac, itl_labels)


def windows_of(log: RawLog, eager_excess_frac: np.ndarray, itl_labels: Sequence[str]) -> Windows:
    """`removable_windows` with the ITL graph baseline's per-step excess fraction given:
    reads the log's segments, GC pauses, steps, prefill chunks, evictions and requests
    (never its emissions)."""
    rm = set(itl_labels)
    sg = log.segments
    causes = segment_causes(log)
    frac = np.isin(causes, list(rm)).astype(np.float64) if len(sg) else np.zeros(0)
    if len(sg):
        # a window outside every step (another thread's, step -1) has no step to scale by
        in_step = (sg.step >= 0) & (sg.step < len(log.steps))
        step = np.where(in_step, sg.step, 0)
        if "graph" in rm and len(eager_excess_frac):
            dec = (causes == "decode") & in_step
            frac[dec] = eager_excess_frac[step[dec]]
        if "preempt" in rm and "prefill" not in rm:
            pre = (causes == "prefill") & in_step
            frac[pre] = _readmit_prefill_share(log)[step[pre]]
        # a re-prefill after a recompute eviction: its victim's preempt, others' prefill
        # (docs/partition.md, "Who evicted whom"): either removal takes the window
        if rm & {"preempt", "prefill"}:
            frac[causes == RECOMPUTE_CLASS] = 1.0
    gc = log.gc_pauses
    return Windows(
        start_s=np.concatenate([sg.t_start_s, gc.t_start_s]),
        end_s=np.concatenate([sg.t_end_s, gc.t_end_s]),
        frac=np.concatenate([frac, np.full(len(gc), 1.0 if "gc" in rm else 0.0)]),
        kind=np.concatenate([np.where(sg.is_device == 1, 1, 0), np.full(len(gc), 2)]).astype(
            np.int64
        ),
    )


def replay_removed(w: Windows, is_gc_removed: bool) -> tuple[np.ndarray, np.ndarray]:
    """`(bounds_s, R_s)`: the removable time from the first boundary to each boundary
    (docs/whatif.md, "The removable rate of an instant"); `R(x)` is linear between them."""
    ok = w.end_s > w.start_s
    s, e, f, k = w.start_s[ok], w.end_s[ok], w.frac[ok], w.kind[ok]
    if not len(s):
        return np.zeros(1), np.zeros(1)
    bounds = np.unique(np.concatenate([s, e]))
    m = len(bounds) - 1
    a = np.searchsorted(bounds, s)
    b = np.searchsorted(bounds, e)
    every = np.ones(len(s), dtype=bool)
    # how many windows of each kind (or the sum of their fractions) cover each elementary
    # interval: +1 where one starts, -1 where it ends, summed
    cover = {key: np.cumsum(d)[:m] for key, d in cover_deltas(a, every, b, every, f, k,
                                                               m + 1).items()}  # fmt: skip
    r = cover_rates(cover, is_gc_removed)
    return bounds, np.concatenate([[0.0], np.cumsum(r * np.diff(bounds))])


def cover_deltas(
    a: np.ndarray, on_a: np.ndarray, b: np.ndarray, on_b: np.ndarray, f: np.ndarray,
    k: np.ndarray, size: int,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Per bound (`size` of them), the change in each cover `cover_rates` reads: windows of
    one kind (host, device, GC pause) and removable fraction (0, 1, between) starting there
    (`a`: the bound a window starts at, where `on_a`) less those ending there (`b`,
    `on_b`); `sf_*` sums the fractions (each bound's in the windows' order)."""
    zero, one = f <= 0.0, f >= 1.0
    part_f = ~zero & ~one
    host, dev, gcw = k == 0, k == 1, k == 2
    sels = {"n_gc": (gcw, None), "n0_dev": (dev & zero, None), "n1_dev": (dev & one, None),
            "nf_dev": (dev & part_f, None), "sf_dev": (dev & part_f, f),
            "n0_host": (host & zero, None), "n1_host": (host & one, None),
            "nf_host": (host & part_f, None), "sf_host": (host & part_f, f)}  # fmt: skip
    out = {}
    for key, (sel, wt) in sels.items():
        sa, sb = sel & on_a, sel & on_b
        out[key] = np.bincount(a[sa], None if wt is None else wt[sa], minlength=size) - (
            np.bincount(b[sb], None if wt is None else wt[sb], minlength=size)
        )
    return out


def cover_rates(c: Mapping[str, np.ndarray], is_gc_removed: bool) -> np.ndarray:
    """The removable rate of each elementary interval from its covers (`cover_deltas`
    summed): the instant goes only where every window over it goes (docs/whatif.md)."""

    def rate(n0, n1, nf, sf) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            fr = np.where(nf > 0.5, sf / np.maximum(nf, 1.0), 1.0)
        covered = (n0 + n1 + nf) > 0.5
        return np.where(covered & (n0 < 0.5), fr, 0.0)

    n_gc, sf_dev, sf_host = c["n_gc"], c["sf_dev"], c["sf_host"]
    n0_dev, n1_dev, nf_dev = c["n0_dev"], c["n1_dev"], c["nf_dev"]
    n0_host, n1_host, nf_host = c["n0_host"], c["n1_host"], c["nf_host"]
    in_gc = n_gc > 0.5
    if is_gc_removed:
        # a pause stops the interpreter: only device windows hold its time
        r_gc = np.where(
            n0_dev > 0.5, 0.0, np.where(nf_dev > 0.5, sf_dev / np.maximum(nf_dev, 1), 1.0)
        )
        r_live = rate(n0_dev + n0_host, n1_dev + n1_host, nf_dev + nf_host, sf_dev + sf_host)
        return np.where(in_gc, r_gc, r_live)
    return rate(n0_dev + n0_host + n_gc, n1_dev + n1_host, nf_dev + nf_host, sf_dev + sf_host)


def replay_removed_reference(w: Windows, is_gc_removed: bool, x_s: Sequence[float]) -> list[float]:
    """`R(x)` for each x, by walking every elementary interval and every window."""
    ws = [
        (float(a), float(b), float(f), int(k))
        for a, b, f, k in zip(w.start_s, w.end_s, w.frac, w.kind, strict=True)
        if b > a
    ]
    cuts = sorted({t for a, b, _, _ in ws for t in (a, b)})
    pieces = []  # (lo, hi, rate)
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        mid = (lo + hi) / 2
        on = [(f, k) for a, b, f, k in ws if a <= mid < b]
        in_gc = any(k == 2 for _, k in on)
        if is_gc_removed and in_gc:
            held = [f for f, k in on if k == 1]
            rate = 1.0 if not held else (0.0 if min(held) <= 0 else _mean_or_one(held))
        else:
            fs = [f for f, _ in on]
            rate = 0.0 if not fs or min(fs) <= 0 else _mean_or_one(fs)
        pieces.append((lo, hi, rate))
    out = []
    for x in x_s:
        out.append(sum(max(0.0, min(hi, x) - lo) * rt for lo, hi, rt in pieces if x > lo))
    return out


def _mean_or_one(fs: list[float]) -> float:
    """The rate where every covering window is removable: the mean of the fractional ones."""
    frac = [f for f in fs if f < 1.0]
    return sum(frac) / len(frac) if frac else 1.0


def _at(bounds: np.ndarray, cum: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.interp(x, bounds, cum)


def os_removed(log: RawLog, itl_labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """`(bounds_s, R_os_s)`: the time the OS took from the engine's threads, of the removed OS
    labels (`os_runqueue`, `os_blocked`), from the run's start to each bound, on the ITL
    partition's timeline (its shares of each instant: docs/partition.md, "OS evidence");
    None where nothing of the OS is removed or the run has no OS evidence."""
    want = {lb for lb in itl_labels if lb in OS_LABELS}
    if not want:
        return None
    run = PreparedRun(log).corrected()  # the ITL partition's run
    if not run.has_os:
        return None
    tl = run.timeline()
    r_share, b_share = run.os_shares(tl)
    m = len(tl.bounds)
    rate = np.zeros(max(m - 1, 0))
    if OS_RUNQUEUE in want:
        rate = rate + r_share[1:m]
    if OS_BLOCKED in want:
        rate = rate + b_share[1:m]
    return tl.bounds, np.concatenate([[0.0], np.cumsum(rate * np.diff(tl.bounds))])


def with_os_removed(
    bounds: np.ndarray, cum: np.ndarray, os_: tuple[np.ndarray, np.ndarray] | None
) -> tuple[np.ndarray, np.ndarray]:
    """The windows' removable time and the OS's composed instant by instant: where the
    windows remove a fraction `f` of an instant, the OS's share `o` of it is taken from what
    is left, so the instant goes at rate `f + (1 - f) * o` (docs/whatif.md, "Removing the
    OS")."""
    if os_ is None:
        return bounds, cum
    ob, oc = os_
    grid = np.union1d(bounds, ob)
    width = np.diff(grid)
    safe = np.where(width > 0, width, 1.0)
    f = np.where(width > 0, np.diff(_at(bounds, cum, grid)) / safe, 0.0)
    o = np.where(width > 0, np.diff(_at(ob, oc, grid)) / safe, 0.0)
    return grid, np.concatenate([[0.0], np.cumsum((f + (1.0 - f) * o) * width)])


def _victim_gaps(
    log: RawLog, part: Partition, bounds: np.ndarray, cum: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Preemption removed: (rows of the evicted gaps, the replayed gaps that replace them):
    each evicted gap split at the end of every step that ended while its request was out."""
    rq, a, b = evicted_windows(log)
    ends = np.sort(log.steps.t_end_s)
    rows = np.flatnonzero(part.num_evictions > 0)
    if not len(rows):
        return rows, np.zeros(0)
    cuts: list[list[float]] = [[] for _ in rows]
    pos = {int(g): i for i, g in enumerate(rows)}
    for ri, ai, bi in zip(rq.tolist(), a.tolist(), b.tolist(), strict=True):  # one per eviction
        lo = int(np.searchsorted(part.request, ri, "left"))
        hi = int(np.searchsorted(part.request, ri, "right"))
        g = lo + int(np.searchsorted(part.t1_s[lo:hi], ai, "right"))
        if g >= hi or g not in pos or not part.t0_s[g] <= ai < part.t1_s[g]:
            continue
        x0, x1 = max(ai, part.t0_s[g]), min(bi, part.t1_s[g])
        cuts[pos[g]] += ends[
            np.searchsorted(ends, x0, "right") : np.searchsorted(ends, x1, "left")
        ].tolist()
    # every victim gap's points in one array: t0, its cuts, t1; replayed in one pass
    pts = [np.array([part.t0_s[g], *sorted(set(cuts[i])), part.t1_s[g]]) for i, g in
           enumerate(rows.tolist())]  # fmt: skip
    x = np.concatenate(pts)
    last = np.cumsum([len(p) for p in pts]) - 1  # each gap's t1: no gap starts there
    d = np.diff(x - _at(bounds, cum, x)) * 1e3
    return rows, np.maximum(np.delete(d, last[:-1]), 0.0)


def _state_windows(log: RawLog, labels: Iterable[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request, start, end) of the evictions and waits whose TTFT label is in `labels`."""
    want = set(labels)
    rs, ss, es = [], [], []
    if "preempt" in want:
        r, a, b = evicted_windows(log)
        rs.append(r)
        ss.append(a)
        es.append(b)
    wr, wa, wb, reason = wait_windows(log)
    if len(wr):
        names = np.array([f"wait_{x}" for x in WAIT_REASONS], dtype=object)[reason]
        sel = np.isin(names, list(want))
        rs.append(wr[sel])
        ss.append(wa[sel])
        es.append(wb[sel])
    if not rs:
        z = np.zeros(0)
        return z.astype(np.int64), z, z
    return np.concatenate(rs).astype(np.int64), np.concatenate(ss), np.concatenate(es)


def second_order(log: RawLog, part: Partition, tpart: TtftPartition, r: Removal) -> Prediction:
    """docs/whatif.md, "Second order": the recorded schedule replayed without `r`."""
    bounds, cum = replayed(log, part.baseline.eager_excess_frac, r.itl_labels)
    gap, removed_ms = second_order_gaps(log, part, r, bounds, cum)
    ttft = second_order_ttfts(log, tpart, r, bounds, cum)
    return Prediction(r, SECOND, _figures(gap, ttft), float(removed_ms.sum()), len(gap))


def replayed(
    log: RawLog, eager_excess_frac: np.ndarray, itl_labels: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    """`(bounds_s, R_s)`: the run's removable time from its start to each bound, windows
    and OS composed (`replay_removed`, `with_os_removed`); `R(x)` is linear between them.
    Reads no emission of the log."""
    w = windows_of(log, eager_excess_frac, itl_labels)
    bounds, cum = replay_removed(w, "gc" in itl_labels)
    return with_os_removed(bounds, cum, os_removed(log, itl_labels))


def second_order_gaps(
    log: RawLog, part: Partition, r: Removal, bounds: np.ndarray, cum: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The second order's gaps (ms) of `part` on the replayed timeline `(bounds, cum)`
    (`replayed`), a victim's evicted gap split at every step it missed (`log`'s steps and
    evictions over the gap), and the time each gap of `part` lost."""
    if cum[0] == cum[-1]:  # nothing removable on this stretch: the same values, faster
        removed_ms = np.zeros(len(part.gap_ms))
    else:
        removed_ms = (_at(bounds, cum, part.t1_s) - _at(bounds, cum, part.t0_s)) * 1e3
    gap = np.maximum(part.gap_ms - removed_ms, 0.0)
    if "preempt" in r.itl_labels:
        rows, split = _victim_gaps(log, part, bounds, cum)
        keep = np.ones(len(gap), bool)
        keep[rows] = False
        gap = np.concatenate([gap[keep], split])
    return gap, removed_ms


def second_order_ttfts(
    log: RawLog, tpart: TtftPartition, r: Removal, bounds: np.ndarray, cum: np.ndarray
) -> np.ndarray:
    """The second order's TTFTs (ms) on the replayed timeline `(bounds, cum)`; `log`: the
    run's evictions, waits and steps (its emissions are not read)."""
    # TTFT: the request's own state parts go whole; the engine time after arrival, outside
    # those states, goes where it is removable
    tl = _second_ttft_labels(r)
    state = [lb for lb in tl if lb in _STATE_TTFT]
    engine = (_at(bounds, cum, tpart.first_token_s) - _at(bounds, cum, tpart.arrival_s)) * 1e3
    if state:
        sr, sa, sb = _state_windows(log, state)
        row_of = np.full(len(log.requests), -1)
        row_of[tpart.request] = np.arange(len(tpart))
        rr = row_of[sr] if len(sr) else np.zeros(0, np.int64)
        ok = rr >= 0
        rr, sa, sb = rr[ok], sa[ok], sb[ok]
        x0 = np.maximum(sa, tpart.arrival_s[rr])
        x1 = np.minimum(sb, tpart.first_token_s[rr])
        inside = x1 > x0
        held = np.zeros(len(tpart))
        d = (_at(bounds, cum, x1[inside]) - _at(bounds, cum, x0[inside])) * 1e3
        np.add.at(held, rr[inside], d)
        engine = engine - held
    if "prefill" in r.itl_labels:
        # the timeline lost every prefill window, the request's own prefill with them: that
        # stays in its TTFT (and an unsplit request's prefill, own and others' mixed, too)
        engine = engine - _owned(tpart.parts_ms, tpart.labels, ("prefill_own", "prefill"))
    ttft = tpart.ttft_ms - _owned(tpart.parts_ms, tpart.labels, state) - np.maximum(engine, 0.0)
    return np.maximum(ttft, 0.0)


def second_order_reference(
    log: RawLog, part: Partition, tpart: TtftPartition, r: Removal
) -> Prediction:
    """`second_order` with plain loops: R(x) by `replay_removed_reference`, each victim's
    missed steps found by walking every step, each TTFT's states by walking every eviction
    and wait row."""
    w = removable_windows(log, part, r.itl_labels)
    is_gc = "gc" in r.itl_labels
    os_labels = frozenset(lb for lb in r.itl_labels if lb in OS_LABELS)
    has_os = bool(os_labels) and has_os_evidence(log)
    # every instant where the windows' rate or the OS's share can change
    ends_os = os_bounds(log) if has_os else None
    rate_cuts = sorted({float(x) for x in (*w.start_s, *w.end_s)}
                       | (set(ends_os.tolist()) if ends_os is not None else set()))  # fmt: skip

    # both walks from the run's start to every cut, once (each x is walked on its own, so
    # these are the values a walk to [z, y] alone gives)
    fw_cut = replay_removed_reference(w, is_gc, rate_cuts) if has_os else []
    fo_cut = os_taken_reference(log, rate_cuts, os_labels) if has_os else []
    known: dict[float, float] = {}  # R at each x asked before: gaps share their ends

    def rem(x: float) -> float:
        if x in known:
            return known[x]
        if not has_os:
            known[x] = replay_removed_reference(w, is_gc, [x])[0]
            return known[x]
        total = 0.0  # instant by instant: f + (1 - f) * o, each rate a cell's mean
        for k, (z, y) in enumerate(zip(rate_cuts[:-1], rate_cuts[1:], strict=True)):
            if z >= x:
                break
            if y <= x:
                dw, do = fw_cut[k + 1] - fw_cut[k], fo_cut[k + 1] - fo_cut[k]
            else:  # the cell x ends inside
                y = x
                fw = replay_removed_reference(w, is_gc, [z, y])
                fo = os_taken_reference(log, [z, y], os_labels)
                dw, do = fw[1] - fw[0], fo[1] - fo[0]
            total += dw + (1.0 - dw / (y - z)) * do
        known[x] = total
        return total

    ends = [float(t) for t in log.steps.t_end_s]
    evs = list(zip(*(a.tolist() for a in evicted_windows(log)), strict=True))
    gaps: list[float] = []
    removed = 0.0
    for i in range(len(part)):
        t0, t1 = float(part.t0_s[i]), float(part.t1_s[i])
        removed += (rem(t1) - rem(t0)) * 1e3
        pts = [t0, t1]
        if "preempt" in r.itl_labels and part.num_evictions[i] > 0:
            cuts = set()
            for rq, a, b in evs:
                if rq == int(part.request[i]) and t0 <= a < t1:
                    cuts |= {e for e in ends if max(a, t0) < e < min(b, t1)}
            pts = [t0, *sorted(cuts), t1]
        for x, y in zip(pts, pts[1:], strict=False):
            gaps.append(max(0.0, ((y - rem(y)) - (x - rem(x))) * 1e3))
    labels = _second_ttft_labels(r)
    state = [lb for lb in labels if lb in _STATE_TTFT]
    z = np.zeros(0)
    sr, sa, sb = _state_windows(log, state) if state else (z.astype(np.int64), z, z)
    ttfts = []
    for i in range(len(tpart)):
        a, f = float(tpart.arrival_s[i]), float(tpart.first_token_s[i])
        engine = (rem(f) - rem(a)) * 1e3
        for rq, x0, x1 in zip(sr.tolist(), sa.tolist(), sb.tolist(), strict=True):
            lo, hi = max(float(x0), a), min(float(x1), f)
            if rq == int(tpart.request[i]) and hi > lo:
                engine -= (rem(hi) - rem(lo)) * 1e3
        own = {lb: float(tpart.parts_ms[i, j]) for j, lb in enumerate(tpart.labels)}
        if "prefill" in r.itl_labels:
            engine -= own.get("prefill_own", 0.0) + own.get("prefill", 0.0)
        held = sum(own.get(lb, 0.0) for lb in state)
        ttfts.append(max(0.0, float(tpart.ttft_ms[i]) - held - max(engine, 0.0)))
    figs = {}
    for name, which, q in FIGURES:
        figs[name] = _percentile_reference(gaps if which == "itl" else ttfts, q)
    return Prediction(r, SECOND, figs, removed, len(gaps))


# -- one run, every removal -----------------------------------------------------------------


def whatif(
    log: RawLog,
    part: Partition,
    tpart: TtftPartition,
    names: Sequence[str] | None = None,
    window: Window | None = None,
) -> WhatIf:
    """Every removal of the run (or those named), by both models. With a `window`: the
    prediction for the gaps ending in it and the TTFTs whose first token lands in it, each
    from the whole run's partition and (second order) the whole run's replayed timeline
    (docs/whatif.md, "A window"); the removals are the causes with time in those."""
    p, tp = select_gaps(part, window), select_ttfts(tpart, window)
    rs = removals(p, tp) if names is None else [find_removal(p, tp, n) for n in names]
    preds = []
    for r in rs:
        preds.append(first_order(p, tp, r))
        preds.append(second_order(log, p, tp, r))
    return WhatIf(
        path=log.path,
        config=dict(log.config),
        measured=_figures(p.gap_ms, tp.ttft_ms),
        num_gaps=len(p),
        predictions=tuple(preds),
        warnings=tuple(log.warnings) + tuple(part.warnings),
        victim_policy=victim_policy(log),
        window=window.to_dict() if window is not None else None,
    )


def ranked(w: WhatIf, model: str = SECOND, figure: str = "itl_p999_ms") -> list[Prediction]:
    """The removals of one run by predicted gain in `figure`, largest first."""
    ps = [p for p in w.predictions if p.model == model and math.isfinite(p.figures[figure])]
    return sorted(ps, key=lambda p: (p.figures[figure] - w.measured[figure], p.removal.name))


# -- checked against a ladder ----------------------------------------------------------------

#: The figures the ladder check reports.
LADDER_FIGURES = ("itl_p99_ms", "itl_p999_ms", "ttft_p50_ms")


@dataclass(frozen=True)
class LadderCheck:
    """Group `to_key`'s fix, predicted from group `from_key`'s runs, against `to_key`'s."""

    from_key: str
    to_key: str
    fixes: str
    figure: str
    model: str
    predicted: Spread  # across the `from` group's runs
    measured: Spread  # across the `to` group's runs
    #: per seed present in both groups (config `seed`: the same workload), the prediction's
    #: error as a fraction of that seed's measured value; None without common seeds
    paired_error_frac: Spread | None = None

    @property
    def error_ms(self) -> float:
        return self.predicted.median - self.measured.median

    @property
    def error_frac(self) -> float:
        m = self.measured.median
        return self.error_ms / m if m else math.nan

    @property
    def is_outside_spread(self) -> bool:
        """The median prediction lies outside the measured runs' [min-max] (by more than
        float rounding: a replayed time carries the rounding of the run's clock)."""
        tol = 1e-9 * max(1.0, abs(self.measured.hi))
        lo, hi = self.measured.lo - tol, self.measured.hi + tol
        return not (lo <= self.predicted.median <= hi)

    def to_dict(self) -> dict[str, Any]:
        return {
            "from": self.from_key,
            "to": self.to_key,
            "fixes": self.fixes,
            "figure": self.figure,
            "model": self.model,
            "predicted": self.predicted.to_dict(),
            "measured": self.measured.to_dict(),
            "error_ms": _finite(self.error_ms),
            "error_frac": _finite(self.error_frac),
            "outside_spread": self.is_outside_spread,
            "paired_error_frac": self.paired_error_frac.to_dict()
            if self.paired_error_frac is not None
            else None,
        }


def fixes_of(config: Mapping[str, Any]) -> str | None:
    """The removal a run's config says its rung makes (`fixes`), or None."""
    f = config.get("fixes")
    return f if isinstance(f, str) and f else None


def ladder_checks(groups: Sequence[tuple[str, Sequence[WhatIf]]]) -> list[LadderCheck]:
    """For each group k+1 whose runs name what they fix, the prediction from group k's runs
    of removing it, against group k+1's measured runs, per model and figure."""
    out = []
    for (k0, prev), (k1, cur) in zip(groups, groups[1:], strict=False):
        fx = {fixes_of(w.config) for w in cur} - {None}
        if len(fx) != 1 or not prev:
            continue
        (name,) = fx
        assert name is not None
        for fig in LADDER_FIGURES:
            measured = Spread.of([w.measured[fig] for w in cur])
            by_seed = {_seed(w): w.measured[fig] for w in cur if _seed(w) is not None}
            for model in MODELS:
                vals, errs = [], []
                for w in prev:
                    p = w.get(name, model)
                    if p is None and not _always_known(name):
                        continue
                    # a standard cause with no time in the run: removing it changes nothing
                    v = w.measured[fig] if p is None else p.figures[fig]
                    vals.append(v)
                    m = by_seed.get(_seed(w))
                    if m is not None and m and math.isfinite(m):
                        errs.append((v - m) / m)
                if not vals:
                    continue
                paired = Spread.of(errs) if errs else None
                out.append(LadderCheck(k0, k1, name, fig, model, Spread.of(vals), measured, paired))
    return out


def _always_known(name: str) -> bool:
    """A name every run has, with or without time: a standard label, a TTFT label, a family."""
    return name in STANDARD_LABELS or name in TTFT_STANDARD_LABELS or name in FAMILIES


def _seed(w: WhatIf) -> str | None:
    s = w.config.get("seed")
    return None if s is None else str(s)


def family_of(name: str) -> str | None:
    """The family a removal belongs to (a family is its own)."""
    if name in FAMILIES:
        return name
    for fam, (il, tl) in FAMILIES.items():
        if name in il or name in tl:
            return fam
    return "os" if is_os_label(name) else None
