"""Per-run analysis: every figure of design.md's "What a run's analysis reports".

Pure: a `RawLog` and its `Partition` in, a `RunAnalysis` out. Nothing here prints or plots.
Gaps are pooled over all requests of the run; percentiles are numpy's default (linear).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tracekit.analysis.evictions import EvictionSummary, eviction_summary
from tracekit.analysis.interval_figures import (
    clean_forward_median,
    clean_last,
    forward_median,
    gap_percentiles,
    hist_grid,
    primary_counts,
)
from tracekit.analysis.ranks import RankView, rank_view
from tracekit.analysis.results import ClientSummary, SpecAcceptance, client_result, spec_result
from tracekit.analysis.unrecorded import unrecorded_report
from tracekit.analysis.window import Window, select_gaps, select_ttfts
from tracekit.attribution.client import client_partition
from tracekit.attribution.client_ttft import client_ttft_partition
from tracekit.attribution.itl import FIT_ALL_CAPTURED, Partition, partition
from tracekit.attribution.timeline import PreparedRun
from tracekit.attribution.ttft import TtftFigures, TtftPartition, ttft_figures, ttft_partition
from tracekit.formats import json_safe
from tracekit.log.rawlog import GRAPH_EAGER, RawLog

#: ITL histogram bin edges, ms: bins are [lo, hi).
HIST_EDGES_MS: tuple[float, ...] = (0, 5, 10, 15, 20, 30, 50, 80, 120, 200, 400, 800, math.inf)
PERCENTILES = (("itl_p50", 50.0), ("itl_p90", 90.0), ("itl_p99", 99.0), ("itl_p999", 99.9))


@dataclass(frozen=True)
class HistBin:
    lo_ms: float
    hi_ms: float  # inf for the last bin
    count: int
    by_primary: dict[str, int]  # every cause and "clean"


@dataclass(frozen=True)
class RunAnalysis:
    """One run's figures. Times in ms unless the name says otherwise; shares are fractions."""

    path: str
    rung: str | None
    seed: Any
    config: dict[str, Any]
    labels: tuple[str, ...]
    requests: int  # requests recorded in the log
    tokens: int  # emitted tokens (emission rows weighted by their token count)
    gaps: int  # consecutive-emission pairs of one request
    wall_s: float
    tok_per_s: float  # tokens / wall_s
    itl_p50: float
    itl_p90: float
    itl_p99: float
    itl_p999: float
    itl_max: float
    ttft_p50: float  # first token - arrival, over requests with a first token
    ttft_p99: float
    tail_share: dict[str, float]  # per label: label time in tail gaps / tail gap time
    all_share: dict[str, float]  # the same over all gaps
    tail_count: dict[str, int]  # tail gaps by primary cause, "clean" included
    all_count: dict[str, int]  # all gaps by primary cause
    fwd_share_clean_median: float  # median forward/gap over clean gaps
    fwd_share_tail_median: float  # median forward/gap over tail gaps
    evicted_context_ms: dict[str, float]  # what ran while requests were evicted, by label
    # (`residual`: evicted time no engine activity covered; the labels sum to evicted time)
    reconcile_max_err_ms: float  # max over gaps of |gap - sum(parts)|
    skipped_steps_without_eviction: int
    preemptions: int  # sum of the steps' preemption counts
    eager_steps: int
    max_decode_B: int
    steps: int
    gc_counts: dict[str, int]  # collections per generation ("0", "1", "2")
    gen2_startup_ms: list[float]  # gen-2 pauses ending before the first step starts (0.1 ms)
    gen2_serving_ms: list[float]  # gen-2 pauses ending after it
    hist: list[HistBin]
    graph_baseline: dict[str, float]  # slope_ms_per_row, intercept_ms, num_fit_steps
    device_windows: int = 0  # device execution windows (CUDA events) in the log
    device_clock_drift_ppm: float = math.nan  # device vs host clock over the run, if timed
    device_max_placement_err_ms: float = math.nan  # worst error placing a device window
    warnings: list[str] = field(default_factory=list)
    #: TTFT partition figures (`tracekit.attribution.ttft.TtftFigures`): p50/p90/p99/max_ms,
    #: tail_share / tail_count (requests >= the run's TTFT p90), phase_share, ... (None only
    #: for a `RunAnalysis` built without them: its record has ``{}``)
    ttft: TtftFigures | None = None
    #: the client boundary of a merged server run (`tracekit.analysis.results.ClientSummary`)
    client: ClientSummary | None = None
    #: speculative decoding (`tracekit.analysis.results.SpecAcceptance`): drafted, accepted,
    #: drafts, acceptance, mean accepted length, per-position acceptance, tokens per
    #: emission (or None)
    spec: SpecAcceptance | None = None
    #: tensor parallel: which rank held each slow step (`tracekit.analysis.ranks.RankView`),
    #: or None without rank waits
    tp_ranks: RankView | None = None
    #: recomputed tokens / computed tokens (`evictions.recompute_tax`; 0 without evictions,
    #: NaN without computed tokens)
    recompute_tax: float = 0.0
    #: who evicted whom (`tracekit.analysis.evictions.EvictionSummary`), or None without
    #: evictions
    evictions: EvictionSummary | None = None
    #: the window the per-gap figures are of (`tracekit.analysis.window.Window.to_dict`:
    #: from_s, to_s, how), or None for the whole run (docs/reports.md, "Windows")
    window: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: non-finite numbers become None. The typed results are written by
        their own `to_record`/`to_dict`, in the fields' order."""
        d = asdict(self)  # the typed results' entries are replaced below, where they stand
        d["ttft"] = self.ttft.to_dict() if self.ttft is not None else {}
        d["client"] = self.client.to_record() if self.client is not None else None
        d["spec"] = self.spec.to_record() if self.spec is not None else None
        d["tp_ranks"] = self.tp_ranks.to_dict() if self.tp_ranks is not None else None
        d["evictions"] = self.evictions.to_record() if self.evictions is not None else None
        if self.window is None:  # the whole run: its record as it has always been
            del d["window"]
        return json_safe(d)


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else math.nan


