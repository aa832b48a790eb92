"""The flushed rows: what the recorder hands to every sink at each flush, and what a part on
disk holds.

At a bounded interval the recorder swaps out its flat row buffers; the dispatcher turns one
or more consecutive swaps into one `FlushedRows` and gives it to every sink (parts on
disk, memory, live metrics, a live trace). It is the contract between the recorder and
its sinks, and the format of a part (``part-NNNNNN.npz`` holds exactly these arrays):

- one flat array of rows per table of `TABLES` (the column names, in order; every column
  int64, the ``counters`` table float64, see `DTYPES`). Tick columns (``*_tick``) are
  readings of the recorder's clock; ids index the vocabularies;
- ``labels``, ``counter_names``: the vocabularies at the flush (complete, not deltas);
- ``request_ids``: the request ids new since the previous flush, the first of them at
  index ``request_ids_start``;
- ``config`` (JSON text), ``flush_tick``, ``t0_tick``, ``seconds_per_tick``; on the last
  flush of a run ``stop_tick``; ``dropped_rows`` when a sink shed rows (a full disk);
  ``open_tick`` when a window (a segment on any thread, a collection on another thread)
  was still open at the flush: the earliest start of one, whose row comes in a later
  flush, so no gap after this tick is final yet; ``first_step``: the number of the first
  step whose row the flush holds (rows name steps by number: a reader that starts at a
  later part, the earlier ones removed, places them with it).

Readers go through `FlushedRows.table` and `FlushedRows.column` (by name), never by
column position. A part written before a table existed lacks it (`OPTIONAL_TABLES`); it
reads as empty. (Not to be confused with an SSE chunk of a streamed response, nor with a
prefill chunk, a slice of a prompt computed in one step.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from tracekit.formats import json_safe
from tracekit.log.rawlog import MODE_UNKNOWN, Evictions

#: Per table, its columns in row order. Ticks of the recorder's clock end in ``_tick``.
TABLES: dict[str, tuple[str, ...]] = {
    "steps": (
        "t0_tick", "t1_tick", "num_decode", "num_prefill_tokens", "graph_size",
        "num_preempted", "num_swapped_in",
    ),
    "segments": ("step", "label", "t0_tick", "t1_tick", "thread", "is_device"),
    "gc_pauses": ("t0_tick", "t1_tick", "generation"),
    "emissions": ("request", "t_tick", "step", "num_tokens", "device_step"),
    "events": ("request", "kind", "t_tick", "mode"),  # kind: EVICT or READMIT
    "requests": ("request", "arrival_tick", "prompt_tokens", "max_new_tokens"),
    "counters": ("name", "t_tick", "value"),  # float64: a sampled value need not be whole
    "admissions": ("request", "t_tick"),  # the first time the scheduler took the request
    "prefill_chunks": ("step", "request", "num_tokens"),  # a prompt chunk computed in a step
    "waits": ("step", "request", "reason"),  # why a waiting request was not admitted
    # the OS's account of a recording thread (totals since it started; -1: not available)
    "os_samples": (
        "thread", "kind", "t_tick", "cpu_ns", "runqueue_ns", "num_voluntary_switches",
        "num_involuntary_switches", "num_major_faults",
    ),
    # why an eviction happened (at its `events` row's tick; -1: a count not told)
    "preemptions": (
        "step", "request", "t_tick", "reason", "num_computed_tokens_lost", "num_free_blocks",
        "num_used_blocks",
    ),
    "evictors": ("request", "t_tick", "evictor"),  # whose need evicted `request` at `t_tick`
}  # fmt: skip
#: Each table's dtype (every column of a table shares it).
DTYPES: dict[str, type[np.generic]] = {
    k: (np.float64 if k == "counters" else np.int64) for k in TABLES
}
#: Tables added after the first parts format: a part written before them lacks them.
OPTIONAL_TABLES = frozenset(
    {"admissions", "prefill_chunks", "waits", "os_samples", "preemptions", "evictors"}
)
#: The scalar and vocabulary arrays beside the tables.
VOCAB_KEYS = ("labels", "counter_names", "request_ids")
SCALAR_KEYS = (
    "request_ids_start", "config", "flush_tick", "t0_tick", "seconds_per_tick", "stop_tick",
    "dropped_rows", "open_tick", "first_step",
)  # fmt: skip
#: Every array a flush may hold (anything else in a part's archive is left unread).
KEYS = frozenset(TABLES) | frozenset(VOCAB_KEYS) | frozenset(SCALAR_KEYS)

T = TypeVar("T")

EVICT, READMIT = 0, 1  # ``events.kind``
UNKNOWN_TICK = np.iinfo(np.int64).min  # a tick that was not recorded (an arrival)


def column_index(table: str, column: str) -> int:
    """The position of `column` in `table`'s rows (a KeyError names both if unknown)."""
    try:
        return TABLES[table].index(column)
    except ValueError:
        raise KeyError(f"{table}.{column}: no such column (columns: {TABLES[table]})") from None


