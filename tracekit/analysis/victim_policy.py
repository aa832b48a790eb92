"""What a victim policy would have saved: the recompute tax had the scheduler evicted the
least-computed running request at every recorded decision (docs/whatif.md, "Victim
policy"), first order.

First order: the same decisions, at the same instants, for the same evictors; each takes
the running request with the fewest computed tokens instead of the one recorded (or keeps
it, if it had fewest). What the different victim would have changed later (other
evictions, other batches, the victims' own later evictions) is not modelled.

At a decision at time ``t`` in step ``s`` the *running* requests are those admitted (their
admission row, else their first emission) by ``t``, not evicted at ``t``, emitting again
after ``t``, and not among the decision's evictors. A candidate's computed tokens at ``t``:

- re-prefilling after a recompute eviction (readmitted, not emitted since): its
  `prefill_chunks` tokens since the readmission;
- decoding (it has emitted): its prompt plus the tokens it emitted before ``t``, less one
  (the last token has no KV yet);
- in its first prefill: its `prefill_chunks` tokens before step ``s``;

a candidate whose count the log cannot give (no prompt length, no prefill chunks) is left
out. The recorded victim keeps its recorded loss. Pure: a `RawLog` in, a `VictimPolicy`
out (None: no recompute eviction has a recorded cause).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.analysis.evictions import eviction_summary
from tracekit.attribution.evictions import EvictionCauses, eviction_causes
from tracekit.log.rawlog import MODE_RECOMPUTE, RawLog


@dataclass(frozen=True, slots=True)
class VictimPolicy:
    """The recompute tax as recorded and under the least-computed-victim policy (first
    order), over `num_decisions` recompute evictions with a recorded cause, of which
    `num_changed` would have evicted another request."""

    num_decisions: int
    num_changed: int
    recomputed_tokens: int
    policy_recomputed_tokens: int
    computed_tokens: int
    recompute_tax: float
    policy_recompute_tax: float

    def to_record(self) -> dict[str, Any]:
        return {
            "policy": "least_computed_victim",
            "num_decisions": self.num_decisions,
            "num_changed": self.num_changed,
            "recomputed_tokens": self.recomputed_tokens,
            "policy_recomputed_tokens": self.policy_recomputed_tokens,
            "computed_tokens": self.computed_tokens,
            "recompute_tax": self.recompute_tax,
            "policy_recompute_tax": self.policy_recompute_tax,
        }


class _Computed:
    """Each request's computed tokens at an instant, as the module docstring reads them."""

    def __init__(self, log: RawLog) -> None:
        self.log = log
        em = log.emissions
        o = np.lexsort((em.t_s, em.request))
        self.em_r, self.em_t, self.em_n = em.request[o], em.t_s[o], em.num_tokens[o]
        self.cum_n = np.concatenate([[0], np.cumsum(self.em_n)])
        pf = log.prefill_chunks
        self.pf = (pf.step, pf.request, pf.num_tokens)
        self.step_t0 = log.steps.t_start_s
        adm = np.full(len(log.requests), np.inf)
        if len(log.admissions):
            adm[log.admissions.request] = log.admissions.t_s
        first = log.requests.first_token_s
        self.admitted = np.where(np.isfinite(adm), adm, np.nan_to_num(first, nan=np.inf))
        self.ev = log.evictions
        self.last = np.full(len(log.requests), -np.inf)  # each request's last emission
        if len(self.em_t):
            np.maximum.at(self.last, self.em_r, self.em_t)

    def _emitted(self, r: int, lo: float, hi: float) -> tuple[int, int]:
        """(emission rows, tokens) of request `r` with time in (lo, hi)."""
        a, b = np.searchsorted(self.em_r, r, "left"), np.searchsorted(self.em_r, r, "right")
        i = a + np.searchsorted(self.em_t[a:b], lo, "right")
        j = a + np.searchsorted(self.em_t[a:b], hi, "left")
        return int(j - i), int(self.cum_n[j] - self.cum_n[i])

    def _chunks(self, r: int, t_lo: float, step_hi: int) -> int:
        s, q, n = self.pf
        sel = (q == r) & (s < step_hi) & (self.step_t0[np.clip(s, 0, None)] >= t_lo)
        return int(n[sel].sum())

    def running(self, t: float) -> np.ndarray:
        """The requests running at `t`: admitted by then, not out, emitting after it."""
        on = (self.admitted <= t) & (self.last > t)
        ev = self.ev
        back = np.where(np.isnan(ev.t_readmit_s), np.inf, ev.t_readmit_s)
        out = ev.request[(ev.t_evict_s <= t) & (back > t)]
        on[out] = False
        return on

    def at(self, r: int, t: float, step: int) -> int | None:
        """Request `r`'s computed tokens at `t` (decision step `step`); None: unknown."""
        ev = self.ev
        mine = (ev.request == r) & (ev.mode == MODE_RECOMPUTE) & (ev.t_readmit_s <= t)
        if mine.any():
            back = float(ev.t_readmit_s[mine].max())
            if self._emitted(r, back, t)[0] == 0:  # re-prefilling since its readmission
                return self._chunks(r, back, step)
        rows, tokens = self._emitted(r, -np.inf, t)
        prompt = int(self.log.requests.prompt_tokens[r])
        if rows and prompt >= 0:
            return prompt + tokens - 1
        if not rows and len(self.pf[0]):
            return self._chunks(r, -np.inf, step)
        return None


def has_decisions(log: RawLog) -> bool:
    """Whether the log records a recompute eviction with its cause (a decision the policy
    is estimated at); reads no emission."""
    return bool(len(_decisions(log)[1]))


def _decisions(log: RawLog) -> tuple[EvictionCauses, np.ndarray]:
    """The log's evictions with their causes, and the rows that are recompute decisions."""
    c = eviction_causes(log)
    sel = np.flatnonzero(
        (c.mode == MODE_RECOMPUTE) & c.has_cause & (c.num_computed_tokens_lost >= 0)
    )
    return c, sel


def victim_policy(log: RawLog) -> VictimPolicy | None:
    """The least-computed-victim estimate (see the module docstring)."""
    c, sel = _decisions(log)
    if not len(sel):
        return None
    summary = eviction_summary(log)
    if summary is None:
        return None
    comp = _Computed(log)
    recorded = policy = changed = 0
    for i in sel.tolist():
        t, step, victim = float(c.t_evict_s[i]), int(c.step[i]), int(c.request[i])
        lost = int(c.num_computed_tokens_lost[i])
        best = lost
        on = comp.running(t)
        on[victim] = False
        on[list(c.evictors[i])] = False
        for r in np.flatnonzero(on).tolist():
            n = comp.at(r, t, step)
            if n is not None and n < best:
                best = n
        recorded += lost
        policy += best
        changed += best < lost
    total = summary.computed_tokens
    return VictimPolicy(
        num_decisions=len(sel),
        num_changed=changed,
        recomputed_tokens=recorded,
        policy_recomputed_tokens=policy,
        computed_tokens=total,
        recompute_tax=recorded / total if total else float("nan"),
        policy_recompute_tax=policy / (total - recorded + policy) if total else float("nan"),
    )
