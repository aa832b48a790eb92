"""A parts folder read in slices of consecutive parts, each with the parts before it that
its gaps and TTFTs need (docs/reports.md, "Reading a long run in slices").

A reader that holds a whole run in memory holds every row of it. This one reads a run's
parts twice over at most a few at a time:

- `SlicedRun` lists the folder and makes one *index pass*: every part read once, in order,
  handed to a visitor (the analysis takes its per-run figures there), and from each part's
  emissions and requests, the part that the gaps and TTFTs ending in it reach back to (a
  request's previous emission, or its arrival for its first token);
- `SlicedRun.slices` then yields, for consecutive parts ``[a, b)``, the `RawLog` of parts
  ``[c, b)``, where ``c`` is the earliest part any gap or TTFT ending in ``[a, b)`` reaches
  back to, and at least one part before ``a`` (a GC pause or a window flushed a part early),
  with the times ``[from, to)`` its own gaps end in: from the first emission of part ``a``
  on, to the first of part ``b``. Each slice's log is read from part ``c`` as a run whose
  earlier parts were removed is (`tracekit.log.parts.Retained`: steps numbered from part
  ``c``'s first, requests named only before it ``(removed N)``).

Memory: a slice's parts, bounded by the longest gap or queueing wait in the run plus the
slice's width, never by the run's length; the index pass keeps per request two small
integers and its last emission tick.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from tracekit.log.carried import CarriedRows, OpenStarts, open_rows, with_carried
from tracekit.log.flush import EVICT, READMIT, TABLES, UNKNOWN_TICK
from tracekit.log.merged_tables import MERGED_TABLES
from tracekit.log.parts import (
    DamagedPart,
    Retained,
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
    retention_warning,
    unreadable_part_warning,
)
from tracekit.log.rawlog import MODE_RECOMPUTE, RawLog
from tracekit.log.request_names import RequestNames, Unnamed, renumbered
from tracekit.log.thinned import Thinned, forget_before, part_key

_EMIT = {c: TABLES["emissions"].index(c) for c in ("request", "t_tick")}
#: the tables whose rows name a request
_NAMING = frozenset(k for k, cols in (*TABLES.items(), *MERGED_TABLES.items()) if "request" in cols)
_REQ = TABLES["requests"].index("request")
_ARR = TABLES["requests"].index("arrival_tick")
_FLUSH = 5  # `PartOrder.entry`'s flush tick (`PartEntry.flush_tick`)
_OS_TICK = TABLES["os_samples"].index("t_tick")
_EVENTS = [TABLES["events"].index(c) for c in ("request", "kind", "t_tick", "mode")]
#: how many parts a readmitted recompute victim that has not emitted again keeps the parts
#: after its readmission reaching back to its eviction (`IndexBook._evictions_reached`)
REPREFILL_REACH_PARTS = 64
#: the columns that hold a request's number: (table, column)
_NUMBERED = tuple(
    (k, j)
    for k, cols in (*TABLES.items(), *MERGED_TABLES.items())
    for j, c in enumerate(cols)
    if c in ("request", "evictor")
)


def _only(part: dict[str, Any], tables: frozenset[str] | None) -> dict[str, Any]:
    if tables is None:
        return part
    return {**part, "tables": {k: v for k, v in part["tables"].items() if k in tables}}


class NotSliceable(Exception):
    """The folder cannot be read in slices (its reader reads it whole): why, in words."""


@dataclass(frozen=True, slots=True)
class PartEntry:
    """One part as the index pass saw it."""

    number: int
    path: str
    first_step: int
    num_steps: int
    request_ids_start: int
    flush_tick: int
    num_emissions: int
    #: the requests emitting in it (what a slice reading it before its own parts keeps of
    #: its emissions is at most two a request: `Thinned`)
    num_emitting: int
    #: the earliest part (an index into `SlicedRun.parts`) that a gap or a TTFT ending in
    #: this part reaches back to
    reaches_back_to: int
    #: the earliest emission tick in this part or any later one (None: none from here on)
    cut_tick: int | None
    #: a merged server run's part: the latest end of its API servers' windows and OS
    #: intervals (seconds; -inf: none), which a slice read from a later part may need
    windows_end_s: float = -np.inf
    #: ... and the earliest arrival its API servers saw of the requests it names (seconds;
    #: inf: none): a TTFT starts there, maybe before the part
    arrivals_from_s: float = np.inf
    #: its first OS sample's tick (None: none): a TTFT arriving later may need the sample
    os_from_tick: int | None = None


@dataclass(frozen=True, slots=True)
class Slice:
    """A run's parts ``[first, last]`` read as one log, owning the gaps and TTFTs that end
    in ``[t_from_s, t_to_s)`` (seconds from engine start); ``own_parts``: the parts it owns."""

    log: RawLog
    t_from_s: float
    t_to_s: float
    first: int
    own_parts: tuple[int, int]


_NO_ROWS = np.zeros(0)
_CE = {c: MERGED_TABLES["client_emissions"].index(c) for c in ("request", "t_s", "process")}


@dataclass(frozen=True)
class LocalLog:
    """Some parts' log holding only the requests their rows name (`SlicedRun.local_log_of`)."""

    log: RawLog
    #: each of the log's requests' number in the run (ascending: the log's order is the run's)
    numbers: np.ndarray
    #: the run's request ids as far as the parts name them (``(removed N)`` before the first)
    names: RequestNames


