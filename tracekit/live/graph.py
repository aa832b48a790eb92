"""The settler's graph refit (`tracekit.live.settler`, "graph and forward"): the graph
baseline (design.md rule 4) fitted as steps settle, and the run's graph total
``sum_s frac_s * w_s`` evaluated under it (`GraphRefit`); the per-gap weights ``w_s``
(`eager_weights`). The inputs live in `tracekit.live.steps.StepState`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tracekit.attribution.itl import fit_baseline, partition
from tracekit.labels import cause_of
from tracekit.live.buffers import NO_TICK
from tracekit.live.steps import StepState
from tracekit.log.rawlog import (
    GRAPH_EAGER,
    Emissions,
    Evictions,
    GcPauses,
    RawLog,
    Requests,
    Segments,
    Steps,
)


class RunningLine:
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


class GraphRefit:
    """The run's graph total over the settled gaps, ``sum_s frac_s * w_s``: while the run
    goes, the new gaps' estimates are added and every `refit_s` of engine clock the whole
    sum is re-evaluated under the line fitted so far; at the close, once with the offline
    fit over every step (exact).

    graph_ms: the total so far (what the settler exports as ``graph``).
    """

    def __init__(self, steps: StepState) -> None:
        self._steps = steps
        self._line = RunningLine()
        self._last_refit_tick = -NO_TICK
        self.graph_ms = 0.0  # sum_s frac_s * w_s with the fit so far

    @property
    def fit_steps(self) -> int:
        """How many steps the running line is fitted over."""
        return self._line.n

    def add_steps(self, graph_size: np.ndarray, num_decode: np.ndarray, net_ms: np.ndarray):
        """The next settled steps (their decode time is final): the fit's new inputs."""
        self._steps.settle(graph_size, num_decode, net_ms)
        self._line.add(graph_size, net_ms)

    def excess_frac(self, graph_size: np.ndarray, num_decode: np.ndarray, net_ms: np.ndarray):
        """Each eager step's fraction of decode time over the line so far (0 for others)."""
        return self._line.excess_frac(graph_size, num_decode, net_ms)

    def total_with(self, w_tick: int, added_ms: float, every_ticks: int) -> float:
        """The total once the gaps settled by `w_tick` add `added_ms` under the line so far:
        re-evaluated over every eager step when `every_ticks` passed since the last refit."""
        if w_tick - self._last_refit_tick >= every_ticks:
            graph_ms = self.running_total()
            self._last_refit_tick = w_tick
            return graph_ms
        return self.graph_ms + added_ms

    def running_total(self) -> float:
        """sum_s frac_s * w_s over the settled eager steps, under the running line."""
        num_decode, net_ms, w = self._steps.eager()
        frac = self._line.excess_frac(np.zeros(len(w), dtype=np.int64), num_decode, net_ms)
        return float(np.dot(frac, w))

    def exact_total(self) -> float:
        """sum_s frac_s * w_s with `tracekit.attribution.itl.fit_baseline` over every step of the
        run (design.md rule 4, the offline fit itself): the exact graph total."""
        graph_size, num_decode, net_ms, w = self._steps.settled()
        n = len(graph_size)
        stub = RawLog(
            steps=Steps.from_columns(
                t_start_s=np.zeros(n),
                t_end_s=np.zeros(n),
                num_decode=num_decode,
                num_prefill_tokens=np.zeros(n),
                graph_size=graph_size,
                num_preempted=np.zeros(n),
                num_swapped_in=np.zeros(n),
            ),
            segments=Segments.empty(),
            gc_pauses=GcPauses.empty(),
            emissions=Emissions.empty(),
            evictions=Evictions.empty(),
            requests=Requests.empty(),
        )
        base = fit_baseline(stub, net_ms)
        return float(np.dot(base.eager_excess_frac, w))


def eager_weights(
    win: RawLog, p: Any, eager: np.ndarray, e_ms: np.ndarray, cause_map: dict[str, str]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gap, window step, w) for every gap's eager decode time, per eager step.

    A gap touched by one eager step's decode windows owns ``e_ms`` of it; a gap touched
    by several is partitioned again once per such step with only that step's fraction
    at 1 (rare: a gap spanning several eager steps)."""
    sg = win.segments
    if not len(p) or not eager.any() or not len(sg):
        z = np.zeros(0, dtype=np.int64)
        return z, z, np.zeros(0)
    causes = np.array([cause_of(lb, cause_map) for lb in win.labels] or [""], dtype=object)
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
