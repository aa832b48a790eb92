"""The recorder's request book: request ids interned to handles, what each request has
been through so far, and the checks and rows of the calls that name requests (arrival,
admission, prefill chunks, wait reasons, emissions, evictions, readmissions).

A handle is the request's index: the integer `Recorder.request` returns and the
`*_handles` calls take. The log names requests by the id's string, resolved at flush
(`names`). Each call checks what it may against what the book knows (a first token before
its arrival, an admission after the first emission...) and either refuses it or adjusts its
tick, counting the adjustment in `notes` (warnings at stop).
"""

from __future__ import annotations

import os
import struct
import warnings
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from tracekit.capture.buffers import RowBuffers
from tracekit.capture.checks import as_int, as_int_vector, small_ints
from tracekit.capture.finished import FinishedIds
from tracekit.capture.segments import OpenStep
from tracekit.capture.sinks import EMIT_CALLS, EMIT_HANDLES
from tracekit.log.flush import EVICT, READMIT, UNKNOWN_TICK
from tracekit.log.rawlog import PREEMPT_REASON_CODES, PREEMPT_REASONS
from tracekit.log.validate import MAX_COUNT


def _caller_level() -> int:
    """`warnings.warn`'s stacklevel that names the first frame outside tracekit/capture:
    the engine's call (as `skip_file_prefixes` does from Python 3.12 on)."""
    import inspect  # only when warning: the recorder's import stays light

    here = os.path.dirname(os.path.abspath(__file__))
    level, frame = 1, inspect.currentframe()
    frame = frame.f_back if frame is not None else None
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


#: What the log's warnings say of a new integer id that was another request's handle
HANDLE_AS_ID = (
    "new integer request id(s) given to emit() that were other requests' handles, recorded "
    "as new requests (emit takes ids; emit_handles takes the handles request() returns)"
)

_ROW7 = struct.Struct("7q").pack
_ROW6 = struct.Struct("6q").pack
_ROW4 = struct.Struct("4q").pack
_ROW3 = struct.Struct("3q").pack
_ROW2 = struct.Struct("2q").pack

#: Up to this many handles in a list, a call is checked and packed in Python: for a few
#: values that is cheaper than numpy's fixed cost per operation.
SMALL = 8

#: The request book forgets finished requests' slots once at least this many are before
#: the first request not finished (`RequestBook.compact`).
COMPACT_AT = 4096

#: A tick never reached: a request not yet admitted, emitted or evicted.
NEVER = np.iinfo(np.int64).max


def bytes_of(rows: np.ndarray) -> bytes:
    """An array's bytes in C order (what `array.frombytes` takes): one copy, cheaper than a
    memoryview cast of a few thousand bytes, and right for a strided view too."""
    return rows.tobytes()


_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
_INT32 = np.dtype(np.int32)
_min_of = np.minimum.reduce  # `ndarray.min` without its Python wrapper
#: `r.emitted_np[rel] = _TRUE`: a 0-d array is assigned as is (True is converted first)
_TRUE = np.ones((), dtype=np.bool_)
_TRUE.flags.writeable = False


def in_range(values: Any, lo: int, hi: int) -> np.ndarray | None:
    """`values - lo` (`values` itself when `lo` is 0), when `values` is a flat int64
    array of more than `SMALL` values, each in [lo, hi]: the per-step batch, checked with
    one pass for the largest value as unsigned (a value below `lo` is above `hi - lo`
    there). None otherwise: check it with `as_int_vector`, which names the wrong value
    and converts other types.

    The pass is `argmax`, the array's own method, and the value it points at: for 512
    values ~0.5 µs, against 1.2 µs for `np.maximum.reduce` (a ufunc's fixed cost)."""
    if (
        type(values) is np.ndarray
        and values.dtype is _INT64
        and values.ndim == 1
        and values.size > SMALL
    ):
        rel = values - lo if lo else values
        u = rel.view(_UINT64)
        if u.item(u.argmax()) <= hi - lo:
            return rel
    return None


def few(values: Any) -> bool:
    """A list, tuple or 1-D array of at most `SMALL` values (iterators are not: a check
    would consume them)."""
    if type(values) is np.ndarray:
        return values.ndim == 1 and values.size <= SMALL
    return isinstance(values, (list, tuple)) and len(values) <= SMALL


