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
(`_RunningLine`) and every `refit_s` the whole sum is re-evaluated under it; at the close
it is evaluated once with `fit_baseline` over every step of the run (the offline fit
itself), hence exact. Per-gap figures that must be final when the gap is settled (its
primary cause, a slow gap's graph/forward parts) use the fit so far.

**Sliding window.** ``tail_count``/``tail_ms`` count the gaps at or above the p99 of the
last `tail_window` settled gaps (the batch being settled included).

Memory: the retained rows span the oldest in-flight request's last emission (a request is
in flight until it has emitted its ``max_new_tokens``, or for `max_retain_s` after its last
emission when that is unknown); per step, three numbers for the graph fit and one weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.analysis.figures import HIST_EDGES_MS
from tracekit.attribution.itl import CLEAN, fit_baseline, partition, primary_of
from tracekit.attribution.ttft import TTFT_STANDARD_LABELS, ttft_partition
from tracekit.labels import DEFAULT_CAUSE_MAP, OS_LABELS, STANDARD_LABELS, cause_of
from tracekit.live.stats import LiveTotals, Settlement, SlowGap
from tracekit.log.flush import (
    EVICT,
    TABLES,
    UNKNOWN_TICK,
    FlushedRows,
    column_index,
    pair_evictions,
    to_table,
)
from tracekit.log.rawlog import (
    GRAPH_EAGER,
    Admissions,
    Counters,
    Emissions,
    Evictions,
    GcPauses,
    OsSamples,
    PrefillChunks,
    RawLog,
    Requests,
    Segments,
    Steps,
    Waits,
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

# column positions in the retained rows: the flush's layout (`tracekit.log.flush.TABLES`),
# by name
_ST = {c: i for i, c in enumerate(TABLES["steps"])}
_SG = {c: i for i, c in enumerate(TABLES["segments"])}
_GC = {c: i for i, c in enumerate(TABLES["gc_pauses"])}
_EM = {c: i for i, c in enumerate(TABLES["emissions"])}
_EV = {c: i for i, c in enumerate(TABLES["events"])}
_RQ = {c: i for i, c in enumerate(TABLES["requests"])}
_AD = {c: i for i, c in enumerate(TABLES["admissions"])}
_PF = {c: i for i, c in enumerate(TABLES["prefill_chunks"])}
_WT = {c: i for i, c in enumerate(TABLES["waits"])}
_OS = {c: i for i, c in enumerate(TABLES["os_samples"])}
_NO_TICK = np.iinfo(np.int64).max
#: Parts the partition derives (decode's split, time no window covers): an engine label of
#: that name becomes the cause ``engine_<name>``, so that the two never add up.
DERIVED_CAUSES = frozenset({"graph", "forward", "residual", "decode_other", "prefill_own"})
#: The tables only the TTFT partition reads.
TTFT_TABLES = ("admissions", "prefill_chunks", "waits")


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


class _Grow:
    """A numpy array indexed by a growing integer id (steps, requests), filled with `fill`."""

    def __init__(self, dtype: Any, fill: Any) -> None:
        self.a = np.full(64, fill, dtype=dtype)
        self.fill = fill

    def ensure(self, n: int) -> np.ndarray:
        if n > len(self.a):
            b = np.full(max(n, 2 * len(self.a)), self.fill, dtype=self.a.dtype)
            b[: len(self.a)] = self.a
            self.a = b
        return self.a


class _Ring:
    """The last `n` values (a sliding window), as one preallocated array."""

    def __init__(self, n: int) -> None:
        self.buf = np.zeros(max(1, n))
        self.count = 0

    def extend(self, v: np.ndarray) -> None:
        n = len(self.buf)
        v = v[-n:]
        i = self.count % n
        k = min(len(v), n - i)
        self.buf[i : i + k] = v[:k]
        self.buf[: len(v) - k] = v[k:]
        self.count += len(v)

    def values(self) -> np.ndarray:
        return self.buf[: min(self.count, len(self.buf))]


class _RunningLine:
    """The graph baseline's line (design.md rule 4) fitted as steps settle: least squares
    of GC-free decode ms against the padded batch size over the captured steps with decode
    time, from centred sums merged batch by batch (Chan et al.), so a long run costs O(1)
    per step. A running estimate only: the exact totals use `fit_baseline` at close."""

    def __init__(self) -> None:
        self.n = 0
        self.mx = self.my = self.m2x = self.cxy = 0.0
        self.sizes: set[int] = set()

    def add(self, graph_size: np.ndarray, net_ms: np.ndarray) -> None:
        sel = (graph_size > 0) & (net_ms > 0)
        if not sel.any():
            return
        x, y = graph_size[sel].astype(np.float64), net_ms[sel]
        nb, mxb, myb = len(x), float(x.mean()), float(y.mean())
        m2b = float(((x - mxb) ** 2).sum())
        cb = float(((x - mxb) * (y - myb)).sum())
        n = self.n + nb
        dx, dy = mxb - self.mx, myb - self.my
        self.m2x += m2b + dx * dx * self.n * nb / n
        self.cxy += cb + dx * dy * self.n * nb / n
        self.mx += dx * nb / n
        self.my += dy * nb / n
        self.n = n
        self.sizes.update(np.unique(graph_size[sel]).tolist())

    def excess_frac(self, graph_size: np.ndarray, num_decode: np.ndarray, net_ms: np.ndarray):
        """Each eager step's fraction of decode time over the line (0 for the others)."""
        frac = np.zeros(len(net_ms))
        if self.n == 0:
            return frac
        slope = self.cxy / self.m2x if len(self.sizes) >= 2 else 0.0
        icpt = self.my - slope * self.mx
        eager = (graph_size == GRAPH_EAGER) & (net_ms > 0)
        net = net_ms[eager]
        frac[eager] = np.minimum(
            1.0, np.maximum(0.0, net - (slope * num_decode[eager] + icpt)) / net
        )
        return frac


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
        for name, b in (("gap_buckets_s", gap_buckets_s), ("ttft_buckets_s", ttft_buckets_s)):
            if (
                not b
                or any(not (x > 0 and math.isfinite(x)) for x in b)
                or list(b) != sorted(set(b))
            ):
                raise ValueError(f"{name}: {b!r} is not an increasing list of finite seconds > 0")
        self.gap_buckets_s = tuple(float(x) for x in gap_buckets_s)
        self.ttft_buckets_s = tuple(float(x) for x in ttft_buckets_s)
        for name, v, ok in (("hold_s", hold_s, hold_s >= 0), ("refit_s", refit_s, refit_s >= 0),
                            ("max_retain_s", max_retain_s, max_retain_s > 0),
                            ("max_open_s", max_open_s, max_open_s >= 0),
                            ("tail_window", tail_window, tail_window >= 1)):  # fmt: skip
            if not (ok and math.isfinite(v)):
                raise ValueError(f"{name}: {v!r} is out of range")
        self.hold_s = hold_s
        self._max_open_s = max_open_s
        self.slo_ms = slo_ms
        self._max_retain_s = max_retain_s
        self._refit_s = refit_s
        self._ttft_partitioner = ttft_partitioner
        self._tail = _Ring(tail_window)
        self._ttft_ring = _Ring(tail_window)
        # the run's clock and vocabularies
        self._t0_tick = 0
        self._spt = 1e-9
        self._hold_ticks = self._retain_ticks = self._refit_ticks = self._max_open_ticks = 0
        self._cause_map: dict[str, str] = dict(DEFAULT_CAUSE_MAP)
        self._labels: list[str] = []
        self._req_ids: list[str] = []
        # retained rows (ticks), see _prune
        cols = {k: len(c) for k, c in TABLES.items()}
        self._segs = np.zeros((0, cols["segments"]), dtype=np.int64)
        self._gcs = np.zeros((0, cols["gc_pauses"]), dtype=np.int64)
        self._events = np.zeros((0, cols["events"]), dtype=np.int64)
        # the loop thread's OS samples (docs/partition.md, "OS evidence"), from the one
        # before the oldest retained tick on (the OS interval that covers it starts there)
        self._os_rows = np.zeros((0, cols["os_samples"]), dtype=np.int64)
        # the TTFT partition's rows (admissions, prefill chunks, waits) of the requests whose
        # TTFT is not settled yet (prefill chunks: of every retained step, a step's token
        # total splits its prefill time)
        self._ttft_rows = {k: np.zeros((0, cols[k]), dtype=np.int64) for k in TTFT_TABLES}
        self._pending = np.zeros((0, cols["emissions"]), dtype=np.int64)  # unsettled emissions
        self._steps = np.zeros((0, cols["steps"]), dtype=np.int64)
        self._step_base = 0  # global index of self._steps[0]
        self._settled_to_tick = -_NO_TICK  # gaps closing at or before this tick are settled
        self._horizon_tick = -_NO_TICK  # rows ending before this tick were dropped
        self._flush_tick = -_NO_TICK
        self._open_tick: int | None = None  # the latest flush's earliest open window
        # per request (by index): its last settled emission (carried into the next window):
        # tick, step, token count, device step
        self._carry_tick = _Grow(np.int64, UNKNOWN_TICK)
        self._carry_step = _Grow(np.int64, -1)
        self._carry_nt = _Grow(np.int64, 0)
        self._carry_dstep = _Grow(np.int64, -1)
        self._tokens = _Grow(np.int64, 0)
        self._max_new = _Grow(np.int64, -1)
        self._prompt = _Grow(np.int64, -1)
        self._arrival_tick = _Grow(np.int64, UNKNOWN_TICK)
        self._first_tick = _Grow(np.int64, _NO_TICK)
        # requests whose arrival is known and TTFT not yet settled; requests with a carried
        # emission not known to be finished (they pin the retained rows)
        self._ttft_open = np.zeros(0, dtype=np.int64)
        self._inflight = np.zeros(0, dtype=np.int64)
        # per step (global index): the graph fit's inputs, and each eager step's weight w_s
        self._st_graph = _Grow(np.int64, -1)
        self._st_ndec = _Grow(np.int64, 0)
        self._st_net = _Grow(np.float64, 0.0)
        self._w = _Grow(np.float64, 0.0)
        self._num_settled_steps = 0
        self._line = _RunningLine()
        self._eager_idx = _Grow(np.int64, 0)  # settled eager steps, in order
        self._num_eager = 0
        self._last_refit_tick = -_NO_TICK
        self._graph_ms = 0.0  # sum_s frac_s * w_s with the fit so far
        self.totals = LiveTotals(
            hist=np.zeros(len(HIST_EDGES_MS) - 1, dtype=np.int64),
            gap_le=np.zeros(len(self.gap_buckets_s) + 1, dtype=np.int64),
            cause_ms=dict.fromkeys(STANDARD_LABELS, 0.0),
            tail_count=dict.fromkeys(
                [lb for lb in STANDARD_LABELS if lb not in ("forward", "residual")] + ["clean"], 0
            ),
            tail_ms=dict.fromkeys(STANDARD_LABELS, 0.0),
            ttft_hist=np.zeros(len(self.ttft_buckets_s) + 1, dtype=np.int64),
        )
        if ttft_partitioner is ttft_by_cause:  # its standard labels, at 0 from the start
            self.totals.ttft_cause_ms = dict.fromkeys(TTFT_STANDARD_LABELS, 0.0)

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

    def _os_series_at_zero(self) -> None:
        """The OS causes' series, at 0 before the first settlement (a run that records OS
        evidence may have them in every partition). A counter series first scraped above 0
        loses that first value to Prometheus' `increase()`, which counts from the first
        sample it sees (it extrapolates towards 0 by at most half a scrape interval)."""
        t = self.totals
        for lb in OS_LABELS:
            t.cause_ms.setdefault(lb, 0.0)
            t.tail_ms.setdefault(lb, 0.0)
            t.tail_count.setdefault(lb, 0)
            if self._ttft_partitioner is ttft_by_cause:
                t.ttft_cause_ms.setdefault(lb, 0.0)

    @property
    def flush_s(self) -> float:
        """The latest flush, engine-clock seconds (NaN: none yet)."""
        if self._flush_tick == -_NO_TICK:
            return math.nan
        return float(self.secs(np.array([self._flush_tick]))[0])

    def secs(self, ticks: np.ndarray) -> np.ndarray:
        """Engine-clock seconds since the run's start, computed as the raw log's merge does."""
        return (ticks - self._t0_tick).astype(np.float64) * self._spt

    def retained(self) -> dict[str, int]:
        """How many rows the settler holds (what bounds its memory)."""
        return {
            "segments": len(self._segs),
            "os_samples": len(self._os_rows),
            "steps": len(self._steps),
            "pending_emissions": len(self._pending),
            "ttft_rows": sum(len(v) for v in self._ttft_rows.values()),
            "inflight": len(self._inflight),
        }

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
        if b.labels is not None:
            self._labels = b.labels
            for lb in b.labels:  # an engine label named like a derived part: its own cause
                cause = cause_of(lb, self._cause_map)
                if cause in DERIVED_CAUSES:
                    self._cause_map[lb] = f"engine_{cause}"
        start = b.request_ids_start if b.request_ids_start is not None else len(self._req_ids)
        self._req_ids[start : start + len(b.request_ids)] = b.request_ids
        n_req = len(self._req_ids)

        # a row that starts before what is settled was open longer than hold_s: late
        late = 0
        for k, start_col in (("segments", "t0_tick"), ("gc_pauses", "t0_tick"),
                             ("emissions", "t_tick"), ("events", "t_tick")):  # fmt: skip
            if k in rows and len(rows[k]):
                col = column_index(k, start_col)
                late += int((rows[k][:, col] < self._settled_to_tick).sum())
        st = rows.get("steps")
        if st is not None and len(st):
            late += int((st[:, _ST["t0_tick"]] < self._settled_to_tick).sum())
            self._steps = np.concatenate([self._steps, st])
        self.totals.late_rows += late
        for k, attr in (("segments", "_segs"), ("gc_pauses", "_gcs"), ("events", "_events"),
                        ("os_samples", "_os_rows")):  # fmt: skip
            if k in rows and len(rows[k]):
                setattr(self, attr, np.concatenate([getattr(self, attr), rows[k]]))
        rq = rows.get("requests")
        if rq is not None and len(rq):
            arr = self._arrival_tick.ensure(n_req)
            req, arrival = rq[:, _RQ["request"]], rq[:, _RQ["arrival_tick"]]
            known = arrival != UNKNOWN_TICK
            fresh = req[known][arr[req[known]] == UNKNOWN_TICK]
            arr[req[known]] = arrival[known]
            self._ttft_open = np.union1d(self._ttft_open, fresh)
            self._max_new.ensure(n_req)[req] = rq[:, _RQ["max_new_tokens"]]
            self._prompt.ensure(n_req)[req] = rq[:, _RQ["prompt_tokens"]]
        for k in TTFT_TABLES:
            if k in rows and len(rows[k]):
                self._ttft_rows[k] = np.concatenate([self._ttft_rows[k], rows[k]])
        em = rows.get("emissions")
        if em is not None and len(em):
            self._pending = np.concatenate([self._pending, em])
            req = em[:, _EM["request"]]
            np.add.at(self._tokens.ensure(n_req), req, em[:, _EM["num_tokens"]])
            np.minimum.at(self._first_tick.ensure(n_req), req, em[:, _EM["t_tick"]])
        if b.flush_tick is not None:
            self._flush_tick = b.flush_tick
            self._open_tick = b.open_tick

    # -- TTFT -------------------------------------------------------------------------------
    def _settle_ttft(self, w_tick: int, out: Settlement) -> None:
        """The requests whose first token came by w_tick (and whose arrival is known): held
        like the gaps, so a TTFT partition sees every window of their wait."""
        n_req = len(self._req_ids)
        first = self._first_tick.ensure(n_req)
        arr = self._arrival_tick.ensure(n_req)
        o = self._ttft_open
        came = (first[o] != _NO_TICK) & (first[o] <= w_tick)
        new = o[came]
        if not len(new):
            return
        self._ttft_open = o[~came]
        # first token - arrival, ms: the offline figure's arithmetic (seconds, then subtract)
        ttft_ms = (self.secs(first[new]) - self.secs(arr[new])) * 1e3
        self._ttft_ring.extend(ttft_ms)
        window = self._ttft_ring.values()
        # bucket i counts the TTFTs <= bound i (in seconds, as a scraper compares them)
        which = np.searchsorted(self.ttft_buckets_s, ttft_ms / 1e3, side="left")
        parts = None
        # a request that waited longer than max_retain_s lost the rows of its wait's start:
        # counted, never partitioned
        whole = new[arr[new] >= self._horizon_tick]
        self.totals.truncated_ttfts += len(new) - len(whole)
        if self._ttft_partitioner is not None and len(whole):
            lo_tick = int(arr[whole].min())  # every row from the earliest of their arrivals on
            win = self._window(self._pending[:0], lo_tick=lo_tick, ttft_requests=whole)[0]
            try:  # a failing TTFT partition costs its causes, never the gaps or the counts
                parts = self._ttft_partitioner(win, whole)
            except Exception as e:
                out.errors.append(e)
        if self._ttft_partitioner is not None:
            self._drop_ttft_rows()
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
        w_tick = _NO_TICK if final else self._flush_tick - self._hold_ticks
        if not final and self._open_tick is not None:
            # a window open at the flush (its row is still to come) holds back every gap
            # it may overlap, for at most `max_open_s`; one open longer arrives late
            w_tick = min(w_tick, max(self._open_tick, self._flush_tick - self._max_open_ticks))
        if w_tick <= self._settled_to_tick:
            return out
        pend = self._pending
        take = pend[:, _EM["t_tick"]] <= w_tick
        new_em = pend[take]
        self._pending = pend[~take]
        steps_done = self._steps_to_settle(w_tick)
        if len(new_em) or steps_done:
            self._settle_window(new_em, w_tick, final, out)
        self._settle_ttft(w_tick, out)
        self._settled_to_tick = w_tick
        if not final:
            self.totals.settled_to_s = float(self.secs(np.array([w_tick]))[0])
        if final:
            self._graph_ms = self._graph_exact()
            self.totals.final = out.is_final = True
        else:
            self._prune(w_tick)
        self._export_graph()
        return out

    def _export_graph(self) -> None:
        t = self.totals
        t.cause_ms["graph"] = self._graph_ms
        t.cause_ms["forward"] = t.decode_ms - self._graph_ms

    def _steps_to_settle(self, w_tick: int) -> int:
        """How many retained steps, from the first unsettled one, ended by w_tick."""
        i = self._num_settled_steps - self._step_base
        ends = self._steps[i:, _ST["t1_tick"]]
        return int(np.searchsorted(np.cumsum(ends > w_tick), 0, side="right")) if len(ends) else 0

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
        req = np.unique(new_em[:, _EM["request"]])
        n = len(self._req_ids)
        c_t = self._carry_tick.ensure(n)[req]
        carried = np.column_stack(
            [
                req,
                c_t,
                self._carry_step.ensure(n)[req],
                self._carry_nt.ensure(n)[req],
                self._carry_dstep.ensure(n)[req],
            ]
        )[c_t != UNKNOWN_TICK]
        em = np.concatenate([carried, new_em]) if len(carried) else new_em
        starts = [int(em[:, _EM["t_tick"]].min())] if len(em) else []
        first_unsettled = self._num_settled_steps - self._step_base
        if first_unsettled < len(self._steps):
            starts.append(int(self._steps[first_unsettled, _ST["t0_tick"]]))
        if lo_tick is None:
            lo_tick = min(starts) if starts else self._settled_to_tick
        if len(em):
            if len(carried):
                self.totals.truncated_gaps += int(
                    (carried[:, _EM["t_tick"]] < self._horizon_tick).sum()
                )
        segs = self._segs[self._segs[:, _SG["t1_tick"]] >= lo_tick]
        gcs = self._gcs[self._gcs[:, _GC["t1_tick"]] >= lo_tick]
        os_rows = self._os_rows[_from_the_sample_before(self._os_rows, lo_tick) :]
        # steps: every one a row refers to (the emitting ones too: a span lists the steps
        # its gap overlaps), from the first unsettled one on
        refs = [segs[:, _SG["step"]], em[:, _EM["step"]], em[:, _EM["device_step"]]]
        tt = self._ttft_rows
        if ttft_requests is not None:
            refs += [tt["prefill_chunks"][:, _PF["step"]], tt["waits"][:, _WT["step"]]]
        ref = np.concatenate(refs)
        ref = ref[ref >= self._step_base]
        step_lo = min(
            int(ref.min()) if len(ref) else self._num_settled_steps, self._num_settled_steps
        )
        step_lo = max(step_lo, self._step_base)
        step_hi = max(int(ref.max()) + 1 if len(ref) else 0, self._step_base + len(self._steps))
        st = np.zeros((step_hi - step_lo, len(TABLES["steps"])), dtype=np.int64)
        st[:, _ST["graph_size"]] = -1  # a step not yet ended: no decode known
        st[:, _ST["t0_tick"]] = st[:, _ST["t1_tick"]] = self._t0_tick
        known = self._steps[step_lo - self._step_base :]
        st[: len(known)] = known

        def rebase(s: np.ndarray) -> np.ndarray:
            return np.where(s >= 0, s - step_lo, s)

        secs = self.secs
        window = RawLog(
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
            evictions=pair_evictions(self._events, secs),
            os_samples=to_table(OsSamples, "os_samples", os_rows, secs),
            # the partition never reads the requests: built only for a TTFT partitioner
            requests=self._requests_table(ttft_requests)
            if ttft_requests is not None
            else Requests.empty(),
            counters=Counters.empty(),
            **(self._ttft_tables(step_lo, step_hi) if ttft_requests is not None else {}),
            labels=tuple(self._labels),
            request_ids=tuple(self._req_ids) if ttft_requests is not None else (),
            cause_map=self._cause_map,
            path="<live window>",
        )
        return window, step_lo, em

    def _ttft_tables(self, step_lo: int, step_hi: int) -> dict[str, Any]:
        """The retained TTFT rows as the window's tables (steps re-based to `step_lo`); a
        request's first admission only (what the raw log keeps)."""
        tt = self._ttft_rows
        ad = tt["admissions"]
        ar, at = _AD["request"], _AD["t_tick"]
        if len(ad):
            ad = ad[np.lexsort((ad[:, at], ad[:, ar]))]
            ad = ad[np.r_[True, ad[1:, ar] != ad[:-1, ar]]]
        pf, wt = tt["prefill_chunks"], tt["waits"]
        pf = pf[(pf[:, _PF["step"]] >= step_lo) & (pf[:, _PF["step"]] < step_hi)]
        wt = wt[(wt[:, _WT["step"]] >= step_lo) & (wt[:, _WT["step"]] < step_hi)]
        return {
            "admissions": to_table(Admissions, "admissions", ad, self.secs),
            "prefill_chunks": replace(
                to_table(PrefillChunks, "prefill_chunks", pf, self.secs),
                step=pf[:, _PF["step"]] - step_lo,
            ),
            "waits": replace(
                to_table(Waits, "waits", wt, self.secs), step=wt[:, _WT["step"]] - step_lo
            ),
        }

    def _drop_ttft_rows(self) -> None:
        """Keep the admissions and waits of the requests whose TTFT is still open and
        whose rows since arrival are all retained."""
        o = self._ttft_open
        o = o[self._arrival_tick.ensure(len(self._req_ids))[o] >= self._horizon_tick]
        for k in ("admissions", "waits"):
            rows = self._ttft_rows[k]
            self._ttft_rows[k] = rows[np.isin(rows[:, column_index(k, "request")], o)]

    def _requests_table(self, which: np.ndarray) -> Requests:
        """Every request so far: arrival (NaN: unknown, or not in `which`) and first token
        (NaN: not yet), prompt, max new tokens."""
        n = len(self._req_ids)
        arr, first = self._arrival_tick.ensure(n)[:n], self._first_tick.ensure(n)[:n]
        arrival_s = np.full(n, np.nan)
        ok = which[arr[which] != UNKNOWN_TICK]
        arrival_s[ok] = self.secs(arr[ok])
        return Requests(
            arrival_s=arrival_s,
            prompt_tokens=self._prompt.ensure(n)[:n].copy(),
            max_new_tokens=self._max_new.ensure(n)[:n].copy(),
            first_token_s=np.where(first != _NO_TICK, self.secs(first), np.nan),
        )

    def _settle_window(self, new_em: np.ndarray, w_tick: int, final: bool, out: Settlement):
        win, step_lo, em = self._window(new_em)
        eager = win.steps.graph_size == GRAPH_EAGER
        # frac = 1 on every eager step: the graph column is then each gap's eager decode
        # time, sum_s w_{g,s}; graph + forward is the gap's decode time whatever the fit
        p = partition(win, excess_frac=eager.astype(np.float64))
        net = p.baseline.decode_net_ms
        n_win = len(win.steps)

        # steps that ended by w_tick: their GC-free decode time is final (rule 4's inputs)
        first = self._num_settled_steps - step_lo
        n_done = n_win - first if final else self._steps_to_settle(w_tick)
        if n_done:
            g = slice(self._num_settled_steps, self._num_settled_steps + n_done)
            hi = self._num_settled_steps + n_done
            self._st_graph.ensure(hi)[g] = win.steps.graph_size[first : first + n_done]
            self._st_ndec.ensure(hi)[g] = win.steps.num_decode[first : first + n_done]
            self._st_net.ensure(hi)[g] = net[first : first + n_done]
            self._line.add(
                win.steps.graph_size[first : first + n_done], net[first : first + n_done]
            )
            eager_done = np.flatnonzero(win.steps.graph_size[first : first + n_done] == 0)
            if len(eager_done):
                k = self._num_eager
                self._eager_idx.ensure(k + len(eager_done))[k : k + len(eager_done)] = (
                    self._num_settled_steps + eager_done
                )
                self._num_eager += len(eager_done)
            self._num_settled_steps = hi

        # each gap's weight w_{g,s} per eager step it touches
        gcol, fcol = p.labels.index("graph"), p.labels.index("forward")
        e_ms = p.parts_ms[:, gcol].copy()
        d_ms = e_ms + p.parts_ms[:, fcol]
        gi, si, wv = self._eager_weights(win, p, eager, e_ms)
        if len(gi):
            np.add.at(self._w.ensure(step_lo + n_win), step_lo + si, wv)

        # each gap's graph under the running line (this window's decode times)
        frac_win = self._line.excess_frac(win.steps.graph_size, win.steps.num_decode, net)
        g_est = np.zeros(len(p))
        np.add.at(g_est, gi, frac_win[si] * wv)
        # the run's graph total: exact at close (design.md's fit over every captured step);
        # meanwhile the new gaps' estimates are added, and every `refit_s` of engine clock
        # the whole total is re-evaluated under the line so far
        if w_tick - self._last_refit_tick >= self._refit_ticks:
            graph_ms = self._graph_running()
            self._last_refit_tick = w_tick
        else:
            graph_ms = self._graph_ms + float(g_est.sum())
        parts = p.parts_ms.copy()
        parts[:, gcol] = g_est
        parts[:, fcol] = d_ms - g_est
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
        self._graph_ms = graph_ms
        t.fit_steps = self._line.n
        for nm in names[tail].tolist():
            t.tail_count[nm] = t.tail_count.get(nm, 0) + 1
        if len(p):
            t.itl_window_p99_ms = p99
        out.num_gaps += len(p)
        if self.slo_ms is not None and len(p):
            sel = np.flatnonzero(p.gap_ms >= self.slo_ms)
            out.slow_gaps += self._slow_gaps(win, p, parts, names, step_lo, sel)

        # carry each request's last settled emission into the next window
        if len(new_em):
            o = np.lexsort((new_em[:, _EM["t_tick"]], new_em[:, _EM["request"]]))
            req = new_em[o, _EM["request"]]
            last = o[np.r_[req[1:] != req[:-1], True]]
            r = new_em[last, _EM["request"]]
            n = int(r.max()) + 1
            self._carry_tick.ensure(n)[r] = new_em[last, _EM["t_tick"]]
            self._carry_step.ensure(n)[r] = new_em[last, _EM["step"]]
            self._carry_nt.ensure(n)[r] = new_em[last, _EM["num_tokens"]]
            self._carry_dstep.ensure(n)[r] = new_em[last, _EM["device_step"]]
            self._inflight = np.union1d(self._inflight, r)

    def _eager_weights(self, win: RawLog, p: Any, eager: np.ndarray, e_ms: np.ndarray):
        """(gap, window step, w) for every gap's eager decode time, per eager step.

        A gap touched by one eager step's decode windows owns ``e_ms`` of it; a gap touched
        by several is partitioned again once per such step with only that step's fraction
        at 1 (rare: a gap spanning several eager steps)."""
        sg = win.segments
        if not len(p) or not eager.any() or not len(sg):
            z = np.zeros(0, dtype=np.int64)
            return z, z, np.zeros(0)
        causes = np.array(
            [cause_of(lb, self._cause_map) for lb in win.labels] or [""], dtype=object
        )
        dec = np.flatnonzero(
            (causes[sg.label] == "decode") & (sg.step >= 0) & eager[np.maximum(sg.step, 0)]
        )
        if not len(dec):
            z = np.zeros(0, dtype=np.int64)
            return z, z, np.zeros(0)
        # touching: the decode window overlaps the gap's open interval
        hit_g, hit_s = [], []
        for j in dec.tolist():
            g = np.flatnonzero((p.t0_s < sg.t_end_s[j]) & (p.t1_s > sg.t_start_s[j]))
            hit_g.append(g)
            hit_s.append(np.full(len(g), sg.step[j]))
        pairs = np.unique(np.column_stack([np.concatenate(hit_g), np.concatenate(hit_s)]), axis=0)
        gi, si = pairs[:, 0], pairs[:, 1]
        per_gap = np.bincount(gi, minlength=len(p))
        one = per_gap[gi] == 1
        w = np.where(one, e_ms[gi], 0.0)
        multi = np.flatnonzero(~one)
        for s in np.unique(si[multi]).tolist():
            frac = np.zeros(len(win.steps))
            frac[s] = 1.0
            col = partition(win, excess_frac=frac, check=False).column("graph")
            k = multi[si[multi] == s]
            w[k] = col[gi[k]]
        return gi, si, w

    def _graph_running(self) -> float:
        """sum_s frac_s * w_s over the settled eager steps, under the running line."""
        idx = self._eager_idx.a[: self._num_eager]
        frac = self._line.excess_frac(
            np.zeros(len(idx), dtype=np.int64), self._st_ndec.a[idx], self._st_net.a[idx]
        )
        return float(np.dot(frac, self._w.a[idx]))

    def _graph_exact(self) -> float:
        """sum_s frac_s * w_s with `tracekit.attribution.itl.fit_baseline` over every step of the
        run (design.md rule 4, the offline fit itself): the exact graph total."""
        n = self._num_settled_steps
        stub = RawLog(
            steps=Steps.from_columns(
                t_start_s=np.zeros(n),
                t_end_s=np.zeros(n),
                num_decode=self._st_ndec.ensure(n)[:n],
                num_prefill_tokens=np.zeros(n),
                graph_size=self._st_graph.ensure(n)[:n],
                num_preempted=np.zeros(n),
                num_swapped_in=np.zeros(n),
            ),
            segments=Segments.empty(),
            gc_pauses=GcPauses.empty(),
            emissions=Emissions.empty(),
            evictions=Evictions.empty(),
            requests=Requests.empty(),
        )
        base = fit_baseline(stub, self._st_net.ensure(n)[:n])
        return float(np.dot(base.eager_excess_frac, self._w.ensure(n)[:n]))

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
                    request_id=self._req_ids[r],
                    gap_ms=float(p.gap_ms[i]),
                    t0_s=t0,
                    t1_s=t1,
                    step0=int(p.step0[i]),
                    step1=int(p.step1[i]),
                    steps=hit.tolist(),
                    num_steps=n_hit,
                    primary_cause=str(names[i]),
                    parts_ms=dict(zip(p.labels, parts[i].tolist(), strict=True)),
                    graph_fit_steps=self._line.n,
                )
            )
        return out

    # -- retention --------------------------------------------------------------------------------
    def _prune(self, w_tick: int) -> None:
        """Drop the rows no future gap (or unsettled step) can overlap."""
        n_req = len(self._req_ids)
        carry = self._carry_tick.ensure(n_req)
        inf = self._inflight
        max_new = self._max_new.ensure(n_req)[inf]
        done = (max_new > 0) & (self._tokens.ensure(n_req)[inf] >= max_new)
        inf = self._inflight = inf[~done & (carry[inf] >= w_tick - self._retain_ticks)]
        # and a request with emissions still to settle needs the rows from its carried one
        pend = np.unique(self._pending[:, _EM["request"]])
        live = np.union1d(inf, pend[carry[pend] != UNKNOWN_TICK])
        bounds = [w_tick]
        if len(live):
            bounds.append(int(carry[live].min()))
        if len(self._pending):
            bounds.append(int(self._pending[:, _EM["t_tick"]].min()))
        i = self._num_settled_steps - self._step_base
        if i < len(self._steps):
            bounds.append(int(self._steps[i, _ST["t0_tick"]]))
        if self._ttft_partitioner is not None and len(self._ttft_open):
            # the requests waiting for a first token pin the rows from their arrival on,
            # for at most max_retain_s (an aborted request never gets one)
            a = self._arrival_tick.ensure(n_req)[self._ttft_open]
            a = a[a >= w_tick - self._retain_ticks]
            if len(a):
                bounds.append(int(a.min()))
        h_tick = min(bounds)
        if h_tick <= self._horizon_tick:
            return
        self._horizon_tick = h_tick
        self._segs = self._segs[self._segs[:, _SG["t1_tick"]] >= h_tick]
        self._gcs = self._gcs[self._gcs[:, _GC["t1_tick"]] >= h_tick]
        self._os_rows = self._os_rows[_from_the_sample_before(self._os_rows, h_tick) :]
        self._events = _drop_closed_evictions(self._events, h_tick)
        # steps: keep every one a retained row or a live carry may still name
        keep = [self._num_settled_steps]
        s = self._segs[:, _SG["step"]]
        if len(s[s >= 0]):
            keep.append(int(s[s >= 0].min()))
        for a in (self._carry_step.ensure(n_req)[live], self._carry_dstep.ensure(n_req)[live]):
            if len(a[a >= 0]):
                keep.append(int(a[a >= 0].min()))
        for col in ("step", "device_step"):
            a = self._pending[:, _EM[col]]
            if len(a[a >= 0]):
                keep.append(int(a[a >= 0].min()))
        # and every step an open TTFT's rows name (a prefill chunk of another request in
        # such a step: its token total splits the step's prefill time)
        pf, wt = self._ttft_rows["prefill_chunks"], self._ttft_rows["waits"]
        pf_step = pf[:, _PF["step"]]
        for a in (pf_step[np.isin(pf[:, _PF["request"]], self._ttft_open)], wt[:, _WT["step"]]):
            if len(a):
                keep.append(int(a.min()))
        first = max(self._step_base, min(keep))
        self._steps = self._steps[first - self._step_base :]
        self._step_base = first
        self._ttft_rows["prefill_chunks"] = pf[pf_step >= first]


