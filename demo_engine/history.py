"""What gives Python's garbage collector its work: a startup heap and per-token history.

`build_startup_heap` stands in for a real server's configs and registries: long-lived,
GC-tracked containers that a full (generation-2) collection walks every time unless they
are frozen (`gc.freeze()`, the `+gc.freeze` rung).

The per-token history is what a metrics store or streaming buffer keeps: for every
emitted token, either a record object plus a dict of top-k logprob objects (seven
GC-tracked objects per token, `ObjectHistory`), or a row in a flat `array('d')` that the
collector cannot see (`CompactHistory`, the `+compact history` rung).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol

import numpy as np


def build_startup_heap(num_objects: int) -> list[dict[str, object]]:
    """About `num_objects` long-lived GC-tracked objects: half dicts, half lists."""
    return [{"id": i, "tags": [i, "registry"]} for i in range(num_objects // 2)]


class Logprob:
    """One top-k candidate of one token, kept as an object (the GC-visible way)."""

    __slots__ = ("logprob", "rank", "token_id")

    def __init__(self, logprob: float, rank: int, token_id: int) -> None:
        self.logprob = logprob
        self.rank = rank
        self.token_id = token_id


class TokenRecord:
    """One emitted token with its top-k logprobs dict (the GC-visible way)."""

    __slots__ = ("token_id", "logprob", "step", "top")

    def __init__(self, token_id: int, logprob: float, step: int, top: dict[int, Logprob]) -> None:
        self.token_id = token_id
        self.logprob = logprob
        self.step = step
        self.top = top


class History(Protocol):
    """Per-request token history: `record` one step's tokens, `close` a finished request."""

    def record(
        self,
        rids: Sequence[int],
        step: int,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        topk_ids: np.ndarray,
        topk_logprobs: np.ndarray,
    ) -> None: ...

    def close(self, rid: int) -> None: ...

    def num_tokens(self, rid: int) -> int: ...


class ObjectHistory:
    """A record + a dict of k `Logprob` objects per token: 2 + k tracked objects each."""

    def __init__(self) -> None:
        self._by_rid: dict[int, list[TokenRecord]] = {}

    def record(self, rids, step, token_ids, logprobs, topk_ids, topk_logprobs) -> None:  # type: ignore[no-untyped-def]
        toks, lps = token_ids.tolist(), logprobs.tolist()
        tids, tlps = topk_ids.tolist(), topk_logprobs.tolist()
        for i, rid in enumerate(rids):
            top = {
                t: Logprob(lp, k, t) for k, (t, lp) in enumerate(zip(tids[i], tlps[i], strict=True))
            }
            rec = TokenRecord(toks[i], lps[i], step, top)
            hist = self._by_rid.get(rid)
            if hist is None:
                hist = self._by_rid[rid] = []
            hist.append(rec)

    def close(self, rid: int) -> None:
        self._by_rid.pop(rid, None)

    def num_tokens(self, rid: int) -> int:
        return len(self._by_rid.get(rid, ()))


class CompactHistory:
    """The same numbers in one flat `array('d')` per request: nothing for the GC to scan."""

    def __init__(self, num_topk: int) -> None:
        self._by_rid: dict[int, array] = {}
        self._row = 3 + 2 * num_topk  # token, logprob, step, k ids, k logprobs

    def record(self, rids, step, token_ids, logprobs, topk_ids, topk_logprobs) -> None:  # type: ignore[no-untyped-def]
        n = len(rids)
        rows = np.empty((n, self._row), np.float64)
        rows[:, 0] = token_ids
        rows[:, 1] = logprobs
        rows[:, 2] = step
        k = topk_ids.shape[1]
        rows[:, 3 : 3 + k] = topk_ids
        rows[:, 3 + k :] = topk_logprobs
        for i, rid in enumerate(rids):
            hist = self._by_rid.get(rid)
            if hist is None:
                hist = self._by_rid[rid] = array("d")
            hist.frombytes(rows[i].tobytes())

    def close(self, rid: int) -> None:
        self._by_rid.pop(rid, None)

    def num_tokens(self, rid: int) -> int:
        return len(self._by_rid.get(rid, ())) // self._row
