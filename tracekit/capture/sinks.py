"""Where a recorder's rows go: one producer (the `Recorder`), several sinks.

The recorder appends rows to flat buffers on the engine's threads; at each flush it swaps
the buffers and hands them to a dispatcher thread, which builds one *chunk* and calls
`write(chunk)` on every sink, never on the engine thread. A chunk is a dict of numpy
arrays: for each table of `tracekit.log.parts.TABLE_COLS` a flat int64 array of rows
(counters float64), plus ``labels``, ``counter_names``, ``request_ids`` (the ids new since
the previous chunk, starting at index ``request_ids_start``), ``config`` (JSON),
``flush_tick``, ``t0_tick``, ``seconds_per_tick`` and, on the last chunk, ``stop_tick``.

    class Sink(Protocol):
        def open(self, meta): ...    # at Recorder.start(), on the starting thread
        def write(self, chunk): ...  # once per flush, on the dispatcher thread
        def close(self, final): ...  # at Recorder.stop(), after the last write

Sinks here: `PartsSink` (numbered parts on disk, crash-safe; what `Recorder(out=PATH)`
adds), `MemorySink` (what `Recorder(out=None)` adds; never touches the disk) and
`ChromeTraceSink` (a Chrome trace written while the run records). A sink that raises is
logged once (a warning on the ``tracekit`` logger) and detached; the run goes on.

If the sinks fall behind (a slow disk, a burst of rows), the chunks waiting for the
dispatcher are merged into one, so each sink gets one write for all of them and the time
from a row's recording to its write stays about one flush interval plus one write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from tracekit.log.parts import (
    EVICT,
    LOCK_NAME,
    READMIT,
    RECOVERED_NAME,
    TABLE_COLS,
    lock_owner,
    merge_chunks,
    merge_parts,
    parse_chunk,
    part_paths,
    parts_dir_for,
    write_part,
)
from tracekit.log.rawlog import RawLog

logger = logging.getLogger("tracekit")


@runtime_checkable
class Sink(Protocol):
    """What receives a recorder's flushed chunks (see the module docstring)."""

    def open(self, meta: Mapping[str, Any]) -> None: ...

    def write(self, chunk: Mapping[str, np.ndarray]) -> None: ...

    def close(self, final: Mapping[str, Any]) -> None: ...


class CaptureError(RuntimeError):
    """A recording that cannot start or be saved as asked (the message says how to fix)."""


# -- the buffers of one flush, and the chunk they become ---------------------------------


class Flush(NamedTuple):
    """What `Recorder._flush` hands over: the swapped-out buffers and the vocabularies at
    that moment (lists are copies; nothing here is touched by the engine again)."""

    buffers: dict[str, Any]  # table -> array.array of flat rows
    labels: list[str]
    counter_names: list[str]
    new_request_ids: list[str]
    request_ids_start: int
    config: dict[str, Any]
    flush_tick: int
    stop_tick: int | None
    # the earliest start of a window still open at the flush (a segment on any thread):
    # its row comes in a later chunk, so no gap after this tick is final yet (None: none)
    open_tick: int | None = None


def build_chunk(flushes: list[Flush], t0_tick: int, seconds_per_tick: float) -> dict[str, Any]:
    """One chunk from one or more consecutive flushes (the later vocabularies win; the
    request ids and rows are concatenated in order)."""
    last = flushes[-1]
    chunk: dict[str, Any] = {}
    for k in TABLE_COLS:
        dtype = np.float64 if k == "counters" else np.int64
        arrays = [np.frombuffer(f.buffers[k], dtype=dtype) for f in flushes]
        # frombuffer shares the swapped-out array.array, which nothing appends to any more
        a = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        a.flags.writeable = False  # one chunk goes to every sink: none may change it
        chunk[k] = a
    new_ids = [i for f in flushes for i in f.new_request_ids]
    chunk["labels"] = np.array(last.labels, dtype=str)
    chunk["counter_names"] = np.array(last.counter_names, dtype=str)
    chunk["request_ids"] = np.array(new_ids, dtype=str)
    chunk["request_ids_start"] = np.array(flushes[0].request_ids_start, dtype=np.int64)
    chunk["config"] = np.array(json.dumps(_jsonable(last.config), sort_keys=True))
    chunk["flush_tick"] = np.array(last.flush_tick, dtype=np.int64)
    chunk["t0_tick"] = np.array(t0_tick, dtype=np.int64)
    chunk["seconds_per_tick"] = np.array(seconds_per_tick)
    if last.stop_tick is not None:
        chunk["stop_tick"] = np.array(last.stop_tick, dtype=np.int64)
    if last.open_tick is not None:
        chunk["open_tick"] = np.array(last.open_tick, dtype=np.int64)
    return chunk