def _share(parts: np.ndarray, gap_ms: np.ndarray, labels: tuple[str, ...]) -> dict[str, float]:
    total = float(gap_ms.sum())
    if total <= 0:
        return {lb: 0.0 for lb in labels}
    s = parts.sum(axis=0) / total
    return {lb: float(v) for lb, v in zip(labels, s, strict=True)}


def _counts(prim: np.ndarray, causes: tuple[str, ...]) -> dict[str, int]:
    """Gaps by primary cause; `prim` indexes causes, with "clean" as ``len(causes)``."""
    return _named(np.bincount(prim, minlength=len(causes) + 1), causes)


def _named(counts: np.ndarray, causes: tuple[str, ...]) -> dict[str, int]:
    """Counts by primary cause (clean last) by name."""
    return {name: int(v) for name, v in zip((*causes, "clean"), counts, strict=True)}


def _gc_figures(log: RawLog) -> tuple[dict[str, int], list[float], list[float]]:
    """GC counts by generation, and the generation-2 pauses (ms) that ended before the
    first engine step (startup) and after it (serving)."""
    st = log.steps
    gcp = log.gc_pauses
    gens = np.bincount(gcp.generation, minlength=3) if len(gcp) else np.zeros(3, int)
    first_step = float(st.t_start_s.min()) if len(st) else math.inf
    g2 = gcp.generation == 2
    g2_ms = (gcp.t_end_s[g2] - gcp.t_start_s[g2]) * 1e3
    g2_end = gcp.t_end_s[g2]
    return (
        {str(g): int(c) for g, c in enumerate(gens)},
        [round(float(x), 1) for x in g2_ms[g2_end <= first_step]],
        [round(float(x), 1) for x in g2_ms[g2_end > first_step]],
    )


def _itl_histogram(p: Partition) -> list[HistBin]:
    """The ITL histogram (`HIST_EDGES_MS`) with each bin's count by primary cause, in one
    pass."""
    hist = []
    causes = p.causes
    edges = np.array(HIST_EDGES_MS)
    grid = hist_grid(p, edges)
    for b in range(len(edges) - 1):
        hist.append(
            HistBin(
                lo_ms=float(edges[b]),
                hi_ms=float(edges[b + 1]),
                count=int(grid[b].sum()),
                by_primary={
                    name: int(v) for name, v in zip((*causes, "clean"), grid[b], strict=True)
                },
            )
        )
    return hist


def _client_figures(
    log: RawLog, run: PreparedRun, tp: TtftPartition, gap: np.ndarray, spec: Any
) -> tuple[ClientSummary | None, list[dict[str, Any]]]:
    """A merged server run's client boundary (its gaps and, docs/ttft.md "The client
    boundary", its TTFTs to the first chunk's write), and what each process left
    unrecorded (docs/partition.md, "Unrecorded windows")."""
    cp = client_partition(log, run=run) if len(log.client_emissions) else None
    unrecorded = unrecorded_report(log, cp)  # partial or missing evidence, per process
    if cp is None:
        return None, unrecorded
    ct = client_ttft_partition(log, engine=tp)
    return client_result(log, cp, gap, spec, unrecorded, ct), unrecorded


def _device_figures(log: RawLog) -> dict[str, Any]:
    """The run's device timing: its windows, clock drift and worst placement error."""
    calibration = dict(log.meta.get("device_calibration") or {})
    return {
        "device_windows": int((log.segments.is_device == 1).sum()),
        "device_clock_drift_ppm": float(log.meta.get("device_clock_drift_ppm", math.nan)),
        "device_max_placement_err_ms": float(calibration.get("max_placement_err_ms", math.nan)),
    }


