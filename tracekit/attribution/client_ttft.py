"""Time to first token at the client boundary of a merged server run (docs/ttft.md, "The
client boundary").

The engine boundary's TTFT (`tracekit.attribution.ttft`) is ``[arrival, e]``: from the
request's arrival at the API server to the engine core's first token. What a streaming
client measures (``vllm bench serve``, GuideLLM, AIPerf) ends later, where the API server
wrote the request's first chunk ``w`` (its first `RawLog.client_emissions` row). The client
boundary's TTFT is ``[arrival, w]``, every millisecond to exactly one label:

1. ``[arrival, x]``, ``x = clip(e, arrival, w)``: the engine boundary's TTFT partition,
   part for part (its rule 0's ``http`` / ``frontend`` and their OS shares included);
2. ``[x, w]``: the frontend part, by the client partition's own kernel
   (`tracekit.attribution.client.frontend_part`: ``frontend_gc`` > ``sse_write`` >
   ``output`` > ``input`` > ``hop`` > ``frontend_other``, the API server's OS shares, and
   ``unrecorded:api_server`` outside its span), as a client gap's frontend part with
   ``e`` the first token and the hop to when that API server received the first token's
   step.

A request with a TTFT whose first chunk was written before its first token (the clocks of
the two processes disagree; a consistent run has none) is left out and said in a note: its
engine part is not the engine boundary's TTFT. Parts sum to the TTFT (checked).

`client_ttft_partition` is vectorised (it reuses the two partitions);
`client_ttft_reference` (`tracekit.attribution.reference`) does the same with loops over
each request's pieces. Tests check they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracekit.attribution import itl
from tracekit.attribution.client import (
    FRONTEND_LABELS,
    FRONTEND_OS_LABELS,
    UNRECORDED_API,
    frontend_part,
    received_at,
)
from tracekit.attribution.itl import RECONCILE_TOL_MS
from tracekit.attribution.timeline import PreparedRun
from tracekit.attribution.ttft import TTFT_NON_CAUSES, TtftPartition, ttft_partition
from tracekit.errors import ReconcileError
from tracekit.log.rawlog import RawLog

#: Parts that are not causes of a late first chunk: the TTFT's (the request's own prefill,
#: uncovered time) and the client gap's (the API server's time no window covers).
CLIENT_TTFT_NON_CAUSES = TTFT_NON_CAUSES | {"frontend_other"}


@dataclass(frozen=True)
class ClientTtft:
    """Every client-boundary TTFT of a run. Rows are requests with a TTFT and a first chunk
    written at or after their first token, in request order."""

    # the engine boundary's TTFT labels, FRONTEND_LABELS, FRONTEND_OS_LABELS (with proc_os,
    # where the TTFT labels do not have them yet), unrecorded:api_server (if any)
    labels: tuple[str, ...]
    request: np.ndarray  # request index (into RawLog.requests)
    arrival_s: np.ndarray  # run clock: the first byte of the HTTP request
    first_token_s: np.ndarray  # x: the engine core's first token (the engine boundary's end)
    write_s: np.ndarray  # w: the API server wrote the first chunk
    process: np.ndarray  # the API server that wrote it (meta["processes"])
    ttft_ms: np.ndarray  # (write_s - arrival_s) * 1e3
    engine_ttft_ms: np.ndarray  # (first_token_s - arrival_s) * 1e3: the engine boundary's
    parts_ms: np.ndarray  # (requests, labels): exclusive, sums to ttft_ms
    notes: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.ttft_ms)

    def take(self, rows: np.ndarray) -> ClientTtft:
        """The requests at `rows` (indices or a boolean mask), each partitioned as here."""
        cols = ("request", "arrival_s", "first_token_s", "write_s", "process", "ttft_ms",
                "engine_ttft_ms", "parts_ms")  # fmt: skip
        return replace(self, **{f: getattr(self, f)[rows] for f in cols})

    @property
    def reconcile_err_ms(self) -> np.ndarray:
        return np.abs(self.ttft_ms - self.parts_ms.sum(axis=1))

    def column(self, label: str) -> np.ndarray:
        return self.parts_ms[:, self.labels.index(label)]

    def frontend_ms(self) -> np.ndarray:
        """Each TTFT's frontend part ``[x, w]``: from the first token to the chunk's write."""
        return (self.ttft_ms - self.engine_ttft_ms).copy()

    def primary_names(self) -> np.ndarray:
        """Largest part of each TTFT if >= 1 ms and >= 25% of it (the ITL rule, its tolerance
        and ties), `CLIENT_TTFT_NON_CAUSES` excluded; else 'clean'."""
        prim, causes = itl.primary_of(self.parts_ms, self.ttft_ms, self.labels,
                                      CLIENT_TTFT_NON_CAUSES)  # fmt: skip
        if not causes:
            return np.array(["clean"] * len(self), dtype=object)
        return np.array([*causes, "clean"], dtype=object)[prim]


def first_chunks(log: RawLog) -> tuple[np.ndarray, np.ndarray]:
    """Per request of the log, when its first chunk was written (NaN: none) and by which API
    server (-1: none). Of chunks written at the same instant, the first row."""
    ce = log.client_emissions
    w = np.full(len(log.requests), np.nan)
    proc = np.full(len(log.requests), -1, dtype=np.int64)
    o = np.lexsort((-np.arange(len(ce)), -ce.t_s, ce.request))  # per request latest first
    w[ce.request[o]] = ce.t_s[o]  # the last assignment, the first chunk, wins
    proc[ce.request[o]] = ce.process[o]
    return w, proc


def first_token_steps(log: RawLog) -> np.ndarray:
    """Per request of the log, the step of its first engine emission (-1: none)."""
    em = log.emissions
    step = np.full(len(log.requests), -1, dtype=np.int64)
    o = np.lexsort((-np.arange(len(em)), -em.t_s, em.request))
    step[em.request[o]] = em.step[o]
    return step


def client_ttft_labels(
    engine_labels: tuple[str, ...], has_proc_os: bool, unrecorded: bool
) -> tuple[str, ...]:
    """The engine boundary's TTFT labels, then the frontend's, its OS labels (with the API
    servers' OS intervals, where not there yet) and ``unrecorded:api_server`` (if any)."""
    os_labels = tuple(lb for lb in FRONTEND_OS_LABELS if has_proc_os and lb not in engine_labels)
    return (
        *engine_labels,
        *FRONTEND_LABELS,
        *os_labels,
        *((UNRECORDED_API,) if unrecorded else ()),
    )


def client_ttft_rows(log: RawLog, p: TtftPartition) -> tuple[np.ndarray, tuple[str, ...]]:
    """The rows of the engine boundary's partition `p` that have a client-boundary TTFT, and
    notes on the requests with a TTFT that have none."""
    w, _ = first_chunks(log)
    wr = w[p.request] if len(p) else np.zeros(0)
    keep = np.isfinite(wr)
    notes: tuple[str, ...] = ()
    if (~keep).any():
        notes += (f"{int((~keep).sum())} request(s) with a TTFT have no client-boundary TTFT: "
                  "no chunk was written for them",)  # fmt: skip
    early = keep & (wr < p.first_token_s)
    if early.any():
        notes += (f"{int(early.sum())} request(s) left out of the client boundary: first chunk "
                  "written before the engine core's first token (the processes' clocks "
                  "disagree)",)  # fmt: skip
    return np.flatnonzero(keep & ~early), notes


def client_ttft_partition(
    log: RawLog,
    *,
    check: bool = True,
    run: PreparedRun | None = None,
    engine: TtftPartition | None = None,
) -> ClientTtft:
    """Partition every client-boundary TTFT of a merged server run (the module docstring).

    `engine`: the run's engine-boundary TTFT partition, if already made; `run`: its
    `PreparedRun` (`tracekit.attribution.ttft.ttft_partition`)."""
    p = engine if engine is not None else ttft_partition(log, check=check, run=run)
    rows, notes = client_ttft_rows(log, p)
    w_all, proc_all = first_chunks(log)
    req = p.request[rows]
    w, proc = w_all[req], proc_all[req]
    # [x, w]: the frontend part, a client gap's with e = the first token, the hop until the
    # API server that wrote the chunk received the first token's step
    x = p.first_token_s[rows]
    recv = received_at(log, first_token_steps(log)[req], proc)
    front, unrec = frontend_part(log, proc, x, w, x, recv)
    out = client_ttft_assembled(p.take(rows), w, proc, front, unrec, len(log.proc_os) > 0, notes)
    return check_client_ttft_reconciled(out, log.path) if check else out


def client_ttft_assembled(
    p: TtftPartition,
    w: np.ndarray,
    proc: np.ndarray,
    front: np.ndarray,
    unrec: np.ndarray,
    has_proc_os: bool,
    notes: tuple[str, ...] = (),
) -> ClientTtft:
    """The client-boundary TTFTs of the engine boundary's rows `p` (each with a chunk written
    at `w` by API server `proc`, at or after its first token) from their frontend parts
    (`frontend_part`'s columns `front` and ``unrecorded:api_server`` `unrec`, ms); `has_proc_os`:
    whether the run has API server OS intervals. A run's TTFTs (`client_ttft_partition`) or
    a long run's, gathered from its slices (`tracekit.analysis.stream_client`)."""
    labels = client_ttft_labels(p.labels, has_proc_os, bool((unrec > 0).any()))
    parts = np.zeros((len(p), len(labels)))
    parts[:, : len(p.labels)] = p.parts_ms  # [arrival, x]: the engine boundary's
    col = {lb: j for j, lb in enumerate(labels)}
    for j, lb in enumerate((*FRONTEND_LABELS, *FRONTEND_OS_LABELS)):
        if lb in col:
            parts[:, col[lb]] += front[:, j]
    if UNRECORDED_API in col:
        parts[:, col[UNRECORDED_API]] = unrec
    return ClientTtft(
        labels=labels,
        request=p.request,
        arrival_s=p.arrival_s,
        first_token_s=p.first_token_s,
        write_s=w,
        process=proc,
        ttft_ms=(w - p.arrival_s) * 1e3,
        engine_ttft_ms=p.ttft_ms,
        parts_ms=parts,
        notes=notes,
    )


def check_client_ttft_reconciled(p: ClientTtft, path: str = "") -> ClientTtft:
    """Raise `ReconcileError` if any request's parts do not sum to its client TTFT."""
    if not len(p):
        return p
    err = p.reconcile_err_ms
    i = int(np.argmax(err))
    if err[i] > RECONCILE_TOL_MS * max(1.0, p.ttft_ms[i]) or p.parts_ms.min() < -RECONCILE_TOL_MS:
        raise ReconcileError(
            f"{path}: client-boundary TTFT of request {int(p.request[i])} is {p.ttft_ms[i]!r} "
            f"ms but its parts sum to {p.parts_ms[i].sum()!r} ms "
            f"({dict(zip(p.labels, p.parts_ms[i].round(6).tolist(), strict=True))})"
        )
    return p


def client_ttft_figures(p: ClientTtft) -> dict[str, Any]:
    """The run's client-boundary TTFT figures: percentiles (numpy's linear) of the client
    and engine boundaries' TTFT over the same requests, ms; per label its time over all
    client TTFT time; the frontend part's share of it."""
    t, e = p.ttft_ms, p.engine_ttft_ms
    total = float(t.sum())

    def pct(v: np.ndarray, q: float) -> float:
        return float(np.percentile(v, q)) if len(v) else float("nan")

    return {
        "requests": len(p),
        "p50_ms": pct(t, 50),
        "p90_ms": pct(t, 90),
        "p99_ms": pct(t, 99),
        "engine_p50_ms": pct(e, 50),
        "engine_p99_ms": pct(e, 99),
        "share": {
            lb: float(p.parts_ms[:, j].sum() / total) if total > 0 else 0.0
            for j, lb in enumerate(p.labels)
        },  # fmt: skip
        "frontend_share": float(p.frontend_ms().sum() / total) if total > 0 else 0.0,
        "reconcile_max_err_ms": float(p.reconcile_err_ms.max()) if len(p) else 0.0,
    }


def client_ttft_records(
    log: RawLog, p: ClientTtft, *, min_ms: float | None = None, request_id: str | None = None
) -> list[dict[str, Any]]:
    """One dict per request: request id, arrival, first token, first chunk's write (s, run
    clock), ttft_ms (to the write), engine_ttft_ms (to the first token), frontend_ms, parts
    (ms by label, sum to ttft_ms), primary."""
    ids = log.request_names()
    sel = np.ones(len(p), dtype=bool)
    if min_ms is not None:
        sel &= p.ttft_ms >= min_ms
    if request_id is not None:
        sel &= np.array([ids[int(r)] == request_id for r in p.request], dtype=bool)
    prim, front = p.primary_names(), p.frontend_ms()
    return [
        {
            "request": ids[int(p.request[i])],
            "arrival": float(p.arrival_s[i]),
            "first_token": float(p.first_token_s[i]),
            "first_chunk": float(p.write_s[i]),
            "ttft_ms": float(p.ttft_ms[i]),
            "engine_ttft_ms": float(p.engine_ttft_ms[i]),
            "frontend_ms": float(front[i]),
            "parts": {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[i], strict=True)},
            "primary": str(prim[i]),
        }
        for i in np.flatnonzero(sel).tolist()
    ]


__all__ = [
    "CLIENT_TTFT_NON_CAUSES",
    "ClientTtft",
    "check_client_ttft_reconciled",
    "client_ttft_figures",
    "client_ttft_assembled",
    "client_ttft_partition",
    "client_ttft_records",
    "first_chunks",
    "first_token_steps",
]
