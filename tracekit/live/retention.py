"""The settler's retention (`tracekit.live.settler`): the flushed rows that unsettled gaps
and TTFTs may still need, and what is dropped as time settles.

The retained rows span the oldest in-flight request's last emission (`tracekit.live.requests`
says which requests are in flight), the emissions still to settle, the first unsettled step
and, while a TTFT partitioner runs, the arrival of every request waiting for its first
token (for at most ``max_retain_s``). Steps are kept from the first one a retained row or a
carried emission names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tracekit.live.buffers import NO_TICK
from tracekit.live.requests import RequestState
from tracekit.log.flush import EVICT, READMIT, TABLES, column_index, to_table
from tracekit.log.rawlog import Admissions, Evictions, PrefillChunks, Waits

#: The tables only the TTFT partition reads.
TTFT_TABLES = ("admissions", "prefill_chunks", "waits")

# column positions in the retained rows: the flush's layout (`tracekit.log.flush.TABLES`),
# by name
_ST = {c: i for i, c in enumerate(TABLES["steps"])}
_SG = {c: i for i, c in enumerate(TABLES["segments"])}
_GC = {c: i for i, c in enumerate(TABLES["gc_pauses"])}
_EM = {c: i for i, c in enumerate(TABLES["emissions"])}
_EV = {c: i for i, c in enumerate(TABLES["events"])}
_AD = {c: i for i, c in enumerate(TABLES["admissions"])}
_PF = {c: i for i, c in enumerate(TABLES["prefill_chunks"])}
_WT = {c: i for i, c in enumerate(TABLES["waits"])}
_OS = {c: i for i, c in enumerate(TABLES["os_samples"])}


class Retention:
    """The retained rows (ticks), in the flush's layouts. Only its methods change them.

    segments, gc_pauses, events: every row that ends at or after `horizon_tick`.
    os_samples: the loop thread's OS samples (docs/partition.md, "OS evidence"), from the
    one before the oldest retained tick on (the OS interval that covers it starts there).
    ttft_rows: the TTFT partition's rows (admissions, prefill chunks, waits) of the
    requests whose TTFT is not settled yet (prefill chunks: of every retained step, a
    step's token total splits its prefill time). pending: the emissions not yet settled.
    steps: the retained steps, the first being the run's step `step_base`.
    next_emission: per retained readmission (request, tick), the request's first emission
    after it (None: none yet), whatever emissions a window holds: which victims are still
    re-prefilling in a step (docs/live.md) needs it.
    """

    def __init__(self) -> None:
        cols = {k: len(c) for k, c in TABLES.items()}
        self.segments = np.zeros((0, cols["segments"]), dtype=np.int64)
        self.gc_pauses = np.zeros((0, cols["gc_pauses"]), dtype=np.int64)
        self.events = np.zeros((0, cols["events"]), dtype=np.int64)
        self.os_samples = np.zeros((0, cols["os_samples"]), dtype=np.int64)
        self.ttft_rows = {k: np.zeros((0, cols[k]), dtype=np.int64) for k in TTFT_TABLES}
        self.pending = np.zeros((0, cols["emissions"]), dtype=np.int64)
        self.steps = np.zeros((0, cols["steps"]), dtype=np.int64)
        self.step_base = 0  # global index of self.steps[0]
        self.horizon_tick = -NO_TICK  # rows ending before this tick were dropped
        self.next_emission: dict[tuple[int, int], int | None] = {}

    def counts(self) -> dict[str, int]:
        """How many rows are retained (what bounds the settler's memory)."""
        return {
            "segments": len(self.segments),
            "os_samples": len(self.os_samples),
            "steps": len(self.steps),
            "pending_emissions": len(self.pending),
            "ttft_rows": sum(len(v) for v in self.ttft_rows.values()),
        }

    def append(self, rows: Mapping[str, np.ndarray]) -> None:
        """A flush's rows (table name -> rows), appended to what is retained."""
        st = rows.get("steps")
        if st is not None and len(st):
            self.steps = np.concatenate([self.steps, st])
        for k in ("segments", "gc_pauses", "events", "os_samples"):
            if k in rows and len(rows[k]):
                setattr(self, k, np.concatenate([getattr(self, k), rows[k]]))
        for k in TTFT_TABLES:
            if k in rows and len(rows[k]):
                self.ttft_rows[k] = np.concatenate([self.ttft_rows[k], rows[k]])
        em = rows.get("emissions")
        if em is not None and len(em):
            self.pending = np.concatenate([self.pending, em])
        self._note_next_emissions(rows.get("events"), em)

    def _note_next_emissions(self, ev: np.ndarray | None, em: np.ndarray | None) -> None:
        """Each readmission of `ev`, then each still without one its first emission of `em`
        (a readmission is flushed no later than an emission after it)."""
        if ev is not None and len(ev):
            back = ev[ev[:, _EV["kind"]] == READMIT]
            for r, t in zip(back[:, _EV["request"]].tolist(), back[:, _EV["t_tick"]].tolist(),
                            strict=True):  # fmt: skip
                self.next_emission.setdefault((r, t), None)
        if em is None or not len(em):
            return
        for key in [k for k, v in self.next_emission.items() if v is None]:
            mine = em[(em[:, _EM["request"]] == key[0]) & (em[:, _EM["t_tick"]] > key[1])]
            if len(mine):
                self.next_emission[key] = int(mine[:, _EM["t_tick"]].min())

    def next_emissions_s(self, ev: Evictions, secs: Callable[[np.ndarray], Any]) -> list:
        """Per row of `ev` (paired from the retained events), its victim's first emission
        after its readmission in seconds (None: not readmitted, or no emission yet)."""
        known = {}
        for (r, t), nxt in self.next_emission.items():
            if nxt is not None:
                a, b = secs(np.array([t, nxt], dtype=np.int64)).tolist()
                known[(r, a)] = b
        return [known.get((r, t)) for r, t in zip(ev.request.tolist(), ev.t_readmit_s.tolist(),
                                                  strict=True)]  # fmt: skip

    def take_pending(self, w_tick: int) -> np.ndarray:
        """The pending emissions at or before `w_tick`, no longer pending."""
        pend = self.pending
        take = pend[:, _EM["t_tick"]] <= w_tick
        self.pending = pend[~take]
        return pend[take]

    # -- the steps ----------------------------------------------------------------------------
    def steps_ended_by(self, num_settled: int, w_tick: int) -> int:
        """How many retained steps, from the first unsettled one (`num_settled`, a global
        index), ended by w_tick."""
        i = num_settled - self.step_base
        ends = self.steps[i:, _ST["t1_tick"]]
        return int(np.searchsorted(np.cumsum(ends > w_tick), 0, side="right")) if len(ends) else 0

    def step_start(self, step: int) -> int | None:
        """When the run's step `step` started, if it is retained and ended."""
        i = step - self.step_base
        return int(self.steps[i, _ST["t0_tick"]]) if i < len(self.steps) else None

    def steps_block(self, step_lo: int, step_hi: int, t0_tick: int) -> np.ndarray:
        """Step rows for the run's steps [step_lo, step_hi): the retained ones, then a row
        for each step not yet ended (no decode known, at `t0_tick`)."""
        st = np.zeros((step_hi - step_lo, len(TABLES["steps"])), dtype=np.int64)
        st[:, _ST["graph_size"]] = -1  # a step not yet ended: no decode known
        st[:, _ST["t0_tick"]] = st[:, _ST["t1_tick"]] = t0_tick
        known = self.steps[step_lo - self.step_base :]
        st[: len(known)] = known
        return st

    # -- a window's rows --------------------------------------------------------------------------
    def rows_from(self, lo_tick: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The segments and GC pauses ending at or after `lo_tick`, and the OS samples a
        window from `lo_tick` needs."""
        segs = self.segments[self.segments[:, _SG["t1_tick"]] >= lo_tick]
        gcs = self.gc_pauses[self.gc_pauses[:, _GC["t1_tick"]] >= lo_tick]
        os_rows = self.os_samples[_from_the_sample_before(self.os_samples, lo_tick) :]
        return segs, gcs, os_rows

    def ttft_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """The steps the retained prefill chunks and waits name."""
        return self.ttft_rows["prefill_chunks"][:, _PF["step"]], self.ttft_rows["waits"][
            :, _WT["step"]
        ]

    def ttft_tables(
        self, step_lo: int, step_hi: int, secs: Callable[[np.ndarray], Any]
    ) -> dict[str, Any]:
        """The retained TTFT rows as a window's tables (steps re-based to `step_lo`); a
        request's first admission only (what the raw log keeps)."""
        tt = self.ttft_rows
        ad = tt["admissions"]
        ar, at = _AD["request"], _AD["t_tick"]
        if len(ad):
            ad = ad[np.lexsort((ad[:, at], ad[:, ar]))]
            ad = ad[np.r_[True, ad[1:, ar] != ad[:-1, ar]]]
        pf, wt = tt["prefill_chunks"], tt["waits"]
        pf = pf[(pf[:, _PF["step"]] >= step_lo) & (pf[:, _PF["step"]] < step_hi)]
        wt = wt[(wt[:, _WT["step"]] >= step_lo) & (wt[:, _WT["step"]] < step_hi)]
        return {
            "admissions": to_table(Admissions, "admissions", ad, secs),
            "prefill_chunks": replace(
                to_table(PrefillChunks, "prefill_chunks", pf, secs),
                step=pf[:, _PF["step"]] - step_lo,
            ),
            "waits": replace(to_table(Waits, "waits", wt, secs), step=wt[:, _WT["step"]] - step_lo),
        }

    def keep_ttft_rows_of(self, requests: np.ndarray) -> None:
        """Keep only `requests`' admissions and waits."""
        for k in ("admissions", "waits"):
            rows = self.ttft_rows[k]
            self.ttft_rows[k] = rows[np.isin(rows[:, column_index(k, "request")], requests)]

    # -- dropping ------------------------------------------------------------------------------
    def prune(
        self,
        w_tick: int,
        requests: RequestState,
        *,
        num_settled: int,
        retain_ticks: int,
        pin_ttfts: bool,
    ) -> None:
        """Drop the rows no future gap (or unsettled step) can overlap, once every gap
        closing by `w_tick` is settled. `num_settled`: the settled steps; `retain_ticks`:
        how long a quiet request (or a TTFT wait, with `pin_ttfts`) pins the rows."""
        # a request with emissions still to settle needs the rows from its carried one
        pend = np.unique(self.pending[:, _EM["request"]])
        live = requests.pinning(w_tick - retain_ticks, pend)
        bounds = [w_tick]
        if len(live):
            bounds.append(int(requests.carry_tick_of(live).min()))
        if len(self.pending):
            bounds.append(int(self.pending[:, _EM["t_tick"]].min()))
        start = self.step_start(num_settled)
        if start is not None:
            bounds.append(start)
        if pin_ttfts and len(requests.ttft_open):
            # the requests waiting for a first token pin the rows from their arrival on,
            # for at most max_retain_s (an aborted request never gets one)
            a = requests.arrival_tick_of(requests.ttft_open)
            a = a[a >= w_tick - retain_ticks]
            if len(a):
                bounds.append(int(a.min()))
        h_tick = min(bounds)
        if h_tick <= self.horizon_tick:
            return
        self.horizon_tick = h_tick
        self.segments = self.segments[self.segments[:, _SG["t1_tick"]] >= h_tick]
        self.gc_pauses = self.gc_pauses[self.gc_pauses[:, _GC["t1_tick"]] >= h_tick]
        self.os_samples = self.os_samples[_from_the_sample_before(self.os_samples, h_tick) :]
        self.events = _drop_closed_evictions(self.events, h_tick)
        self.next_emission = {k: v for k, v in self.next_emission.items() if k[1] >= h_tick}
        self._drop_steps(requests, live, num_settled)

    def _drop_steps(self, requests: RequestState, live: np.ndarray, num_settled: int) -> None:
        """Keep every step a retained row or a live carry may still name."""
        keep = [num_settled]
        s = self.segments[:, _SG["step"]]
        if len(s[s >= 0]):
            keep.append(int(s[s >= 0].min()))
        for a in requests.carried_steps(live):
            if len(a[a >= 0]):
                keep.append(int(a[a >= 0].min()))
        for col in ("step", "device_step"):
            a = self.pending[:, _EM[col]]
            if len(a[a >= 0]):
                keep.append(int(a[a >= 0].min()))
        # and every step an open TTFT's rows name (a prefill chunk of another request in
        # such a step: its token total splits the step's prefill time)
        pf, wt = self.ttft_rows["prefill_chunks"], self.ttft_rows["waits"]
        pf_step = pf[:, _PF["step"]]
        for a in (pf_step[np.isin(pf[:, _PF["request"]], requests.ttft_open)], wt[:, _WT["step"]]):
            if len(a):
                keep.append(int(a.min()))
        first = max(self.step_base, min(keep))
        self.steps = self.steps[first - self.step_base :]
        self.step_base = first
        self.ttft_rows["prefill_chunks"] = pf[pf_step >= first]


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
