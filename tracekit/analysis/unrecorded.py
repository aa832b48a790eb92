"""Where a run's evidence is missing: per recording process, the span its rows cover and
the client-gap time left `unrecorded` for want of it, and the processes that left no log.

`unrecorded_report` is what `analyze`, `report` and `merge` print (docs/partition.md,
"Unrecorded windows"): one entry per process whose span is partial (recovered from parts
after a kill) or that left client-gap time unrecorded, and one per missing process (named
in ``meta["missing_processes"]`` by the merge). A run whose every process stopped cleanly
and left nothing unrecorded has no entry: its outputs are as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tracekit.attribution.client import (
    UNRECORDED_API,
    UNRECORDED_CORE,
    ClientPartition,
    client_gaps,
    client_partition,
    core_process,
)
from tracekit.log.rawlog import RawLog
from tracekit.log.serve_contract import ADDED, CORE, FRONTEND


def unrecorded_report(log: RawLog, cp: ClientPartition | None = None) -> list[dict[str, Any]]:
    """Entries (JSON-ready dicts with a readable ``line``) for the processes whose evidence
    is partial or missing; `cp`: the run's client partition if already computed."""
    if cp is None and len(log.client_emissions):
        cp = client_partition(log)
    core = core_process(log)
    return unrecorded_entries(
        log,
        lambda k, role: _unrecorded_of(log, cp, k, role, core),
        cp is not None and len(cp) > 0,
        lambda t_s: _added_before(log, t_s),
    )


def unrecorded_entries(
    log: RawLog,
    lost: Callable[[int, str], tuple[float, int]],
    has_gaps: bool,
    added_before: Callable[[float], int],
) -> list[dict[str, Any]]:
    """`unrecorded_report` from what it reads of the client partition and the counters:
    `lost(process, role)`, the (ms, gaps) of client-gap time left unrecorded for want of
    that process; `has_gaps`, whether the run has client gaps; `added_before(t_s)`, the
    requests the engine core added before `t_s`. `log`: the run's meta, config and
    coverage (a long run's gaps are partitioned in slices: `tracekit.analysis.stream_client`)."""
    procs = log.meta.get("processes")
    procs = procs if isinstance(procs, list) and procs else [dict(log.config.get("process", {}))]
    core = core_process(log)
    cov = log.coverage
    out: list[dict[str, Any]] = []
    api_starts = [
        float(cov.t_start_s[r])
        for r in range(len(cov))
        if int(cov.process[r]) < len(procs)
        and isinstance(procs[int(cov.process[r])], dict)
        and procs[int(cov.process[r])].get("role") == FRONTEND
    ]
    first_api = min(api_starts, default=None)  # the earliest API server's recorder start
    for row in range(len(cov)):
        k = int(cov.process[row])
        p = procs[k] if k < len(procs) and isinstance(procs[k], dict) else {}
        role = str(p.get("role", "process"))
        ms, n = lost(k, role)
        clean = bool(cov.is_clean_stop[row])
        t0, t1 = float(cov.t_start_s[row]), float(cov.t_end_s[row])
        early = added_before(t0) if role == FRONTEND and t0 == first_api else 0
        if clean and ms <= 0 and not early:
            continue
        what = f"{role} pid {p.get('pid', '?')}"
        span = (
            f"rows from {t0:.3f} s to its stop at {t1:.3f} s"
            if clean
            else f"no rows after {t1:.3f} s (killed? recovered from parts)"
        )
        if early:
            span += (
                f", none before {t0:.3f} s (its recorder started then): {early} request(s) "
                "the engine core added before that have no client boundary"
            )
        # client gaps depend on the engine core and the API servers only (workers' time is
        # inside the engine core's forward windows)
        depends = role in (CORE, FRONTEND) or k == core
        gone = (
            f", {ms / 1e3:.3f} s of client gap time unrecorded ({n} gaps)"
            if has_gaps and depends
            else ""
        )
        out.append({
            "process": k, "role": role, "pid": p.get("pid"), "t_start_s": t0, "t_end_s": t1,
            "is_clean_stop": clean, "unrecorded_ms": ms, "gaps": n,
            "line": f"{what}: {span}{gone}",
        })  # fmt: skip
    for m in log.meta.get("missing_processes", []) or []:
        if isinstance(m, dict):
            from tracekit.log.merge import missing_line  # deferred: merged server runs only

            out.append({"process": None, **m, "line": missing_line(m)})
    return out


def _added_before(log: RawLog, t_s: float) -> int:
    """Requests the engine core added (counter ``serve.added``) before `t_s`: an API server
    must have sent them, but none was recording yet."""
    if ADDED not in log.counter_names:
        return 0
    c = log.counters
    m = c.name == log.counter_names.index(ADDED)
    return int((c.t_s[m] < t_s).sum())


def _unrecorded_of(
    log: RawLog, cp: ClientPartition | None, k: int, role: str, core: int
) -> tuple[float, int]:
    """(ms, gaps) of client-gap time unrecorded because process `k` recorded nothing."""
    if cp is None or not len(cp):
        return 0.0, 0
    if k == core and UNRECORDED_CORE in cp.labels:
        v = cp.column(UNRECORDED_CORE)
    elif role == FRONTEND and UNRECORDED_API in cp.labels:
        # each gap's frontend part depends on the API server that wrote its later chunk
        v = np.where(client_gaps(log).process == k, cp.column(UNRECORDED_API), 0.0)
    else:
        return 0.0, 0
    return float(v.sum()), int((v > 0).sum())


__all__ = ["unrecorded_entries", "unrecorded_report"]
