"""The raw log: one run's recorded events, the boundary between capture and analysis.

A `RawLog` holds flat numpy tables with every time in seconds from engine start (the
recorder's start). Capture writes one; analysis reads one and never sees a live engine.

On disk it is one `.npz` per run (`save`/`load`), self-describing:

- ``schema`` = ``"tracekit.rawlog"``, ``schema_version`` = 5 (version 4, which has no
  ``preemptions`` and ``evictors``, version 3, which has no ``coverage`` either, version 2,
  which has no ``os_samples`` either, and version 1, which has no TTFT tables either, still
  load: the tables they lack are empty; an empty ``coverage`` means the span each process
  covers is unknown, never that it is partial; empty ``preemptions``, that no eviction's
  cause was recorded);
- one array per table column, named ``TABLE.COLUMN`` with the unit in the column name
  (``steps.t_start_s``, ``segments.label``, ...);
- ``labels`` (segment label vocabulary), ``cause_map`` (JSON), ``config`` (JSON),
  ``meta`` (JSON: clock source, tracekit version, warnings recorded at capture),
  ``request_ids`` (strings), ``counter_names``, ``wall_s``, ``wait_reasons`` (the
  vocabulary of ``waits.reason``, written so a log explains its own codes),
  ``preempt_reasons`` (the same for ``preemptions.reason``);
- a run merged from a multi-process server (`tracekit.log.merge`) also has the optional tables
  ``proc_segments``, ``client_emissions``, ``deliveries`` and ``proc_os`` (absent in other
  logs: loaded as empty).

`load` also reads the *published* layout (the `.npz` files written by the method tracekit
industrialises, design.md's table) unchanged: `tracekit.log.published`. A log can never
execute code: `tracekit.log.archive` reads the arrays from their `.npy` headers with pickles
refused, and members the layout does not define are skipped unread; what it reads is
bounded by the file (see `tracekit.log.archive`), and names longer than `MAX_NAME_CHARS` are
shortened at load so that no output repeats a huge string per gap. What is rejected and
what is only warned about: `tracekit.log.validate`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from tracekit.errors import LogError, one_line
from tracekit.formats import json_safe
from tracekit.fsio import atomic_open
from tracekit.labels import DEFAULT_CAUSE_MAP
from tracekit.log.archive import column, json_member, scalar_str, str_list

SCHEMA = "tracekit.rawlog"
SCHEMA_VERSION = 5
#: Versions `load` reads: 1 lacks the TTFT tables (admissions, prefill_chunks, waits), 2
#: lacks the OS evidence (os_samples), 3 the span each recording process covers (coverage),
#: 4 the causes of evictions (preemptions, evictors).
READABLE_VERSIONS = (1, 2, 3, 4, 5)

#: Why the scheduler did not admit a waiting request in a step (`waits.reason` codes).
#: `kv_blocks`: not enough free KV blocks (including a watermark's headroom);
#: `max_num_seqs`: the running batch is full; `token_budget`: the step's token budget is
#: spent; `preempted_first`: preempted requests are readmitted before new ones;
#: `other`: a reason the engine has but this vocabulary does not name; `tokenizing`: the
#: prompt is still being tokenised off the engine loop. New reasons are only appended
#: (codes never change; each log stores the vocabulary it was written with).
WAIT_REASONS: tuple[str, ...] = (
    "kv_blocks",
    "max_num_seqs",
    "token_budget",
    "preempted_first",
    "other",
    "tokenizing",
)
WAIT_REASON_CODES: dict[str, int] = {name: i for i, name in enumerate(WAIT_REASONS)}

#: Why the scheduler evicted a running request (`preemptions.reason` codes). `kv_full`:
#: the KV cache had no free block for what another request needed (its admission, a
#: prefill chunk, a decode step's growth); `priority`: a request of higher priority took
#: its place; `other`: a reason the engine has but this vocabulary does not name. New
#: reasons are only appended (codes never change; each log stores its vocabulary).
PREEMPT_REASONS: tuple[str, ...] = ("kv_full", "priority", "other")
PREEMPT_REASON_CODES: dict[str, int] = {name: i for i, name in enumerate(PREEMPT_REASONS)}

# Eviction modes.
MODE_SWAP = 0
MODE_RECOMPUTE = 1
MODE_UNKNOWN = -1
MODES = {"swap": MODE_SWAP, "recompute": MODE_RECOMPUTE, "unknown": MODE_UNKNOWN}

# `steps.graph_size`: -1 no decode rows in the step, 0 ran eager, n > 0 padded captured size.
GRAPH_EAGER = 0


class _Table:
    """A table of equal-length 1-D numpy columns. Subclasses are dataclasses of columns."""

    DTYPES: dict[str, Any] = {}

    def __len__(self) -> int:
        first = fields(self)[0].name  # type: ignore[arg-type]
        return int(len(getattr(self, first)))

    @classmethod
    def empty(cls):
        return cls(**{k: np.zeros(0, dtype=d) for k, d in cls.DTYPES.items()})

    @classmethod
    def from_columns(cls, **cols):
        """The table from named columns; a column with a dataclass default may be left out."""
        return cls(**{k: np.asarray(cols[k], dtype=d) for k, d in cls.DTYPES.items() if k in cols})

    @classmethod
    def from_rows(cls, rows: Any, *, time: Any = None, **fill: Any):
        """The table from a 2-D array of rows whose columns are this table's in `DTYPES`
        order (the order of the recorder's buffers and of the published layout).

        `time`: a function applied to the time columns (named ``*_s``), e.g. ticks or
        milliseconds to seconds. Columns past the array's width take their value from
        `fill` (a scalar or an array), or their dataclass default."""
        rows = np.asarray(rows)
        if rows.ndim != 2:
            raise ValueError(f"{cls.__name__}.from_rows: expected rows (n, k), got {rows.shape}")
        cols: dict[str, np.ndarray] = {}
        for j, (name, dtype) in enumerate(cls.DTYPES.items()):
            if j < rows.shape[1]:
                col = rows[:, j]
                if time is not None and name.endswith("_s"):
                    col = time(col)
                cols[name] = np.array(col, dtype=dtype)  # a contiguous copy
            elif name in fill:
                cols[name] = np.broadcast_to(np.asarray(fill[name], dtype=dtype), len(rows)).copy()
        return cls(**cols)

    def take(self, idx):
        return type(self)(**{k: getattr(self, k)[idx] for k in self.DTYPES})

    def columns(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.DTYPES}


@dataclass(frozen=True)
class Steps(_Table):
    """One row per engine step. `t_start_s`/`t_end_s`: the step's boundaries, engine clock."""

    t_start_s: np.ndarray
    t_end_s: np.ndarray
    num_decode: np.ndarray  # decode rows in the step
    num_prefill_tokens: np.ndarray  # prompt tokens prefilled in the step
    graph_size: np.ndarray  # -1 no decode, 0 eager, n > 0 padded captured batch size
    num_preempted: np.ndarray  # requests evicted during the step
    num_swapped_in: np.ndarray  # requests readmitted during the step
    DTYPES = {
        "t_start_s": np.float64,
        "t_end_s": np.float64,
        "num_decode": np.int64,
        "num_prefill_tokens": np.int64,
        "graph_size": np.int64,
        "num_preempted": np.int64,
        "num_swapped_in": np.int64,
    }


@dataclass(frozen=True)
class Segments(_Table):
    """Labelled windows. `step` is -1 for a window outside any step (another thread)."""

    step: np.ndarray
    label: np.ndarray  # index into RawLog.labels
    t_start_s: np.ndarray
    t_end_s: np.ndarray
    thread: np.ndarray  # small integer per recording thread, 0 = the thread that started
    is_device: np.ndarray  # 1: device execution time (CUDA events), 0: host time
    DTYPES = {
        "step": np.int64,
        "label": np.int64,
        "t_start_s": np.float64,
        "t_end_s": np.float64,
        "thread": np.int64,
        "is_device": np.int8,
    }


@dataclass(frozen=True)
class GcPauses(_Table):
    """Garbage-collector pauses from `gc.callbacks`, with their generation."""

    t_start_s: np.ndarray
    t_end_s: np.ndarray
    generation: np.ndarray
    DTYPES = {"t_start_s": np.float64, "t_end_s": np.float64, "generation": np.int64}


@dataclass(frozen=True)
class Emissions(_Table):
    """Token emissions at the engine boundary: one row per (request, step) that emitted."""

    request: np.ndarray  # index into RawLog.requests
    t_s: np.ndarray
    step: np.ndarray
    num_tokens: np.ndarray  # > 1 when a step emits several tokens of one request (spec decoding)
    # the step whose device work this emission reads: `step` in a synchronous engine, the
    # previous step under async scheduling (results of step N are read while N+1 runs)
    device_step: np.ndarray = None  # type: ignore[assignment]  # default: `step`
    DTYPES = {
        "request": np.int64,
        "t_s": np.float64,
        "step": np.int64,
        "num_tokens": np.int64,
        "device_step": np.int64,
    }

    def __post_init__(self) -> None:
        if self.device_step is None:
            object.__setattr__(self, "device_step", np.asarray(self.step).copy())


@dataclass(frozen=True)
class Evictions(_Table):
    """Explicit evictions. `t_readmit_s` is NaN for a request never readmitted."""

    request: np.ndarray
    t_evict_s: np.ndarray
    t_readmit_s: np.ndarray
    mode: np.ndarray  # MODE_SWAP, MODE_RECOMPUTE, MODE_UNKNOWN
    DTYPES = {
        "request": np.int64,
        "t_evict_s": np.float64,
        "t_readmit_s": np.float64,
        "mode": np.int64,
    }


@dataclass(frozen=True)
class Requests(_Table):
    """One row per request. NaN arrival or first token: not recorded.

    A server run (`tracekit.log.merge`) stamps arrival where the request reached the server
    (the first byte of the HTTP request) and, optionally, two later stages before the engine
    had it: `handler_s` (the server's request handler started: body read and parsed) and
    `engine_s` (the engine core added it to its scheduler). NaN: no such stage (every
    single-process log; such logs load without these columns)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray  # -1: unknown
    max_new_tokens: np.ndarray  # -1: unknown
    first_token_s: np.ndarray
    handler_s: np.ndarray = None  # type: ignore[assignment]  # default: NaN
    engine_s: np.ndarray = None  # type: ignore[assignment]  # default: NaN
    DTYPES = {
        "arrival_s": np.float64,
        "prompt_tokens": np.int64,
        "max_new_tokens": np.int64,
        "first_token_s": np.float64,
        "handler_s": np.float64,
        "engine_s": np.float64,
    }

    def __post_init__(self) -> None:
        for name in ("handler_s", "engine_s"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.full(len(self.arrival_s), np.nan))


@dataclass(frozen=True)
class Counters(_Table):
    """Sampled engine counters (batch size, free KV blocks, ...)."""

    name: np.ndarray  # index into RawLog.counter_names
    t_s: np.ndarray
    value: np.ndarray
    DTYPES = {"name": np.int64, "t_s": np.float64, "value": np.float64}


@dataclass(frozen=True)
class Admissions(_Table):
    """The first time the scheduler took each request into a running batch (schema v2).

    At most one row per request; readmissions after an eviction are `Evictions` rows."""

    request: np.ndarray  # index into RawLog.requests
    t_s: np.ndarray
    DTYPES = {"request": np.int64, "t_s": np.float64}


@dataclass(frozen=True)
class PrefillChunks(_Table):
    """Prompt chunks a step computed in its `prefill` segments: one row per (step, request)."""

    step: np.ndarray
    request: np.ndarray
    num_tokens: np.ndarray  # prompt tokens of this request computed in the step
    DTYPES = {"step": np.int64, "request": np.int64, "num_tokens": np.int64}


@dataclass(frozen=True)
class Waits(_Table):
    """Why a waiting request was not admitted in a step: one row per (step, request)."""

    step: np.ndarray
    request: np.ndarray
    reason: np.ndarray  # index into WAIT_REASONS
    DTYPES = {"step": np.int64, "request": np.int64, "reason": np.int64}


@dataclass(frozen=True)
class Preemptions(_Table):
    """Why each eviction happened (schema v5): one row per eviction whose cause the
    scheduler told, where it decided it (`Recorder.evict(..., reason=...)`).

    A row belongs to the `Evictions` row of the same request evicted at the same time
    (`t_s` equals its `t_evict_s`: both are the one reading of the clock). The requests
    whose need took the blocks (its evictors) are `Evictors` rows with the same
    (`request`, `t_s`). -1 in a count: not told."""

    step: np.ndarray  # the step that decided it (-1: outside any step)
    request: np.ndarray  # the victim, index into RawLog.requests
    t_s: np.ndarray  # when it was evicted (its eviction's t_evict_s)
    reason: np.ndarray  # index into PREEMPT_REASONS
    num_computed_tokens_lost: np.ndarray  # the victim's computed tokens thrown away
    num_free_blocks: np.ndarray  # free KV blocks when the scheduler decided
    num_used_blocks: np.ndarray  # KV blocks in use when the scheduler decided
    DTYPES = {
        "step": np.int64,
        "request": np.int64,
        "t_s": np.float64,
        "reason": np.int64,
        "num_computed_tokens_lost": np.int64,
        "num_free_blocks": np.int64,
        "num_used_blocks": np.int64,
    }


@dataclass(frozen=True)
class Evictors(_Table):
    """The requests whose need evicted another (schema v5): one row per (eviction,
    evictor), the eviction named by its `Preemptions` row's (`request`, `t_s`). An
    eviction may have several evictors (a step's admissions together) or none told."""

    request: np.ndarray  # the victim, index into RawLog.requests
    t_s: np.ndarray  # its eviction's time (the Preemptions row's t_s)
    evictor: np.ndarray  # the request whose admission, prefill chunk or decode needed blocks
    DTYPES = {"request": np.int64, "t_s": np.float64, "evictor": np.int64}


#: `OsSamples.kind`: where a sample was read (a step's start or end, a segment's start or end).
OS_STEP_START, OS_STEP_END, OS_SEGMENT_START, OS_SEGMENT_END = 0, 1, 2, 3


@dataclass(frozen=True)
class OsSamples(_Table):
    """The operating system's account of a recording thread, read at step boundaries (and
    segment boundaries where asked): every counter is the thread's total since it started,
    so two consecutive samples of one thread bound what the OS did to it between them.
    -1: not available on this platform (docs/partition.md, "OS evidence").

    `cpu_ns`: the thread's CPU time (``CLOCK_THREAD_CPUTIME_ID``); `runqueue_ns`: time it
    was runnable but waited for a CPU (``/proc/thread-self/schedstat``, second field);
    switches and major page faults: ``getrusage(RUSAGE_THREAD)``."""

    thread: np.ndarray  # the recorder's thread number (as in `Segments.thread`)
    kind: np.ndarray  # OS_STEP_START ... OS_SEGMENT_END
    t_s: np.ndarray  # the recorder's clock when the counters were read
    cpu_ns: np.ndarray
    runqueue_ns: np.ndarray
    num_voluntary_switches: np.ndarray
    num_involuntary_switches: np.ndarray
    num_major_faults: np.ndarray
    DTYPES = {
        "thread": np.int64,
        "kind": np.int64,
        "t_s": np.float64,
        "cpu_ns": np.int64,
        "runqueue_ns": np.int64,
        "num_voluntary_switches": np.int64,
        "num_involuntary_switches": np.int64,
        "num_major_faults": np.int64,
    }


@dataclass(frozen=True)
class ProcSegments(_Table):
    """Windows recorded in the other processes of a multi-process server (API server,
    workers), on the merged clock: kept apart from `segments` because they are not the
    engine step's work (`tracekit.attribution.client` partitions client-boundary gaps with them).
    `process` indexes ``meta["processes"]``; `label` indexes `RawLog.labels` (``gc``: a
    garbage-collector pause of that process)."""

    process: np.ndarray
    label: np.ndarray
    t_start_s: np.ndarray
    t_end_s: np.ndarray
    DTYPES = {
        "process": np.int64,
        "label": np.int64,
        "t_start_s": np.float64,
        "t_end_s": np.float64,
    }


@dataclass(frozen=True)
class ClientEmissions(_Table):
    """Emissions at the client boundary: one row per streamed chunk a server wrote
    (`t_s`, when the write returned), with the tokens it carried and when the chunk was
    ready to write (`t_ready_s`); `process` indexes ``meta["processes"]``."""

    request: np.ndarray
    t_s: np.ndarray
    t_ready_s: np.ndarray
    num_tokens: np.ndarray
    process: np.ndarray
    DTYPES = {
        "request": np.int64,
        "t_s": np.float64,
        "t_ready_s": np.float64,
        "num_tokens": np.int64,
        "process": np.int64,
    }


@dataclass(frozen=True)
class Deliveries(_Table):
    """One row per engine step's outputs that reached a frontend process: built at
    `t_out_s` in the engine (its step `step`), received at `t_recv_s` (merged clock)."""

    step: np.ndarray
    t_out_s: np.ndarray
    t_recv_s: np.ndarray
    process: np.ndarray
    DTYPES = {
        "step": np.int64,
        "t_out_s": np.float64,
        "t_recv_s": np.float64,
        "process": np.int64,
    }


@dataclass(frozen=True)
class ProcOs(_Table):
    """What the OS did to each API server's event loop (a merged server run,
    docs/partition.md "Unrecorded windows", rule 5): one row per OS interval ``[t_start_s,
    t_end_s]`` (merged clock) between consecutive samples of the thread that recorded most
    of that API server's segments, holding `runqueue_s` of run-queue wait and `offcpu_s`
    of other off-CPU time (as `tracekit.log.osintervals.intervals_of` computes them);
    `in_segment` is 1 where the thread was inside one of its segments all along, 0 where
    it was between them (it may have sat idle in its poll: its off-CPU time there is not
    evidence). `process` indexes ``meta["processes"]``. Rows are in (process, time) order
    and one process's do not overlap."""

    process: np.ndarray
    t_start_s: np.ndarray
    t_end_s: np.ndarray
    runqueue_s: np.ndarray
    offcpu_s: np.ndarray
    in_segment: np.ndarray
    DTYPES = {
        "process": np.int64,
        "t_start_s": np.float64,
        "t_end_s": np.float64,
        "runqueue_s": np.float64,
        "offcpu_s": np.float64,
        "in_segment": np.int64,
    }


@dataclass(frozen=True)
class Coverage(_Table):
    """The span each recording process's rows cover (schema v4): one row per process.

    `process`: 0 in a single-process log, in a merged run the index into
    ``meta["processes"]``. `t_start_s`: when that process's recorder started, on the run's
    clock. `t_end_s`: up to when its rows are complete: after a clean stop, the stop time;
    for a log recovered from parts, the tick its last flushed batch was taken at (or the
    start of a window still open then, if earlier). `is_clean_stop`: 1 when `stop()` ran
    and wrote the log, 0 when it was recovered from parts. Outside its span a process
    recorded nothing: time there is `unrecorded` (docs/partition.md), never assumed idle.
    An empty table (logs before v4, the published layout): coverage unknown."""

    process: np.ndarray
    t_start_s: np.ndarray
    t_end_s: np.ndarray
    is_clean_stop: np.ndarray
    DTYPES = {
        "process": np.int64,
        "t_start_s": np.float64,
        "t_end_s": np.float64,
        "is_clean_stop": np.int64,
    }


TABLES: dict[str, type[_Table]] = {
    "steps": Steps,
    "segments": Segments,
    "gc_pauses": GcPauses,
    "emissions": Emissions,
    "evictions": Evictions,
    "requests": Requests,
    "counters": Counters,
    "admissions": Admissions,
    "prefill_chunks": PrefillChunks,
    "waits": Waits,
    "os_samples": OsSamples,
    "proc_segments": ProcSegments,
    "client_emissions": ClientEmissions,
    "deliveries": Deliveries,
    "coverage": Coverage,
    "proc_os": ProcOs,
    "preemptions": Preemptions,
    "evictors": Evictors,
}
#: The tables of a merged multi-process server run (`tracekit.log.merge`).
SERVER_TABLES = frozenset({"proc_segments", "client_emissions", "deliveries", "proc_os"})
#: Tables a log may lack as a whole (version 1 logs, the published layout, logs of one
#: process): empty on load.
OPTIONAL_TABLES = (
    frozenset({"counters", "admissions", "prefill_chunks", "waits", "os_samples", "coverage"})
    | frozenset({"preemptions", "evictors"})
    | SERVER_TABLES
)


@dataclass(frozen=True)
class RawLog:
    """One run. Times are seconds from engine start; see the module docstring."""

    steps: Steps
    segments: Segments
    gc_pauses: GcPauses
    emissions: Emissions
    evictions: Evictions
    requests: Requests
    counters: Counters = field(default_factory=Counters.empty)
    admissions: Admissions = field(default_factory=Admissions.empty)
    prefill_chunks: PrefillChunks = field(default_factory=PrefillChunks.empty)
    waits: Waits = field(default_factory=Waits.empty)
    os_samples: OsSamples = field(default_factory=OsSamples.empty)
    proc_segments: ProcSegments = field(default_factory=ProcSegments.empty)
    client_emissions: ClientEmissions = field(default_factory=ClientEmissions.empty)
    deliveries: Deliveries = field(default_factory=Deliveries.empty)
    coverage: Coverage = field(default_factory=Coverage.empty)
    proc_os: ProcOs = field(default_factory=ProcOs.empty)
    preemptions: Preemptions = field(default_factory=Preemptions.empty)
    evictors: Evictors = field(default_factory=Evictors.empty)
    labels: tuple[str, ...] = ()
    #: a tuple; a log read from a later part of a run: `tracekit.log.request_names.RequestNames`
    request_ids: Sequence[str] = ()
    counter_names: tuple[str, ...] = ()
    cause_map: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_CAUSE_MAP))
    config: Mapping[str, Any] = field(default_factory=dict)
    wall_s: float = float("nan")
    meta: Mapping[str, Any] = field(default_factory=dict)
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)
    path: str = "<memory>"
    warnings: tuple[str, ...] = ()

    # -- convenience -------------------------------------------------------------------
    @property
    def rung(self) -> str | None:
        r = self.config.get("rung")
        return None if r is None else str(r)

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    @property
    def source(self) -> str:
        return str(self.meta.get("source", "tracekit"))

    def request_names(self) -> Sequence[str]:
        """Each request's id, or its index as text where the log names none (a log that
        recorded no ids, a merged run whose processes carried none)."""
        if len(self.request_ids) == len(self.requests):
            return self.request_ids
        return tuple(str(i) for i in range(len(self.requests)))

    def with_path(self, path: str) -> RawLog:
        return replace(self, path=path)

    # -- io ----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the current-version `.npz` atomically (`tracekit.fsio.atomic_open`)."""
        path = os.fspath(path)
        arrays: dict[str, np.ndarray] = {
            "schema": np.array(SCHEMA),
            "schema_version": np.array(SCHEMA_VERSION, dtype=np.int64),
            "labels": np.array(self.labels, dtype=str).reshape(-1),
            "request_ids": np.array(list(self.request_ids), dtype=str).reshape(-1),
            "counter_names": np.array(self.counter_names, dtype=str).reshape(-1),
            "cause_map": np.array(json.dumps(dict(self.cause_map), sort_keys=True)),
            "config": np.array(json.dumps(json_safe(self.config), sort_keys=True)),
            "meta": np.array(json.dumps(json_safe(self.meta), sort_keys=True)),
            "wall_s": np.array(float(self.wall_s)),
            "wait_reasons": np.array(WAIT_REASONS, dtype=str),
            "preempt_reasons": np.array(PREEMPT_REASONS, dtype=str),
        }
        for tname in TABLES:
            if tname in SERVER_TABLES and not len(getattr(self, tname)):
                continue  # only a merged server run has them: other logs stay as they were
            for cname, col in getattr(self, tname).columns().items():
                key = f"{tname}.{cname}"
                if key in NAN_DEFAULT_COLUMNS and np.isnan(col).all():
                    continue  # a log without these stages stays as it was
                arrays[key] = col
        for k, v in self.extras.items():
            arrays[f"extra.{k}"] = np.asarray(v)
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with atomic_open(path) as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]  # stub: kwargs could be allow_pickle
        return path