#: `eviction_cause`'s names of the counts it checks, in `preemptions` column order.
CAUSE_COUNTS = ("num_computed_tokens_lost", "num_free_blocks", "num_used_blocks")


def eviction_cause(
    victim: Any, reason: Any, by: Any, step: int, counts: Sequence[Any]
) -> tuple[tuple[int, ...], list[Any]]:
    """`Recorder.evict`'s cause, checked before anything is recorded: the `preemptions`
    row's values after the victim (step, reason code, then `counts` with None as -1: not
    told) and the evictors' ids as a list. Raises naming the argument that is wrong."""
    why = PREEMPT_REASON_CODES.get(reason) if isinstance(reason, str) else None
    if why is None:
        raise ValueError(
            f"evict(reason=): {reason!r:.80} is not one of {list(PREEMPT_REASONS)} "
            f"(evicting {victim!r:.80}: a cause needs its reason)"
        )
    told = tuple(
        -1 if v is None else as_int(v, f"evict({name})")
        for name, v in zip(CAUSE_COUNTS, counts, strict=True)
    )
    if by is None:
        return (step, why, *told), []
    if isinstance(by, (str, bytes)) or not isinstance(by, Iterable):
        raise TypeError(f"evict(by=): expected a list of request ids, got {by!r:.80}")
    evictors = list(by)
    for i, e in enumerate(evictors):
        if e == victim:
            raise ValueError(f"evict(by=): {victim!r:.80} cannot be its own evictor")
        if e in evictors[:i]:
            raise ValueError(f"evict(by=): {e!r:.80} is named twice")
    return (step, why, *told), evictors


class RequestColumns:
    """Per request (by handle), what the checks of later calls need: its arrival tick
    (`UNKNOWN_TICK` before `request()`), the ticks of its admission and first eviction
    (`NEVER` until then), whether `request()` was called, whether it has emitted and
    whether it was finished (`Recorder.finish`).

    The columns hold the handles from `base` on (handle `h` at `h - base`): the requests
    before it are finished and forgotten (`RequestBook.compact`). Each column is an
    `array.array` (a scalar read or write is a Python int, several times cheaper than a
    numpy element) with a numpy view of the same memory (`arrival_np`, `emitted_np`) for
    the checks of a whole batch in one pass. Grown by doubling."""

    __slots__ = (
        "arrival", "told", "admitted_tick", "emitted", "first_evict", "finished", "arrival_np",
        "emitted_np", "base",
    )  # fmt: skip

    #: column -> (array typecode, initial value)
    COLUMNS = {
        "arrival": ("q", UNKNOWN_TICK),
        "admitted_tick": ("q", NEVER),
        "first_evict": ("q", NEVER),
        "told": ("b", 0),  # request() was called
        "emitted": ("b", 0),
        "finished": ("b", 0),
    }

    def __init__(self, capacity: int = 1024) -> None:
        self.base = 0
        self.arrival = self.admitted_tick = self.first_evict = array("q")
        self.told = self.emitted = self.finished = array("b")
        self._fill(0, capacity)

    def _fill(self, old: int, new: int, drop: int = 0) -> None:
        """Columns of `new` slots: slots `drop`..`old` of the current ones, then initial
        values."""
        for name, (code, init) in self.COLUMNS.items():
            col = array(code, getattr(self, name)[drop:old])  # a copy: old views stay valid
            col.extend(array(code, [init]) * (new - (old - drop)))
            setattr(self, name, col)
        self.arrival_np = np.frombuffer(self.arrival, dtype=np.int64)
        self.emitted_np = np.frombuffer(self.emitted, dtype=np.bool_)

    def grow(self, n: int) -> None:
        """Room for `n` slots."""
        cap = len(self.arrival)
        if n > cap:
            self._fill(cap, max(n, 2 * cap))

    def drop_before(self, handle: int, used: int) -> None:
        """Forget the slots of the handles before `handle` (of the `used` slots in use)."""
        k = handle - self.base
        self._fill(used, max(1024, 2 * (used - k)), drop=k)
        self.base = handle


