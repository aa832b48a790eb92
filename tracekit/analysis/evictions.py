"""Who evicted whom, per run: evictions by reason, the recompute tax, the debt each
eviction charged its victim, the requests whose need cost others most, and thrash
(docs/partition.md, "Who evicted whom"; docs/ttft.md, "Eviction debt").

Pure: a `RawLog` in, an `EvictionSummary` out (None for a run without evictions).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.attribution.evictions import EvictionCauses, eviction_causes
from tracekit.labels import RECOMPUTE_LABEL  # a re-prefill's segment: the tax's time
from tracekit.log.rawlog import MODE_RECOMPUTE, PREEMPT_REASONS, RawLog

#: How many evictors, thrashed requests and evictions a summary lists (largest first).
TOP = 10
#: What `by_reason` calls an eviction whose cause the engine did not tell.
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class EvictionRow:
    """One eviction: victim, the step that decided it (None: not told), reason, evictors
    (request ids), computed tokens lost (-1: not told), free/used KV blocks (-1), evicted
    time (eviction to readmission; NaN: never readmitted) and resume time (readmission to
    the victim's next emission; NaN: none): its debt is their sum."""

    victim: str
    t_evict_s: float
    step: int | None
    reason: str
    evictors: tuple[str, ...]
    num_computed_tokens_lost: int
    num_free_blocks: int
    num_used_blocks: int
    evicted_ms: float
    resume_ms: float

    @property
    def debt_ms(self) -> float:
        return self.evicted_ms + self.resume_ms

    def to_record(self) -> dict[str, Any]:
        return {
            "victim": self.victim, "t_evict_s": self.t_evict_s, "step": self.step,
            "reason": self.reason, "evictors": list(self.evictors),
            "num_computed_tokens_lost": self.num_computed_tokens_lost,
            "num_free_blocks": self.num_free_blocks, "num_used_blocks": self.num_used_blocks,
            "evicted_ms": self.evicted_ms, "resume_ms": self.resume_ms, "debt_ms": self.debt_ms,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class EvictionSummary:
    """A run's evictions. `recompute_tax`: recomputed tokens (the computed tokens thrown
    away by recompute evictions, as told) over every token the engine computed (the steps'
    prefill tokens, re-prefills included, plus their decode rows); `recompute_ms`: the
    time of `recompute` segments. `top_evictors`: (request, victims, their debt in ms),
    most debt first; `thrash`: (request, evictions) for requests evicted more than once."""

    num_evictions: int
    num_with_cause: int
    by_reason: dict[str, int]
    recomputed_tokens: int
    computed_tokens: int
    recompute_tax: float
    recompute_ms: float
    evicted_ms: float
    debt_ms: float
    top_evictors: tuple[tuple[str, int, float], ...]
    thrash: tuple[tuple[str, int], ...]
    num_thrashed: int
    worst: tuple[EvictionRow, ...]  # the evictions that charged their victim most

    def to_record(self) -> dict[str, Any]:
        return {
            "num_evictions": self.num_evictions,
            "num_with_cause": self.num_with_cause,
            "by_reason": dict(self.by_reason),
            "recomputed_tokens": self.recomputed_tokens,
            "computed_tokens": self.computed_tokens,
            "recompute_tax": self.recompute_tax,
            "recompute_ms": self.recompute_ms,
            "evicted_ms": self.evicted_ms,
            "debt_ms": self.debt_ms,
            "top_evictors": [
                {"request": r, "victims": n, "victims_debt_ms": ms}
                for r, n, ms in self.top_evictors
            ],
            "thrash": [{"request": r, "evictions": n} for r, n in self.thrash],
            "num_thrashed": self.num_thrashed,
            "worst": [w.to_record() for w in self.worst],
        }


def _recompute_ms(log: RawLog) -> float:
    """Time in `recompute` segments: host windows, or device ones where the engine timed
    only those (an engine with neither reports 0)."""
    if RECOMPUTE_LABEL not in log.labels:
        return 0.0
    seg = log.segments
    on = seg.label == log.labels.index(RECOMPUTE_LABEL)
    host = on & (seg.is_device == 0)
    use = host if host.any() else on
    return float((seg.t_end_s[use] - seg.t_start_s[use]).sum() * 1e3)


def _row(names: Sequence[str], c: EvictionCauses, i: int, evicted: np.ndarray,
         resume: np.ndarray) -> EvictionRow:  # fmt: skip
    """Eviction `i` as an `EvictionRow`."""
    return EvictionRow(
        victim=names[int(c.request[i])],
        t_evict_s=float(c.t_evict_s[i]),
        step=int(c.step[i]) if c.step[i] >= 0 else None,
        reason=PREEMPT_REASONS[int(c.reason[i])] if c.reason[i] >= 0 else UNKNOWN,
        evictors=tuple(names[e] for e in c.evictors[i]),
        num_computed_tokens_lost=int(c.num_computed_tokens_lost[i]),
        num_free_blocks=int(c.num_free_blocks[i]),
        num_used_blocks=int(c.num_used_blocks[i]),
        evicted_ms=float(evicted[i]),
        resume_ms=float(resume[i]),
    )


def eviction_summary(log: RawLog) -> EvictionSummary | None:
    """The run's evictions (None: it has none); see `EvictionSummary`. Computed on the
    columns; only the listed evictions (`worst`) become `EvictionRow`s."""
    if not len(log.evictions):
        return None
    c = eviction_causes(log)
    names = log.request_names()
    # evicted: eviction to readmission; resume: readmission to the next emission (the
    # re-prefill of what a recompute eviction threw away, or the swap-in and one step)
    evicted = (c.t_readmit_s - c.t_evict_s) * 1e3
    resume = (c.t_next_s - c.t_readmit_s) * 1e3
    debt = evicted + resume  # each eviction's `EvictionRow.debt_ms`
    n_reasons = len(PREEMPT_REASONS)
    per_reason = np.bincount(np.where(c.reason >= 0, c.reason, n_reasons), minlength=n_reasons + 1)
    by_reason = dict(zip((*PREEMPT_REASONS, UNKNOWN), per_reason.tolist(), strict=True))
    lost = c.num_computed_tokens_lost
    recomputed = int(lost[(c.mode == MODE_RECOMPUTE) & (lost > 0)].sum())
    st = log.steps
    computed = int(st.num_prefill_tokens.sum() + st.num_decode.sum())
    finite = np.isfinite(debt)
    charged = np.where(finite, debt, 0.0).tolist()
    debts: dict[str, tuple[int, float]] = {}
    for i in (i for i, by in enumerate(c.evictors) if by):  # in eviction order: the sums'
        for e in c.evictors[i]:
            n, ms = debts.get(names[e], (0, 0.0))
            debts[names[e]] = (n + 1, ms + charged[i])
    top = sorted(debts.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))[:TOP]
    counts: dict[str, int] = {}
    for r in c.request.tolist():
        counts[names[r]] = counts.get(names[r], 0) + 1
    thrash = sorted(((r, n) for r, n in counts.items() if n > 1), key=lambda x: (-x[1], x[0]))
    fin = np.flatnonzero(finite)
    worst = fin[np.argsort(-debt[fin], kind="stable")[:TOP]]  # most debt first, ties in order
    return EvictionSummary(
        num_evictions=len(c),
        num_with_cause=int(c.has_cause.sum()),
        by_reason={k: v for k, v in by_reason.items() if v or k != UNKNOWN},
        recomputed_tokens=recomputed,
        computed_tokens=computed,
        recompute_tax=recomputed / computed if computed else math.nan,
        recompute_ms=_recompute_ms(log),
        evicted_ms=float(np.nansum(evicted)),
        debt_ms=float(sum(debt[fin].tolist())),
        top_evictors=tuple((r, n, ms) for r, (n, ms) in top),
        thrash=tuple(thrash[:TOP]),
        num_thrashed=len(thrash),
        worst=tuple(_row(names, c, i, evicted, resume) for i in worst.tolist()),
    )