@dataclass(frozen=True)
class PartOrder:
    """What the index pass's book needs of one part (`order_of`; small: per request that
    emits in it, never per token), so it can be computed where the part is read."""

    path: str
    #: `PartEntry`'s fields from `number` to `num_emissions`
    entry: tuple[Any, ...]
    has_first_step: bool
    num_requests: int  # requests named up to this part
    arrivals: np.ndarray  # the requests with an arrival row in it
    arrival_ticks: np.ndarray  # ... and their arrival ticks
    os_from_tick: int | None  # its first OS sample's tick (None: none)
    requests: np.ndarray  # the requests emitting in it, sorted
    first_tick: np.ndarray  # each one's earliest emission tick in it
    last_tick: np.ndarray  # each one's latest
    min_tick: int | None  # its earliest emission tick (None: none)
    windows_end_s: float  # `PartEntry.windows_end_s`
    arrivals_from_s: float  # `PartEntry.arrivals_from_s`
    # a merged server run's: per request with a chunk written here, its earliest chunk's
    # time and API server (the last row of equal times), as `request_api_servers` reads them
    chunk_requests: np.ndarray
    chunk_t: np.ndarray
    chunk_process: np.ndarray
    #: its ``events`` rows (evictions and readmissions: request, kind, tick, mode), in
    #: time order
    events: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    #: its rows that may have begun before the part before it was flushed (`open_rows`),
    #: and its label vocabulary, for what it carries back (`tracekit.log.carried`)
    open_rows: dict[str, np.ndarray] = field(default_factory=dict)
    labels: tuple[str, ...] = ()


def order_of(path: str, part: dict[str, Any]) -> PartOrder:
    """A parsed part's `PartOrder`."""
    t_ = part["tables"]
    rq, em, steps = t_.get("requests"), t_.get("emissions"), t_.get("steps")
    has_rq = rq is not None and len(rq)
    arrivals = rq[:, _REQ].copy() if has_rq else np.zeros(0, np.int64)
    arrival_ticks = rq[:, _ARR].copy() if has_rq else np.zeros(0, np.int64)
    r = t = np.zeros(0, dtype=np.int64)
    if em is not None and len(em):
        r, t = em[:, _EMIT["request"]], em[:, _EMIT["t_tick"]]
    o = np.lexsort((t, r))
    rs, ts = r[o], t[o]
    head = np.ones(len(rs), dtype=bool)
    head[1:] = rs[1:] != rs[:-1]
    tail = np.ones(len(rs), dtype=bool)
    tail[:-1] = head[1:]
    entry = (part_number(path), path, part["first_step"], 0 if steps is None else len(steps),
             part["request_ids_start"], part["flush_tick"], len(r), int(head.sum()))  # fmt: skip
    windows = [t_.get(k) for k in ("proc_segments", "proc_os")]
    ends = [float(w[:, MERGED_TABLES[k].index("t_end_s")].max())
            for k, w in zip(("proc_segments", "proc_os"), windows, strict=True)
            if w is not None and len(w)]  # fmt: skip
    return PartOrder(
        path, entry, part["first_step"] is not None,
        part["request_ids_start"] + len(part["request_ids"]), arrivals, arrival_ticks,
        int(os_[:, _OS_TICK].min()) if (os_ := t_.get("os_samples")) is not None and len(os_)
        else None,
        rs[head], ts[head],
        ts[tail], int(t.min()) if len(t) else None, max(ends, default=-np.inf),
        float(np.nanmin(cr[:, 1], initial=np.inf)) if (cr := t_.get("client_requests")) is not None
        else np.inf,
        *_first_chunks(t_.get("client_emissions")),
        _events(t_.get("events")),
        open_rows(part),
        tuple(part["labels"]),
    )  # fmt: skip


