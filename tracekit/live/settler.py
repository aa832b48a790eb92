"""The live settler: ingests the rows each flush hands the sinks, keeps the window of rows
that unsettled gaps may still need, and settles gaps and TTFTs with the attribution
package's partitions. Pure measurement: it returns `tracekit.live.stats` objects and
keeps `LiveTotals`; it exports nothing, starts no thread and holds no lock (the facade,
`tracekit.live.LiveMetrics`, runs it on its worker thread).

**Which gaps are settled when.** A flushed batch holds the rows completed before the
flush, but a window still open then (a tokenizer call on another thread, a GC pause, a
device window resolved later) can start before the flush and overlap a gap that has
already closed. So a gap is *settled* only once its closing emission is older than the
latest flush by `hold_s`: a window that was open for less than `hold_s` has arrived by
then. A window open longer than that arrives *late*: it is counted (``late_rows``) and
the gaps it overlapped were settled without it. Each settlement runs
`tracekit.attribution.itl.partition` on a bounded window of rows: the settled gaps' first
emissions (one carried row per request) to the settle tick, and the rows overlapping that
span, nothing older.

**graph and forward.** The graph baseline (design.md rule 4) is fitted over the whole
run's captured steps, so ``graph``/``forward`` cannot be known exactly while the run goes
on; but a gap's graph part is linear in the eager steps' excess fractions:
``graph = sum_s frac_s * w_s``, where ``w_s`` is the decode time of eager step ``s`` the
gap owns (what `partition` charges with ``frac = 1``). The settler keeps ``w_s`` per eager
step and each step's GC-free decode time, and reports ``graph = sum_s frac_s(fit so far)
* w_s``, ``forward = decode time - graph``: their sum is exact at every settlement; while
the run goes, each settled gap adds its graph under the line fitted so far
(`tracekit.live.graph.RunningLine`) and every `refit_s` the whole sum is re-evaluated under
it; at the close it is evaluated once with `fit_baseline` over every step of the run (the
offline fit itself), hence exact. Per-gap figures that must be final when the gap is settled (its
primary cause, a slow gap's graph/forward parts) use the fit so far.

**Sliding window.** ``tail_count``/``tail_ms`` count the gaps at or above the p99 of the
last `tail_window` settled gaps (the batch being settled included).

Memory: the retained rows span the oldest in-flight request's last emission (a request is
in flight until it has emitted its ``max_new_tokens``, or for `max_retain_s` after its last
emission when that is unknown); per step, three numbers for the graph fit and one weight.

**Parts.** `Settler` orchestrates parts that own their state: `tracekit.live.retention`
(the retained rows, and what is dropped as time settles), `tracekit.live.requests` (per
request: carried emission, tokens, arrival, first token), `tracekit.live.steps` (per
settled step: the graph fit's inputs and weights) and `tracekit.live.graph` (the running
fit and the graph total).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.analysis.figures import HIST_EDGES_MS
from tracekit.attribution.itl import CLEAN, partition, primary_of
from tracekit.attribution.reprefill import NEXT_EMISSION_META
from tracekit.attribution.ttft import TTFT_STANDARD_LABELS, ttft_partition
from tracekit.labels import DEFAULT_CAUSE_MAP, OS_LABELS, STANDARD_LABELS, cause_of
from tracekit.live.buffers import NO_TICK, Ring
from tracekit.live.graph import GraphRefit, eager_weights
from tracekit.live.requests import RequestState
from tracekit.live.retention import TTFT_TABLES as TTFT_TABLES
from tracekit.live.retention import Retention
from tracekit.live.stats import LiveTotals, Settlement, SlowGap
from tracekit.live.steps import StepState
from tracekit.log.flush import (
    EVICT,
    TABLES,
    FlushedRows,
    column_index,
    pair_evictions,
    to_table,
)
from tracekit.log.rawlog import (
    GRAPH_EAGER,
    MODE_RECOMPUTE,
    PREEMPT_REASONS,
    Counters,
    Emissions,
    GcPauses,
    OsSamples,
    RawLog,
    Requests,
    Segments,
    Steps,
)

#: Gap histogram buckets, seconds: upper bounds, each counting the gaps <= it (Prometheus'
#: `le`); +Inf added. A single gap can reach seconds (a long prefill chunk, a preemption).
GAP_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10,
)  # fmt: skip
#: TTFT histogram buckets, seconds (upper bounds, counting TTFTs <= each; +Inf added).
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120,
)  # fmt: skip
#: A slow gap lists at most this many of the steps it overlaps (the first and last halves).
MAX_SPAN_STEPS = 64

TtftPartitioner = Callable[[RawLog, np.ndarray], tuple[tuple[str, ...], np.ndarray]]

# column positions in the flushed rows (`tracekit.log.flush.TABLES`), by name
_SG = {c: i for i, c in enumerate(TABLES["segments"])}
_EM = {c: i for i, c in enumerate(TABLES["emissions"])}
_PE = {c: i for i, c in enumerate(TABLES["preemptions"])}
_EV = {c: i for i, c in enumerate(TABLES["events"])}
#: The reason an eviction without a recorded cause is counted under.
UNKNOWN = "unknown"
#: Where a flushed row starts, per table: one that starts before what is settled is late.
_STARTS = (("segments", "t0_tick"), ("gc_pauses", "t0_tick"), ("emissions", "t_tick"),
           ("events", "t_tick"), ("steps", "t0_tick"))  # fmt: skip


@dataclass(slots=True)
class FlushedBatch:
    """One flush's rows in the settler's layouts (see `read_batch`).

    rows: table name -> int64 rows (only the tables the batch has). labels: the label
    vocabulary so far (None: unchanged). flush_tick: the recorder's clock at the flush
    (None: not said); is_stop: the recorder's last batch.
    """

    rows: dict[str, np.ndarray]
    labels: list[str] | None
    request_ids_start: int | None
    request_ids: list[str]
    flush_tick: int | None
    open_tick: int | None
    t0_tick: int | None
    is_stop: bool


def ttft_by_cause(window: RawLog, requests: np.ndarray) -> tuple[tuple[str, ...], np.ndarray]:
    """The TTFT partition by cause (`tracekit.attribution.ttft.ttft_partition`) of
    `requests` over a settler's window: the default TTFT partitioner of live mode."""
    p = ttft_partition(window)
    row_of = {int(r): i for i, r in enumerate(p.request.tolist())}
    rows = [row_of[int(r)] for r in requests.tolist() if int(r) in row_of]
    return p.labels, p.parts_ms[rows]