# -- loading ---------------------------------------------------------------------------

V1_SCALARS = frozenset(
    {"schema", "schema_version", "labels", "request_ids", "counter_names", "cause_map",
     "config", "meta", "wall_s", "wait_reasons", "preempt_reasons"}
)  # fmt: skip
V1_COLUMNS = frozenset(f"{t}.{c}" for t, cls in TABLES.items() for c in cls.DTYPES)
V1_MEMBERS = V1_SCALARS | V1_COLUMNS


#: Optional columns left out of a saved log when they hold no value (all NaN).
NAN_DEFAULT_COLUMNS = frozenset({"requests.handler_s", "requests.engine_s"})
#: Columns a v1 log may lack (each table's dataclass gives their default).
OPTIONAL_COLUMNS = frozenset({"emissions.device_step", "requests.handler_s", "requests.engine_s"})


def warnings_of(meta: Mapping[str, Any]) -> list[str]:
    """A run's warnings from its meta: that it was interrupted (read from the parts of a
    recording that did not stop), then what capture or recovery noted (the first 20, each
    one line of at most 300 characters)."""
    warnings: list[str] = []
    if meta.get("interrupted") is True:
        warnings.append(
            "recovered from the parts of an interrupted recording: "
            "events after its last flush are lost"
        )
    noted = meta.get("warnings")
    if isinstance(noted, list):
        warnings += [one_line(str(w))[:300] for w in noted[:20]]
    return warnings


