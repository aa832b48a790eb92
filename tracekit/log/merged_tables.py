"""The tables a merged server run's parts carry beside the engine core's rows
(docs/design.md, "A merged server run's parts").

A server's run merged into a parts folder (`tracekit.log.merge_stream`) is the engine
core's parts, each with what the merge adds: the other processes' rows that fall in the
part's time range on the core's clock, and what the merge knows of the run as a whole. A
part holds them as float64 tables (seconds on the run's clock, like the one-file log's;
ids and counts are whole numbers, exact in a float64 below 2**53):

- ``proc_segments``, ``client_emissions``, ``deliveries``, ``proc_os``: the rows of the
  one-file log's tables of those names (`tracekit.log.rawlog`), each with ``row``, its
  row in the whole run's table: rows are spread over the parts by time, and ``row`` puts
  them back in the order the one-file merge writes them;
- ``client_requests``: per request the part names, its arrival, handler and engine
  stages as the join gave them (`tracekit.log.request_identity`);
- ``proc_coverage``: each process's span on the run's clock (in the last part);
- ``tp_segments``: where the tensor-parallel rule carved the part's forward windows, the
  part's engine segments in seconds (they replace its ``segments``).

A reader parses them with a part's other tables (`merged_tables_of`: a reader that keeps
only some of a part's tables leaves them out unless it names them) and lays them over the
log the core's rows make (`apply_merged`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.log.rawlog import (
    ClientEmissions,
    Coverage,
    Deliveries,
    ProcOs,
    ProcSegments,
    RawLog,
    Segments,
)

#: Per table, its columns in row order (every column float64).
MERGED_TABLES: dict[str, tuple[str, ...]] = {
    "proc_segments": ("process", "label", "t_start_s", "t_end_s", "row"),
    "client_emissions": ("request", "t_s", "t_ready_s", "num_tokens", "process", "row"),
    "deliveries": ("step", "t_out_s", "t_recv_s", "process", "row"),
    "proc_os": (
        "process", "t_start_s", "t_end_s", "runqueue_s", "offcpu_s", "in_segment", "row",
    ),
    "client_requests": ("request", "arrival_s", "handler_s", "engine_s"),
    "proc_coverage": ("process", "t_start_s", "t_end_s", "is_clean_stop"),
    "tp_segments": ("step", "label", "t_start_s", "t_end_s", "thread", "is_device"),
}  # fmt: skip
#: The one-file log's table each ordered merged table becomes.
_ORDERED: dict[str, Any] = {
    "proc_segments": ProcSegments,
    "client_emissions": ClientEmissions,
    "deliveries": Deliveries,
    "proc_os": ProcOs,
}


def merged_tables_of(z: Mapping[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """A part's merged tables (those it has), as (rows, columns) arrays, checked."""
    out = {}
    for k, cols in MERGED_TABLES.items():
        if k not in z:
            continue
        a = np.asarray(z[k])
        if a.dtype != np.float64:
            raise LogError(where, k, f"dtype {a.dtype} (expected float64)")
        if a.size % len(cols):
            raise LogError(where, k, f"{a.size} values do not make rows of {len(cols)}")
        out[k] = a.reshape(-1, len(cols))
    return out


def merged_rows(table: str, **cols: np.ndarray) -> np.ndarray:
    """Rows of merged table `table` from its columns by name (flat, as a part stores it)."""
    names = MERGED_TABLES[table]
    if set(cols) != set(names):
        raise KeyError(f"{table}: columns {sorted(cols)}, expected {list(names)}")
    a = np.column_stack([np.asarray(cols[c], dtype=np.float64) for c in names])
    return a.reshape(-1)


def apply_merged(log: RawLog, merged: Mapping[str, np.ndarray], first_step: int = 0) -> RawLog:
    """`log` (the engine core's rows of a merged run's parts) with the merged tables laid
    over it; `first_step`: the step a log read from a later part is numbered from (the
    merged tables' steps are renumbered alike). A log without them: as it is."""
    if not merged:
        return log
    fields: dict[str, Any] = {}
    for k, cls in _ORDERED.items():
        if k not in merged:
            continue
        rows = merged[k]
        rows = rows[np.argsort(rows[:, -1], kind="stable")]  # back in the run's order
        cols = {c: rows[:, j] for j, c in enumerate(MERGED_TABLES[k][:-1])}
        if "step" in cols and first_step:
            cols["step"] = np.where(cols["step"] >= 0, cols["step"] - first_step, cols["step"])
        fields[k] = cls.from_columns(**cols)
    if "client_requests" in merged:
        fields["requests"] = _requests_with(log, merged["client_requests"])
    if "proc_coverage" in merged:
        c = merged["proc_coverage"]
        fields["coverage"] = Coverage.from_columns(
            **{n: c[:, j] for j, n in enumerate(MERGED_TABLES["proc_coverage"])}
        )
    if "tp_segments" in merged:
        s = merged["tp_segments"]
        cols = {n: s[:, j] for j, n in enumerate(MERGED_TABLES["tp_segments"])}
        if first_step:
            cols["step"] = np.where(cols["step"] >= 0, cols["step"] - first_step, cols["step"])
        fields["segments"] = Segments.from_columns(**cols)
    return replace(log, **fields)


def _requests_with(log: RawLog, rows: np.ndarray) -> Any:
    """The log's requests with each listed request's stages as the join gave them."""
    rq = log.requests
    n = len(log.request_ids)
    req = rows[:, 0].astype(np.int64)
    ok = (req >= 0) & (req < n)
    arrival, handler, engine = rq.arrival_s.copy(), np.full(n, np.nan), np.full(n, np.nan)
    if len(rq.handler_s) == n:
        handler = rq.handler_s.astype(np.float64).copy()
    if len(rq.engine_s) == n:
        engine = rq.engine_s.astype(np.float64).copy()
    arrival[req[ok]], handler[req[ok]], engine[req[ok]] = rows[ok, 1], rows[ok, 2], rows[ok, 3]
    return replace(rq, arrival_s=arrival, handler_s=handler, engine_s=engine)
