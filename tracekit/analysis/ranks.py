"""Tensor parallel: which rank held each slow step (docs/adapters.md, "Tensor parallel").

A merged tensor-parallel run carries, in the engine core's steps, segments labelled
``rankR:CAUSE`` (`tracekit.attribution.tp.carve_tp_waits`): time the step waited on rank
R, late at a collective, by what R was doing meanwhile. From them, per run:

- a step's *wait on rank R*: the summed length of its ``rankR:*`` segments;
- the step's *holder*: the rank with the most wait in it (a tie goes to the lower rank); a
  step with no wait on any rank has no holder;
- the *slow steps*: the steps that closed a tail gap, a gap at or above the run's p99 ITL
  (the report's tail): the step of the gap's closing emission (`Partition.step1`);
- per rank: the slow steps it held, the wait charged to it in the slow steps (and over the
  whole run), and its top cause in the slow steps (the ``CAUSE`` with the most of that
  wait).

Pure: a log and its partition in, a `RankView` out; renderers draw it.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import numpy as np

from tracekit.attribution.itl import Partition
from tracekit.formats import json_safe
from tracekit.log.rawlog import RawLog

#: A label of time a step waited on a tensor-parallel rank
#: (`tracekit.attribution.tp.tp_label`).
RANK_LABEL = re.compile(r"^rank(\d+):(.+)$")


@dataclass(frozen=True)
class RankRow:
    """One rank's share of the slow steps."""

    rank: int
    slow_steps_held: int  # slow steps where this rank had the most wait
    charged_slow_ms: float  # its wait in the slow steps (held by it or not)
    charged_run_ms: float  # its wait in every step of the run
    top_cause: str | None  # the cause with the most of `charged_slow_ms` (None: no wait)
    top_cause_ms: float


@dataclass(frozen=True)
class SlowStep:
    """One slow step: its wait on each rank and who held it."""

    step: int
    t_start_s: float
    dur_ms: float
    holder: int | None  # the rank with the most wait (None: no rank wait in the step)
    holder_cause: str | None  # the holder's largest cause in this step
    wait_ms: dict[str, float]  # rank (as text, for JSON) -> wait on it in this step


@dataclass(frozen=True)
class RankView:
    """`rank_view`'s result."""

    ranks: list[RankRow]
    slow_steps: list[SlowStep]  # in step order
    itl_p99_ms: float  # the tail threshold the slow steps come from

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: non-finite numbers become None."""
        return json_safe(asdict(self))


def rank_labels(labels: tuple[str, ...] | list[str]) -> dict[int, tuple[int, str]]:
    """Label index -> (rank, cause) for every ``rankR:CAUSE`` label."""
    out: dict[int, tuple[int, str]] = {}
    for i, lb in enumerate(labels):
        m = RANK_LABEL.match(lb)
        if m:
            out[i] = (int(m.group(1)), m.group(2))
    return out


def step_rank_waits(log: RawLog) -> dict[int, dict[int, dict[str, float]]]:
    """Step -> rank -> cause -> wait (ms), from the step's ``rankR:CAUSE`` segments."""
    which = rank_labels(log.labels)
    out: dict[int, dict[int, dict[str, float]]] = {}
    if not which:
        return out
    sg = log.segments
    mine = np.isin(sg.label, np.fromiter(which, dtype=np.int64)) & (sg.step >= 0)
    dur_ms = (sg.t_end_s[mine] - sg.t_start_s[mine]) * 1e3
    for lab, step, d in zip(sg.label[mine].tolist(), sg.step[mine].tolist(), dur_ms.tolist(),
                            strict=True):  # fmt: skip
        rank, cause = which[lab]
        causes = out.setdefault(step, {}).setdefault(rank, {})
        causes[cause] = causes.get(cause, 0.0) + d
    return out


def _holder(waits: dict[int, dict[str, float]]) -> int | None:
    """The rank with the most wait (a tie: the lower rank); None without any wait."""
    best: tuple[float, int] | None = None
    for rank in sorted(waits):
        total = sum(waits[rank].values())
        if total > 0 and (best is None or total > best[0]):
            best = (total, rank)
    return None if best is None else best[1]


def _top(causes: dict[str, float]) -> tuple[str | None, float]:
    """The largest cause (a tie: the first by name) and its time."""
    if not causes or max(causes.values()) <= 0:
        return None, 0.0
    name = min(causes, key=lambda c: (-causes[c], c))
    return name, causes[name]


def rank_view(log: RawLog, part: Partition) -> RankView | None:
    """Which rank held each slow step of a tensor-parallel run (module doc); None for a
    run without ``rankR:CAUSE`` labels."""
    if not rank_labels(log.labels):
        return None
    waits = step_rank_waits(log)
    ranks = sorted({r for w in waits.values() for r in w} |
                   {r for r, _ in rank_labels(log.labels).values()})  # fmt: skip
    gap = part.gap_ms
    p99 = float(np.percentile(gap, 99.0)) if len(gap) else math.nan
    slow = sorted({int(s) for s in part.step1[gap >= p99].tolist()}) if len(gap) else []
    st = log.steps
    slow = [s for s in slow if 0 <= s < len(st)]
    steps: list[SlowStep] = []
    held = dict.fromkeys(ranks, 0)
    slow_causes: dict[int, dict[str, float]] = {r: {} for r in ranks}
    for s in slow:
        w = waits.get(s, {})
        h = _holder(w)
        if h is not None:
            held[h] += 1
        for r, causes in w.items():
            for c, ms in causes.items():
                slow_causes[r][c] = slow_causes[r].get(c, 0.0) + ms
        steps.append(
            SlowStep(
                step=s,
                t_start_s=float(st.t_start_s[s]),
                dur_ms=float((st.t_end_s[s] - st.t_start_s[s]) * 1e3),
                holder=h,
                holder_cause=_top(w[h])[0] if h is not None else None,
                wait_ms={str(r): sum(w[r].values()) for r in sorted(w)},
            )
        )
    run_total = dict.fromkeys(ranks, 0.0)
    for w in waits.values():
        for r, causes in w.items():
            run_total[r] += sum(causes.values())
    rows = []
    for r in ranks:
        top, top_ms = _top(slow_causes[r])
        rows.append(
            RankRow(
                rank=r,
                slow_steps_held=held[r],
                charged_slow_ms=sum(slow_causes[r].values()),
                charged_run_ms=run_total[r],
                top_cause=top,
                top_cause_ms=top_ms,
            )
        )
    return RankView(ranks=rows, slow_steps=steps, itl_p99_ms=p99)


__all__ = ["RANK_LABEL", "RankRow", "RankView", "SlowStep", "rank_labels", "rank_view",
           "step_rank_waits"]  # fmt: skip
