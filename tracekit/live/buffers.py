"""Preallocated numpy buffers the settler's parts keep their state in (`tracekit.live.settler`):
an array indexed by a growing integer id, and a sliding window of the last values."""

from __future__ import annotations

from typing import Any

import numpy as np

#: A tick later than any: "not yet" (a first token) or "no bound" (a settled-to tick).
NO_TICK = np.iinfo(np.int64).max


class Growable:
    """A numpy array indexed by a growing integer id (steps, requests), filled with `fill`."""

    def __init__(self, dtype: Any, fill: Any) -> None:
        self.a = np.full(64, fill, dtype=dtype)
        self.fill = fill

    def ensure(self, n: int) -> np.ndarray:
        """The array, grown (doubling, new cells `fill`) to at least `n` cells."""
        if n > len(self.a):
            b = np.full(max(n, 2 * len(self.a)), self.fill, dtype=self.a.dtype)
            b[: len(self.a)] = self.a
            self.a = b
        return self.a


class Ring:
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