def columns(table: str, rows: np.ndarray) -> dict[str, np.ndarray]:
    """`rows` of `table` (shape (n, k)) as its columns by name (views, not copies)."""
    return {c: rows[:, j] for j, c in enumerate(TABLES[table])}


#: The raw-log field a flush's tick column becomes (in seconds); other fields keep the name.
TICK_FIELDS = {"t_start_s": "t0_tick", "t_end_s": "t1_tick", "t_s": "t_tick"}


def to_table(cls: type[T], table: str, rows: np.ndarray, secs: Callable[[np.ndarray], Any]) -> T:
    """The raw-log table `cls` (`Steps`, `Segments`, ...) of `table`'s rows, column by name:
    each field of ``cls.DTYPES`` takes the flush column of its name (ticks through `secs`
    for the ``*_s`` fields, see `TICK_FIELDS`); fields the flush lacks keep their default."""
    fields: dict[str, np.ndarray] = {}
    for field, dtype in cls.DTYPES.items():  # type: ignore[attr-defined]
        src = TICK_FIELDS.get(field, field)
        if src not in TABLES[table]:
            continue
        col = rows[:, column_index(table, src)]
        fields[field] = np.array(secs(col) if src.endswith("_tick") else col, dtype=dtype)
    return cls(**fields)


def empty_rows(table: str) -> np.ndarray:
    """No rows of `table`: shape (0, number of columns), its dtype."""
    return np.zeros((0, len(TABLES[table])), dtype=DTYPES[table])