def _ttft_ms(log: RawLog, window: Window | None) -> np.ndarray:
    """First token - arrival (ms) of the requests with both, whose first token lands in
    `window` (if given)."""
    rq = log.requests
    has_first = np.isfinite(rq.first_token_s) & np.isfinite(rq.arrival_s)
    if window is not None:
        has_first &= window.contains(rq.first_token_s)
    return (rq.first_token_s[has_first] - rq.arrival_s[has_first]) * 1e3


def analyze(
    log: RawLog,
    part: Partition | None = None,
    ttft_part: TtftPartition | None = None,
    *,
    baseline_fit: str = FIT_ALL_CAPTURED,
    window: Window | None = None,
) -> RunAnalysis:
    """Every per-run figure of design.md for one log (partitioning it if not given, with the
    graph baseline fitted by `baseline_fit`: `tracekit.attribution.itl.BASELINE_FITS`), and the
    TTFT partition's figures (docs/ttft.md). With a `window`, the per-gap and per-TTFT
    figures are of the gaps ending in it and the TTFTs whose first token lands in it, from
    the whole run's partitions; the per-run figures stay the whole run's (docs/reports.md,
    "Windows")."""
    run = PreparedRun(log)  # what the ITL, TTFT and client partitions derive alike, once
    whole = part if part is not None else partition(log, baseline_fit=baseline_fit, run=run)
    tp = ttft_part if ttft_part is not None else ttft_partition(log, run=run)
    spec = spec_result(log)  # per run, as the client boundary and the ranks: the whole run
    ranks = rank_view(log, whole)
    client, unrecorded = _client_figures(log, run, tp, whole.gap_ms, spec)
    evictions = eviction_summary(log)
    p, tp = select_gaps(whole, window), select_ttfts(tp, window)
    gap = p.gap_ms
    labels = p.labels

    # numpy's linear percentiles, counted over the intervals the gaps span
    qs = gap_percentiles(p, [q for _, q in PERCENTILES])
    pct: dict[str, Any] = {name: v for (name, _), v in zip(PERCENTILES, qs, strict=True)}
    p99 = pct["itl_p99"]
    tail = gap >= p99 if len(gap) else np.zeros(0, bool)

    ttft = _ttft_ms(log, window)

    # a gap that skips engine steps needs an eviction of its request to explain it
    skipped = (p.step1 - p.step0 > 1) & (p.num_evictions == 0)

    st = log.steps
    gc_counts, gen2_startup_ms, gen2_serving_ms = _gc_figures(log)
    # primary causes, then "clean" last, as `_counts`
    hist = _itl_histogram(p)

    tokens = int(log.emissions.num_tokens.sum())
    warnings = list(log.warnings) + list(p.warnings)

    if unrecorded:
        warnings += [u["line"] for u in unrecorded]
    return RunAnalysis(
        path=log.path,
        rung=log.rung,
        seed=log.seed,
        config=dict(log.config),
        labels=labels,
        requests=len(log.requests),
        tokens=tokens,
        gaps=len(gap),
        wall_s=float(log.wall_s),
        tok_per_s=tokens / log.wall_s if log.wall_s > 0 else math.nan,
        **pct,
        itl_max=float(gap.max()) if len(gap) else math.nan,
        ttft_p50=_pct(ttft, 50.0),
        ttft_p99=_pct(ttft, 99.0),
        tail_share=_share(p.parts_ms[tail], gap[tail], labels),
        all_share=_share(p.parts_ms, gap, labels),
        tail_count=_counts(clean_last(p.primary[tail], len(p.causes)), p.causes),
        all_count=_named(primary_counts(p), p.causes),
        fwd_share_clean_median=clean_forward_median(p),
        fwd_share_tail_median=forward_median(p, tail),
        evicted_context_ms={
            lb: float(v) for lb, v in zip(labels, p.context_ms.sum(axis=0), strict=True)
        },
        reconcile_max_err_ms=p.reconcile_max_err_ms,
        skipped_steps_without_eviction=int(skipped.sum()),
        preemptions=int(st.num_preempted.sum()),
        eager_steps=int((st.graph_size == GRAPH_EAGER).sum()),
        max_decode_B=int(st.num_decode.max()) if len(st) else 0,
        steps=len(st),
        gc_counts=gc_counts,
        gen2_startup_ms=gen2_startup_ms,
        gen2_serving_ms=gen2_serving_ms,
        hist=hist,
        graph_baseline={
            "slope_ms_per_row": p.baseline.slope_ms_per_row,
            "intercept_ms": p.baseline.intercept_ms,
            "num_fit_steps": p.baseline.num_fit_steps,
        },
        **_device_figures(log),
        warnings=warnings,  # the TTFT partition's own notes stay in `ttft.notes`
        ttft=ttft_figures(tp),
        client=client,
        spec=spec,
        tp_ranks=ranks,
        recompute_tax=evictions.recompute_tax if evictions is not None else 0.0,
        evictions=evictions,
        window=window.to_dict() if window is not None else None,
    )