class RequestBook:
    """Every request a recorder has seen, and the rows of the calls that name them.

    `index`: request id -> handle; `names`: handle -> the id's string (the log's name);
    `notes`: adjusted ticks, by what (warnings at stop). Rows go to `rows` under its lock;
    evictions, readmissions and emissions are counted in the open `step`.

    A finished request (`finish`) leaves `index` and the names by string at once, and its
    `names` entry becomes None once a flush has handed the name over. Its per-handle slots
    (about 45 bytes) go too, once every request before it is finished and its name handed
    over (`compact`): `names`, `_keys` and the columns hold the handles from `base` on
    (handle `h` at `h - base`), `count` handles were given in all, and a handle before
    `base` is refused as finished. What stays of a finished request is its id's hash
    (`FinishedIds`, 16 to 32 bytes), so that a later call naming it is refused.

    A request that never finishes (or is not told finished) keeps every later one's slots:
    the book's memory then grows by request, as before `compact` existed."""

    __slots__ = (
        "index", "names", "notes", "_rows", "_step", "_by_name", "_keys", "_req",
        "_arrival_max", "_admit_max", "_waited", "_waited_no", "_finished", "_unnamed",
        "base", "count", "_low",
    )  # fmt: skip

    def __init__(self, rows: RowBuffers, step: OpenStep) -> None:
        self._rows = rows
        self._step = step
        self.index: dict[Any, int] = {}  # request id -> index (its handle)
        self._by_name: dict[str, int] = {}  # the id's string -> index
        self._keys: list[Any] = []  # index -> the id as given (None: finished)
        self.names: list[str | None] = []  # None: finished, its name handed over
        self._req = RequestColumns()
        self._arrival_max = UNKNOWN_TICK  # the latest arrival tick any request has
        self._admit_max = UNKNOWN_TICK  # the latest admission tick any request has
        self._waited: set[int] = set()  # the handles given a wait reason in step `_waited_no`
        self._waited_no = -1
        self.notes: dict[str, int] = {}  # adjusted ticks, by what: warnings at stop
        self._finished = FinishedIds()  # the ids of finished requests, by hash
        self._unnamed: list[int] = []  # finished handles whose name no flush has taken yet
        self.base = 0  # the first handle the book still keeps (`compact`)
        self.count = 0  # handles given so far: the next request's handle
        self._low = 0  # the first handle not finished

    def note(self, what: str) -> None:
        """Count a call whose tick was adjusted to keep the log valid (a warning at stop)."""
        self.notes[what] = self.notes.get(what, 0) + 1

    # -- ids and handles -------------------------------------------------------------
    def intern(self, request_id: Any, what: str) -> int:
        """The request's index; a new one gets the next index and its name. Two ids with
        one name (``1`` and ``"1"``) are refused: the log names requests by string."""
        idx = self.index.get(request_id)
        if idx is not None:
            return idx
        with self._rows.lock:
            idx = self.index.get(request_id)
            return self._intern_new(request_id, what) if idx is None else idx

    def _intern_new(self, request_id: Any, what: str) -> int:
        """Intern a request id not seen yet (under the lock)."""
        name = str(request_id)
        if self._finished and name in self._finished:
            raise ValueError(
                f"{what}: request {request_id!r:.80} was finished (Recorder.finish): a "
                "finished request's id cannot name a new one (the log names requests by id)"
            )
        other = self._by_name.get(name)
        if other is not None:
            raise ValueError(
                f"{what}: request id {request_id!r:.80} ({type(request_id).__name__}) "
                f"has the same name as the id of request {other} "
                f"({type(self._keys[other - self.base]).__name__}): the log names requests by "
                "string, so give every request an id of one type"
            )
        idx = self.count
        if idx >= MAX_COUNT:  # handles are kept as int32 (`Recorder.emit_handles`' buffer)
            raise ValueError(f"{what}: a recorder records at most {MAX_COUNT} requests")
        if idx - self.base >= len(self._req.arrival):
            self._req.grow(idx - self.base + 1)
        self.index[request_id] = idx
        self._by_name[name] = idx
        self._keys.append(request_id)
        self.names.append(name)
        self.count = idx + 1
        return idx

    def _handle_as_id(self, request_id: int) -> None:
        """One new integer id given to `emit` that is another request's handle."""
        if HANDLE_AS_ID not in self.notes:
            warnings.warn(
                f"emit(): request id {request_id} is new, and is the handle of request "
                f"{self.name_of(request_id)!r:.80}; emit takes ids (a new request is recorded), "
                "emit_handles takes the handles request() returns",
                stacklevel=_caller_level(),
            )
        self.note(HANDLE_AS_ID)

    def intern_all(self, request_ids: Iterable[Any], what: str) -> np.ndarray:
        """The handles of `request_ids`, interning new ones in order (one dict lookup per
        id, no object per id kept)."""
        ids = request_ids if isinstance(request_ids, (list, tuple)) else list(request_ids)
        get = self.index.get
        found = [get(rid) for rid in ids]
        if None in found:
            with self._rows.lock:  # all of them or none: a refused id interns none before it
                n = self.count
                try:
                    found = [
                        self.intern(rid, what) if i is None else i
                        for rid, i in zip(ids, found, strict=True)
                    ]
                except BaseException:
                    self.forget_since(n)
                    raise
                if what == "emit":
                    self._handles_as_ids(ids, n)
        return np.array(found, dtype=np.int64)

    def _handles_as_ids(self, ids: Sequence[Any], n: int) -> None:
        """Of the ids an `emit` call interned (requests n.. are new), the integers that are
        handles of requests before them (0..n-1): most likely handles passed where ids
        belong (`request()` returns handles; `emit_handles` takes them). Recorded as asked
        (new requests); warned about at the call, once, and counted in the log's warnings."""
        new = {
            k
            for k in self._keys[n - self.base :]
            if isinstance(k, (int, np.integer)) and not isinstance(k, bool)
        }
        for rid in ids:
            if rid in new and 0 <= rid < n:
                self._handle_as_id(int(rid))

    def forget_since(self, n: int) -> None:
        """Undo the interning of requests n.. (a call refused after interning them;
        under the lock, before any row names them)."""
        k = n - self.base
        for key in self._keys[k:]:
            self.index.pop(key, None)
        for name in self.names[k:]:
            if name is not None:  # new ones: never finished
                self._by_name.pop(name, None)
        del self._keys[k:], self.names[k:]
        self.count = n

    def check_handles(self, handles: Any, name: str) -> np.ndarray:
        """Handles as one int64 vector, every one a request of this recorder."""
        if in_range(handles, self.base, self.count - 1) is not None:  # the per-step batch
            return handles  # type: ignore[no-any-return]
        h = as_int_vector(handles, name, 0, self.count - 1)
        if len(h) and int(h.min()) < self.base:
            self._forgotten(int(h.min()), name)
        return h

    def check_handle(self, handle: Any, name: str) -> int:
        h = as_int(handle, name, 0, self.count - 1)
        if h < self.base:
            self._forgotten(h, name)
        return h

    def _forgotten(self, handle: int, name: str) -> None:
        raise ValueError(
            f"{name}: handle {handle} is of a finished request (Recorder.finish), which the "
            "recorder has forgotten: a finished request's handle cannot be used again"
        )

    def name_of(self, idx: int) -> str:
        """The request's name for a message (a finished one's may be gone)."""
        name = self.names[idx - self.base] if idx >= self.base else None
        return f"#{idx} (finished)" if name is None else name

    # -- finished requests -----------------------------------------------------------
    def finish(self, request_id: Any) -> None:
        """`Recorder.finish`: the request is over; its id leaves the book."""
        with self._rows.lock:
            idx = self.index.get(request_id)
            if idx is None:
                if str(request_id) in self._finished:
                    raise ValueError(f"finish: request {request_id!r:.80} was finished already")
                raise ValueError(
                    f"finish: {request_id!r:.80} is not a request of this recorder (no call "
                    "named it)"
                )
            self._drop(idx)

    def finish_handle(self, handle: Any) -> None:
        """`Recorder.finish_handle`: `finish` by handle."""
        with self._rows.lock:
            idx = self.check_handle(handle, "finish_handle(handle)")
            if self._req.finished[idx - self.base]:
                raise ValueError(
                    f"finish_handle: request {self.name_of(idx)!r:.80} (handle {idx}) was "
                    "finished already"
                )
            self._drop(idx)

    def _drop(self, idx: int) -> None:
        """Forget a finished request's id (under the lock): its handle stays its own."""
        k = idx - self.base
        name = self.names[k]
        assert name is not None  # a request not finished keeps its name
        del self.index[self._keys[k]], self._by_name[name]
        self._keys[k] = None
        finished = self._req.finished
        finished[k] = 1
        self._finished.add(name)
        if idx < self._rows.num_requests_flushed:  # a flush has handed its name over
            self.names[k] = None
        else:
            self._unnamed.append(idx)
        low, base, count = self._low, self.base, self.count
        while low < count and finished[low - base]:
            low += 1
        self._low = low
        self.compact()

    def compact(self) -> None:
        """Forget the slots of the handles before the first one not finished (and not
        after the names a flush has handed over), once they are at least `COMPACT_AT` and
        at least as many as the slots kept: each slot is then copied at most once on
        average, and a book with `n` requests in flight holds about `2 n` slots."""
        cut = min(self._low, self._rows.num_requests_flushed)
        k = cut - self.base
        if k < COMPACT_AT or k < self.count - cut:
            return
        self._req.drop_before(cut, self.count - self.base)
        del self.names[:k], self._keys[:k]
        self.base = cut

    def hand_over(self, first: int) -> list[str | None]:
        """The names of the requests from `first` on, which a flush takes (under the lock)."""
        names = self.names[first - self.base :]
        self.names_handed_over(first + len(names))
        return names

    def names_handed_over(self, n: int) -> None:
        """A flush took the names of requests 0..n-1: drop the finished ones' (under the lock)."""
        if self._unnamed:
            names, base = self.names, self.base
            keep = [i for i in self._unnamed if i >= n]
            for i in self._unnamed:
                if i < n:
                    names[i - base] = None
            self._unnamed = keep

    # -- arrival and admission -------------------------------------------------------
    def arrive(self, request_id: Any, t: int, prompt: int, max_new: int) -> tuple[int, int | None]:
        """`Recorder.request`'s row: the request's handle, and the arrival tick kept
        (None: it had arrived before, the first arrival is kept and nothing recorded)."""
        rows = self._rows
        with rows.lock:  # one acquisition: interned and told together
            idx = self.index.get(request_id)
            if idx is None:
                idx = self._intern_new(request_id, "request")
            r = self._req
            k = idx - self.base
            if r.told[k]:
                self.note("request() call(s) for a request that had arrived: the first is kept")
                return idx, None
            r.told[k] = True
            if r.emitted[k]:  # a first token cannot precede its arrival: not known
                self.note(
                    "request arrival(s) told after the request's first emission: kept "
                    "unknown (NaN), a first token cannot come before its arrival"
                )
                t = UNKNOWN_TICK
            if t > r.admitted_tick[k]:  # told late: it had arrived by its admission
                self.note("request arrival(s) after the request's admission, taken as it")
                t = r.admitted_tick[k]
            if t != UNKNOWN_TICK:
                r.arrival[k] = t
                if t > self._arrival_max:
                    self._arrival_max = t
            rows.tables["requests"].frombytes(_ROW4(idx, t, prompt, max_new))
        return idx, t

    def admit(self, idx: int, t: int) -> None:
        rows = self._rows
        with rows.lock:
            r = self._req
            k = idx - self.base
            if k < 0:  # checked before the lock: a finish since has forgotten it
                self._forgotten(idx, "admit")
            if r.admitted_tick[k] != NEVER:
                return  # admitted before: the log keeps the first admission (docs/ttft.md)
            arrival = r.arrival[k]
            evicted = r.first_evict[k]
            if arrival != UNKNOWN_TICK and t < arrival:  # another clock's reading, early
                self.note("admission tick(s) before the request's arrival, taken as it")
                t = arrival
            why = (
                "after its first emission"
                if r.emitted[k]
                else f"after its first eviction (tick {evicted})"
                if t > evicted
                else None
            )
            if why is not None:
                raise ValueError(
                    f"admit: request {self.name_of(idx)!r:.80} admitted at tick {t}, {why}: "
                    "admit a request when the scheduler first takes it"
                )
            r.admitted_tick[k] = t
            if t > self._admit_max:
                self._admit_max = t
            rows.tables["admissions"].frombytes(_ROW2(idx, t))

    # -- the open step's prefill chunks and wait reasons ------------------------------
    def prefill(self, step: int, idx: int, n: int) -> None:
        rows = self._rows
        with rows.lock:
            rows.tables["prefill_chunks"].frombytes(_ROW3(step, idx, n))

    def prefill_handles(self, handles: Any, num_tokens: Any, step: int) -> None:
        """`Recorder.prefill_handles`'s rows, checked."""
        last = self.count - 1
        if isinstance(handles, (list, tuple)) and len(handles) <= SMALL:  # numpy costs more
            if not isinstance(num_tokens, (list, tuple, np.ndarray)):
                num_tokens = list(num_tokens)
            if len(num_tokens) != len(handles):
                raise ValueError(
                    f"prefill_handles: {len(handles)} handles but {len(num_tokens)} num_tokens"
                )
            hs, ks = small_ints(handles, self.base, last), small_ints(num_tokens)
            if hs is not None and ks is not None:  # plain ints in range: one pack
                flat = [step, 0, 0] * len(hs)
                flat[1::3] = hs
                flat[2::3] = ks
                rows = struct.pack(f"{len(flat)}q", *flat)
            else:  # one value at a time: the first wrong one raises, naming itself
                rows = b"".join(
                    _ROW3(
                        step,
                        self.check_handle(x, "prefill_handles(handles)"),
                        as_int(k, "prefill_handles(num_tokens)"),
                    )
                    for x, k in zip(handles, num_tokens, strict=True)
                )
        else:
            h = self.check_handles(handles, "prefill_handles(handles)")
            n = as_int_vector(num_tokens, "prefill_handles(num_tokens)")
            if len(n) != len(h):
                raise ValueError(f"prefill_handles: {len(h)} handles but {len(n)} num_tokens")
            a = np.empty((len(h), 3), dtype=np.int64)
            a[:, 0] = step
            a[:, 1] = h
            a[:, 2] = n
            rows = bytes_of(a)  # type: ignore[assignment]
        with self._rows.lock:
            self._rows.tables["prefill_chunks"].frombytes(rows)

    def wait(self, request_ids: Iterable[Any], code: int, step: int) -> None:
        """`Recorder.wait`'s rows: the ids interned and their rows, or neither."""
        with self._rows.lock:
            n = self.count
            try:
                self.wait_rows(self.intern_all(request_ids, "wait"), code, step)
            except BaseException:
                self.forget_since(n)
                raise

    def wait_rows(self, h: np.ndarray, code: int, step: int) -> None:
        n = len(h)
        if not n:
            return
        rows = np.empty((n, 3), dtype=np.int64)
        rows[:, 0] = step
        rows[:, 1] = h
        rows[:, 2] = code
        hl = h.tolist()  # a set of a few hundred ints checks faster than numpy's fancy indexing
        with self._rows.lock:
            waited = self._waited
            if self._waited_no != step:  # the first wait call of this step
                waited.clear()
                self._waited_no = step
            if len(set(hl)) != n or not waited.isdisjoint(hl):
                # the first place whose request was given a reason before, or is again later
                i = next(x for k, x in enumerate(hl) if x in waited or x in hl[k + 1 :])
                raise ValueError(
                    f"wait: request {self.name_of(i)!r:.80} has two wait reasons in step "
                    f"{step} (state one reason per request and step)"
                )
            waited.update(hl)
            self._rows.tables["waits"].frombytes(bytes_of(rows))

    # -- evictions -------------------------------------------------------------------
    def evict(self, idx: int, t: int, code: int) -> None:
        rows = self._rows
        with rows.lock:
            r = self._req
            k = idx - self.base
            if k < 0:  # checked before the lock: a finish since has forgotten it
                self._forgotten(idx, "evict")
            r.first_evict[k] = min(r.first_evict[k], t)
            rows.tables["events"].frombytes(_ROW4(idx, EVICT, t, code))
            self._step.num_evictions += 1

    def evict_with_cause(
        self, victim: Any, by: Sequence[Any], t: int, mode: int, cause: tuple[int, ...]
    ) -> None:
        """`Recorder.evict`'s rows with a cause: the eviction, its `preemptions` row (`cause`:
        step, reason, computed tokens lost, free and used blocks) and one `evictors` row per
        request in `by`; the ids are interned with the rows, or none of it (a refused id)."""
        rows = self._rows
        with rows.lock:
            n = self.count
            try:
                idx = self.intern(victim, "evict")
                hs = self.intern_all(by, "evict(by=)").tolist() if by else []
            except BaseException:
                self.forget_since(n)
                raise
            r = self._req
            k = idx - self.base
            if k < 0:  # checked before the lock: a finish since has forgotten it
                self._forgotten(idx, "evict")
            r.first_evict[k] = min(r.first_evict[k], t)
            tables = rows.tables
            tables["events"].frombytes(_ROW4(idx, EVICT, t, mode))
            step, *counts = cause
            tables["preemptions"].frombytes(_ROW7(step, idx, t, *counts))
            for h in hs:
                tables["evictors"].frombytes(_ROW3(idx, t, h))
            self._step.num_evictions += 1

    def readmit(self, idx: int, t: int) -> None:
        rows = self._rows
        with rows.lock:
            rows.tables["events"].frombytes(_ROW4(idx, READMIT, t, -1))
            self._step.num_readmissions += 1

    # -- emissions -------------------------------------------------------------------
    def emit_few(
        self, hs: list[int], ks: list[int] | None, t: int, dstep: int,
        segment_row: bytes | None = None,
    ) -> None:  # fmt: skip
        """`emit_rows` for a few checked handles (and counts) given as Python ints: the
        same rows, without numpy; `segment_row`, a window's row appended under the same
        lock (`Recorder.emit_chunk`)."""
        n = len(hs)
        if not n:
            return
        st = self._step
        step = st.no if st.is_open else -1
        r = self._req
        rows = self._rows
        with rows.lock:
            base = self.base
            if base:  # checked before the lock: a finish since may have forgotten one
                if min(hs) < base:
                    self._forgotten(min(hs), "emit")
                ls = [x - base for x in hs]
            else:
                ls = hs
            if segment_row is not None:
                rows.segments.frombytes(segment_row)
            if self._arrival_max > t:  # some request arrived after `t`: one of these?
                arrival = r.arrival
                latest = max(arrival[x] for x in ls)
                if latest > t:
                    self.note("emission tick(s) before the request's arrival, taken as it")
                    t = latest
            if self._admit_max > t:  # some request was admitted after `t`: one of these?
                admitted = r.admitted_tick
                latest = max((a for a in (admitted[x] for x in ls) if a != NEVER), default=t)
                if latest > t:
                    self.note("emission tick(s) before the request's admission, taken as it")
                    t = latest
            emitted = r.emitted
            for x in ls:
                emitted[x] = 1
            tables = rows.tables
            hb = tables[EMIT_HANDLES]
            at = len(hb)
            hb.extend(hs)
            if ks is not None:
                hb.extend(ks)
            # last: the call's row commits it (handles without one are never read)
            tables[EMIT_CALLS].frombytes(_ROW6(t, step, dstep, n, ks is not None, at))
            st.num_emit_rows += n

    def emit_rows(
        self, h: np.ndarray, counts: np.ndarray | None, t: int, dstep: int,
        rel: np.ndarray | None = None, lo: int = 0,
    ) -> None:  # fmt: skip
        """One emission call: a header row and the handles (and counts), two copies; the
        dispatcher expands them into one emissions row per request
        (`tracekit.capture.sinks.expand_emissions`). `rel`: the handles less `lo`, when
        `in_range(h, lo, ...)` checked them (computed and checked here otherwise)."""
        n = len(h)
        if not n:
            return
        st = self._step
        step = st.no if st.is_open else -1
        r = self._req
        rows = self._rows
        with rows.lock:
            base = self.base
            if rel is None or lo != base:  # checked before the lock: a finish since may
                rel = h - base if base else h  # have forgotten one
                if base and int(_min_of(rel)) < 0:
                    self._forgotten(int(h.min()), "emit_handles(handles)")
            # no first token before its arrival: a tick from the caller, or one read before
            # another thread's request() took the lock, may be a little early
            if self._arrival_max > t:  # some request arrived after `t`: one of these?
                latest = int(r.arrival_np[rel].max())
                if latest > t:
                    self.note("emission tick(s) before the request's arrival, taken as it")
                    t = latest
            if self._admit_max > t:  # some request was admitted after `t`: one of these?
                adm = np.frombuffer(r.admitted_tick, dtype=np.int64)[rel]
                adm = adm[adm != NEVER]
                if len(adm) and int(adm.max()) > t:
                    self.note("emission tick(s) before the request's admission, taken as it")
                    t = int(adm.max())
            r.emitted_np[rel] = _TRUE
            tables = rows.tables
            hb = tables[EMIT_HANDLES]
            at = len(hb)
            hb.frombytes(h.astype(_INT32).tobytes())
            if counts is not None:
                hb.frombytes(counts.astype(_INT32).tobytes())
            # last: the call's row commits it (handles without one are never read)
            tables[EMIT_CALLS].frombytes(_ROW6(t, step, dstep, n, counts is not None, at))
            st.num_emit_rows += n