class FlushedRows(Mapping[str, np.ndarray]):
    """One flush: its arrays by name (a read-only mapping, what a part stores), with named
    access to its tables and columns.

    Wraps any mapping of the arrays above (a part read back from disk, a test's dict):
    `FlushedRows.of(x)` returns `x` itself when it already is one."""

    __slots__ = ("_arrays",)

    def __init__(self, arrays: Mapping[str, Any]) -> None:
        self._arrays = dict(arrays)

    @classmethod
    def of(cls, x: Mapping[str, Any]) -> FlushedRows:
        return x if isinstance(x, FlushedRows) else cls(x)

    # -- the mapping (what np.savez writes) ----------------------------------------------
    def __getitem__(self, key: str) -> np.ndarray:
        return self._arrays[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    # -- named access ----------------------------------------------------------------------
    def table(self, name: str) -> np.ndarray:
        """`name`'s rows, shape (n, len(TABLES[name])); empty if this flush lacks the table."""
        cols = TABLES[name]
        a = self._arrays.get(name)
        if a is None:
            return empty_rows(name)
        return np.asarray(a).reshape(-1, len(cols))

    def column(self, table: str, column: str) -> np.ndarray:
        """One column of `table`, by name."""
        return self.table(table)[:, column_index(table, column)]

    def num_values(self) -> int:
        """How many table values this flush holds (what bounds the memory it takes)."""
        return sum(int(np.asarray(self._arrays[k]).size) for k in TABLES if k in self._arrays)

    def strings(self, key: str) -> list[str]:
        """A vocabulary (``labels``, ``counter_names``, ``request_ids``); [] if absent."""
        a = self._arrays.get(key)
        return [] if a is None else [str(x) for x in np.asarray(a).reshape(-1)]

    def scalar(self, key: str, default: int | None = None) -> int | None:
        """An integer scalar (``flush_tick``, ``stop_tick``, ...); `default` if absent."""
        a = self._arrays.get(key)
        return default if a is None else int(np.asarray(a))

    @property
    def is_last(self) -> bool:
        """Whether this is the run's last flush (it carries ``stop_tick``)."""
        return "stop_tick" in self._arrays

    def with_tables_emptied(self, dropped: int) -> FlushedRows:
        """The same vocabularies without rows, counting `dropped` more dropped values."""
        out = dict(self._arrays)
        for k in TABLES:
            if k in out:
                out[k] = np.zeros(0, dtype=np.asarray(out[k]).dtype)
        out["dropped_rows"] = np.array(int(self.scalar("dropped_rows", 0) or 0) + dropped)
        return FlushedRows(out)


def build_flushed(
    buffers: Sequence[Mapping[str, Any]],
    *,
    labels: Sequence[str],
    counter_names: Sequence[str],
    request_ids: Sequence[str],
    request_ids_start: int,
    config: Mapping[str, Any],
    flush_tick: int,
    t0_tick: int,
    seconds_per_tick: float,
    stop_tick: int | None = None,
    open_tick: int | None = None,
    first_step: int | None = None,
) -> FlushedRows:
    """One `FlushedRows` from the row buffers of one or more consecutive flushes (each a
    mapping table -> flat buffer of that table's dtype, such as ``array.array``), in order.

    The arrays share the buffers' memory (``np.frombuffer``): nothing may append to them
    any more. Every table array is read-only: one flush goes to every sink."""
    arrays: dict[str, Any] = {}
    for k in TABLES:
        parts = [np.frombuffer(b[k], dtype=DTYPES[k]) for b in buffers]
        a = parts[0] if len(parts) == 1 else np.concatenate(parts)
        a.flags.writeable = False
        arrays[k] = a
    arrays["labels"] = np.array(list(labels), dtype=str)
    arrays["counter_names"] = np.array(list(counter_names), dtype=str)
    arrays["request_ids"] = np.array(list(request_ids), dtype=str)
    arrays["request_ids_start"] = np.array(request_ids_start, dtype=np.int64)
    arrays["config"] = np.array(json.dumps(json_safe(config), sort_keys=True))
    arrays["flush_tick"] = np.array(flush_tick, dtype=np.int64)
    arrays["t0_tick"] = np.array(t0_tick, dtype=np.int64)
    arrays["seconds_per_tick"] = np.array(seconds_per_tick)
    if stop_tick is not None:
        arrays["stop_tick"] = np.array(stop_tick, dtype=np.int64)
    if open_tick is not None:
        arrays["open_tick"] = np.array(open_tick, dtype=np.int64)
    if first_step is not None:
        arrays["first_step"] = np.array(first_step, dtype=np.int64)
    return FlushedRows(arrays)


def pair_evictions(events: np.ndarray, secs: Callable[[np.ndarray], np.ndarray]) -> Evictions:
    """The `Evictions` table of ``events`` rows: each eviction paired with the next
    readmission of the same request (NaN: none). `secs` turns ticks into seconds."""
    if len(events) == 0:
        return Evictions.empty()
    c_req, c_kind = column_index("events", "request"), column_index("events", "kind")
    c_t, c_mode = column_index("events", "t_tick"), column_index("events", "mode")
    ev = events[np.lexsort((np.arange(len(events)), events[:, c_t], events[:, c_req]))]
    req, kind, t, mode = ev[:, c_req], ev[:, c_kind], ev[:, c_t], ev[:, c_mode]
    rows: list[tuple[int, int, int, int]] = []
    open_at: dict[int, tuple[int, int]] = {}
    for i in range(len(ev)):  # per eviction event, not per token: a few hundred per run
        r = int(req[i])
        if kind[i] == EVICT:
            if r in open_at:  # evicted again without a readmission: close the first at NaN
                t_ev, m = open_at.pop(r)
                rows.append((r, t_ev, UNKNOWN_TICK, m))
            open_at[r] = (int(t[i]), int(mode[i]))
        elif r in open_at:
            t_ev, m = open_at.pop(r)
            rows.append((r, t_ev, int(t[i]), m))
    for r, (t_ev, m) in open_at.items():
        rows.append((r, t_ev, UNKNOWN_TICK, m))
    a = np.array(rows, dtype=np.int64).reshape(-1, 4)
    a = a[np.lexsort((a[:, 1], a[:, 0]))]
    readmit = secs(a[:, 2])
    readmit[a[:, 2] == UNKNOWN_TICK] = np.nan
    mode_col = a[:, 3].copy()
    mode_col[mode_col < MODE_UNKNOWN] = MODE_UNKNOWN
    return Evictions(
        request=a[:, 0].copy(), t_evict_s=secs(a[:, 1]), t_readmit_s=readmit, mode=mode_col
    )


__all__ = [
    "DTYPES",
    "EVICT",
    "KEYS",
    "OPTIONAL_TABLES",
    "READMIT",
    "TABLES",
    "UNKNOWN_TICK",
    "FlushedRows",
    "build_flushed",
    "column_index",
    "columns",
    "to_table",
    "empty_rows",
    "pair_evictions",
]
