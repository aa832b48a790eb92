"""One request identity over a server's processes: the engine core's requests, each named
as its client knew it (`join_requests`), repeats of a client id told apart
(`distinct_names`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.log.clocks import ClockFit
from tracekit.log.processes import ProcessLog, counter
from tracekit.log.rawlog import Requests
from tracekit.log.serve_contract import ADDED, FRONT_SEP, FRONTEND, HANDLER, REPEAT_SEP


@dataclass(frozen=True)
class RequestJoin:
    """The run's requests: the engine core's, each named as its client knew it, with its
    stages on the run's clock; `index[k]` maps the (k+1)-th other process's request rows
    to the run's (an API server's only; -1 elsewhere)."""

    names: list[str]
    requests: Requests
    index: list[np.ndarray]
    renamed: int = 0  # requests whose client id another request had: named ~2, ~3, ...


def join_requests(
    core: ProcessLog,
    others: list[ProcessLog],
    fits: list[ClockFit],
    elsewhere: set[str] | frozenset[str] = frozenset(),
) -> RequestJoin:
    """One request identity over every API server (see the module docstring).

    Each API server records a request as ``CLIENT<US>ENGINE``; the engine id is unique in
    the run (vLLM adds a random suffix), the client id need not be (a client may send one
    ``X-Request-Id`` twice). Requests are joined by engine id; the run names each by its
    client id, and a client id used by several requests gets ``~2``, ``~3``, ... on the
    later ones, in order of arrival. Arrival is the API server's (the first byte of the
    HTTP request), with `handler_s` (its handler ran, counter ``serve.handler``) and
    `engine_s` (the engine core added it, counter ``serve.added``)."""
    core_ids = list(core.log.request_ids)
    core_index = {r: i for i, r in enumerate(core_ids)}
    rq = core.log.requests
    n_core = len(core_ids)
    arrival = rq.arrival_s.astype(np.float64).copy()
    handler = np.full(n_core, np.nan)
    engine = np.full(n_core, np.nan)
    a_t, a_v = counter(core.log, ADDED)
    ok = (a_v >= 0) & (a_v < n_core)
    engine[a_v[ok].astype(np.int64)] = a_t[ok]
    client = list(core_ids)
    extra: list[tuple[str, float, float]] = []  # requests the engine core never recorded
    index: list[np.ndarray] = []
    known = np.zeros(n_core, dtype=bool)
    for p, fit in zip(others, fits, strict=True):
        lg = p.log
        ridx = np.full(len(lg.request_ids), -1, dtype=np.int64)
        index.append(ridx)
        if p.role != FRONTEND:
            continue
        h_t, h_v = counter(lg, HANDLER)
        h_of = last_stamps(fit.apply(h_t), h_v, len(lg.request_ids))
        arr = fit.apply(lg.requests.arrival_s) if len(lg.requests) else np.zeros(0)
        for i, name in enumerate(lg.request_ids):
            cl, sep, engine_id = name.partition(FRONT_SEP)
            a = float(arr[i]) if i < len(arr) else float("nan")
            h = float(h_of[i])
            j = core_index.get(engine_id) if sep else None
            if j is None and engine_id in elsewhere:
                continue  # another engine core served it: not this run's (index -1)
            if j is None:
                ridx[i] = n_core + len(extra)
                extra.append((cl, a, h))
                continue
            ridx[i] = j
            client[j] = cl
            known[j] = True
            if np.isfinite(a):
                arrival[j] = a
            handler[j] = h
    n = n_core + len(extra)
    if extra:
        client += [e[0] for e in extra]
        arrival = np.concatenate([arrival, [e[1] for e in extra]])
        handler = np.concatenate([handler, [e[2] for e in extra]])
        engine = np.concatenate([engine, np.full(len(extra), np.nan)])
    # a stage before the HTTP arrival means the handler or core stamp belongs elsewhere:
    # keep only what follows arrival
    handler[~(handler >= arrival)] = np.nan
    fe = np.concatenate([known, np.ones(len(extra), dtype=bool)])
    engine[~fe | ~(engine >= arrival)] = np.nan
    names = distinct_names(client, arrival)
    pad = len(extra)
    requests = Requests(
        arrival_s=arrival,
        prompt_tokens=np.concatenate([rq.prompt_tokens, np.full(pad, -1)]),
        max_new_tokens=np.concatenate([rq.max_new_tokens, np.full(pad, -1)]),
        first_token_s=np.concatenate([rq.first_token_s, np.full(pad, np.nan)]),
        handler_s=handler,
        engine_s=engine,
    )
    assert len(names) == n
    renamed = sum(1 for a, b in zip(names, client, strict=True) if a != b)
    return RequestJoin(names, requests, index, renamed)


def last_stamps(t: np.ndarray, v: np.ndarray, n: int) -> np.ndarray:
    """Per request ``0..n-1`` of a log, the time `t` of the last stamp whose value `v` names
    it (a value's integer part, as ``int()`` truncates; a value that names no request, NaN
    included, is left out), NaN where none does: an array, not a dictionary per request."""
    out = np.full(n, np.nan)
    k = np.trunc(np.asarray(v, dtype=np.float64))
    ok = (k >= 0) & (k < n)
    k_rev, t_rev = k[ok].astype(np.int64)[::-1], np.asarray(t, dtype=np.float64)[ok][::-1]
    named, last = np.unique(k_rev, return_index=True)  # the first from the end: the last
    out[named] = t_rev[last]
    return out


def distinct_names(names: list[str], arrival: np.ndarray) -> list[str]:
    """`names` with every repeat but the earliest arrival's suffixed ``~K`` (K >= 2)."""
    out = list(names)
    taken: set[str] = set()  # every name, then every name given
    repeated: set[str] = set()
    for nm in names:
        (repeated if nm in taken else taken).add(nm)
    groups: dict[str, list[int]] = {}  # the rows of repeated names only (a list for every
    for i, nm in enumerate(names):  # request: 5 MB at 21 k requests, gone when it returns)
        if nm in repeated:
            groups.setdefault(nm, []).append(i)
    for nm, rows in groups.items():
        key = np.nan_to_num(arrival[rows], nan=np.inf)
        order = [rows[j] for j in np.argsort(key, kind="stable")]
        k = 2
        for i in order[1:]:
            while f"{nm}{REPEAT_SEP}{k}" in taken:
                k += 1
            out[i] = f"{nm}{REPEAT_SEP}{k}"
            taken.add(out[i])
            k += 1
    return out
