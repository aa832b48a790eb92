"""Checks a loaded raw log: reject what cannot be analysed, warn about what is odd but usable.

Reading (`tracekit.log.reader.load`) and these checks together decide. docs/input-validation.md
repeats both lists word for word (a test keeps them in sync).

Rejected (a `LogError` naming file, field and problem; the CLI prints one line, exits 2):

- a path that is not a regular file (a FIFO, a device such as /dev/zero, or a symlink to
  one), refused before it is read
- a file that is not a readable zip archive (text, HTML, gzip, a bare .npy, truncated)
- a damaged archive member (bad CRC, bad deflate stream, unknown compression, sizes that do not fit)
- an array whose .npy header does not match its data (shape claims more or fewer bytes)
- an object array anywhere the log's layout defines an array: a pickle is never loaded
- an archive member that appears twice
- arrays that would inflate beyond the inflate limit (a deflate bomb, zero-filled columns):
  their declared sizes are summed before anything is inflated
- a tracekit log without `schema`, with another schema name, or a `schema_version` other than 1,
  2, 3, 4 or 5
- neither a `schema` array nor the published layout's `steps` and `segs`
- a missing required array or column (only the counters table, the TTFT tables `admissions`,
  `prefill_chunks` and `waits`, the OS evidence `os_samples`, `coverage` and the eviction
  causes `preemptions` and `evictors` as whole tables, `emissions.device_step` and the JSON
  fields are optional)
- a column that is not 1-D, not numeric (strings, complex, datetimes, records), or of unequal length
  within its table
- a published array that is not 2-D with its documented number of columns
- an integer column holding NaN, fractions, or values that do not fit its type
- `config`, `meta` or `cause_map` that is not a JSON object, nests too deeply or holds an
  unconvertible number
- non-finite times where a time is required (all but readmission, arrival and first token, which may
  be NaN)
- times beyond `MAX_ABS_TIME_S` (1e7 s) from engine start, and a wall time beyond it
- a negative or non-finite wall time
- reversed intervals: a step, segment or GC pause that ends before it starts
- a readmission before its eviction
- an index outside its table: segment label or step, emission request or step, eviction request,
  counter name, admission request, prefill or wait request or step, wait reason
- in a log with admission events: a first token before its request's arrival
- an admission before its request's arrival, before the engine core added it (a server run's
  `requests.engine_s`) or after its first token, a request admitted twice, an eviction
  before its request's admission, two wait reasons for one request in one step
- a request-id list whose length is not the number of requests, and duplicate request ids
- negative counts, a token count below 1, a GC generation other than 0, 1 or 2, an is_device flag
  other than 0 or 1, an eviction mode other than -1, 0 or 1
- counts, ids and thread numbers above `MAX_COUNT` (2**31 - 1)
- in `os_samples`: a non-finite time, a negative thread number, a kind other than 0-3, a
  counter below -1 (-1: not available), a CPU or run-queue total above `MAX_OS_NS`
- in `coverage`: a non-finite time, a span that ends before it starts, a process index
  outside the log's processes (0 in a single-process log, an index into `meta.processes` in
  a merged run), two rows for one process, an `is_clean_stop` other than 0 or 1; a
  `meta.missing_processes` that is not a list of objects
- in `proc_os` (a merged run): a non-finite time or share, an interval that ends before it
  starts, a negative share, run-queue and off-CPU time that exceed the interval, an
  `in_segment` other than 0 or 1, a process index outside the run's processes, rows out of
  (process, time) order or overlapping within a process
- in `preemptions`: a non-finite time, a victim outside the requests, a step outside the
  steps (-1: outside any step), a reason outside `preempt_reasons`, a count below -1 (-1:
  not told), a row with no eviction of its request at its time, two rows for one eviction;
  in `evictors`: a victim or evictor outside the requests, a request its own evictor, a
  row with no `preemptions` row of its eviction, an evictor named twice for one eviction

Accepted with a warning (kept on `RawLog.warnings`, printed by the CLI on stderr):

- archive members the layout does not define (skipped unread, named in the warning)
- a run with no emissions, or with no request that has two (nothing to partition)
- emissions out of time order (the partition sorts them per request)
- emissions before their request's arrival
- overlapping GC pauses (the partition uses their union)
- an eviction with no readmission before the request emits again (it runs to the end of the
  gap it lies in, as design.md says); one still open when the run ends is normal and silent
- overlapping evictions of one request (their union is used)
- a run recovered from the parts of an interrupted recording (events after the last flush are lost)
- labels, causes, counter names or request ids longer than the name limit (shortened to it,
  with their length and a hash; see Limits in docs/input-validation.md)

Accepted silently: zero-length intervals, steps and segments in any order, segments outside
any step (step -1), negative times (before engine start), integral floats in integer
columns, big-endian or narrower dtypes, extra `extra.*` arrays, any label or cause name,
and strings that are not valid Unicode (lone surrogates become U+FFFD).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from tracekit.errors import LogError
from tracekit.log.rawlog import (
    MODE_RECOMPUTE,
    MODE_UNKNOWN,
    OS_SEGMENT_END,
    PREEMPT_REASONS,
    WAIT_REASONS,
    RawLog,
)

#: Times further than this from engine start (about 115 days) are rejected as absurd.
MAX_ABS_TIME_S = 1.0e7
#: Counts (tokens, batch rows, thread ids) above this are rejected as absurd: they would
#: overflow sums and allocations downstream (a GC generation of 2**63 crashed numpy).
MAX_COUNT = 2**31 - 1
#: CPython's collector generations, as `gc.callbacks` reports them.
GC_GENERATIONS = (0, 1, 2)


def _finite_times(log: RawLog, table: str, col: str, *, allow_nan: bool = False) -> None:
    a = getattr(getattr(log, table), col)
    if a.size:  # the common case in two reductions: a NaN or an inf shows in one of them
        lo, hi = a.min(), a.max()
        if np.isfinite(lo) and np.isfinite(hi) and max(-lo, hi) <= MAX_ABS_TIME_S:
            return
    bad = ~np.isfinite(a)
    if allow_nan:
        bad &= ~np.isnan(a)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LogError(log.path, f"{table}.{col}", f"row {i}: non-finite time {float(a[i])!r}")
    fin = a[np.isfinite(a)]
    if fin.size and np.abs(fin).max() > MAX_ABS_TIME_S:
        i = int(np.flatnonzero(np.abs(np.nan_to_num(a)) > MAX_ABS_TIME_S)[0])
        raise LogError(
            log.path,
            f"{table}.{col}",
            f"row {i}: absurd time {float(a[i])!r} s (times are seconds from engine start)",
        )


def _ordered(log: RawLog, table: str, start: str, end: str) -> None:
    t = getattr(log, table)
    a, b = getattr(t, start), getattr(t, end)
    bad = b < a
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LogError(
            log.path,
            f"{table}.{end}",
            f"row {i}: ends ({float(b[i])!r}) before it starts ({float(a[i])!r})",
        )


def _index(log: RawLog, table: str, col: str, n: int, *, allow_minus_one: bool = False) -> None:
    a = getattr(getattr(log, table), col)
    lo = -1 if allow_minus_one else 0
    if not a.size or (a.min() >= lo and a.max() < n):  # the common case: two reductions
        return
    bad = (a < lo) | (a >= n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LogError(
            log.path, f"{table}.{col}", f"row {i}: index {int(a[i])} outside [{lo}, {n - 1}]"
        )


def _in_range(log: RawLog, table: str, col: str, lo: int = 0, hi: int = MAX_COUNT) -> None:
    a = getattr(getattr(log, table), col)
    if not a.size or (a.min() >= lo and a.max() <= hi):  # the common case: two reductions
        return
    bad = (a < lo) | (a > hi)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        what = "is below" if a[i] < lo else "is absurd: above"
        raise LogError(
            log.path, f"{table}.{col}", f"row {i}: {int(a[i])} {what} {lo if a[i] < lo else hi}"
        )


def validate_log(log: RawLog) -> RawLog:
    """Raise `LogError` for what cannot be analysed; return the log with warnings attached."""
    _check_times(log)
    n_steps, n_req = len(log.steps), len(log.requests)
    _check_references(log, n_steps, n_req)
    _check_merged_tables(log, n_steps, n_req)
    validate_os(log)
    validate_proc_os(log)
    validate_coverage(log)
    _in_range(log, "client_emissions", "num_tokens", lo=1)
    _check_request_ids(log, n_req)
    _check_counts(log)
    validate_ttft(log)
    validate_preemptions(log)
    warnings = list(log.warnings) + _odd_but_usable(log)
    return replace(log, warnings=tuple(dict.fromkeys(warnings)))


def _check_times(log: RawLog) -> None:
    """Every time is finite (NaN where a table allows "unknown"), every span ends at or
    after its start, and no request is readmitted before it was evicted."""
    for table, cols in (
        ("steps", ("t_start_s", "t_end_s")),
        ("segments", ("t_start_s", "t_end_s")),
        ("gc_pauses", ("t_start_s", "t_end_s")),
        ("emissions", ("t_s",)),
        ("evictions", ("t_evict_s",)),
        ("counters", ("t_s",)),
    ):
        for c in cols:
            _finite_times(log, table, c)
    _finite_times(log, "evictions", "t_readmit_s", allow_nan=True)
    _finite_times(log, "requests", "arrival_s", allow_nan=True)
    _finite_times(log, "requests", "first_token_s", allow_nan=True)
    _finite_times(log, "requests", "handler_s", allow_nan=True)
    _finite_times(log, "requests", "engine_s", allow_nan=True)
    _ordered(log, "steps", "t_start_s", "t_end_s")
    _ordered(log, "segments", "t_start_s", "t_end_s")
    _ordered(log, "gc_pauses", "t_start_s", "t_end_s")
    ev = log.evictions
    back = ev.t_readmit_s < ev.t_evict_s  # NaN compares False: never readmitted is fine
    if back.any():
        i = int(np.flatnonzero(back)[0])
        raise LogError(log.path, "evictions.t_readmit_s", f"row {i}: readmitted before evicted")


def _check_references(log: RawLog, n_steps: int, n_req: int) -> None:
    """Every label, step, request and counter a row names exists (-1: no step)."""
    _index(log, "segments", "label", len(log.labels))
    _index(log, "segments", "step", n_steps, allow_minus_one=True)
    _index(log, "emissions", "request", n_req)
    _index(log, "emissions", "step", n_steps, allow_minus_one=True)
    _index(log, "emissions", "device_step", n_steps, allow_minus_one=True)
    _index(log, "evictions", "request", n_req)
    _index(log, "counters", "name", len(log.counter_names))


def _check_merged_tables(log: RawLog, n_steps: int, n_req: int) -> None:
    """A merged server run's tables (tracekit.log.merge; empty in every other log): finite,
    ordered times and indices that exist."""
    for table, cols in (
        ("proc_segments", ("t_start_s", "t_end_s")),
        ("client_emissions", ("t_s", "t_ready_s")),
        ("deliveries", ("t_out_s", "t_recv_s")),
    ):
        for c in cols:
            _finite_times(log, table, c)
    _ordered(log, "proc_segments", "t_start_s", "t_end_s")
    _index(log, "proc_segments", "label", len(log.labels))
    _index(log, "client_emissions", "request", n_req)
    _index(log, "deliveries", "step", n_steps, allow_minus_one=True)


def _check_request_ids(log: RawLog, n_req: int) -> None:
    """One id per request, each its own."""
    if log.request_ids and len(log.request_ids) != n_req:
        raise LogError(
            log.path,
            "request_ids",
            f"{len(log.request_ids)} ids for {n_req} requests (one id per requests row)",
        )
    if len(set(log.request_ids)) != len(log.request_ids):
        seen: dict[str, int] = {}
        for i, rid in enumerate(log.request_ids):
            if rid in seen:
                raise LogError(
                    log.path,
                    "request_ids",
                    f"duplicate id {rid[:80]!r} (rows {seen[rid]} and {i}): each request "
                    "needs its own id, or gaps and --request would mix two requests",
                )
            seen[rid] = i


def _check_counts(log: RawLog) -> None:
    """Counts, flags and enumerations in their ranges, and a wall time that can be one."""
    for col in ("num_decode", "num_prefill_tokens", "num_preempted", "num_swapped_in"):
        _in_range(log, "steps", col)
    _in_range(log, "steps", "graph_size", lo=-1)
    _in_range(log, "emissions", "num_tokens", lo=1)
    _in_range(log, "requests", "prompt_tokens", lo=-1)
    _in_range(log, "requests", "max_new_tokens", lo=-1)
    _in_range(log, "segments", "thread")
    _in_range(log, "segments", "is_device", hi=1)
    _in_range(log, "evictions", "mode", lo=MODE_UNKNOWN, hi=MODE_RECOMPUTE)
    _in_range(log, "gc_pauses", "generation", lo=GC_GENERATIONS[0], hi=GC_GENERATIONS[-1])
    if not np.isfinite(log.wall_s) or log.wall_s < 0:
        raise LogError(log.path, "wall_s", f"{log.wall_s!r} is not a non-negative wall time")
    if log.wall_s > MAX_ABS_TIME_S:
        raise LogError(log.path, "wall_s", f"absurd wall time {log.wall_s!r} s")


def _odd_but_usable(log: RawLog) -> list[str]:
    """The warnings of a log that is odd but can be analysed: no emissions or no gaps,
    emissions out of order or before their request's arrival, overlapping GC pauses,
    evictions never readmitted or overlapping."""
    warnings: list[str] = []
    em = log.emissions
    if len(em) == 0:
        warnings.append("no emissions: the run has no gaps to partition")
    else:
        # in (request, time) order, or in time order: checked pairwise in one pass each
        # (what comparing a stable sort's permutation with arange decides, without sorting)
        r, t = em.request, em.t_s
        if not np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (t[1:] >= t[:-1]))):
            if not np.all(t[1:] >= t[:-1]):
                warnings.append("emissions are not in time order (sorted per request)")
        if np.bincount(r, minlength=1).max() <= 1:  # request indices are checked above
            warnings.append("no gaps: no request has two emissions")
        arr = log.requests.arrival_s[em.request]
        early = em.t_s < arr
        if early.any():
            warnings.append(f"{int(early.sum())} emission(s) before their request's arrival")
    gc_ = log.gc_pauses
    if len(gc_) > 1:
        o = np.argsort(gc_.t_start_s, kind="stable")
        ends = np.maximum.accumulate(gc_.t_end_s[o])
        if np.any(gc_.t_start_s[o][1:] < ends[:-1]):
            warnings.append("overlapping GC pauses (the partition uses their union)")
    ev = log.evictions
    if len(ev):
        # open at the run's end is normal (the run stopped); odd is a request that emits
        # again without a readmission: its eviction runs to the end of that gap
        last_emit = np.full(len(log.requests), -np.inf)
        if len(em):
            np.maximum.at(last_emit, em.request, em.t_s)
        never = np.isnan(ev.t_readmit_s) & (ev.t_evict_s < last_emit[ev.request])
        if never.any():
            warnings.append(
                f"{int(never.sum())} eviction(s) never readmitted although the request emitted "
                "again (charged to the end of the gap)"
            )
        o = np.lexsort((ev.t_evict_s, ev.request))
        r, s = ev.request[o], ev.t_evict_s[o]
        e = np.where(np.isnan(ev.t_readmit_s[o]), np.inf, ev.t_readmit_s[o])
        same = r[1:] == r[:-1]
        if np.any(same & (s[1:] < e[:-1])):
            warnings.append("overlapping evictions of one request (their union is used)")
    return warnings


#: The largest OS counter in ns a log may hold (a thread's total over `MAX_ABS_TIME_S`).
MAX_OS_NS = int(MAX_ABS_TIME_S * 1e9)


def validate_os(log: RawLog) -> None:
    """The OS evidence (schema v3, ``os_samples``): raise `LogError` for what the partition
    cannot use. -1 is "not available" for every counter; a counter that goes back between
    two samples of a thread is not an error (that interval is not used, docs/partition.md)."""
    _finite_times(log, "os_samples", "t_s")
    _in_range(log, "os_samples", "thread")
    _in_range(log, "os_samples", "kind", hi=OS_SEGMENT_END)
    for c in ("cpu_ns", "runqueue_ns"):
        _in_range(log, "os_samples", c, lo=-1, hi=MAX_OS_NS)
    for c in ("num_voluntary_switches", "num_involuntary_switches", "num_major_faults"):
        _in_range(log, "os_samples", c, lo=-1)


def validate_proc_os(log: RawLog) -> None:
    """An API server's OS intervals in a merged run (``proc_os``): raise `LogError` for what
    the client partition cannot use: a non-finite or absurd time or share, an interval that
    ends before it starts, a share below 0, shares that sum past the interval's length, an
    `in_segment` flag other than 0 or 1, a process outside the run's processes, rows out
    of (process, time) order or overlapping within a process (one thread's consecutive
    samples never overlap)."""
    po = log.proc_os
    if not len(po):
        return
    for c in ("t_start_s", "t_end_s", "runqueue_s", "offcpu_s"):
        _finite_times(log, "proc_os", c)
    _ordered(log, "proc_os", "t_start_s", "t_end_s")
    _in_range(log, "proc_os", "in_segment", hi=1)
    procs = log.meta.get("processes")
    _index(log, "proc_os", "process", len(procs) if isinstance(procs, list) and procs else 1)
    length = po.t_end_s - po.t_start_s
    for c in ("runqueue_s", "offcpu_s"):
        bad = getattr(po, c) < 0
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LogError(log.path, f"proc_os.{c}", f"row {i}: {float(getattr(po, c)[i])!r} < 0")
    over = po.runqueue_s + po.offcpu_s > length * (1 + 1e-9) + 1e-12
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise LogError(
            log.path,
            "proc_os.offcpu_s",
            f"row {i}: run-queue and off-CPU time ({float(po.runqueue_s[i] + po.offcpu_s[i])!r}"
            f" s) exceed the interval ({float(length[i])!r} s)",
        )
    p, a, b = po.process, po.t_start_s, po.t_end_s
    same = p[1:] == p[:-1]
    bad = (p[1:] < p[:-1]) | (same & (a[1:] < b[:-1]))
    if bad.any():
        i = int(np.flatnonzero(bad)[0]) + 1
        raise LogError(
            log.path,
            "proc_os.t_start_s",
            f"row {i}: out of (process, time) order or overlapping the row before it",
        )


def validate_coverage(log: RawLog) -> None:
    """The span each process covers (schema v4, ``coverage``): raise `LogError` for a table
    that contradicts itself or the log's processes (an empty table: coverage unknown)."""
    _finite_times(log, "coverage", "t_start_s")
    _finite_times(log, "coverage", "t_end_s")
    _ordered(log, "coverage", "t_start_s", "t_end_s")
    procs = log.meta.get("processes")
    n = len(procs) if isinstance(procs, list) and procs else 1
    _index(log, "coverage", "process", n)
    _in_range(log, "coverage", "is_clean_stop", hi=1)
    p = log.coverage.process
    u, counts = np.unique(p, return_counts=True)
    if (counts > 1).any():
        i = int(np.flatnonzero(p == u[counts > 1][0])[1])
        raise LogError(
            log.path,
            "coverage.process",
            f"row {i}: process {int(p[i])} has two rows (one a process)",
        )
    missing = log.meta.get("missing_processes", [])
    if not isinstance(missing, list) or not all(isinstance(m, dict) for m in missing):
        raise LogError(log.path, "meta.missing_processes", "not a list of objects")