def _events(ev: np.ndarray | None) -> np.ndarray:
    """A part's ``events`` rows as (request, kind, tick, mode), in time order (a
    request's in the order written)."""
    if ev is None or not len(ev):
        return np.zeros((0, 4), np.int64)
    ev = ev[:, _EVENTS].astype(np.int64)
    return ev[np.argsort(ev[:, 2], kind="stable")]


def _first_chunks(ce: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per request with a chunk in `ce` (a part's merged ``client_emissions`` rows), its
    earliest chunk's time and process, the last row of equal times: `PartOrder.chunk_*`."""
    if ce is None or not len(ce):
        return _NO_ROWS, _NO_ROWS, _NO_ROWS
    r, t = ce[:, _CE["request"]].astype(np.int64), ce[:, _CE["t_s"]]
    o = np.lexsort((-np.arange(len(r)), t, r))  # by request, time, then the last row first
    head = np.ones(len(o), dtype=bool)
    head[1:] = r[o][1:] != r[o][:-1]
    k = o[head]
    return r[k], t[k], ce[k, _CE["process"]].astype(np.int64)


def parts_holding(
    flushed: np.ndarray, ticks: np.ndarray, i: int, sampled: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """For arrival rows in part `i` (`flushed`: the flush ticks of the parts before it;
    `sampled`: of those with OS samples, each one's part and first sample tick, in order),
    the earliest part a TTFT from each arrival reads: the part whose time holds the arrival
    (the first that flushed after it), or the earlier part holding the last OS sample at or
    before it (the OS interval the arrival falls in starts there). A recorder may write an
    arrival after the time it took place (an engine that adds a request after tokenising it
    off the loop, vLLM's engine core with the time the request reached the server), and rows
    of its TTFT from then on (a wait, a step) may lie in earlier parts; an arrival not
    recorded stays in part `i`."""
    at = np.full(len(ticks), i, dtype=np.int64)
    known = ticks != UNKNOWN_TICK
    if not i or not known.any():
        return at
    at[known] = np.searchsorted(flushed[:i], ticks[known], side="right")
    parts, first = sampled
    if not len(parts):
        return at
    k = np.searchsorted(first, ticks[known], side="right") - 1  # the last part sampled by then
    at[known] = np.where(k >= 0, np.minimum(at[known], parts[np.maximum(k, 0)]), at[known])
    return at


def grown(room: dict[str, np.ndarray], key: str, a: np.ndarray, n: int, fill: float) -> np.ndarray:
    """`a` with rows up to `n`, the new ones `fill`: a view of a buffer kept in `room` under
    `key`, grown by a quarter when full (requests appear a part at a time: a copy of every
    row for each part was the index pass's cost on a long run; doubling left up to half of
    a day's per-request columns unused, and three times them held while copying)."""
    if n <= len(a):
        return a
    buf = room.get(key)
    if buf is None or a.base is not buf or len(buf) < n:
        buf = np.full(max(n, len(a) + len(a) // 4), fill, dtype=a.dtype)
        buf[: len(a)] = a
        room[key] = buf
    return buf[:n]


class IndexBook:
    """The index pass's book, part by part in order (`add`): per request, the part of its
    latest emission, its latest emission tick and the part of its arrival; per part, how
    far back the gaps and TTFTs ending in it reach, its earliest emission and its entry."""

    def __init__(self) -> None:
        self.last_part = np.zeros(0, dtype=np.int64)
        self.last_tick = np.zeros(0, dtype=np.int64)
        self.arrival_part = np.zeros(0, dtype=np.int64)
        self.reach: list[int] = []
        self.min_tick: list[int | None] = []
        self.windows_end_s: list[float] = []
        self.os_from_tick: list[int | None] = []
        self.arrivals_from_s: list[float] = []
        self.chunk_t = np.zeros(0)  # per request: its earliest chunk's time (inf: none yet)
        self.api_server = np.zeros(0, dtype=np.int64)  # ... and its API server (-1: none)
        self.entries: list[tuple[Any, ...]] = []
        self.flush_ticks = np.zeros(0, dtype=np.int64)  # per part added: its flush tick
        # the parts with OS samples, in order, and each one's first sample tick
        self.sampled_parts = np.zeros(0, dtype=np.int64)
        self.sampled_first = np.zeros(0, dtype=np.int64)
        self.num_sampled = 0
        # recompute victims (`_evictions_reached`): while out, the part of the eviction; once
        # readmitted and until they emit again, the part of their earliest such eviction,
        # their last readmission's tick and its part
        self.evicted_in: dict[int, int] = {}
        self.readmitted: dict[int, tuple[int, int, int]] = {}
        # victims evicted in another mode (a swap), while out: the part of their eviction
        self.swapped_out: dict[int, int] = {}
        self.carried = CarriedRows()  # what each part carries back (`tracekit.log.carried`)
        self.open_starts = OpenStarts()
        self._room: dict[str, np.ndarray] = {}

    def add(self, i: int, o: PartOrder) -> None:
        """Part `i` (the next), or `NotSliceable` where the run cannot be read in slices."""
        name = os.path.basename(o.path)
        if not o.has_first_step:
            raise NotSliceable(f"{name} does not say its first step")
        n, room = o.num_requests, self._room
        if n > len(self.last_part):
            self.last_part = grown(room, "last_part", self.last_part, n, -1)
            self.last_tick = grown(room, "last_tick", self.last_tick, n, np.iinfo(np.int64).min)
            self.arrival_part = grown(room, "arrival_part", self.arrival_part, n, -1)
        n_s = self.num_sampled
        self.arrival_part[o.arrivals] = parts_holding(
            self.flush_ticks[:i], o.arrival_ticks, i,
            (self.sampled_parts[:n_s], self.sampled_first[:n_s]),
        )  # fmt: skip
        back, u = i, o.requests
        if len(u):
            if np.any(o.first_tick < self.last_tick[u]):  # a request's emissions in time order
                raise NotSliceable(f"{name}: emissions out of time order")
            seen = self.last_part[u]
            back = min(back, int(seen[seen >= 0].min()) if (seen >= 0).any() else back)
            arr = self.arrival_part[u[seen < 0]]  # first tokens: back to their arrival
            if (arr >= 0).any():
                back = min(back, int(arr[arr >= 0].min()))
            self.last_part[u] = i
            self.last_tick[u] = np.maximum(self.last_tick[u], o.last_tick)
        back = min(back, self._evictions_reached(i, o))
        if o.open_rows:
            before = int(self.flush_ticks[i - 1]) if i else np.iinfo(np.int64).min
            rows = self.open_starts.carried_back(i, o.open_rows, before)
            if rows is not None:
                self.carried.add(i, rows, o.labels)
        self.min_tick.append(o.min_tick)
        self.windows_end_s.append(o.windows_end_s)
        self.arrivals_from_s.append(o.arrivals_from_s)
        if len(o.chunk_requests):
            self._first_chunks(o)
        self.reach.append(back)
        self.entries.append(o.entry)
        self.flush_ticks = grown(self._room, "flush_ticks", self.flush_ticks, i + 1, 0)
        self.flush_ticks[i] = o.entry[_FLUSH]
        if o.os_from_tick is not None:
            n_s = self.num_sampled + 1
            self.sampled_parts = grown(self._room, "sampled_parts", self.sampled_parts, n_s, 0)
            self.sampled_first = grown(self._room, "sampled_first", self.sampled_first, n_s, 0)
            self.sampled_parts[n_s - 1], self.sampled_first[n_s - 1] = i, o.os_from_tick
            self.num_sampled = n_s
        self.os_from_tick.append(o.os_from_tick)

    def _evictions_reached(self, i: int, o: PartOrder) -> int:
        """The earliest part holding the eviction of a victim that re-prefills in part `i`
        (`i`: none): whose re-prefill a step's `recompute` segment is names every eviction
        in recompute mode readmitted by the step's end whose victim has not emitted since
        (docs/partition.md, "The re-prefill in the partition"), so the gaps ending in part
        `i` are split knowing each such eviction (a slice from a later part would miss
        it). Such an eviction counts from its readmission until its victim emits again,
        through a second eviction of the victim meanwhile. A victim that has not emitted
        `REPREFILL_REACH_PARTS` parts after its last readmission (aborted, say) is let go:
        the rule still counts it, and a slice that starts after its eviction does not
        (docs/reports.md, "Reading a long run"), where reaching back for it would have
        every later slice read from its eviction on. Likewise the eviction of a victim
        readmitted in part `i` from another mode (a swap in): a step's `swap` segment is
        named after the victims evicted or readmitted in the step (docs/partition.md,
        "Naming the parts", 3), and the step readmitting it may lie in a slice that its
        own next gap does not end in."""
        for r in [r for r, (_, _, at) in self.readmitted.items()
                  if i - at > REPREFILL_REACH_PARTS]:  # fmt: skip
            del self.readmitted[r]
        back = min((first for first, _, _ in self.readmitted.values()), default=i)
        for r, kind, t, mode in o.events.tolist():
            if kind == EVICT:
                if mode == MODE_RECOMPUTE:
                    self.evicted_in[r] = i
                else:
                    self.evicted_in.pop(r, None)
                    self.swapped_out.setdefault(r, i)
            elif kind == READMIT and r in self.swapped_out:
                back = min(back, self.swapped_out.pop(r))
            elif kind == READMIT and r in self.evicted_in:
                at = self.evicted_in.pop(r)
                first = self.readmitted[r][0] if r in self.readmitted else at
                self.readmitted[r] = (first, t, i)
                back = min(back, first)
        if self.readmitted and len(o.requests):
            asked = np.fromiter(self.readmitted, np.int64)
            k = np.minimum(np.searchsorted(o.requests, asked), len(o.requests) - 1)
            for r, j in zip(asked.tolist(), k.tolist(), strict=True):
                if o.requests[j] == r and o.last_tick[j] > self.readmitted[r][1]:
                    del self.readmitted[r]  # emitted after its last readmission: done
        return back

    def _first_chunks(self, o: PartOrder) -> None:
        """Part `o`'s earliest chunk per request, kept where it is the run's so far (a
        later part's wins a tie: it comes later in the run's rows)."""
        u = o.chunk_requests
        n = int(u.max()) + 1
        if n > len(self.chunk_t):
            self.chunk_t = grown(self._room, "chunk_t", self.chunk_t, n, np.inf)
            self.api_server = grown(self._room, "api_server", self.api_server, n, -1)
        first = o.chunk_t <= self.chunk_t[u]
        self.chunk_t[u[first]] = o.chunk_t[first]
        self.api_server[u[first]] = o.chunk_process[first]


class SlicedRun:
    """A parts folder read part by part (see the module's docstring)."""

    def __init__(
        self,
        parts_dir: str,
        *,
        max_inflate_mb: float | None = None,
        parts: tuple[int, Sequence[str]] = (0, ()),
    ) -> None:
        """`parts`: ``(c, paths)``, the paths of parts ``c, c + 1, ...`` as the index pass
        listed them, for a slice's reader (`log_of` of those parts only): the folder is
        not listed again (a day's holds ~50,000 parts, listed for every slice was half of
        its reading time; and a folder that retention trims while it is read would number
        its parts anew). Without them the folder is listed."""
        self.parts_dir = parts_dir
        self.max_inflate_mb = max_inflate_mb
        self.meta = read_meta(parts_dir)
        self.final = read_final(parts_dir, max_inflate_mb=max_inflate_mb)
        self.t0_tick = int(self.meta["t0_tick"])
        self.seconds_per_tick = float(self.meta.get("seconds_per_tick", 1e-9))
        first, given = parts
        # a slice's: indexed as the folder's list (its parts before `first` never read)
        self.paths = [""] * first + list(given) if given else part_paths(parts_dir)
        self.parts: list[PartEntry] = []
        #: per request, the part whose time holds its arrival (-1: none), after `index`
        #: (`IndexBook._parts_holding`: the part of its arrival row, or an earlier one)
        self.arrival_part = np.zeros(0, dtype=np.int64)
        self.warnings: list[str] = []
        self.api_server = np.zeros(0, dtype=np.int64)
        self._cache: dict[int, dict[str, Any]] = {}
        self._reach: tuple[np.ndarray, ...] | None = None  # `windows_back_to`'s columns
        self.carried = CarriedRows()  # after `index`: what each part carries back

    def secs(self, ticks: np.ndarray) -> np.ndarray:
        """Ticks as seconds from engine start, as every reader computes them."""
        return (ticks - self.t0_tick).astype(np.float64) * self.seconds_per_tick

    def read(self, i: int) -> dict[str, Any]:
        """Part `i` (of `paths`), parsed (the last few read are kept)."""
        hit = self._cache.get(i)
        if hit is None:
            hit = parse_flushed(read_part(self.paths[i], max_inflate_mb=self.max_inflate_mb),
                                self.paths[i])  # fmt: skip
            self._keep(i, hit)
        return hit

    def _keep(self, i: int, part: dict[str, Any]) -> None:
        """Keep part `i` as read (the last few read)."""
        if len(self._cache) >= 4:
            self._cache.pop(min(self._cache))
        self._cache[i] = part

    def index(self, visit: Callable[[int, dict[str, Any]], None] | None = None) -> None:
        """The index pass: every part once, in order (`visit(i, part)` for each). Raises
        `NotSliceable` for a folder whose parts do not say where they begin. A part missing
        or damaged ends the run before it, as the whole-run reader ends it (`merge_parts`),
        with its warnings (`warnings`, said with the run's); so does what the index says
        and a folder whose first parts were removed."""
        if not self.paths:
            raise NotSliceable("no parts")
        book = IndexBook()
        for i, path in enumerate(self.paths):
            if not self.follows(i):
                self.end_before(i, missing_part_warning(self.paths, i))
                break
            try:
                part = self.read_indexed(i)
            except DamagedPart as e:
                self.end_before(i, unreadable_part_warning(self.paths, i, e.cause))
                break
            book.add(i, order_of(path, part))
            if visit is not None:
                visit(i, part)
        self.indexed(book)

    def end_before(self, i: int, warning: str) -> None:
        """The run ends before part `i` (missing or damaged; `NotSliceable` for the first:
        the whole-run reader says why)."""
        if i == 0:
            raise NotSliceable(warning)
        self.paths = self.paths[:i]
        self.warnings.append(warning)

    def read_indexed(self, i: int) -> dict[str, Any]:
        """`read` as the index pass reads: `DamagedPart` for a part damaged on disk
        (`tracekit.log.parts.read_flushed_part`'s rule)."""
        hit = self._cache.get(i)
        if hit is None:
            hit = read_flushed_part(self.paths[i], self.max_inflate_mb)
            self._keep(i, hit)
        return hit

    def follows(self, i: int) -> bool:
        """Part `i`'s number follows the part before it's."""
        return not i or part_number(self.paths[i]) == part_number(self.paths[i - 1]) + 1

    def indexed(self, book: IndexBook) -> None:
        """The index pass's result (`book`, every part added in order): `parts`,
        `arrival_part`, and the warnings the whole-run reader says of the folder."""
        cut: list[int | None] = [None] * (len(book.entries) + 1)
        for i in range(len(book.entries) - 1, -1, -1):
            m, later = book.min_tick[i], cut[i + 1]
            cut[i] = m if later is None else (later if m is None else min(m, later))
        self.warnings += index_warnings(self.parts_dir, self.paths, self.warnings)
        if part_number(self.paths[0]) != 1:  # the folder's first parts were removed
            self.warnings.append(retention_warning(part_number(self.paths[0]),
                                                   book.entries[0][4]))  # fmt: skip
        self.arrival_part = book.arrival_part
        #: per request, the API server that wrote its first chunk (-1: none; a merged
        #: server run's: `tracekit.attribution.client.request_api_servers` of the whole run)
        self.api_server = book.api_server
        self._reach = None
        self.carried = book.carried
        self.parts = [PartEntry(*e, reaches_back_to=book.reach[i], cut_tick=cut[i],  # type: ignore[misc]
                                windows_end_s=book.windows_end_s[i],
                                arrivals_from_s=book.arrivals_from_s[i],
                                os_from_tick=book.os_from_tick[i])
                      for i, e in enumerate(book.entries)]  # fmt: skip

    def carried_into(self, c: int, b: int) -> dict[str, Any] | None:
        """What other parts carry to a log of parts ``[c, b)``, after `index`
        (`tracekit.log.carried`; None: nothing)."""
        if not 0 <= c < b <= len(self.parts):
            return None
        if b == len(self.parts):  # nothing after it: the flush and step past every row
            flushed, first = np.iinfo(np.int64).min, np.iinfo(np.int64).max
        else:
            flushed, first = self.parts[b - 1].flush_tick, self.parts[b].first_step
        return self.carried.into(c, b, flushed, first)

    def retained(self, c: int) -> Retained | None:
        """How a log read from part `c` starts (None: from the run's first part)."""
        if c == 0 and part_number(self.paths[0]) == 1:
            return None
        before = self.parts[c - 1].flush_tick if c > 0 and self.parts else None
        if self.parts:  # after the index pass: what the part says, from its entry
            e = self.parts[c]
            return Retained(e.number, e.request_ids_start, e.first_step, before)
        part = self.read(c)
        return Retained(part_number(self.paths[c]), part["request_ids_start"],
                        part["first_step"], before)  # fmt: skip

    def log_of(
        self,
        c: int,
        b: int,
        *,
        tables: frozenset[str] | None = None,
        final: bool = False,
        retained: Retained | None | bool = True,
        carried: dict[str, Any] | None | bool = True,
    ) -> RawLog:
        """The `RawLog` of parts ``[c, b)``; `tables`: keep only these (the others empty);
        `final`: with what the run's clean stop wrote (its config, wall time, warnings);
        `retained`: how a log read from part `c` starts, where known (default: read it);
        `carried`: what other parts carry to it (default: the index's)."""
        # each part cut to `tables` as it is read: never every part's rows at once
        parts = [_only(self.read(i), tables) for i in range(c, b)]
        if parts:
            more = self.carried_into(c, b) if carried is True else carried or None
            parts[-1] = _only(with_carried(parts[-1], more), tables)
        start = self.retained(c) if retained is True else retained or None
        return merge_flushed(self.meta, parts, path=self.parts_dir, retained=start,
                             final=self.final if final else None,
                             warnings=list(self.warnings) if final else None)  # fmt: skip

    def local_log_of(
        self,
        c: int,
        b: int,
        *,
        retained: Retained | None | bool = True,
        thin_before_s: float = -np.inf,
        final: bool = False,
        carried: dict[str, Any] | None | bool = True,
    ) -> LocalLog:
        """`log_of` parts ``[c, b)`` holding only the requests their rows name, numbered
        0, 1, ... in the run's order (`LocalLog.numbers`: each one's number in the run).
        `log_of` holds every request named so far: its per-request columns, and a slice's
        work on them, grew with the run (a day's last slices held ~3 M requests for the
        ~20,000 they read). Parts whose rows name a request they do not (damage): read as
        `log_of` reads them, numbered as the run numbers them, its errors raised.

        `thin_before_s`: of the emissions before it, keep per part each request's first
        and last, and every emission of a request evicted in the parts (`Thinned`): what a
        slice whose own gaps end from there needs of them. `final`, `carried`: as
        `log_of`'s."""
        thin = Thinned(thin_before_s, self.secs)
        if c < len(self.paths) and self.paths[c]:
            forget_before(self.paths[c])  # no later slice reads before part `c`
        for i in range(c, b):
            key = part_key(self.paths[i], self.max_inflate_mb)  # and the clock it is read by
            clocked = None if key is None else (*key, self.t0_tick, self.seconds_per_tick)
            thin.add(clocked, partial(self.read, i))
        parts = thin.kept()
        if parts is None:  # (each part read again: none held twice)
            parts = [self.read(i) for i in range(c, b)]
        more = self.carried_into(c, b) if carried is True else carried or None
        if parts:
            parts[-1] = with_carried(parts[-1], more)
        return self.local_log_from(c, b, parts, retained=retained, final=final,
                                   carried=more)  # fmt: skip

    def local_log_from(
        self,
        c: int,
        b: int,
        parts: list[dict[str, Any]],
        *,
        retained: Retained | None | bool = True,
        final: bool = False,
        cut_to: frozenset[str] | None = None,
        carried: dict[str, Any] | None = None,
    ) -> LocalLog:
        """`local_log_of` parts ``[c, b)`` as read (`parts`: each one's `read`, maybe cut
        to the tables `cut_to` or thinned; the last with what later parts carry back to it,
        `carried`). Parts whose rows name a request they do not: `log_of` them (cut to
        `cut_to`, with `carried`), numbered as the run numbers them, its errors raised."""
        start = self.retained(c) if retained is True else retained or None
        n0 = parts[0]["request_ids_start"] if parts else 0
        names = RequestNames(n0)
        cols: list[np.ndarray] = []
        ok = n0 == (start.num_requests if start else 0)
        for part in parts:
            ok = ok and part["request_ids_start"] == len(names)
            names.extend(part["request_ids"])
            mine = [part["tables"][k][:, j] for k, j in _NUMBERED if k in part["tables"]]
            ok = ok and all(not len(x) or (x.min() >= 0 and x.max() < len(names)) for x in mine)
            cols += mine
        if not ok:  # rows naming what the parts do not: the run's numbering and errors
            log = self.log_of(c, b, retained=start, final=final, tables=cut_to,
                              carried=carried)  # fmt: skip
            return LocalLog(log, np.arange(len(log.request_ids)), names)
        numbers, local = renumbered([x.astype(np.int64) for x in cols])
        it = iter(local)
        own = []
        for k, part in enumerate(parts):
            tables = dict(part["tables"])
            for table, j in _NUMBERED:
                if table in tables:
                    tables[table] = tables[table].copy()
                    tables[table][:, j] = next(it)
            ids = Unnamed(len(numbers) if k == 0 else 0)  # named once merged
            own.append({**part, "tables": tables, "request_ids": ids,
                        "request_ids_start": 0 if k == 0 else len(numbers)})  # fmt: skip
        at = None if start is None else replace(start, num_requests=0)
        log = merge_flushed(self.meta, own, path=self.parts_dir, retained=at,
                            final=self.final if final else None,
                            warnings=list(self.warnings) if final else None)  # fmt: skip
        return LocalLog(replace(log, request_ids=names.picked(numbers)), numbers, names)

    def unnamed_log_of(self, c: int, b: int, tables: frozenset[str]) -> RawLog:
        """`log_of` parts ``[c, b)`` cut to `tables`, none of which names a request: a log
        that holds no request (as `log_of`, it would hold per request named so far its
        columns and its id: the index pass reads such a log at every part, so a long run's
        pass grew with the square of its length)."""
        if tables & _NAMING:
            raise ValueError(f"{sorted(tables & _NAMING)} name requests")
        parts = [{**_only(self.read(i), tables), "request_ids_start": 0, "request_ids": []}
                 for i in range(c, b)]  # fmt: skip
        start = self.retained(c)
        if start is not None:
            start = replace(start, num_requests=0)
        return merge_flushed(self.meta, parts, path=self.parts_dir, retained=start)

    def cut_s(self, i: int) -> float:
        """Where the gaps of parts `i`.. begin: their earliest emission (inf: none)."""
        tick = self.parts[i].cut_tick
        return np.inf if tick is None else float(self.secs(np.array(tick)))

    def bounds(self, max_emissions: int) -> list[tuple[int, int, int]]:
        """Each slice's parts (after `index`): ``(c, a, b)``, read ``[c, b)``, own
        ``[a, b)``; as many parts as keep the emissions kept within `max_emissions` (its
        own parts' and the part before them whole, at most two a request emitting of each
        earlier part: `Thinned`) and its own parts' within half of it (a gap partitioned
        holds ~3x its emission row: on an hour of a busy server, own parts up to the whole
        budget peaked at 376 MB, up to half at 271 MB, in the same time); at least one
        part a slice."""
        out: list[tuple[int, int, int]] = []
        n, a = len(self.parts), 0
        counts = np.array([e.num_emissions for e in self.parts], dtype=np.int64)
        thin = np.minimum(counts, 2 * np.array([e.num_emitting for e in self.parts], np.int64))
        cum, cum_thin = (np.concatenate([[0], np.cumsum(x)]) for x in (counts, thin))
        while a < n:
            b, c = a + 1, min(self.parts[a].reaches_back_to, max(0, a - 1))
            while b < n:
                c2 = min(c, self.parts[b].reaches_back_to)
                whole = max(a - 1, c2)  # from the part before `a`: kept whole
                kept = cum[b + 1] - cum[whole] + cum_thin[whole] - cum_thin[c2]
                if kept > max_emissions or 2 * (cum[b + 1] - cum[a]) > max_emissions:
                    break
                b, c = b + 1, c2
            out.append((self.windows_back_to(c, b), a, b))
            a = b
        return out

    def windows_back_to(self, c: int, b: int) -> int:
        """`c`, or an earlier part, for a merged server run's TTFTs of parts ``[c, b)``:
        a TTFT starts at its API server's arrival (maybe before part `c`), and reads the API
        servers' windows and OS intervals from there, each in the part of its start
        (docs/ttft.md, the frontend's time). The parts' columns are made once a run (a day
        holds ~86,000 parts, and every slice asks)."""
        if self._reach is None:
            ends = np.array([e.windows_end_s for e in self.parts])
            arrived = np.array([e.arrivals_from_s for e in self.parts])
            flush_s = self.secs(np.array([e.flush_tick for e in self.parts], dtype=np.int64))
            is_merged = bool(np.isfinite(ends).any() or np.isfinite(arrived).any())
            self._reach = (ends, arrived, flush_s) if is_merged else ()
        if not self._reach or c == 0:
            return c  # not a merged server run's, or nothing before part `c`
        ends, arrived, flush_s = self._reach
        since = min(float(flush_s[c - 1]), float(arrived[c:b].min(initial=np.inf)))
        c = min(c, int(np.searchsorted(flush_s[:c], since, side="right")))  # the part holding it
        reach = np.flatnonzero(ends[:c] > since)
        return int(reach[0]) if len(reach) else c

    def slices(self, max_emissions: int) -> Iterator[Slice]:
        """The slices of `bounds`, each read as one log (after `index`)."""
        n = len(self.parts)
        for c, a, b in self.bounds(max_emissions):
            yield Slice(
                log=self.log_of(c, b),
                t_from_s=-np.inf if a == 0 else self.cut_s(a),
                t_to_s=np.inf if b == n else self.cut_s(b),
                first=c,
                own_parts=(a, b),
            )