def _jsonable(obj: Any) -> Any:
    from tracekit.formats import json_safe as impl

    return impl(obj)


def chunk_values(chunk: Mapping[str, np.ndarray]) -> int:
    """How many table values a chunk holds (what bounds the memory it takes)."""
    return sum(int(np.asarray(chunk[k]).size) for k in TABLE_COLS if k in chunk)


# -- the dispatcher: sinks' writes off the engine thread --------------------------------


class Dispatcher:
    """The thread that turns flushes into chunks and calls every sink's `write`.

    `idle` is called (from this thread) when no flush arrived for `interval_s`: the
    recorder flushes rows recorded just before the engine went idle, if no step is open.
    `submit` never blocks the engine unless `max_pending_values` table values are already
    waiting (the sinks are stuck): then it waits for them, so memory stays bounded.
    """

    def __init__(
        self,
        sinks: list[Sink],
        *,
        t0_tick: int,
        seconds_per_tick: float,
        interval_s: float,
        idle: Callable[[], None],
        max_pending_values: int = 50_000_000,
    ) -> None:
        self.sinks = list(sinks)
        self._t0 = t0_tick
        self._spt = seconds_per_tick
        # the idle timer's period: the flush interval, but never a busy loop or an overflow
        self._interval_s = min(max(interval_s, 0.01), 3600.0)
        self._idle = idle
        self._max_pending = max_pending_values
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[Flush] = deque()
        self._pending_values = 0
        self._closing = False
        self._busy = False
        self.last_submit_s = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tracekit-writer", daemon=True)
        self._thread.start()

    def submit(self, flush: Flush) -> None:
        n = sum(len(b) for b in flush.buffers.values())
        with self._cond:
            while (
                self._pending_values > self._max_pending
                and self._thread.is_alive()
                and threading.current_thread() is not self._thread
            ):
                self._cond.wait(0.05)  # back-pressure: the sinks are this far behind
            self._pending.append(flush)
            self._pending_values += n
            self.last_submit_s = time.monotonic()
            self._cond.notify_all()

    def close(self) -> None:
        """Write every pending flush, then end the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    wait_s = self.last_submit_s + self._interval_s - time.monotonic()
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                batch = list(self._pending)
                self._pending.clear()
                self._pending_values = 0
                closing = self._closing
                self._cond.notify_all()
            if batch:
                _guard(functools.partial(self._deliver, batch), "a flush")
            elif closing:
                return
            else:  # nothing arrived for a whole interval: the engine may be idle
                self.last_submit_s = time.monotonic()
                _guard(self._idle, "idle flush")

    def _deliver(self, batch: list[Flush]) -> None:
        self._write(build_chunk(batch, self._t0, self._spt))

    def _write(self, chunk: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            if not _call(sink, "write", chunk):
                self.sinks.remove(sink)


def _call(sink: Any, method: str, arg: Any) -> bool:
    """Call `sink.method(arg)`; a failure is logged once and reported as False."""
    try:
        getattr(sink, method)(arg)
        return True
    except Exception as e:
        logger.warning(
            "tracekit: sink %s failed in %s() (%s: %s); it is detached, the run goes on",
            type(sink).__name__,
            method,
            type(e).__name__,
            str(e)[:200],
        )
        return False


def _guard(fn: Callable[[], None], what: str) -> None:
    try:
        fn()
    except Exception as e:  # never end the dispatcher: the sinks still need it
        logger.warning("tracekit: %s failed (%s: %s)", what, type(e).__name__, str(e)[:200])


# -- parts on disk ---------------------------------------------------------------------


class PartsSink:
    """Numbered parts in ``OUT.parts/`` while the run records; ``OUT`` at close.

    Crash-safe: each part is written whole or not at all (`tracekit.fsio`), so a killed
    run leaves parts that `tracekit recover` merges. The folder holds a ``lock`` file with
    the recording process's pid: a second recorder on the same path is refused while this
    one runs, and a folder left by a killed run (unrecovered parts) is refused too, never
    emptied (recover it, or record to another path).

    A failing write (a full disk) does not stop the run: the chunk is kept in memory and
    written, in order, at the next write or at close, once there is space again. At most
    `max_pending_values` table values are held; beyond that the oldest held rows are
    dropped (their vocabularies kept, so later parts stay consistent) and the log says how
    many. If the parts still cannot be written at close, the run is merged in memory and
    saved as ``OUT`` if that works, else `CaptureError` says where the run is.
    """

    def __init__(self, out: str | os.PathLike[str], *, max_pending_values: int = 20_000_000):
        self.out = os.fspath(out)
        self.dir = parts_dir_for(self.out)
        self.log: RawLog | None = None
        self._max_pending = max_pending_values
        self._pending: deque[dict[str, Any]] = deque()
        self._n = 0  # parts written
        self._failing: OSError | None = None
        self._meta: dict[str, Any] = {}

    def open(self, meta: Mapping[str, Any]) -> None:
        from tracekit.fsio import atomic_write

        self._meta = dict(meta)
        os.makedirs(os.path.dirname(os.path.abspath(self.dir)), exist_ok=True)
        try:
            os.mkdir(self.dir)
        except FileExistsError:
            self._refuse_or_reuse()
        lock = os.path.join(self.dir, LOCK_NAME)
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise CaptureError(
                f"{self.dir}: another recorder started on this path at the same moment; "
                "give each recorder its own output path"
            ) from None
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{os.getpid()}\n")
        atomic_write(os.path.join(self.dir, "meta.json"), json.dumps(_jsonable(meta)).encode())

    def _refuse_or_reuse(self) -> None:
        owner = lock_owner(self.dir)
        if owner is not None:
            who = "this process" if owner == os.getpid() else f"process {owner}"
            raise CaptureError(
                f"{self.out}: {who} is already recording to this path; give each "
                "recorder its own output path"
            )
        recovered = _read_small(os.path.join(self.dir, RECOVERED_NAME))
        if recovered is not None:
            raise CaptureError(
                f"{self.dir}: holds the parts of an earlier run, already recovered into "
                f"{recovered!r}; remove the folder, or record to another path"
            )
        if os.listdir(self.dir):
            raise CaptureError(
                f"{self.dir}: holds the parts of an earlier run that did not stop cleanly; "
                f"recover them first (tracekit recover {self.dir}), move them away, or "
                "record to another path"
            )

    def write(self, chunk: Mapping[str, np.ndarray]) -> None:
        self._pending.append(dict(chunk))
        self._drain()

    def _drain(self) -> None:
        while self._pending:
            try:
                write_part(self.dir, self._n + 1, self._pending[0])
            except OSError as e:
                if self._failing is None:
                    logger.warning(
                        "tracekit: cannot write parts to %s (%s); rows are kept in memory "
                        "and written once that works again",
                        self.dir,
                        e,
                    )
                self._failing = e
                self._shed()
                return
            self._pending.popleft()
            self._n += 1
        if self._failing is not None:
            logger.warning("tracekit: writing parts to %s again", self.dir)
            self._failing = None

    def _shed(self) -> None:
        """Drop the oldest held rows beyond the bound, keeping each chunk's vocabularies."""
        held = sum(chunk_values(c) for c in self._pending)
        for c in self._pending:
            if held <= self._max_pending:
                return
            n = chunk_values(c)
            if not n:
                continue
            for k in TABLE_COLS:
                c[k] = np.zeros(0, dtype=np.asarray(c[k]).dtype)
            prior = int(np.asarray(c.get("dropped_rows", 0)))
            c["dropped_rows"] = np.array(prior + n, dtype=np.int64)
            held -= n

    def close(self, final: Mapping[str, Any]) -> None:
        self._drain()
        if not self._pending:
            log = merge_parts(self.dir, final=final)
        else:  # the disk is still refusing parts: merge what is on disk and what is held
            parts = []
            with contextlib.suppress(OSError):
                for p in part_paths(self.dir):
                    with np.load(p, allow_pickle=False) as z:
                        parts.append(parse_chunk(z, p))
            parts += [parse_chunk(c, f"{self.dir} (held chunk)") for c in self._pending]
            log = merge_chunks(self._meta, parts, final=final, path=self.dir)
        self.log = log.with_path(self.out)
        try:
            log.save(self.out)
        except OSError as e:
            with contextlib.suppress(OSError):  # no process records here any more
                os.unlink(os.path.join(self.dir, LOCK_NAME))
            held = f" ({len(self._pending)} flush(es) not on disk)" if self._pending else ""
            raise CaptureError(
                f"{self.out}: could not be written ({e}); the run is kept in "
                f"Recorder.log(){held} and its parts in {self.dir}: free space, then save "
                f"the log or run tracekit recover {self.dir}"
            ) from e
        self._pending.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _read_small(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return fh.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return None


# -- memory ----------------------------------------------------------------------------


class MemorySink:
    """Keeps the chunks in memory and merges them at close (the same merge as parts on
    disk, `tracekit.log.parts.merge_chunks`); `log` is the run afterwards."""

    def __init__(self) -> None:
        self.log: RawLog | None = None
        self._meta: dict[str, Any] = {}
        self._chunks: list[dict[str, Any]] = []

    def open(self, meta: Mapping[str, Any]) -> None:
        self._meta = dict(meta)

    def write(self, chunk: Mapping[str, np.ndarray]) -> None:
        self._chunks.append(parse_chunk(chunk, f"<memory> chunk {len(self._chunks) + 1}"))

    def close(self, final: Mapping[str, Any]) -> None:
        self.log = merge_chunks(self._meta, self._chunks, final=final, path="<memory>")
        self._chunks = []


# -- a Chrome trace while the run records ----------------------------------------------


class ChromeTraceSink:
    """Write a Chrome trace (JSON Array Format) while a run records.

        rec = tracekit.Recorder("raw/run.npz", sinks=[ChromeTraceSink("raw/run.trace.json")])

    Each chunk becomes events appended to the file on the dispatcher thread, so the engine
    loop never formats JSON or waits on disk. Events are formatted column-wise by numpy
    string operations, never through per-row Python containers, so the trace does not feed
    the garbage collector it measures. A killed run leaves a file without its closing
    ``]``, which Perfetto and chrome://tracing open anyway (`read_trace` reads it too).

    Tracks (those of `tracekit.render.perfetto`): the engine loop (steps and, on nested
    tracks per thread, segments), gc, counters, and per request its gaps (named ``gap``:
    the partition needs the whole run, so the cause of each gap is in the post-run trace,
    ``tracekit trace``) and its evictions on a second track ``req ID evictions``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fh: Any = None
        self._n = 0
        self._t0 = 0
        self._us_per_tick = 1e-3
        self._labels: list[str] = []
        self._req_names: list[str] = []
        self._named: set[tuple[int, int]] = set()
        # per request: the last emission (tick, step) and an open eviction (tick)
        self._last_t = np.zeros(0, dtype=np.int64)
        self._last_step = np.zeros(0, dtype=np.int64)
        self._has_last = np.zeros(0, dtype=bool)
        self._evict_t = np.zeros(0, dtype=np.int64)
        self._has_evict = np.zeros(0, dtype=bool)

    def open(self, meta: Mapping[str, Any]) -> None:
        from tracekit.render import perfetto as pf

        self._t0 = int(meta["t0_tick"])
        self._us_per_tick = float(meta["seconds_per_tick"]) * 1e6
        self._fh = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._fh.write("[\n")
        self._put(
            [
                _dumps(pf._meta(pf.PID_ENGINE, None, "process_name", "engine")),
                _dumps(pf._meta(pf.PID_REQUESTS, None, "process_name", "requests")),
                _dumps(pf._meta(pf.PID_ENGINE, pf.TID_LOOP, "thread_name", "engine loop")),
                _dumps(pf._meta(pf.PID_ENGINE, pf.TID_GC, "thread_name", "gc")),
            ]
        )
        self._fh.flush()

    def write(self, chunk: Mapping[str, np.ndarray]) -> None:
        self._put(self.chunk_events(chunk))
        self._fh.flush()

    def close(self, final: Mapping[str, Any]) -> None:
        if self._fh is None or self._fh.closed:
            return
        self._fh.write("\n]\n")
        self._fh.close()

    def _put(self, lines: list[str] | np.ndarray) -> None:
        if len(lines) == 0:
            return
        text = ",\n".join(lines.tolist() if isinstance(lines, np.ndarray) else lines)
        self._fh.write(text if self._n == 0 else ",\n" + text)
        self._n += len(lines)

    def _thread_meta(self, pid: int, tid: int, name: str) -> list[str]:
        if (pid, tid) in self._named:
            return []
        self._named.add((pid, tid))
        return [
            _dumps(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
            )
        ]

    def _us(self, ticks: np.ndarray) -> np.ndarray:
        return np.round((ticks - self._t0) * self._us_per_tick, 3)

    def chunk_events(self, chunk: Mapping[str, np.ndarray]) -> np.ndarray:
        """The chunk's events, one JSON text each, as a numpy string array."""
        from tracekit.render import perfetto as pf

        self._labels = [str(x) for x in np.asarray(chunk.get("labels", self._labels))]
        counter_names = [str(x) for x in np.asarray(chunk.get("counter_names", []))]
        start = int(chunk.get("request_ids_start", len(self._req_names)))
        new = [str(x) for x in np.asarray(chunk.get("request_ids", []))]
        self._req_names[start : start + len(new)] = new
        out: list[np.ndarray] = []
        meta: list[str] = []

        def rows(name: str) -> np.ndarray:
            a = np.asarray(chunk.get(name, np.zeros(0)))
            return a.reshape(-1, len(TABLE_COLS[name]))

        def x_events(pid: Any, tid: Any, a: np.ndarray, b: np.ndarray, rest: Any) -> None:
            us_a = self._us(a)
            dur = np.round(self._us(b) - us_a, 3)
            out.append(
                _cat(
                    f'{{"ph":"X","pid":{pid},"tid":',
                    tid,
                    ',"ts":',
                    _f3(us_a),
                    ',"dur":',
                    _f3(dur),
                    rest,
                )
            )

        st = rows("steps")
        if len(st):
            x_events(
                pf.PID_ENGINE,
                str(pf.TID_LOOP),
                st[:, 0],
                st[:, 1],
                _cat(
                    ',"name":"step","args":{"num_decode":',
                    _i(st[:, 2]),
                    ',"num_prefill_tokens":',
                    _i(st[:, 3]),
                    ',"graph_size":',
                    _i(st[:, 4]),
                    ',"num_preempted":',
                    _i(st[:, 5]),
                    ',"num_swapped_in":',
                    _i(st[:, 6]),
                    "}}",
                ),
            )
        sg = rows("segments")
        if len(sg):
            th, dev = sg[:, 4], sg[:, 5]
            # the loop thread's host segments nest inside its steps (context managers nest)
            off_loop = np.where(dev != 0, pf.TID_DEVICE, pf.TID_THREADS) + th
            tid = np.where((th == 0) & (dev == 0), pf.TID_LOOP, off_loop)
            tracks = np.unique(np.stack([tid, th, dev], axis=1), axis=0)
            for t, h, d in tracks.tolist():  # one per thread, not per row
                if t != pf.TID_LOOP:
                    meta += self._thread_meta(
                        pf.PID_ENGINE, t, f"{'device' if d else 'thread'} {h}"
                    )
            names = np.array(
                [json.dumps(n or f"label {i}") for i, n in enumerate(self._labels)] or [""]
            )
            lab = sg[:, 1]
            ok = (lab >= 0) & (lab < len(self._labels))
            name = np.where(ok, names[np.where(ok, lab, 0)], _cat('"label ', _i(lab), '"'))
            x_events(
                pf.PID_ENGINE,
                _i(tid),
                sg[:, 2],
                sg[:, 3],
                _cat(',"name":', name, ',"args":{"step":', _i(sg[:, 0]), "}}"),
            )
        g = rows("gc_pauses")
        if len(g):
            x_events(
                pf.PID_ENGINE,
                str(pf.TID_GC),
                g[:, 0],
                g[:, 1],
                _cat(',"name":"gc","args":{"generation":', _i(g[:, 2]), "}}"),
            )
        ct = rows("counters")
        if len(ct):
            ct = ct[np.isfinite(ct[:, 2])]
            n = ct[:, 0].astype(np.int64)
            cnames = np.array(
                [json.dumps(c or f"counter {i}") for i, c in enumerate(counter_names)] or [""]
            )
            ok = (n >= 0) & (n < len(counter_names))
            name = np.where(ok, cnames[np.where(ok, n, 0)], _cat('"counter ', _i(n), '"'))
            ts = np.round((ct[:, 1] - self._t0) * self._us_per_tick, 3)
            out.append(
                _cat(
                    f'{{"ph":"C","pid":{pf.PID_ENGINE},"ts":',
                    _f3(ts),
                    ',"name":',
                    name,
                    ',"args":{"value":',
                    np.char.mod("%.17g", ct[:, 2]),
                    "}}",
                )
            )
        meta += self._emissions(rows("emissions"), out)
        meta += self._evictions(rows("events"), out)
        head = np.array(meta, dtype=str)
        return np.concatenate([head, *out]) if out else head

    def _grow(self, n: int) -> None:
        if n <= len(self._has_last):
            return
        m = max(n, 2 * len(self._has_last))
        for name, fill in (
            ("_last_t", 0),
            ("_last_step", 0),
            ("_has_last", False),
            ("_evict_t", 0),
            ("_has_evict", False),
        ):
            old = getattr(self, name)
            new = np.full(m, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _emissions(self, em: np.ndarray, out: list[np.ndarray]) -> list[str]:
        """Per request, a ``gap`` slice from each emission to the next (across chunks)."""
        from tracekit.render import perfetto as pf

        em = em[em[:, 0] >= 0]
        if not len(em):
            return []
        order = np.argsort(em[:, 0], kind="stable")  # chunk order within each request
        r, t, step, ntok = (em[order, j] for j in range(4))
        self._grow(int(r.max()) + 1)
        first = np.ones(len(r), dtype=bool)
        first[1:] = r[1:] != r[:-1]
        prev_t, prev_step = np.roll(t, 1), np.roll(step, 1)
        has_prev = np.ones(len(r), dtype=bool)
        prev_t[first], prev_step[first] = self._last_t[r[first]], self._last_step[r[first]]
        has_prev[first] = self._has_last[r[first]]
        meta: list[str] = []
        for q in np.unique(r[first & ~has_prev]):  # a request's first emission: its track
            meta += self._thread_meta(
                pf.PID_REQUESTS, pf.TID_REQUESTS + 2 * int(q), f"req {self._req_name(int(q))}"
            )
        last = np.ones(len(r), dtype=bool)
        last[:-1] = r[:-1] != r[1:]
        self._last_t[r[last]], self._last_step[r[last]] = t[last], step[last]
        self._has_last[r[last]] = True
        k = has_prev
        if k.any():
            a, b = prev_t[k], t[k]
            us_a = self._us(a)
            out.append(
                _cat(
                    f'{{"ph":"X","pid":{pf.PID_REQUESTS},"tid":',
                    _i(pf.TID_REQUESTS + 2 * r[k]),
                    ',"ts":',
                    _f3(us_a),
                    ',"dur":',
                    _f3(np.round(self._us(b) - us_a, 3)),
                    ',"name":"gap","args":{"gap_ms":',
                    np.char.mod("%.6f", np.round((b - a) * self._us_per_tick * 1e-3, 6)),
                    ',"step0":',
                    _i(prev_step[k]),
                    ',"step1":',
                    _i(step[k]),
                    ',"num_tokens":',
                    _i(ntok[k]),
                    "}}",
                )
            )
        return meta

    def _evictions(self, ev: np.ndarray, out: list[np.ndarray]) -> list[str]:
        """Per request, an ``evicted`` slice from each eviction to its readmission."""
        from tracekit.render import perfetto as pf

        ev = ev[ev[:, 0] >= 0]
        if not len(ev):
            return []
        order = np.argsort(ev[:, 0], kind="stable")
        r, kind, t = ev[order, 0], ev[order, 1], ev[order, 2]
        self._grow(int(r.max()) + 1)
        first = np.ones(len(r), dtype=bool)
        first[1:] = r[1:] != r[:-1]
        prev_kind, prev_t = np.roll(kind, 1), np.roll(t, 1)
        prev_kind[first] = np.where(self._has_evict[r[first]], EVICT, -1)
        prev_t[first] = self._evict_t[r[first]]
        last = np.ones(len(r), dtype=bool)
        last[:-1] = r[:-1] != r[1:]
        self._has_evict[r[last]] = kind[last] == EVICT
        self._evict_t[r[last]] = t[last]
        k = (kind == READMIT) & (prev_kind == EVICT)  # each readmission closes the eviction
        if not k.any():
            return []
        tid = pf.TID_REQUESTS + 2 * r[k] + 1  # beside the request's own track
        meta: list[str] = []
        for q in np.unique(r[k]):
            meta += self._thread_meta(
                pf.PID_REQUESTS,
                pf.TID_REQUESTS + 2 * int(q) + 1,
                f"req {self._req_name(int(q))} evictions",
            )
        us_a = self._us(prev_t[k])
        out.append(
            _cat(
                f'{{"ph":"X","pid":{pf.PID_REQUESTS},"tid":',
                _i(tid),
                ',"ts":',
                _f3(us_a),
                ',"dur":',
                _f3(np.round(self._us(t[k]) - us_a, 3)),
                ',"name":"evicted","args":{}}',
            )
        )
        return meta

    def _req_name(self, r: int) -> str:
        return self._req_names[r] if 0 <= r < len(self._req_names) else str(r)


def _dumps(ev: Mapping[str, Any]) -> str:
    return json.dumps(ev, separators=(",", ":"))


def _i(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.int64).astype(str)


def _f3(a: np.ndarray) -> np.ndarray:
    return np.char.mod("%.3f", a)


def _cat(*parts: Any) -> np.ndarray:
    """Element-wise concatenation of string arrays and plain strings."""
    acc: Any = parts[0]
    for p in parts[1:]:
        acc = np.char.add(acc, p)
    return np.asarray(acc)


__all__ = [
    "CaptureError",
    "ChromeTraceSink",
    "Dispatcher",
    "Flush",
    "MemorySink",
    "PartsSink",
    "Sink",
    "build_chunk",
]