def _row_of_pair(log: RawLog, field: str, i: int, what: str) -> LogError:
    return LogError(log.path, field, f"row {i}: {what}")


def validate_preemptions(log: RawLog) -> None:
    """The causes of evictions (schema v5, ``preemptions`` and ``evictors``): raise
    `LogError` for rows the eviction analysis cannot join (docs/partition.md, "Who evicted
    whom"). A preemption row is its eviction's: same request, same time (one clock reading
    both were written from); an evictors row is a preemption row's."""
    pe, ev, by = log.preemptions, log.evictions, log.evictors
    n_steps, n_req = len(log.steps), len(log.requests)
    _finite_times(log, "preemptions", "t_s")
    _index(log, "preemptions", "request", n_req)
    _index(log, "preemptions", "step", n_steps, allow_minus_one=True)
    _index(log, "preemptions", "reason", len(PREEMPT_REASONS))
    for c in ("num_computed_tokens_lost", "num_free_blocks", "num_used_blocks"):
        _in_range(log, "preemptions", c, lo=-1)
    _finite_times(log, "evictors", "t_s")
    _index(log, "evictors", "request", n_req)
    _index(log, "evictors", "evictor", n_req)
    if not len(pe) and not len(by):
        return
    evicted = set(zip(ev.request.tolist(), ev.t_evict_s.tolist(), strict=True))
    seen: set[tuple[int, float]] = set()
    for i, key in enumerate(zip(pe.request.tolist(), pe.t_s.tolist(), strict=True)):
        if key not in evicted:
            raise _row_of_pair(
                log, "preemptions.t_s", i,
                f"request {key[0]} has no eviction at {key[1]!r} s (a preemption row is the "
                "cause of an eviction recorded at the same instant)",
            )  # fmt: skip
        if key in seen:
            raise _row_of_pair(
                log, "preemptions.request", i,
                f"request {key[0]} has two causes for its eviction at {key[1]!r} s",
            )  # fmt: skip
        seen.add(key)
    pairs: set[tuple[int, float, int]] = set()
    for i, (r, t, e) in enumerate(
        zip(by.request.tolist(), by.t_s.tolist(), by.evictor.tolist(), strict=True)
    ):
        if r == e:
            raise _row_of_pair(log, "evictors.evictor", i, f"request {r} is its own evictor")
        if (r, t) not in seen:
            raise _row_of_pair(
                log, "evictors.t_s", i, f"request {r} has no preemptions row at {t!r} s"
            )
        if (r, t, e) in pairs:
            raise _row_of_pair(
                log, "evictors.evictor", i,
                f"request {e} named twice as the evictor of request {r} at {t!r} s",
            )  # fmt: skip
        pairs.add((r, t, e))