def read_batch(batch: Mapping[str, Any]) -> FlushedBatch:
    """The one place that reads a recorder's flushed rows (`tracekit.log.flush.FlushedRows`,
    or any mapping of its arrays), table by table and column by name."""
    f = FlushedRows.of(batch)
    return FlushedBatch(
        rows={k: f.table(k) for k in TABLES if k in f and k != "counters"},
        labels=f.strings("labels") if "labels" in f else None,
        request_ids_start=f.scalar("request_ids_start"),
        request_ids=f.strings("request_ids"),
        flush_tick=f.scalar("flush_tick"),
        open_tick=f.scalar("open_tick"),
        t0_tick=f.scalar("t0_tick"),
        is_stop=f.is_last,
    )


class Settler:
    """Settles a run's gaps and TTFTs from its flushed batches, as the run goes.

    hold_s: how long after a flush a gap waits to be settled; and a gap a window still
        open at the flush may overlap (the batch's ``open_tick``) waits for that window's
        row, for at most `max_open_s`: only a window open longer, or one recorded after the
        fact (`Recorder.add_segment`) more than `hold_s` late, is late.
    tail_window: how many recent gaps (and TTFTs) the sliding p99 is taken over.
    max_retain_s: a request with no known ``max_new_tokens`` stops pinning the retained
        rows this long after its last emission; a later gap of it is counted truncated.
    refit_s: how often (engine clock) the running graph total is re-evaluated over every
        eager step under the line fitted so far. slo_ms: gaps at least this long are
        returned as `SlowGap` (None: none). ttft_partitioner: see `tracekit.live.LiveMetrics`.
    """

    def __init__(
        self,
        *,
        hold_s: float = 2.0,
        tail_window: int = 10_000,
        max_retain_s: float = 300.0,
        refit_s: float = 10.0,
        slo_ms: float | None = None,
        ttft_partitioner: TtftPartitioner | None = None,
        gap_buckets_s: tuple[float, ...] = GAP_BUCKETS_S,
        ttft_buckets_s: tuple[float, ...] = TTFT_BUCKETS_S,
        max_open_s: float = 60.0,
    ) -> None:
        _check_args(gap_buckets_s, ttft_buckets_s, hold_s=hold_s, refit_s=refit_s,
                    max_retain_s=max_retain_s, max_open_s=max_open_s,
                    tail_window=tail_window)  # fmt: skip
        self.gap_buckets_s = tuple(float(x) for x in gap_buckets_s)
        self.ttft_buckets_s = tuple(float(x) for x in ttft_buckets_s)
        self.hold_s = hold_s
        self._max_open_s = max_open_s
        self.slo_ms = slo_ms
        self._max_retain_s = max_retain_s
        self._refit_s = refit_s
        self._ttft_partitioner = ttft_partitioner
        self._tail = Ring(tail_window)
        self._ttft_ring = Ring(tail_window)
        # the run's clock and vocabularies
        self._t0_tick = 0
        self._spt = 1e-9
        self._hold_ticks = self._retain_ticks = self._refit_ticks = self._max_open_ticks = 0
        self._cause_map: dict[str, str] = dict(DEFAULT_CAUSE_MAP)
        self._labels: list[str] = []
        # the parts: retained rows (ticks), per request, per settled step, the graph fit
        self._rows = Retention()
        self._requests = RequestState()
        self._steps = StepState()
        self._graph = GraphRefit(self._steps)
        self._settled_to_tick = -NO_TICK  # gaps closing at or before this tick are settled
        self._flush_tick = -NO_TICK
        self._open_tick: int | None = None  # the latest flush's earliest open window
        self.totals = _zero_totals(self.gap_buckets_s, self.ttft_buckets_s)
        if ttft_partitioner is ttft_by_cause:  # its standard labels, at 0 from the start
            self.totals.ttft_cause_ms = dict.fromkeys(TTFT_STANDARD_LABELS, 0.0)
        self._note_created()

    def open(self, meta: Mapping[str, Any]) -> None:
        """The run's clock and cause map (the recorder's start meta)."""
        self._t0_tick = int(meta["t0_tick"])
        self._spt = float(meta.get("seconds_per_tick", 1e-9))
        self._cause_map = {**DEFAULT_CAUSE_MAP, **dict(meta.get("cause_map") or {})}
        self._hold_ticks = int(self.hold_s / self._spt)
        self._max_open_ticks = int(self._max_open_s / self._spt)
        self._retain_ticks = int(self._max_retain_s / self._spt)
        self._refit_ticks = int(self._refit_s / self._spt)
        os_ev = meta.get("os_evidence")
        if isinstance(os_ev, Mapping) and os_ev.get("recorded"):
            self._os_series_at_zero()

    def _note_created(self) -> None:
        """Every cause label with a series now and no creation time yet: created now."""
        t, now = self.totals, time.time()
        for d in (t.cause_ms, t.tail_count, t.tail_ms, t.ttft_cause_ms):
            for lb in d:
                t.created_s.setdefault(lb, now)
        t.created_s.setdefault("decode", now)

    def _series_at_zero(self, labels: Sequence[str]) -> None:
        """A series at 0 for the cause of every label the recorder has named, from the flush
        that first names it: every scraper then sees it begin at 0, long before the gaps
        that carry its time settle (`hold_s` later), and its creation time is set
        (docs/live.md, "Series that appear mid-run"). Decode is graph + forward, exported
        as it settles."""
        causes = {cause_of(lb, self._cause_map) for lb in labels} - {"decode"}
        self._causes_at_zero(sorted(causes))

    def _os_series_at_zero(self) -> None:
        """The OS causes' series, at 0 before the first settlement (a run that records OS
        evidence may have them in every partition). A counter series first scraped above 0
        loses that first value to Prometheus' `increase()`, which counts from the first
        sample it sees (it extrapolates towards 0 by at most half a scrape interval)."""
        self._causes_at_zero(OS_LABELS)

    def _causes_at_zero(self, causes: Sequence[str]) -> None:
        """Each cause's series (gap time, tail time and count, TTFT time) at 0 where it has
        none yet, created now."""
        t = self.totals
        for cause in causes:
            t.cause_ms.setdefault(cause, 0.0)
            t.tail_ms.setdefault(cause, 0.0)
            t.tail_count.setdefault(cause, 0)
            if self._ttft_partitioner is ttft_by_cause:
                t.ttft_cause_ms.setdefault(cause, 0.0)
        self._note_created()

    @property
    def flush_s(self) -> float:
        """The latest flush, engine-clock seconds (NaN: none yet)."""
        if self._flush_tick == -NO_TICK:
            return math.nan
        return float(self.secs(np.array([self._flush_tick]))[0])

    def secs(self, ticks: np.ndarray) -> np.ndarray:
        """Engine-clock seconds since the run's start, computed as the raw log's merge does."""
        return (ticks - self._t0_tick).astype(np.float64) * self._spt

    def retained(self) -> dict[str, int]:
        """How many rows the settler holds (what bounds its memory)."""
        return {**self._rows.counts(), "inflight": len(self._requests.inflight)}

    def add(self, batch: Mapping[str, Any]) -> Settlement:
        """Ingest one flushed batch and settle what it makes settleable."""
        b = read_batch(batch)
        self._ingest(b)
        return self.settle(final=b.is_stop)

    def _ingest(self, b: FlushedBatch) -> None:
        """Append a batch's rows (a row older than what is settled is counted late)."""
        rows = b.rows
        if b.t0_tick is not None and not self._t0_tick:
            self._t0_tick = b.t0_tick
        if b.labels is not None:  # (an engine label named like a produced part: `cause_of`)
            self._labels = b.labels
            self._series_at_zero(b.labels)
        self._requests.set_ids(b.request_ids_start, b.request_ids)
        # a row that starts before what is settled was open longer than hold_s: late
        late = 0
        for k, start_col in _STARTS:
            if k in rows and len(rows[k]):
                col = column_index(k, start_col)
                late += int((rows[k][:, col] < self._settled_to_tick).sum())
        self.totals.late_rows += late
        self._rows.append(rows)
        rq = rows.get("requests")
        if rq is not None and len(rq):
            self._requests.add_requests(rq)
        em = rows.get("emissions")
        if em is not None and len(em):
            self._requests.add_emissions(em)
        _count_evictions(self.totals, rows)
        if b.flush_tick is not None:
            self._flush_tick = b.flush_tick
            self._open_tick = b.open_tick

    # -- TTFT -------------------------------------------------------------------------------
    def _settle_ttft(self, w_tick: int, out: Settlement) -> None:
        """The requests whose first token came by w_tick (and whose arrival is known): held
        like the gaps, so a TTFT partition sees every window of their wait."""
        new = self._requests.take_first_tokens(w_tick)
        if not len(new):
            return
        arr = self._requests.arrival_tick_of(new)
        # first token - arrival, ms: the offline figure's arithmetic (seconds, then subtract)
        ttft_ms = (self.secs(self._requests.first_tick_of(new)) - self.secs(arr)) * 1e3
        self._ttft_ring.extend(ttft_ms)
        window = self._ttft_ring.values()
        # bucket i counts the TTFTs <= bound i (in seconds, as a scraper compares them)
        which = np.searchsorted(self.ttft_buckets_s, ttft_ms / 1e3, side="left")
        parts = None
        # a request that waited longer than max_retain_s lost the rows of its wait's start:
        # counted, never partitioned
        whole_rows = arr >= self._rows.horizon_tick
        whole = new[whole_rows]
        self.totals.truncated_ttfts += len(new) - len(whole)
        if self._ttft_partitioner is not None and len(whole):
            lo_tick = int(arr[whole_rows].min())  # every row from the earliest arrival on
            win = self._window(self._rows.pending[:0], lo_tick=lo_tick, ttft_requests=whole)[0]
            try:  # a failing TTFT partition costs its causes, never the gaps or the counts
                parts = self._ttft_partitioner(win, whole)
            except Exception as e:
                out.errors.append(e)
        if self._ttft_partitioner is not None:
            # keep the admissions and waits of the requests whose TTFT is still open and
            # whose rows since arrival are all retained
            self._rows.keep_ttft_rows_of(self._requests.open_ttfts_since(self._rows.horizon_tick))
        t = self.totals
        t.ttft_n += len(new)
        t.ttft_sum_s += float(ttft_ms.sum()) / 1e3
        np.add.at(t.ttft_hist, which, 1)
        t.ttft_window_p50_ms = float(np.percentile(window, 50))
        t.ttft_window_p99_ms = float(np.percentile(window, 99))
        if parts is not None:
            labels, ms = parts
            for lb, v in zip(labels, np.asarray(ms).sum(axis=0).tolist(), strict=True):
                t.ttft_cause_ms[lb] = t.ttft_cause_ms.get(lb, 0.0) + _rise(v)

    # -- settling gaps ------------------------------------------------------------------------
    def settle(self, *, final: bool) -> Settlement:
        """Settle every gap closing by the latest flush less `hold_s` (every gap, and the
        graph/forward split on the whole run's fit, when `final`)."""
        out = Settlement()
        w_tick = NO_TICK if final else self._flush_tick - self._hold_ticks
        if not final and self._open_tick is not None:
            # a window open at the flush (its row is still to come) holds back every gap
            # it may overlap, for at most `max_open_s`; one open longer arrives late
            w_tick = min(w_tick, max(self._open_tick, self._flush_tick - self._max_open_ticks))
        if w_tick <= self._settled_to_tick:
            return out
        new_em = self._rows.take_pending(w_tick)
        steps_done = self._rows.steps_ended_by(self._steps.num_settled, w_tick)
        if len(new_em) or steps_done:
            self._settle_window(new_em, w_tick, final, out)
        self._settle_ttft(w_tick, out)
        self._settled_to_tick = w_tick
        if not final:
            self.totals.settled_to_s = float(self.secs(np.array([w_tick]))[0])
        if final:
            self._graph.graph_ms = self._graph.exact_total()
            self.totals.final = out.is_final = True
        else:
            self._rows.prune(
                w_tick,
                self._requests,
                num_settled=self._steps.num_settled,
                retain_ticks=self._retain_ticks,
                pin_ttfts=self._ttft_partitioner is not None,
            )
        self._export_graph()
        return out

    def _export_graph(self) -> None:
        t = self.totals
        t.cause_ms["graph"] = self._graph.graph_ms
        t.cause_ms["forward"] = t.decode_ms - self._graph.graph_ms

    def _window(
        self,
        new_em: np.ndarray,
        *,
        lo_tick: int | None = None,
        ttft_requests: np.ndarray | None = None,
    ) -> tuple[RawLog, int, np.ndarray]:
        """The rows that settling `new_em` needs, as a RawLog (steps re-based to `step_lo`),
        and the window's emissions (the involved requests' carried rows, then `new_em`).
        With `ttft_requests`: their requests table rows (every other request's arrival NaN)
        and the TTFT tables, for the TTFT partition of these requests."""
        rows, num_settled = self._rows, self._steps.num_settled
        carried = self._requests.carried(np.unique(new_em[:, _EM["request"]]))
        em = np.concatenate([carried, new_em]) if len(carried) else new_em
        starts = [int(em[:, _EM["t_tick"]].min())] if len(em) else []
        first_start = rows.step_start(num_settled)
        if first_start is not None:
            starts.append(first_start)
        if lo_tick is None:
            lo_tick = min(starts) if starts else self._settled_to_tick
        if len(em):
            if len(carried):
                self.totals.truncated_gaps += int(
                    (carried[:, _EM["t_tick"]] < rows.horizon_tick).sum()
                )
        segs, gcs, os_rows = rows.rows_from(lo_tick)
        # steps: every one a row refers to (the emitting ones too: a span lists the steps
        # its gap overlaps), from the first unsettled one on
        refs = [segs[:, _SG["step"]], em[:, _EM["step"]], em[:, _EM["device_step"]]]
        if ttft_requests is not None:
            refs += rows.ttft_steps()
        ref = np.concatenate(refs)
        ref = ref[ref >= rows.step_base]
        step_lo = min(int(ref.min()) if len(ref) else num_settled, num_settled)
        step_lo = max(step_lo, rows.step_base)
        step_hi = max(int(ref.max()) + 1 if len(ref) else 0, rows.step_base + len(rows.steps))
        st = rows.steps_block(step_lo, step_hi, self._t0_tick)
        window = self._window_log(st, segs, gcs, em, os_rows, step_lo, step_hi, ttft_requests)
        return window, step_lo, em

    def _window_log(self, st, segs, gcs, em, os_rows, step_lo, step_hi, ttft_requests) -> RawLog:
        """A window's rows as a RawLog, steps re-based to `step_lo` (see `_window`)."""

        def rebase(s: np.ndarray) -> np.ndarray:
            return np.where(s >= 0, s - step_lo, s)

        secs = self.secs
        evictions = pair_evictions(self._rows.events, secs)
        ttft = self._rows.ttft_tables(step_lo, step_hi, secs)
        if ttft_requests is None:  # the gaps' partition reads the steps' prefill tokens only
            ttft = {"prefill_chunks": ttft["prefill_chunks"]}
        return RawLog(
            steps=to_table(Steps, "steps", st, secs),
            segments=replace(
                to_table(Segments, "segments", segs, secs), step=rebase(segs[:, _SG["step"]])
            ),
            gc_pauses=to_table(GcPauses, "gc_pauses", gcs, secs),
            emissions=replace(
                # step: global, only reported (step0/step1), never indexed
                to_table(Emissions, "emissions", em, secs),
                device_step=np.where(
                    em[:, _EM["device_step"]] >= step_lo, em[:, _EM["device_step"]] - step_lo, -1
                ),
            ),
            evictions=evictions,
            os_samples=to_table(OsSamples, "os_samples", os_rows, secs),
            # the partition never reads the requests: built only for a TTFT partitioner
            requests=self._requests.requests_table(ttft_requests, secs)
            if ttft_requests is not None
            else Requests.empty(),
            counters=Counters.empty(),
            **ttft,
            labels=tuple(self._labels),
            request_ids=tuple(self._requests.ids) if ttft_requests is not None else (),
            cause_map=self._cause_map,
            # whose re-prefill a step is: each victim's next emission, which the window's
            # emissions may not hold (docs/live.md)
            meta={NEXT_EMISSION_META: self._rows.next_emissions_s(evictions, secs)},
            path="<live window>",
        )

    def _settle_window(self, new_em: np.ndarray, w_tick: int, final: bool, out: Settlement):
        win, step_lo, em = self._window(new_em)
        eager = win.steps.graph_size == GRAPH_EAGER
        # frac = 1 on every eager step: the graph column is then each gap's eager decode
        # time, sum_s w_{g,s}; graph + forward is the gap's decode time whatever the fit
        p = partition(win, excess_frac=eager.astype(np.float64))
        net = p.baseline.decode_net_ms
        n_win = len(win.steps)
        self._settle_steps(win, net, step_lo, w_tick, final)

        # each gap's weight w_{g,s} per eager step it touches
        gcol, fcol = p.labels.index("graph"), p.labels.index("forward")
        e_ms = p.parts_ms[:, gcol].copy()
        d_ms = e_ms + p.parts_ms[:, fcol]
        gi, si, wv = eager_weights(win, p, eager, e_ms, self._cause_map)
        if len(gi):
            self._steps.add_weights(step_lo + si, wv, step_lo + n_win)

        # each gap's graph under the running line (this window's decode times)
        frac_win = self._graph.excess_frac(win.steps.graph_size, win.steps.num_decode, net)
        g_est = np.zeros(len(p))
        np.add.at(g_est, gi, frac_win[si] * wv)
        # the run's graph total: exact at close (design.md's fit over every captured step);
        # meanwhile the new gaps' estimates are added, and every `refit_s` of engine clock
        # the whole total is re-evaluated under the line so far
        graph_ms = self._graph.total_with(w_tick, float(g_est.sum()), self._refit_ticks)
        parts = p.parts_ms.copy()
        parts[:, gcol] = g_est
        parts[:, fcol] = d_ms - g_est
        self._count_gaps(win, p, parts, d_ms, graph_ms, step_lo, out)

        # carry each request's last settled emission into the next window
        if len(new_em):
            self._requests.carry(new_em)

    def _settle_steps(self, win: RawLog, net: np.ndarray, step_lo: int, w_tick: int, final: bool):
        """The steps that ended by w_tick: their GC-free decode time is final (rule 4's
        inputs), for the graph fit."""
        first = self._steps.num_settled - step_lo
        n_done = (
            len(win.steps) - first
            if final
            else self._rows.steps_ended_by(self._steps.num_settled, w_tick)
        )
        if n_done:
            done = slice(first, first + n_done)
            self._graph.add_steps(win.steps.graph_size[done], win.steps.num_decode[done], net[done])

    def _count_gaps(self, win, p, parts, d_ms, graph_ms, step_lo, out: Settlement) -> None:
        """Add a window's settled gaps (`parts`: graph/forward under the fit so far) to the
        totals, the sliding window's tail and the slow gaps."""
        gcol, fcol = p.labels.index("graph"), p.labels.index("forward")
        primary, causes = primary_of(parts, p.gap_ms, p.labels)
        # the sliding window's p99, the batch included
        self._tail.extend(p.gap_ms)
        window = self._tail.values()
        p99 = float(np.percentile(window, 99)) if len(window) else math.nan
        tail = p.gap_ms >= p99
        names = np.array([*causes, "clean"], dtype=object)[
            np.where(primary == CLEAN, len(causes), primary)
        ]
        which = np.searchsorted(np.array(HIST_EDGES_MS), p.gap_ms, side="right") - 1
        le = np.searchsorted(self.gap_buckets_s, p.gap_ms / 1e3, side="left")
        sums = p.parts_ms.sum(axis=0)
        tail_sums = parts[tail].sum(axis=0)
        t = self.totals
        t.gaps += len(p)
        t.gap_sum_s += float(p.gap_ms.sum()) / 1e3
        np.add.at(t.hist, which, 1)
        np.add.at(t.gap_le, le, 1)
        for j, lb in enumerate(p.labels):
            if j not in (gcol, fcol):
                t.cause_ms[lb] = t.cause_ms.get(lb, 0.0) + _rise(float(sums[j]))
            t.tail_ms[lb] = t.tail_ms.get(lb, 0.0) + _rise(float(tail_sums[j]))
        t.decode_ms += _rise(float(d_ms.sum()))
        self._graph.graph_ms = graph_ms
        t.fit_steps = self._graph.fit_steps
        for nm in names[tail].tolist():
            t.tail_count[nm] = t.tail_count.get(nm, 0) + 1
        if len(p):
            t.itl_window_p99_ms = p99
        out.num_gaps += len(p)
        if self.slo_ms is not None and len(p):
            sel = np.flatnonzero(p.gap_ms >= self.slo_ms)
            out.slow_gaps += self._slow_gaps(win, p, parts, names, step_lo, sel)

    def _slow_gaps(self, win, p, parts, names, step_lo, sel) -> list[SlowGap]:
        st = win.steps
        out = []
        for i in sel.tolist():
            t0, t1 = float(p.t0_s[i]), float(p.t1_s[i])
            hit = np.flatnonzero((st.t_start_s < t1) & (st.t_end_s > t0)) + step_lo
            n_hit = len(hit)
            if n_hit > MAX_SPAN_STEPS:  # a long gap: its first and last steps, where its cause is
                half = MAX_SPAN_STEPS // 2
                hit = np.concatenate([hit[:half], hit[-half:]])
            r = int(p.request[i])
            out.append(
                SlowGap(
                    request_index=r,
                    request_id=self._requests.ids[r],
                    gap_ms=float(p.gap_ms[i]),
                    t0_s=t0,
                    t1_s=t1,
                    step0=int(p.step0[i]),
                    step1=int(p.step1[i]),
                    steps=hit.tolist(),
                    num_steps=n_hit,
                    primary_cause=str(names[i]),
                    parts_ms=dict(zip(p.labels, parts[i].tolist(), strict=True)),
                    graph_fit_steps=self._graph.fit_steps,
                )
            )
        return out


