"""The settler's per-request state (`tracekit.live.settler`): what it knows of each request
of the run, by the request's index in the run's request ids, in growable arrays.

A request's last settled emission is *carried* into the next settlement's window (a gap
opens at it). A request is *in flight* while its carried emission may still open a gap: it
has not emitted its ``max_new_tokens`` (when known), and it emitted within ``max_retain_s``;
in-flight requests pin the retained rows (`tracekit.live.retention`). Its TTFT is *open*
from its arrival (when recorded) until its first token is settled.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tracekit.live.buffers import NO_TICK, Growable
from tracekit.log.flush import TABLES, UNKNOWN_TICK
from tracekit.log.rawlog import Requests

# column positions in the flushed rows (`tracekit.log.flush.TABLES`), by name
_EM = {c: i for i, c in enumerate(TABLES["emissions"])}
_RQ = {c: i for i, c in enumerate(TABLES["requests"])}


class RequestState:
    """Per request (by index): its carried emission, token count, arrival and first token.

    ids: the run's request ids so far (index -> id). ttft_open: the requests whose arrival
    is known and TTFT not yet settled; inflight: those with a carried emission not known to
    be finished. Both are sorted index arrays, changed only by this class's methods.
    """

    def __init__(self) -> None:
        self.ids: list[str] = []
        # its last settled emission (carried into the next window): tick, step, token
        # count, device step
        self._carry_tick = Growable(np.int64, UNKNOWN_TICK)
        self._carry_step = Growable(np.int64, -1)
        self._carry_nt = Growable(np.int64, 0)
        self._carry_dstep = Growable(np.int64, -1)
        self._tokens = Growable(np.int64, 0)  # tokens emitted so far
        self._max_new = Growable(np.int64, -1)  # -1: not known
        self._prompt = Growable(np.int64, -1)
        self._arrival_tick = Growable(np.int64, UNKNOWN_TICK)
        self._first_tick = Growable(np.int64, NO_TICK)  # NO_TICK: no token yet
        self.ttft_open = np.zeros(0, dtype=np.int64)
        self.inflight = np.zeros(0, dtype=np.int64)

    def ensure(self, n: int) -> None:
        """Room for the requests with an index below `n` (every array grown together)."""
        for g in (self._carry_tick, self._carry_step, self._carry_nt, self._carry_dstep,
                  self._tokens, self._max_new, self._prompt, self._arrival_tick,
                  self._first_tick):  # fmt: skip
            g.ensure(n)

    # -- what a flush adds --------------------------------------------------------------------
    def set_ids(self, start: int | None, ids: list[str]) -> None:
        """The flush's request ids, from index `start` (None: after the known ones)."""
        if start is None:
            start = len(self.ids)
        self.ids[start : start + len(ids)] = ids
        self.ensure(len(self.ids))

    def add_requests(self, rq: np.ndarray) -> None:
        """Requests rows: arrival (a newly known one opens the request's TTFT), prompt
        tokens and max new tokens."""
        arr = self._arrival_tick.a
        req, arrival = rq[:, _RQ["request"]], rq[:, _RQ["arrival_tick"]]
        known = arrival != UNKNOWN_TICK
        fresh = req[known][arr[req[known]] == UNKNOWN_TICK]
        arr[req[known]] = arrival[known]
        self.ttft_open = np.union1d(self.ttft_open, fresh)
        self._max_new.a[req] = rq[:, _RQ["max_new_tokens"]]
        self._prompt.a[req] = rq[:, _RQ["prompt_tokens"]]

    def add_emissions(self, em: np.ndarray) -> None:
        """Emission rows (not yet settled): token counts, and each request's first token."""
        req = em[:, _EM["request"]]
        np.add.at(self._tokens.a, req, em[:, _EM["num_tokens"]])
        np.minimum.at(self._first_tick.a, req, em[:, _EM["t_tick"]])

    # -- carried emissions ----------------------------------------------------------------------
    def carried(self, req: np.ndarray) -> np.ndarray:
        """The carried emissions of `req` (those that have one), as emission rows."""
        c_t = self._carry_tick.a[req]
        return np.column_stack(
            [
                req,
                c_t,
                self._carry_step.a[req],
                self._carry_nt.a[req],
                self._carry_dstep.a[req],
            ]
        )[c_t != UNKNOWN_TICK]

    def carry(self, new_em: np.ndarray) -> None:
        """Carry each request's last emission of the settled `new_em` into the next window
        (the request is in flight from now on)."""
        o = np.lexsort((new_em[:, _EM["t_tick"]], new_em[:, _EM["request"]]))
        req = new_em[o, _EM["request"]]
        last = o[np.r_[req[1:] != req[:-1], True]]
        r = new_em[last, _EM["request"]]
        self.ensure(int(r.max()) + 1)
        self._carry_tick.a[r] = new_em[last, _EM["t_tick"]]
        self._carry_step.a[r] = new_em[last, _EM["step"]]
        self._carry_nt.a[r] = new_em[last, _EM["num_tokens"]]
        self._carry_dstep.a[r] = new_em[last, _EM["device_step"]]
        self.inflight = np.union1d(self.inflight, r)

    def carry_tick_of(self, req: np.ndarray) -> np.ndarray:
        return self._carry_tick.a[req]

    def carried_steps(self, req: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step and device step of `req`'s carried emissions (-1: none)."""
        return self._carry_step.a[req], self._carry_dstep.a[req]

    def pinning(self, since_tick: int, pending: np.ndarray) -> np.ndarray:
        """The requests whose carried emission pins the retained rows: those in flight
        (a request that emitted its max new tokens, or nothing since `since_tick`, is no
        longer), and those of `pending` (with emissions still to settle) that carry one."""
        carry = self._carry_tick.a
        inf = self.inflight
        max_new = self._max_new.a[inf]
        done = (max_new > 0) & (self._tokens.a[inf] >= max_new)
        inf = self.inflight = inf[~done & (carry[inf] >= since_tick)]
        return np.union1d(inf, pending[carry[pending] != UNKNOWN_TICK])

    # -- TTFT ----------------------------------------------------------------------------------
    def take_first_tokens(self, w_tick: int) -> np.ndarray:
        """The open TTFTs whose first token came by `w_tick`: closed, and returned."""
        first, o = self._first_tick.a, self.ttft_open
        came = (first[o] != NO_TICK) & (first[o] <= w_tick)
        new = o[came]
        if len(new):
            self.ttft_open = o[~came]
        return new

    def first_tick_of(self, req: np.ndarray) -> np.ndarray:
        return self._first_tick.a[req]

    def arrival_tick_of(self, req: np.ndarray) -> np.ndarray:
        return self._arrival_tick.a[req]

    def open_ttfts_since(self, tick: int) -> np.ndarray:
        """The open TTFTs of the requests that arrived at or after `tick`."""
        o = self.ttft_open
        return o[self._arrival_tick.a[o] >= tick]

    def requests_table(self, which: np.ndarray, secs: Callable[[np.ndarray], np.ndarray]):
        """Every request so far: arrival (NaN: unknown, or not in `which`) and first token
        (NaN: not yet), prompt, max new tokens; `secs`: ticks to engine-clock seconds."""
        n = len(self.ids)
        arr, first = self._arrival_tick.a[:n], self._first_tick.a[:n]
        arrival_s = np.full(n, np.nan)
        ok = which[arr[which] != UNKNOWN_TICK]
        arrival_s[ok] = secs(arr[ok])
        return Requests(
            arrival_s=arrival_s,
            prompt_tokens=self._prompt.a[:n].copy(),
            max_new_tokens=self._max_new.a[:n].copy(),
            first_token_s=np.where(first != NO_TICK, secs(first), np.nan),
        )