def from_v1(path: str, arrays: dict[str, np.ndarray]) -> RawLog:
    schema = scalar_str(path, arrays, "schema")
    if schema != SCHEMA:
        raise LogError(path, "schema", f"is {schema!r}, expected {SCHEMA!r}")
    v = arrays.get("schema_version")
    if v is None or v.shape != () or v.dtype.kind not in "iu":
        raise LogError(path, "schema_version", "missing or not an integer scalar")
    if int(v) not in READABLE_VERSIONS:
        raise LogError(
            path,
            "schema_version",
            f"is {int(v)}; this tracekit reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} (upgrade tracekit)",
        )
    if int(v) >= 2:
        _check_vocabulary(path, arrays, "wait_reasons", WAIT_REASONS)
    if int(v) >= 5:
        _check_vocabulary(path, arrays, "preempt_reasons", PREEMPT_REASONS)
    tables: dict[str, _Table] = {}
    for tname, cls in TABLES.items():
        keys = [f"{tname}.{c}" for c in cls.DTYPES]
        if tname in OPTIONAL_TABLES and not any(k in arrays for k in keys):
            tables[tname] = cls.empty()  # optional as a whole table
            continue
        cols = {
            c: column(path, arrays, f"{tname}.{c}", dt)
            for c, dt in cls.DTYPES.items()
            if f"{tname}.{c}" not in OPTIONAL_COLUMNS or f"{tname}.{c}" in arrays
        }
        n = {len(c) for c in cols.values()}
        if len(n) > 1:
            lens = ", ".join(f"{k}={len(c)}" for k, c in cols.items())
            raise LogError(path, tname, f"columns differ in length ({lens})")
        tables[tname] = cls(**cols)
    wall = arrays.get("wall_s")
    if wall is None or wall.shape != () or wall.dtype.kind not in "iuf":
        raise LogError(path, "wall_s", "missing or not a number")
    cause_map = json_member(path, arrays, "cause_map", default=dict(DEFAULT_CAUSE_MAP))
    config = json_member(path, arrays, "config", default={})
    meta = json_member(path, arrays, "meta", default={})
    for key, val in (("cause_map", cause_map), ("config", config), ("meta", meta)):
        if not isinstance(val, dict):
            raise LogError(path, key, f"expected a JSON object, got {type(val).__name__}")
    if not all(isinstance(k, str) and isinstance(x, str) for k, x in cause_map.items()):
        raise LogError(path, "cause_map", "expected an object of label -> cause strings")
    extras = {k[len("extra.") :]: a for k, a in arrays.items() if k.startswith("extra.")}
    warnings = warnings_of(meta)
    return RawLog(
        **tables,  # type: ignore[arg-type]
        labels=str_list(path, arrays, "labels"),
        request_ids=str_list(path, arrays, "request_ids"),
        counter_names=str_list(path, arrays, "counter_names"),
        cause_map=cause_map,
        config=config,
        wall_s=float(wall),
        meta=meta,
        extras=extras,
        path=path,
        warnings=tuple(warnings),
    )


def _check_vocabulary(
    path: str, arrays: dict[str, np.ndarray], key: str, known: tuple[str, ...]
) -> None:
    """A log names its reason codes (``wait_reasons`` from v2, ``preempt_reasons`` from
    v5); they must be the ones this tracekit knows (a prefix: codes are only appended)."""
    names = str_list(path, arrays, key)
    if names and names != known[: len(names)]:
        raise LogError(
            path, key, f"vocabulary {list(names)} differs from this tracekit's {list(known)}"
        )
