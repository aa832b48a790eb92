"""The settler's per-step state (`tracekit.live.settler`): per settled step of the run (its
global index), the graph baseline's inputs (padded batch size, decode count, GC-free decode
time), and per eager step its weight ``w_s``: the decode time of that step the settled gaps
own (see the settler's "graph and forward"). `tracekit.live.graph` fits and evaluates them.
"""

from __future__ import annotations

import numpy as np

from tracekit.live.buffers import Growable
from tracekit.log.rawlog import GRAPH_EAGER


class StepState:
    """The settled steps' graph-fit inputs and eager weights, in growable arrays.

    num_settled: how many steps (from the run's first) are settled: their decode time is
    final. num_eager: how many of them are eager.
    """

    def __init__(self) -> None:
        self._graph_size = Growable(np.int64, -1)
        self._num_decode = Growable(np.int64, 0)
        self._net_ms = Growable(np.float64, 0.0)  # GC-free decode time
        self._w = Growable(np.float64, 0.0)  # the settled gaps' decode time, eager steps
        self._eager = Growable(np.int64, 0)  # settled eager steps, in order
        self.num_eager = 0
        self.num_settled = 0

    def ensure(self, n: int) -> None:
        """Room for `n` steps' fit inputs (the weights grow as gaps add to them)."""
        for g in (self._graph_size, self._num_decode, self._net_ms):
            g.ensure(n)

    def settle(self, graph_size: np.ndarray, num_decode: np.ndarray, net_ms: np.ndarray) -> None:
        """The next steps' fit inputs, in order: they are settled."""
        lo, hi = self.num_settled, self.num_settled + len(graph_size)
        self.ensure(hi)
        self._graph_size.a[lo:hi] = graph_size
        self._num_decode.a[lo:hi] = num_decode
        self._net_ms.a[lo:hi] = net_ms
        eager_done = np.flatnonzero(graph_size == GRAPH_EAGER)
        if len(eager_done):
            k = self.num_eager
            self._eager.ensure(k + len(eager_done))[k : k + len(eager_done)] = lo + eager_done
            self.num_eager += len(eager_done)
        self.num_settled = hi

    def add_weights(self, steps: np.ndarray, w_ms: np.ndarray, n: int) -> None:
        """Add gaps' decode time `w_ms` to `steps`' weights (`n`: room for that many)."""
        np.add.at(self._w.ensure(n), steps, w_ms)

    def eager(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The settled eager steps' (decode count, GC-free decode ms, weight)."""
        idx = self._eager.a[: self.num_eager]
        return self._num_decode.a[idx], self._net_ms.a[idx], self._w.a[idx]

    def settled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every settled step's (padded batch size, decode count, GC-free decode ms, weight)."""
        n = self.num_settled
        return (
            self._graph_size.ensure(n)[:n],
            self._num_decode.ensure(n)[:n],
            self._net_ms.ensure(n)[:n],
            self._w.ensure(n)[:n],
        )
