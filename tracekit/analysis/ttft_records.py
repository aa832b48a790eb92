"""Single TTFTs as records (`tracekit ttft --format jsonl`), as `tracekit.analysis.gaps`
has gaps: each request's phases, parts and context, and the evictions its `preempt` part and
its share of others' re-prefill come from (docs/ttft.md)."""

from __future__ import annotations

import numpy as np

from tracekit.attribution.evictions import name_preempt, name_reprefill, ttft_named_windows
from tracekit.attribution.ttft import PHASES, TtftPartition, ttft_partition
from tracekit.errors import LogError
from tracekit.log.rawlog import RawLog


def ttft_records(log: RawLog, p: TtftPartition | None = None, *, min_ms: float | None = None,
                 request_id: str | None = None) -> list[dict]:  # fmt: skip
    """One dict per request (as `tracekit.analysis.gaps.gap_records` for gaps): request id, arrival,
    admission (null: unsplit), first token (s, engine clock), ttft_ms, phases and parts
    (ms; each sums to ttft_ms), context (what ran while held or evicted), primary; a
    request with `preempt` time also has ``preempt_causes`` (its pieces, each naming the
    eviction it comes from) and one whose others' prefill holds another's re-prefill
    ``recompute_causes`` (each naming the victim's eviction), as a gap's record has them
    (docs/ttft.md, rule 4)."""
    p = p if p is not None else ttft_partition(log)
    ids = log.request_ids or tuple(str(i) for i in range(len(log.requests)))
    sel = np.ones(len(p), dtype=bool)
    if min_ms is not None:
        sel &= p.ttft_ms >= min_ms
    if request_id is not None:
        if request_id not in ids:
            raise LogError(log.path, "request", f"no request with id {request_id!r} in this run")
        sel &= p.request == ids.index(request_id)
    prim = p.primary_names()
    rows = np.flatnonzero(sel)
    named = ttft_named_windows(log, p)
    pre, rc = name_preempt(log, named, rows), name_reprefill(log, named, rows)
    out = []
    for i in rows.tolist():
        adm = float(p.admit_s[i])
        out.append(
            {
                "request": ids[int(p.request[i])],
                "arrival": float(p.arrival_s[i]),
                "admitted": adm if np.isfinite(adm) else None,
                "first_token": float(p.first_token_s[i]),
                "ttft_ms": float(p.ttft_ms[i]),
                "phases": {ph: float(v) for ph, v in zip(PHASES, p.phases_ms[i], strict=True)},
                "parts": {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[i], strict=True)},
                "context": {
                    lb: float(v) for lb, v in zip(p.labels, p.context_ms[i], strict=True) if v
                },
                "primary": str(prim[i]),
            }
        )
        if i in pre:
            out[-1]["preempt_causes"] = pre[i]
        if i in rc:
            out[-1]["recompute_causes"] = rc[i]
    return out
