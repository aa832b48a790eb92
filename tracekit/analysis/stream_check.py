"""`tracekit check` of a long one-process run, part by part (docs/reports.md, "Reading a
long run in slices"; the rules: `tracekit.log.validate`).

`load` holds a whole run to validate it: an hour of a busy server is several GB. Here a run
longer than one slice (`tracekit.analysis.workers.reads_in_slices`) is read one part at a
time, with the verdict, the counts, the warnings and the error `load` gives:

- each part is read and checked as `merge_parts` reads it (a missing or damaged part ends
  the run at the part before it, with its warning; a part whose contents contradict the
  run is a `LogError` naming the part and the field, raised once every part is read, as
  the merge raises it);
- the rules of rows that stand alone (times, spans, counts, flags) are checked on each
  part's rows; a failure cites the whole log's row (rows of earlier parts counted);
- indices into what only the run's end knows (its steps, labels, counter names and
  requests) keep each part's smallest and largest value; the part that fails is read
  again to name its row;
- what is kept whole is per request, per eviction or per collection, never per token:
  requests, eviction events, admissions, eviction causes, GC pauses, and per request the
  count, first and last emission; these are checked as one log (`validate_log`) whose
  steps are placeholders (their number only) and whose emissions are empty, the emission
  warnings and the first tokens taken from the parts;
- of several failures, the one `validate_log` checks first is raised (each rule's place
  in its order: `_FINITE`, `_RANGES`, `_DEFERRED`, `_KEPT_ORDER`).

A folder whose first parts were removed (retention) is read as `merge_parts` reads it: steps
numbered from its first part's, the requests named only before it ``(removed N)``. A run
read whole today (a one-file log, a process directory), a pointer file with other
members than its one (`load` warns of them), and a folder whose part gives a
request that already emitted a new arrival (its earlier emissions were compared with the
old one), or whose first part vanishes while it is read, is read whole here too
(`NotSliceable` -> `load`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.analysis.run import parts_dir_of
from tracekit.analysis.workers import reads_in_slices
from tracekit.errors import LogError
from tracekit.log.archive import read_npz
from tracekit.log.flush import TABLES, UNKNOWN_TICK, column_index
from tracekit.log.parts import (
    POINTER_MEMBER,
    DamagedPart,
    Retained,
    check_request_rows,
    index_warnings,
    merge_flushed,
    missing_part_warning,
    parse_flushed,
    part_number,
    part_paths,
    read_final,
    read_flushed_part,
    read_meta,
    read_part,
    retained_start,
    unreadable_part_warning,
)
from tracekit.log.rawlog import OS_SEGMENT_END, WAIT_REASONS, RawLog
from tracekit.log.reader import load, shorten_names
from tracekit.log.request_names import RequestNames, Unnamed, renumbered
from tracekit.log.slices import NotSliceable, grown
from tracekit.log.validate import MAX_ABS_TIME_S, MAX_COUNT, MAX_OS_NS, validate_log


@dataclass(frozen=True, slots=True)
class Checked:
    """What `check` says of a valid run: its steps, its emissions, its warnings."""

    num_steps: int
    num_emissions: int
    warnings: tuple[str, ...]


def check_run(path: str, **limits: Any) -> Checked:
    """Validate the run at `path` as `load` does (the same `LogError`, counts and
    warnings); a one-process run longer than one slice part by part, in bounded memory."""
    parts_dir = parts_dir_of(path)
    try:
        sliced = parts_dir is not None and reads_in_slices(path) and _plain_pointer(path)
    except (LogError, OSError):  # an unreadable index: `load` says so
        sliced = False
    if parts_dir is not None and sliced:
        shown = parts_dir if os.path.isdir(path) or not os.path.exists(path) else path
        try:
            return PartByPart(parts_dir, shown, limits.get("max_inflate_mb")).check(
                limits.get("max_label_chars")
            )
        except NotSliceable:
            pass
    log = load(path, **limits)
    return Checked(len(log.steps), len(log.emissions), log.warnings)


def _plain_pointer(path: str) -> bool:
    """Not a pointer file with members besides its one (`load` warns of those)."""
    if not os.path.isfile(path):
        return True
    _, ignored = read_npz(path, lambda names: [n for n in names if n == POINTER_MEMBER])
    return not ignored


# The order in which `validate_log` checks (a failure's key: (order, sub-order)).
# Rules checked on each part's rows: (order, table, column) ...
_FINITE = ((1, "steps", "t_start_s"), (2, "steps", "t_end_s"), (3, "segments", "t_start_s"),
           (4, "segments", "t_end_s"), (7, "emissions", "t_s"), (9, "counters", "t_s"),
           (30, "os_samples", "t_s"))  # fmt: skip
_ORDERED = ((15, "steps", "t_start_s", "t_end_s"), (16, "segments", "t_start_s", "t_end_s"))
_RANGES = (
    (31, "os_samples", "thread", 0, MAX_COUNT),
    (32, "os_samples", "kind", 0, OS_SEGMENT_END),
    (33, "os_samples", "cpu_ns", -1, MAX_OS_NS),
    (34, "os_samples", "runqueue_ns", -1, MAX_OS_NS),
    (35, "os_samples", "num_voluntary_switches", -1, MAX_COUNT),
    (36, "os_samples", "num_involuntary_switches", -1, MAX_COUNT),
    (37, "os_samples", "num_major_faults", -1, MAX_COUNT),
    (50, "steps", "num_decode", 0, MAX_COUNT),
    (51, "steps", "num_prefill_tokens", 0, MAX_COUNT),
    (52, "steps", "num_preempted", 0, MAX_COUNT),
    (53, "steps", "num_swapped_in", 0, MAX_COUNT),
    (54, "steps", "graph_size", -1, MAX_COUNT),
    (55, "emissions", "num_tokens", 1, MAX_COUNT),
    (58, "segments", "thread", 0, MAX_COUNT),
    (59, "segments", "is_device", 0, 1),
    (74, "prefill_chunks", "num_tokens", 0, MAX_COUNT),
)
# ... indices into what the run's end knows: (order, table, column, lowest, what counts)
_DEFERRED = (
    (20, "segments", "label", 0, "labels"),
    (21, "segments", "step", -1, "steps"),
    (23, "emissions", "step", -1, "steps"),
    (24, "emissions", "device_step", -1, "steps"),
    (26, "counters", "name", 0, "counter_names"),
    (72, "prefill_chunks", "request", 0, "requests"),
    (73, "prefill_chunks", "step", 0, "steps"),
    (75, "waits", "request", 0, "requests"),
    (76, "waits", "step", 0, "steps"),
)
_WAIT_REASON, _WAITS_TWICE = 77, 82
#: the tables whose rows name a request (a part's log renumbers them: `_part_log`)
_NAMING = tuple(k for k, cols in TABLES.items() if "request" in cols)
# Rules checked on the kept tables (`validate_log` of the placeholder log), by field; a
# field two rules name is told apart by its message.
_KEPT_ORDER = {
    "gc_pauses.t_start_s": 5, "gc_pauses.t_end_s": 6, "evictions.t_evict_s": 8,
    "evictions.t_readmit_s": 10, "requests.arrival_s": 11, "requests.first_token_s": 12,
    "requests.handler_s": 13, "requests.engine_s": 14, "evictions.request": 25,
    "request_ids": 45, "requests.prompt_tokens": 56, "requests.max_new_tokens": 57,
    "evictions.mode": 60, "gc_pauses.generation": 61, "wall_s": 62,
    "admissions.request": 70, "admissions.t_s": 71,
}  # fmt: skip
_KEPT_LATER = {  # (field, words of the later rule's message): its order
    ("gc_pauses.t_end_s", "before it starts"): 17,
    ("evictions.t_readmit_s", "readmitted before evicted"): 18,
    ("requests.first_token_s", "before the request's arrival"): 78,
    ("admissions.request", "admitted twice"): 79,
    ("admissions.t_s", "admitted at"): 80,
    ("evictions.t_evict_s", "evicted before its admission"): 81,
}
#: the tables kept whole: one row per request, eviction event, admission or collection
_KEPT = ("requests", "events", "admissions", "preemptions", "evictors", "gc_pauses")


def _kept_order(e: LogError) -> tuple[int, int]:
    field, msg = e.field, str(e)
    for (f, words), order in _KEPT_LATER.items():
        if f == field and words in msg:
            return order, 0
    if field in _KEPT_ORDER:
        return _KEPT_ORDER[field], 0
    if field.startswith(("coverage.", "meta.")):
        return 40, 0
    if field.startswith(("preemptions.", "evictors.")):
        return 90, 0
    return 0, 0  # nothing else can fail in the placeholder log: say it first


def _first(mask: np.ndarray) -> int | None:
    return int(np.flatnonzero(mask)[0]) if mask.any() else None


class PartByPart:
    """One run's parts checked one at a time (see the module's docstring)."""

    def __init__(self, parts_dir: str, shown: str, max_inflate_mb: float | None) -> None:
        self.parts_dir, self.shown, self.max_inflate_mb = parts_dir, shown, max_inflate_mb
        self.meta = read_meta(parts_dir)
        self.final = read_final(parts_dir, max_inflate_mb=max_inflate_mb)
        self.paths = part_paths(parts_dir)
        self.first: dict[str, Any] | None = None  # how the first part read begins
        self.retained: Retained | None = None  # how the run starts, after the parts
        self.t0_tick = int(self.meta["t0_tick"])
        self.scale = float(self.meta.get("seconds_per_tick", 1e-9))
        self.errors: dict[tuple[int, int], LogError] = {}  # the first failure of each rule
        self.fold_error: LogError | None = None
        self.rows: dict[str, int] = {k: 0 for k in TABLES}  # rows of the parts so far
        self.offsets: list[dict[str, int]] = []  # per part read: rows before it, by table
        self.extent: list[dict[tuple[str, str], tuple[int, int]]] = []  # per part: min, max
        self.kept: dict[str, list[np.ndarray]] = {k: [] for k in _KEPT}
        self.request_ids = RequestNames()
        self._room: dict[str, np.ndarray] = {}  # the buffers of the per-request columns
        self.num_emitted = np.zeros(0, dtype=np.int64)  # per request
        self.first_t = np.zeros(0)
        self.last_t = np.zeros(0)
        self.arrival = np.zeros(0)
        self.prev_emission: tuple[int, float] | None = None
        self.in_request_order = self.in_time_order = True
        self.num_early = 0
        self.prev_waits = np.zeros((0, 3), dtype=np.int64)  # step, request, row
        self.twice: tuple[int, int, int, int] | None = None  # key, row, request, step
        self.heads: dict[str, Any] = {"dropped": 0, "flush": None, "stop": None, "last": None}
        self.first_step: int | None = 0  # the run's first step (None: not said, read none)

    def check(self, max_label_chars: int | None) -> Checked:
        """Read every part once; raise the error `load` raises, else what it says."""
        warnings = self._read_all()
        warnings += index_warnings(self.parts_dir, self.paths, warnings)
        first = [self.first] if self.first else []
        self.retained = retained_start(self.parts_dir, self.paths, first, warnings)
        if self.fold_error is not None:
            raise self.fold_error
        kept = shorten_names(self._kept_log(warnings), max_label_chars)
        try:
            validated = validate_log(kept).warnings
        except LogError as e:
            self.errors.setdefault(_kept_order(e), e)
            validated = ()
        self._check_deferred(kept)
        if self.errors:
            raise self.errors[min(self.errors)]
        return Checked(self.rows["steps"], self.rows["emissions"],
                       self._warnings(kept, validated))  # fmt: skip

    def _read_all(self) -> list[str]:
        """Every part in order, as `merge_parts` reads them: the warnings of a run that
        ends early (a part missing or damaged)."""
        for i, p in enumerate(self.paths):
            if i and part_number(p) != part_number(self.paths[i - 1]) + 1:
                return [missing_part_warning(self.paths, i)]
            try:
                part = read_flushed_part(p, self.max_inflate_mb)
            except DamagedPart as e:
                if isinstance(e.cause, FileNotFoundError) and i == 0:  # removed by retention
                    raise NotSliceable("its first part was removed while it was read") from None
                return [unreadable_part_warning(self.paths, i, e.cause)]
            if i == 0:
                self._begin(part)
            if self.fold_error is None and self.first_step is not None:
                self._add(part)  # else the parts are only read, as the merge reads them
        return []

    def _begin(self, part: dict[str, Any]) -> None:
        """Where the run starts: a folder whose first parts were removed starts at its
        first part's step and requests (`retained_start`; without them, read nothing)."""
        self.first = {k: part[k] for k in ("first_step", "request_ids_start")}
        if part_number(part["where"]) != 1:
            self.first_step = part["first_step"]
            self.request_ids = RequestNames(part["request_ids_start"])
            self._grow(len(self.request_ids))

    def _part_log(self, part: dict[str, Any]) -> RawLog:
        """One part as a log: rows in seconds, steps and requests numbered in the run (a
        row naming a request not named so far: the `LogError` `merge_flushed` raises). The
        log holds only the requests its rows name, renumbered in order and numbered back in
        the rows read here: a log holding every request named so far made each part's
        check grow with the run, and the whole check with its square."""
        check_request_rows(part, part["request_ids_start"] + len(part["request_ids"]))
        tables = dict(part["tables"])
        naming = [(k, column_index(k, "request")) for k in _NAMING if k in tables]
        u, numbered = renumbered([tables[k][:, c] for k, c in naming])
        for (k, c), col in zip(naming, numbered, strict=True):
            tables[k] = tables[k].copy()
            tables[k][:, c] = col
        retained = Retained(part_number(part["where"]), 0, self.first_step or 0, None)
        local = {**part, "tables": tables, "request_ids_start": 0, "request_ids": Unnamed(len(u))}
        log = merge_flushed(self.meta, [local], path=self.shown, retained=retained)
        return replace(log, **{k: replace(getattr(log, k), request=u[getattr(log, k).request])
                               for k in ("emissions", "waits", "prefill_chunks")})  # fmt: skip

    def _add(self, part: dict[str, Any]) -> None:
        start, n = part["request_ids_start"], len(self.request_ids)
        if start != n:  # as `merge_flushed` folds the parts
            self.fold_error = LogError(
                part["where"], "request_ids_start",
                f"{start}, but the parts before it name {n} request id(s) "
                f"({'overlapping' if start < n else 'skipping'} them)",
            )  # fmt: skip
            return
        try:
            log = self._part_log(part)
        except LogError as e:  # a row naming a request not named so far
            self.fold_error = e
            return
        self.request_ids.extend(part["request_ids"])
        self._grow(len(self.request_ids))
        for k in _KEPT:
            rows = part["tables"].get(k)
            if rows is not None:
                self.kept[k].append(rows)
        self.heads["dropped"] += part["dropped_rows"]
        flush = self.heads["flush"]
        self.heads["flush"] = (
            part["flush_tick"] if flush is None else max(flush, part["flush_tick"])
        )
        if part["stop_tick"] is not None:
            self.heads["stop"] = part["stop_tick"]
        self.heads["last"] = part
        self._arrivals(part)
        self._check_rows(log)
        self._emissions(log)
        self._waits(log)
        self.offsets.append(dict(self.rows))
        for k in self.rows:
            self.rows[k] += len(part["tables"].get(k, ()))

    def _grow(self, n: int) -> None:
        """The per-request columns lengthened to `n` requests (views of buffers that grow by
        a quarter when full, `grown`: a copy of every request's at each part was quadratic
        over a long run)."""
        for key, fill in (("num_emitted", 0), ("first_t", np.inf), ("last_t", -np.inf),
                          ("arrival", np.nan)):  # fmt: skip
            setattr(self, key, grown(self._room, key, getattr(self, key), n, fill))

    def _arrivals(self, part: dict[str, Any]) -> None:
        """Each request's arrival as the whole run will hold it, before its emissions are
        compared with it (a request that already emitted and arrives anew: read whole)."""
        rq = part["tables"].get("requests")
        if rq is None:
            return
        r, tick = (
            rq[:, column_index("requests", "request")],
            rq[:, column_index("requests", "arrival_tick")],
        )
        known = tick != UNKNOWN_TICK
        r, t = r[known], (tick[known] - self.t0_tick).astype(np.float64) * self.scale
        old = self.arrival[r]
        moved = (self.num_emitted[r] > 0) & ~((old == t) | (np.isnan(old) & np.isnan(t)))
        if moved.any():
            raise NotSliceable("a request arrives again after it emitted (read whole)")
        self.arrival[r] = t

    def _fail(self, key: tuple[int, int], field: str, problem: str) -> None:
        self.errors.setdefault(key, LogError(self.shown, field, problem))

    def _check_rows(self, log: RawLog) -> None:
        """The rules a part's rows keep on their own; rows cited in the whole log."""
        off = self.rows
        for order, table, col in _FINITE:
            a, base = getattr(getattr(log, table), col), off[table]
            if (i := _first(~np.isfinite(a))) is not None:
                self._fail((order, 0), f"{table}.{col}",
                           f"row {base + i}: non-finite time {float(a[i])!r}")  # fmt: skip
            elif (i := _first(np.abs(a) > MAX_ABS_TIME_S)) is not None:
                self._fail((order, 1), f"{table}.{col}", f"row {base + i}: absurd time "
                           f"{float(a[i])!r} s (times are seconds from engine start)")  # fmt: skip
        for order, table, start, end in _ORDERED:
            t = getattr(log, table)
            a, b = getattr(t, start), getattr(t, end)
            if (i := _first(b < a)) is not None:
                self._fail((order, 0), f"{table}.{end}", f"row {off[table] + i}: ends "
                           f"({float(b[i])!r}) before it starts ({float(a[i])!r})")  # fmt: skip
        for order, table, col, lo, hi in _RANGES:
            a = getattr(getattr(log, table), col)
            if (i := _first((a < lo) | (a > hi))) is not None:
                what = "is below" if a[i] < lo else "is absurd: above"
                self._fail((order, 0), f"{table}.{col}", f"row {off[table] + i}: {int(a[i])} "
                           f"{what} {lo if a[i] < lo else hi}")  # fmt: skip
        reason = log.waits.reason
        if (i := _first((reason < 0) | (reason >= len(WAIT_REASONS)))) is not None:
            self._fail((_WAIT_REASON, 0), "waits.reason", f"row {off['waits'] + i}: index "
                       f"{int(reason[i])} outside [0, {len(WAIT_REASONS) - 1}]")  # fmt: skip
        extent: dict[tuple[str, str], tuple[int, int]] = {}
        for _, table, col, _, _ in _DEFERRED:
            a = getattr(getattr(log, table), col)
            if len(a):
                extent[(table, col)] = (int(a.min()), int(a.max()))
        self.extent.append(extent)

    def _emissions(self, log: RawLog) -> None:
        """Per request: emissions counted, first and last; the order and early counts."""
        em = log.emissions
        if not len(em):
            return
        r, t = em.request, em.t_s
        if self.prev_emission is not None:
            r = np.concatenate([[self.prev_emission[0]], r])
            t = np.concatenate([[self.prev_emission[1]], t])
        same = r[1:] == r[:-1]
        self.in_request_order &= bool(np.all((r[1:] > r[:-1]) | (same & (t[1:] >= t[:-1]))))
        self.in_time_order &= bool(np.all(t[1:] >= t[:-1]))
        self.prev_emission = (int(r[-1]), float(t[-1]))
        r, t = em.request, em.t_s
        np.add.at(self.num_emitted, r, 1)  # never a column of every request
        np.minimum.at(self.first_t, r, t)
        np.maximum.at(self.last_t, r, t)
        self.num_early += int((t < self.arrival[r]).sum())

    def _waits(self, log: RawLog) -> None:
        """Two wait reasons for one request in one step, within this part and the one
        before it (a step's rows are in one part): the smallest (step, request) twice."""
        w = log.waits
        rows = np.stack([w.step, w.request, self.rows["waits"] + np.arange(len(w))], axis=1)
        both = np.concatenate([self.prev_waits, rows])
        self.prev_waits = rows
        if len(both) < 2:
            return
        key = both[:, 0] * (1 << 31) + both[:, 1]
        u, c = np.unique(key, return_counts=True)
        if not (c > 1).any():
            return
        k = int(u[c > 1][0])
        row = both[np.flatnonzero(key == k)[1]]
        if self.twice is None or k < self.twice[0]:
            self.twice = (k, int(row[2]), int(row[1]), int(row[0]))

    def _kept_log(self, warnings: list[str]) -> RawLog:
        """The run as one log of its kept tables (`_KEPT`), its steps placeholders, no
        emissions: what `merge_parts` makes of the run but the per-token rows."""
        last = self.heads["last"]
        if last is None:
            return merge_flushed(self.meta, [], final=self.final, path=self.shown,
                                 warnings=warnings)  # fmt: skip
        steps = np.zeros((self.rows["steps"], len(TABLES["steps"])), dtype=np.int64)
        steps[:, :2] = self.t0_tick
        tables = {k: np.concatenate(v) for k, v in self.kept.items() if v}
        tables["steps"] = steps
        removed = self.retained.num_requests if self.retained else 0
        head = {**last, "tables": tables, "request_ids_start": removed,
                "request_ids": self.request_ids[removed:], "flush_tick": self.heads["flush"],
                "stop_tick": self.heads["stop"], "open_tick": None,
                "dropped_rows": self.heads["dropped"]}  # fmt: skip
        tail = {**last, "tables": {}, "request_ids_start": len(self.request_ids),
                "request_ids": [], "dropped_rows": 0}  # fmt: skip
        log = merge_flushed(self.meta, [head, tail], final=self.final, path=self.shown,
                            warnings=warnings, retained=self.retained)  # fmt: skip
        first = np.where(np.isfinite(self.first_t), self.first_t, np.nan)
        return replace(log, requests=replace(log.requests, first_token_s=first))

    def _check_deferred(self, kept: RawLog) -> None:
        """The indices into the run's steps, labels, counter names and requests: the first
        part with one outside them is read again to name its row."""
        counts = {
            "steps": len(kept.steps),
            "labels": len(kept.labels),
            "counter_names": len(kept.counter_names),
            "requests": len(kept.requests),
        }
        for order, table, col, lo, what in _DEFERRED:
            n = counts[what]
            for i, extent in enumerate(self.extent):
                mn, mx = extent.get((table, col), (lo, n - 1))  # no rows: none outside
                if mn < lo or mx >= n:
                    a = getattr(getattr(self._reread(i), table), col)
                    j = int(np.flatnonzero((a < lo) | (a >= n))[0])
                    self._fail((order, 0), f"{table}.{col}", f"row {self.offsets[i][table] + j}"
                               f": index {int(a[j])} outside [{lo}, {n - 1}]")  # fmt: skip
                    break
        if self.twice is not None and len(kept.admissions):
            _, row, r, s = self.twice
            problem = (f"row {row}: request {r} has two wait reasons in step {s} (state one "
                       "reason per request and step)")  # fmt: skip
            self._fail((_WAITS_TWICE, 0), "waits.request", problem)

    def _reread(self, i: int) -> RawLog:
        path = self.paths[i]
        return self._part_log(parse_flushed(read_part(path, max_inflate_mb=self.max_inflate_mb),
                                            path))  # fmt: skip

    def _warnings(self, kept: RawLog, validated: tuple[str, ...]) -> tuple[str, ...]:
        """`load`'s warnings: the kept log's, with the emissions' put where `validate_log`
        says them (before those of GC pauses and evictions)."""
        before = list(dict.fromkeys(kept.warnings))
        odd = list(validated[len(before) :])  # the kept log's: no emissions, GC, evictions
        emitted: list[str] = []
        if not self.rows["emissions"]:
            emitted.append(odd[0])
        else:
            if not self.in_request_order and not self.in_time_order:
                emitted.append("emissions are not in time order (sorted per request)")
            if self.num_emitted.max(initial=0) <= 1:
                emitted.append("no gaps: no request has two emissions")
            if self.num_early:
                emitted.append(f"{self.num_early} emission(s) before their request's arrival")
        rest = odd[1:]
        gc_ = [w for w in rest if w.startswith("overlapping GC")]
        ev = kept.evictions
        never = np.isnan(ev.t_readmit_s) & (ev.t_evict_s < self.last_t[ev.request])
        readmit = [] if not never.any() else [
            f"{int(never.sum())} eviction(s) never readmitted although the request emitted "
            "again (charged to the end of the gap)"
        ]  # fmt: skip
        out = before + emitted + gc_ + readmit + [w for w in rest if w not in gc_]
        return tuple(dict.fromkeys(out))
