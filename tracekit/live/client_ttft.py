"""Live TTFT at the client boundary, in an API server (docs/live.md, "TTFT at the client
boundary").

The client boundary's TTFT of a request (docs/ttft.md, "The client boundary") is
``[arrival, w]``: from the first byte of its HTTP request at the API server to that API
server's write of its first streamed chunk. Both ends are the API server's own rows: the
request's ``requests.arrival_tick`` and its earliest ``emissions`` row (an emission at the
client boundary is one chunk written). So a sink on the API server's own recorder has the
whole window, with no other process's rows and no clock between processes, and counts it
as soon as the flush that carries the first chunk reaches it. Its parts by cause need the
engine core's rows (the engine boundary's partition up to the first token): they stay
offline (`tracekit ttft --boundary client`).

`ClientTtftLive` is that sink: ``tracekit_ttft_client_seconds``, a histogram (its buckets
``le``: <=) of what `tracekit ttft --boundary client` gives for the same requests of the
merged run, to float rounding: the merge moves an API server's rows onto the run's clock by
an offset on one host, which a difference of two of its ticks does not see.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from tracekit.live.settler import TTFT_BUCKETS_S
from tracekit.log.flush import UNKNOWN_TICK, FlushedRows, column_index

_RQ_REQUEST = column_index("requests", "request")
_RQ_ARRIVAL = column_index("requests", "arrival_tick")
_EM_REQUEST = column_index("emissions", "request")
_EM_T = column_index("emissions", "t_tick")


class ClientTtftLive:
    """A recorder sink for an API server's recorder: every streamed request's TTFT at the
    client boundary, as a Prometheus histogram.

    const_labels: the labels on every series (run, engine, model, process, ...).
    buckets_s: the histogram's upper bounds, seconds (+Inf added).
    max_wait_s: a request with no chunk this long after its arrival (not streamed, or
        failed before its first chunk) is forgotten: one streamed later is not counted.
    addr: the address `serve` binds.

    The series are there, at 0, from `serve` on (before the recorder starts); `write` folds
    each flush in at once (a few operations a request: it runs on the recorder's dispatcher
    thread, never the server's event loop).
    """

    #: Idle flushes carry nothing this sink needs: a TTFT is counted when its chunk's row is.
    follows_idle_clock = False

    def __init__(
        self,
        *,
        const_labels: Mapping[str, str],
        buckets_s: tuple[float, ...] = TTFT_BUCKETS_S,
        max_wait_s: float = 3600.0,
        addr: str = "127.0.0.1",
    ) -> None:
        # optional dependency: the exporter imports prometheus_client at its top, so it is
        # imported only when a sink is made (`import tracekit.live` needs neither)
        try:
            import tracekit.live.prometheus as prometheus
        except ImportError as e:
            raise ImportError(
                f"tracekit.live needs the `live` extra ({e.name} is missing): "
                "pip install 'tracekit[live]'"
            ) from None
        bounds = np.asarray(buckets_s, dtype=np.float64)
        if len(bounds) == 0 or not np.all(np.diff(bounds) > 0) or not bounds[0] > 0:
            raise ValueError(f"buckets_s: expected increasing positive bounds, got {buckets_s}")
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s: expected seconds > 0, got {max_wait_s!r}")
        self._bounds = bounds
        self._max_wait_s = float(max_wait_s)
        self._prometheus = prometheus
        self._addr = addr
        self._lock = threading.Lock()  # guards what a scrape reads
        self._counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self._sum_s = 0.0
        self._final = False
        self._seconds_per_tick = 0.0
        # request index -> arrival tick, for the requests with no chunk yet (arrival order)
        self._waiting: dict[int, int] = {}
        self._server: Any = None
        self.port: int | None = None
        self.registry = prometheus.client_ttft_registry(
            self._read, const_labels=const_labels, buckets_s=tuple(buckets_s)
        )

    # -- the sink protocol -------------------------------------------------------------
    def open(self, meta: Mapping[str, Any]) -> None:
        """At the recorder's start: its clock's seconds per tick."""
        self._seconds_per_tick = float(meta["seconds_per_tick"])

    def write(self, rows: Mapping[str, np.ndarray]) -> None:
        """One flush: the arrivals it adds, then each waiting request's first chunk in it
        (a request's chunks are recorded in the order they are written, after its arrival,
        so its earliest row is in the first flush that holds any)."""
        b = FlushedRows.of(rows)
        rq = b.table("requests")
        for i, tick in zip(rq[:, _RQ_REQUEST].tolist(), rq[:, _RQ_ARRIVAL].tolist(),
                           strict=True):  # fmt: skip
            if tick != UNKNOWN_TICK:
                self._waiting[int(i)] = int(tick)
        em = b.table("emissions")
        ttft_s: list[float] = []
        if len(em):
            order = np.argsort(em[:, _EM_T], kind="stable")
            req, t = em[order, _EM_REQUEST], em[order, _EM_T]
            first_req, first = np.unique(req, return_index=True)
            for i, k in zip(first_req.tolist(), first.tolist(), strict=True):
                arrival = self._waiting.pop(int(i), None)
                if arrival is not None:  # else counted already, or forgotten
                    # [arrival, w]: the HTTP request's first byte to the first chunk's write
                    ttft_s.append((int(t[k]) - arrival) * self._seconds_per_tick)
        self._forget_old(b.scalar("flush_tick"))
        if ttft_s:
            v = np.asarray(ttft_s)
            n = np.bincount(np.searchsorted(self._bounds, v, side="left"),
                            minlength=len(self._counts))  # fmt: skip
            with self._lock:
                self._counts += n
                self._sum_s += float(v.sum())

    def close(self, final: Mapping[str, Any] | None = None) -> None:
        """At the recorder's stop, after its last flush: every TTFT is counted."""
        with self._lock:
            self._final = True

    def _forget_old(self, flush_tick: int | None) -> None:
        """Forget the requests that arrived more than `max_wait_s` before this flush with no
        chunk since (in arrival order: the oldest are first)."""
        if flush_tick is None or not self._seconds_per_tick > 0:
            return
        cutoff = flush_tick - self._max_wait_s / self._seconds_per_tick
        while self._waiting:
            i, arrival = next(iter(self._waiting.items()))
            if arrival >= cutoff:
                break
            del self._waiting[i]

    # -- serving ---------------------------------------------------------------------------
    def serve(self, port: int = 0) -> int:
        """Serve ``/metrics`` (its own threads); returns the port."""
        self._server = self._prometheus.serve(self.registry, port, self._addr)
        self.port = int(self._server.server_port)
        return self.port

    def shutdown(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _read(self) -> tuple[np.ndarray, float, bool]:
        with self._lock:
            return self._counts.copy(), self._sum_s, self._final

    def snapshot(self) -> dict[str, Any]:
        """What a scrape sees: counts per bucket (the last +Inf), their sum, final."""
        counts, sum_s, final = self._read()
        return {"counts": counts, "count": int(counts.sum()), "sum_s": sum_s, "final": final}


__all__ = ["ClientTtftLive"]
