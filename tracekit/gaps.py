"""Single gaps as records: for drilling into the tail (`tracekit gaps`, the HTML report)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .partition import Partition, partition
from .rawlog import RawLog


def gap_records(
    log: RawLog,
    part: Partition | None = None,
    *,
    min_ms: float | None = None,
    request_id: str | None = None,
    index: np.ndarray | None = None,
) -> list[dict[str, Any]]:
    """One dict per gap: request (its id), t0, t1 (s, engine clock), gap_ms, parts and
    context (ms by label; parts sum to gap_ms), primary, and the steps it spans."""
    p = part if part is not None else partition(log)
    sel = np.ones(len(p), dtype=bool) if index is None else np.zeros(len(p), dtype=bool)
    if index is not None:
        sel[index] = True
    if min_ms is not None:
        sel &= p.gap_ms >= min_ms
    ids = log.request_ids or tuple(str(i) for i in range(len(log.requests)))
    if request_id is not None:
        if request_id not in ids:
            from .errors import LogError

            raise LogError(log.path, "request", f"no request with id {request_id!r} in this run")
        sel &= p.request == ids.index(request_id)
    rows = np.flatnonzero(sel) if index is None else np.asarray(index)[sel[np.asarray(index)]]
    prim = p.primary_names()
    out = []
    for i in rows.tolist():
        out.append(
            {
                "request": ids[int(p.request[i])],
                "t0": float(p.t0_s[i]),
                "t1": float(p.t1_s[i]),
                "gap_ms": float(p.gap_ms[i]),
                "parts": {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[i], strict=True)},
                "context": {
                    lb: float(v) for lb, v in zip(p.labels, p.context_ms[i], strict=True) if v
                },
                "primary": str(prim[i]),
                "step0": int(p.step0[i]),
                "step1": int(p.step1[i]),
            }
        )
    return out