def _check_args(
    gap_buckets_s: tuple[float, ...], ttft_buckets_s: tuple[float, ...], **limits: float
) -> None:
    """ValueError unless the buckets increase (finite seconds > 0) and each limit is in range."""
    for name, b in (("gap_buckets_s", gap_buckets_s), ("ttft_buckets_s", ttft_buckets_s)):
        if not b or any(not (x > 0 and math.isfinite(x)) for x in b) or list(b) != sorted(set(b)):
            raise ValueError(f"{name}: {b!r} is not an increasing list of finite seconds > 0")
    ok = {
        "hold_s": limits["hold_s"] >= 0,
        "refit_s": limits["refit_s"] >= 0,
        "max_retain_s": limits["max_retain_s"] > 0,
        "max_open_s": limits["max_open_s"] >= 0,
        "tail_window": limits["tail_window"] >= 1,
    }
    for name, v_ok in ok.items():
        v = limits[name]
        if not (v_ok and math.isfinite(v)):
            raise ValueError(f"{name}: {v!r} is out of range")


def _count_evictions(t: LiveTotals, rows: Mapping[str, np.ndarray]) -> None:
    """A batch's evictions by reason and recomputed tokens. An eviction's cause is written
    with its `events` row under one lock, so both are in the same batch."""
    ev = rows.get("events")
    if ev is None or not len(ev):
        return
    pe = rows.get("preemptions")
    if pe is None:
        pe = np.zeros((0, len(_PE)), dtype=np.int64)
    by = t.evictions_by_reason
    n_ev = int((ev[:, _EV["kind"]] == EVICT).sum())
    by[UNKNOWN] = by.get(UNKNOWN, 0) + n_ev - len(pe)
    for code in pe[:, _PE["reason"]].tolist():
        name = PREEMPT_REASONS[code] if 0 <= code < len(PREEMPT_REASONS) else "other"
        by[name] = by.get(name, 0) + 1
    recompute = {
        (r, x)
        for r, k, x, m in ev[:, [_EV["request"], _EV["kind"], _EV["t_tick"], _EV["mode"]]].tolist()
        if k == EVICT and m == MODE_RECOMPUTE
    }
    cols = [_PE["request"], _PE["t_tick"], _PE["num_computed_tokens_lost"]]
    for r, x, lost in pe[:, cols].tolist():
        if lost > 0 and (r, x) in recompute:
            t.recomputed_tokens += lost


def _zero_totals(gap_buckets_s: tuple[float, ...], ttft_buckets_s: tuple[float, ...]):
    """Totals before the first settlement: every standard series at 0."""
    return LiveTotals(
        hist=np.zeros(len(HIST_EDGES_MS) - 1, dtype=np.int64),
        gap_le=np.zeros(len(gap_buckets_s) + 1, dtype=np.int64),
        cause_ms=dict.fromkeys(STANDARD_LABELS, 0.0),
        tail_count=dict.fromkeys(
            [lb for lb in STANDARD_LABELS if lb not in ("forward", "residual")] + ["clean"], 0
        ),
        tail_ms=dict.fromkeys(STANDARD_LABELS, 0.0),
        ttft_hist=np.zeros(len(ttft_buckets_s) + 1, dtype=np.int64),
        evictions_by_reason=dict.fromkeys((*PREEMPT_REASONS, UNKNOWN), 0),
    )


def _rise(v: float) -> float:
    """What a settlement adds to a counter: its sum, or 0 where float rounding left it
    below 0 (a label that is 0 in every gap can sum to -1e-15 ms). A counter that went down
    by even that much reads as a reset to Prometheus, and `increase()` would double it."""
    return v if v > 0.0 else 0.0