def validate_ttft(log: RawLog) -> None:
    """The TTFT tables (schema v2) and the TTFT window: raise `LogError` for what the TTFT
    partition cannot use (docs/ttft.md, "Bad input")."""
    n_steps, n_req = len(log.steps), len(log.requests)
    rq, ad = log.requests, log.admissions
    _index(log, "admissions", "request", n_req)
    _finite_times(log, "admissions", "t_s")
    _index(log, "prefill_chunks", "request", n_req)
    _index(log, "prefill_chunks", "step", n_steps)
    _in_range(log, "prefill_chunks", "num_tokens")
    _index(log, "waits", "request", n_req)
    _index(log, "waits", "step", n_steps)
    _index(log, "waits", "reason", len(WAIT_REASONS))
    if len(ad) == 0:
        return  # no TTFT events: a reversed window is only warned about (emissions above)
    # a first token before its request arrived: the TTFT window is reversed
    early = rq.first_token_s < rq.arrival_s  # NaN compares False: not recorded is fine
    if early.any():
        i = int(np.flatnonzero(early)[0])
        raise LogError(
            log.path,
            "requests.first_token_s",
            f"row {i}: first token at {float(rq.first_token_s[i])!r} s is before the "
            f"request's arrival at {float(rq.arrival_s[i])!r} s",
        )
    # admissions: one per request, between its arrival and its first token
    o = np.lexsort((ad.t_s, ad.request))
    twice = np.flatnonzero(ad.request[o][1:] == ad.request[o][:-1])
    if len(twice):
        i = int(o[twice[0] + 1])
        raise LogError(
            log.path,
            "admissions.request",
            f"row {i}: request {int(ad.request[i])} admitted twice (an admission is the first "
            "time the scheduler takes it; readmissions are evictions rows)",
        )
    arrival, first = rq.arrival_s[ad.request], rq.first_token_s[ad.request]
    added = rq.engine_s[ad.request]  # a server run's engine-core add (NaN elsewhere)
    for bad, what, when in (
        (ad.t_s < arrival, "before its arrival", arrival),
        (ad.t_s > first, "after its first token", first),
        (ad.t_s < added, "before the engine core added it", added),
    ):
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LogError(
                log.path,
                "admissions.t_s",
                f"row {i}: request {int(ad.request[i])} admitted at {float(ad.t_s[i])!r} s, "
                f"{what} at {float(when[i])!r} s (admission events out of order)",
            )
    ev = log.evictions
    if len(ev):
        admitted = np.full(n_req, np.inf)
        admitted[ad.request] = ad.t_s
        bad = ev.t_evict_s < admitted[ev.request]
        bad &= np.isfinite(admitted[ev.request])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LogError(
                log.path,
                "evictions.t_evict_s",
                f"row {i}: request {int(ev.request[i])} evicted before its admission at "
                f"{float(admitted[ev.request[i]])!r} s",
            )
    wt = log.waits
    if len(wt):
        key = wt.step * max(n_req, 1) + wt.request
        u, c = np.unique(key, return_counts=True)
        if (c > 1).any():
            i = int(np.flatnonzero(key == u[c > 1][0])[1])
            raise LogError(
                log.path,
                "waits.request",
                f"row {i}: request {int(wt.request[i])} has two wait reasons in step "
                f"{int(wt.step[i])} (state one reason per request and step)",
            )