def _rise(v: float) -> float:
    """What a settlement adds to a counter: its sum, or 0 where float rounding left it
    below 0 (a label that is 0 in every gap can sum to -1e-15 ms). A counter that went down
    by even that much reads as a reset to Prometheus, and `increase()` would double it."""
    return v if v > 0.0 else 0.0


def _from_the_sample_before(os_rows: np.ndarray, tick: int) -> int:
    """The first OS sample a window from `tick` needs: each thread's last one at or before
    it (the OS interval that covers `tick` starts there), the earliest of those, else the
    first one. Samples are kept in the order they were recorded: each thread's are in time
    order (the loop thread's at its steps, another thread's at its segments)."""
    t, th = os_rows[:, _OS["t_tick"]], os_rows[:, _OS["thread"]]
    first = len(os_rows)
    for x in np.unique(th).tolist():
        before = np.flatnonzero((th == x) & (t <= tick))
        if len(before):
            first = min(first, int(before[-1]))
    return first if first < len(os_rows) else 0


def _drop_closed_evictions(ev: np.ndarray, horizon: int) -> np.ndarray:
    """Event rows without the eviction/readmission pairs that ended before `horizon`."""
    if not len(ev):
        return ev
    req, kinds, ts = (ev[:, _EV[c]] for c in ("request", "kind", "t_tick"))
    order = np.lexsort((np.arange(len(ev)), ts, req))
    drop = np.zeros(len(ev), dtype=bool)
    open_at: dict[int, int] = {}
    for i in order.tolist():  # per eviction event: a few per second at most
        r, kind, t = int(req[i]), int(kinds[i]), int(ts[i])
        if kind == EVICT:
            open_at[r] = i
        elif r in open_at:
            j = open_at.pop(r)
            if t < horizon:
                drop[i] = drop[j] = True
        elif t < horizon:
            drop[i] = True  # a readmission without its eviction: it pairs with nothing
    return ev[~drop]
