"""Where a recorder's rows go: one producer (the `Recorder`), several sinks.

The recorder appends rows to flat buffers on the engine's threads; at each flush it swaps
the buffers and hands them to a dispatcher thread, which builds one
`tracekit.log.flush.FlushedRows` (the contract: tables and columns by name, vocabularies,
ticks) and calls `write(rows)` on every sink, never on the engine thread.

    class Sink(Protocol):
        def open(self, meta): ...    # at Recorder.start(), on the starting thread
        def write(self, rows): ...   # once per flush (a FlushedRows), on the dispatcher thread
        def close(self, final): ...  # at Recorder.stop(), after the last write

Sinks here: `PartsSink` (numbered parts on disk, crash-safe; what `Recorder(out=PATH)`
adds) and `MemorySink` (what `Recorder(out=None)` adds; never touches the disk). Others
read the same rows: `tracekit.live.LiveMetrics` (Prometheus, OTel) and
`tracekit.live.trace.ChromeTraceSink` (a Chrome trace written while the run records). A
sink that raises is logged once (a warning on the ``tracekit`` logger) and detached; the
run goes on.

If the sinks fall behind (a slow disk, a burst of rows), the flushes waiting for the
dispatcher are merged into one, so each sink gets one write for all of them and the time
from a row's recording to its write stays about one flush interval plus one write.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from tracekit.errors import LogError
from tracekit.formats import json_safe
from tracekit.fsio import Syncer, atomic_write, fsync_folder
from tracekit.log.flush import FlushedRows, build_flushed
from tracekit.log.parts import (
    FINAL_NAME,
    LOCK_NAME,
    RECOVERED_NAME,
    append_index,
    lock_owner,
    merge_flushed,
    parse_flushed,
    part_paths,
    parts_dir_for,
    read_part,
    write_final,
    write_part,
    write_pointer,
)
from tracekit.log.rawlog import RawLog

logger = logging.getLogger("tracekit")


@runtime_checkable
class Sink(Protocol):
    """What receives a recorder's flushed rows (see the module docstring)."""

    def open(self, meta: Mapping[str, Any]) -> None: ...

    def write(self, chunk: Mapping[str, np.ndarray]) -> None: ...

    def close(self, final: Mapping[str, Any]) -> None: ...


class CaptureError(RuntimeError):
    """A recording that cannot start or be saved as asked (the message says how to fix)."""


# -- the buffers of one flush, and the rows they become --------------------------------


class Flush(NamedTuple):
    """What a flush hands over (`tracekit.capture.buffers.RowBuffers.flush`): the swapped-out
    buffers and the vocabularies at that moment (lists are copies; nothing here is touched by
    the engine again)."""

    buffers: dict[str, Any]  # table -> array.array of flat rows
    labels: list[str]
    counter_names: list[str]
    new_request_ids: list[str]
    request_ids_start: int
    config: dict[str, Any]
    flush_tick: int
    stop_tick: int | None
    # the earliest start of a window still open at the flush (a segment on any thread):
    # its row comes in a later flush, so no gap after this tick is final yet (None: none)
    open_tick: int | None = None
    # an idle engine's flush with no rows: only the clock moved (see `Dispatcher`)
    is_clock_only: bool = False
    # the number of the first step whose row this flush holds (steps before it: earlier
    # flushes); rows name steps by number, so a reader of later parts alone can place them
    first_step: int = 0


#: The recorder's compact form of emissions (`Recorder.emit_handles`): per call one
#: ``EMIT_CALLS`` row (t_tick, step, device_step, number of requests, has counts, offset)
#: and, in ``EMIT_HANDLES`` from that offset, the call's request handles followed by its
#: token counts if it has them (int32: handles and counts are below 2**31; half the bytes
#: the engine thread writes, so half the fresh pages it touches). The engine thread
#: appends the handles, then the row (the row commits the call: handles without one, left
#: by a signal between the two, are never read); `expand_emissions` turns them into
#: ``emissions`` rows on the dispatcher thread.
EMIT_CALLS, EMIT_HANDLES = "emit_calls", "emit_handles"
EMIT_CALL_WIDTH = 6


def expand_emissions(buffers: Mapping[str, Any]) -> dict[str, Any]:
    """`buffers` with the compact emissions expanded into ``emissions`` rows (request,
    t_tick, step, num_tokens, device_step), in call order and, within a call, in the
    order of its handles: the rows one `emit` row per request would have made."""
    out = {k: v for k, v in buffers.items() if k not in (EMIT_CALLS, EMIT_HANDLES)}
    calls_buf = buffers.get(EMIT_CALLS)
    if calls_buf is None or not len(calls_buf):
        return out
    calls = np.frombuffer(calls_buf, dtype=np.int64).reshape(-1, EMIT_CALL_WIDTH)
    flat = np.frombuffer(buffers[EMIT_HANDLES], dtype=np.int32)
    t, step, dstep, n, has_counts, start = calls.T
    rows = np.empty((int(n.sum()), 5), dtype=np.int64)
    rows[:, 1] = np.repeat(t, n)
    rows[:, 2] = np.repeat(step, n)
    rows[:, 4] = np.repeat(dstep, n)
    if len(flat) == len(rows) and not has_counts.any():  # the common case
        rows[:, 0] = flat  # every call's handles, back to back: the request column
        rows[:, 3] = 1
    else:  # from each call's offset: its n handles, then its n counts if it has them
        call = np.repeat(np.arange(len(calls)), n)  # the call of each row
        at = start[call] + np.arange(len(rows)) - np.repeat(np.cumsum(n) - n, n)
        rows[:, 0] = flat[at]
        counted = has_counts[call] == 1
        rows[:, 3] = 1
        rows[counted, 3] = flat[at[counted] + n[call[counted]]]
    before = out.get("emissions")
    if before is not None and len(before):
        rows = np.concatenate((np.frombuffer(before, dtype=np.int64).reshape(-1, 5), rows))
    out["emissions"] = rows.reshape(-1)
    return out


def build_chunk(flushes: list[Flush], t0_tick: int, seconds_per_tick: float) -> FlushedRows:
    """The `FlushedRows` of one or more consecutive flushes (the later vocabularies win;
    the request ids and rows are concatenated in order)."""
    last = flushes[-1]
    return build_flushed(
        [expand_emissions(f.buffers) for f in flushes],
        labels=last.labels,
        counter_names=last.counter_names,
        request_ids=[i for f in flushes for i in f.new_request_ids],
        request_ids_start=flushes[0].request_ids_start,
        config=last.config,
        flush_tick=last.flush_tick,
        t0_tick=t0_tick,
        seconds_per_tick=seconds_per_tick,
        stop_tick=last.stop_tick,
        open_tick=last.open_tick,
        first_step=flushes[0].first_step,
    )


# -- the dispatcher: sinks' writes off the engine thread --------------------------------


class Dispatcher:
    """The thread that turns flushes into `FlushedRows` and calls every sink's `write`.

    `idle` is called (from this thread) when no flush arrived for `interval_s`: the
    recorder flushes rows recorded just before the engine went idle, if no step is open.

    The bound on flush lag (what a `kill -9` can lose): while the sinks keep up, a row
    reaches them within one interval plus one write. When they fall behind (a write
    longer than the interval: a slow disk, a burst of rows, a machine too busy to give
    this thread the GIL), the recorder sees a flush already `waiting` and keeps its rows
    in its own buffer (the backlog) instead of handing over another, for up to one more
    interval; then it waits until the writer takes the waiting flush (`wait_taken`) and
    hands over the backlog whole. So at most one flush waits while one is written, a row
    waits for at most two intervals, the write in progress and its own, and memory stays
    bounded. Counted in the engine's own time (its clock, which does not move while it
    waits), the rows not yet on disk span at most six intervals and three steps: the
    flush being written and the one waiting (each at most two intervals and a step) and
    the backlog. (Flushes submitted otherwise, such as arrivals of an idle engine, are merged
    into the next write.) `submit` blocks only if `max_pending_values` table values are
    already waiting (the sinks are stuck).

    A sink with ``follows_idle_clock = True`` (a live sink: its watermark moves only with
    flushes) also gets, while the engine idles, one flush with no rows per interval
    (`Flush.is_clock_only`): every row completed before its tick has been handed over, so
    the sink can settle the gaps the engine's last rows closed. The other sinks (the parts
    on disk) never see those.
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
        self._t0_tick = t0_tick
        self._spt = seconds_per_tick
        # the idle timer's period: the flush interval, but never a busy loop or an overflow
        self._interval_s = min(max(interval_s, 0.01), 3600.0)
        self._idle = idle
        self._max_pending = max_pending_values
        self._cond = threading.Condition(threading.Lock())
        self._pending: deque[Flush] = deque()
        self._pending_values = 0
        self._closing = False
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

    def wait_taken(self) -> None:
        """Block until the writer has taken every waiting flush (the engine thread, when
        its backlog is two intervals old: the bound on lag of the class doc). Waiting
        only while a write runs would let flushes pile up in the moment between two
        writes, when the writer has not yet taken the next: the engine hands over at
        most one flush at a time."""
        with self._cond:
            while self._pending and self._thread.is_alive():
                self._cond.wait(0.05)

    def wake(self) -> None:
        """Run the idle call now (`Recorder.flush_soon`), not at the interval's end."""
        with self._cond:
            self.last_submit_s = -math.inf
            self._cond.notify_all()

    def waiting(self) -> bool:
        """Whether a flush is waiting for the writer (it is behind: see the class doc)."""
        return bool(self._pending)  # one read of the deque's length: no lock needed

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
                self._cond.notify_all()  # taken: `wait_taken` and `submit` may go on
            if batch:
                _guard(functools.partial(self._deliver, batch), "a flush")
            elif closing:
                return
            else:  # nothing arrived for a whole interval: the engine may be idle
                self.last_submit_s = time.monotonic()
                _guard(self._idle, "idle flush")

    def follows_idle_clock(self) -> bool:
        """Whether a sink wants the idle engine's clock-only flushes."""
        return any(getattr(s, "follows_idle_clock", False) for s in self.sinks)

    def _deliver(self, batch: list[Flush]) -> None:
        clock_only = all(f.is_clock_only for f in batch)
        self._write(build_chunk(batch, self._t0_tick, self._spt), clock_only=clock_only)

    def _write(self, rows: FlushedRows, *, clock_only: bool = False) -> None:
        for sink in list(self.sinks):
            if clock_only and not getattr(sink, "follows_idle_clock", False):
                continue
            if not call_sink(sink, "write", rows):
                self.sinks.remove(sink)


def call_sink(sink: Any, method: str, arg: Any) -> bool:
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
    """Numbered parts in ``OUT.parts/`` while the run records; at close, what only the
    stop knows (``final.json``) and ``OUT``, a small file naming the folder: nothing is
    merged or copied, so closing costs the same for a run of a minute or of a day
    (docs/design.md, "The run's log on disk").

    Crash-safe: each part is written whole or not at all (`tracekit.fsio`), so a killed
    run leaves parts that every command reads in place (and `tracekit recover` writes as
    one `.npz`). A part is renamed into place as soon
    as it is written (a kill loses nothing the kernel has) and fsynced afterwards by a
    `tracekit.fsio.Syncer`, never on the writer's path: an fsync that takes hundreds of ms
    under I/O load would keep the written part from view, and the next flush waiting.

    The folder holds a ``lock`` file with the recording process's pid: a second recorder
    on the same path is refused while this one runs, and a folder left by a killed run
    (unrecovered parts) is refused too, never emptied (recover it, or record to another
    path). A folder of a run that stopped cleanly is replaced, as the file ``OUT`` was
    before: recording twice to one path keeps the second run.

    A failing write (a full disk) does not stop the run: the rows are kept in memory and
    written, in order, at the next write or at close, once there is space again. At most
    `max_pending_values` table values are held; beyond that the oldest held rows are
    dropped (their vocabularies kept, so later parts stay consistent) and the log says how
    many. If the parts still cannot be written at close, the run is merged in memory and
    saved as ``OUT`` (one `.npz`) if that works, else `CaptureError` says where the run is.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        max_pending_values: int = 20_000_000,
        retain_s: float | None = None,
    ):
        self.out = os.fspath(out)
        self._retain_s = retain_s
        self._kept: deque[tuple[int, str]] = deque()  # (flush tick, path) of parts on disk
        self.dir = parts_dir_for(self.out)
        self.log: RawLog | None = None
        self._max_pending = max_pending_values
        self._pending: deque[FlushedRows] = deque()
        self._n = 0  # parts written
        self._failing: OSError | None = None
        self._meta: dict[str, Any] = {}
        self._syncer: Syncer | None = None  # the parts' fsyncs, off the writer's path
        self._index_failed = False

    def open(self, meta: Mapping[str, Any]) -> None:
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
        atomic_write(os.path.join(self.dir, "meta.json"), json.dumps(json_safe(meta)).encode())
        fsync_folder(os.path.dirname(os.path.abspath(self.dir)))  # the folder's own name
        self._syncer = Syncer()

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
        if os.path.islink(self.dir):
            raise CaptureError(
                f"{self.dir}: is a symbolic link; a recorder never empties a folder it reaches "
                "through one: record to another path"
            )
        if os.path.isfile(os.path.join(self.dir, FINAL_NAME)):
            # a run that stopped cleanly: replaced, as one file OUT was (its pointer first,
            # so OUT never names a folder being emptied)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.out)
            shutil.rmtree(self.dir)
            os.mkdir(self.dir)
            return
        if os.listdir(self.dir):
            raise CaptureError(
                f"{self.dir}: holds the parts of an earlier run that did not stop cleanly; "
                f"recover them first (tracekit recover {self.dir}), move them away, or "
                "record to another path"
            )

    def write(self, chunk: Mapping[str, np.ndarray]) -> None:
        self._pending.append(FlushedRows.of(chunk))
        self._drain()

    def _drain(self) -> None:
        while self._pending:
            try:  # renamed into place at once: a kill loses nothing of it (fsio)
                path = write_part(self.dir, self._n + 1, self._pending[0], fsync=False)
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
            if self._syncer is not None:  # durable against a power loss, in order
                self._syncer.add(path)
            rows = self._pending.popleft()
            self._n += 1
            if self._retain_s is not None:
                self._retire(path, rows.scalar("flush_tick") or 0)
            try:  # the index is a reader's shortcut: the parts themselves are the run
                append_index(self.dir, path, rows)
            except OSError as e:
                if not self._index_failed:
                    logger.warning("tracekit: cannot append to %s's index (%s)", self.dir, e)
                self._index_failed = True
        if self._failing is not None:
            logger.warning("tracekit: writing parts to %s again", self.dir)
            self._failing = None

    def _retire(self, path: str, flush_tick: int) -> None:
        """Remove the parts whose rows all end `retain_s` before this part's flush, oldest
        first (the newest part always stays). A part still being synced is removed all
        the same: its fsync then fails and is logged, nothing else."""
        self._kept.append((flush_tick, path))
        spt = float(self._meta.get("seconds_per_tick", 1e-9))
        cutoff = flush_tick - int((self._retain_s or 0.0) / spt)
        while len(self._kept) > 1 and self._kept[0][0] < cutoff:
            _, old = self._kept.popleft()
            try:
                os.unlink(old)
            except FileNotFoundError:  # a user archived it already
                pass
            except OSError as e:
                logger.warning("tracekit: cannot remove %s (retain_s) (%s)", old, e)

    def _shed(self) -> None:
        """Drop the oldest held rows beyond the bound, keeping each flush's vocabularies."""
        held = sum(c.num_values() for c in self._pending)
        for i, c in enumerate(self._pending):
            if held <= self._max_pending:
                return
            n = c.num_values()
            if not n:
                continue
            self._pending[i] = c.with_tables_emptied(n)
            held -= n

    def close(self, final: Mapping[str, Any]) -> None:
        self._drain()
        if self._syncer is not None:  # every part durable before the run is called stopped
            self._syncer.close()
        if not self._pending:
            try:
                write_final(self.dir, final)  # whole, and its name durable (atomic_write)
                write_pointer(self.out, self.dir)
            except OSError as e:
                raise CaptureError(
                    f"{self.out}: the run's parts are all in {self.dir}, but its stop could "
                    f"not be written ({e}); every command reads the folder as it is (an "
                    "interrupted run), or free space and run tracekit recover on it"
                ) from e
            finally:
                with contextlib.suppress(OSError):  # no process records here any more
                    os.unlink(os.path.join(self.dir, LOCK_NAME))
            return
        # the disk is still refusing parts: merge what is on disk and what is held, and
        # save the run as one file if the disk takes that
        parts = []
        with contextlib.suppress(OSError, LogError):
            for p in part_paths(self.dir):
                parts.append(parse_flushed(read_part(p), p))
        parts += [parse_flushed(c, f"{self.dir} (held flush)") for c in self._pending]
        log = merge_flushed(self._meta, parts, final=final, path=self.dir)
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
    """Keeps the flushed rows in memory and merges them at close (the same merge as parts
    on disk, `tracekit.log.parts.merge_flushed`); `log` is the run afterwards."""

    def __init__(self) -> None:
        self.log: RawLog | None = None
        self._meta: dict[str, Any] = {}
        self._chunks: list[dict[str, Any]] = []

    def open(self, meta: Mapping[str, Any]) -> None:
        self._meta = dict(meta)

    def write(self, chunk: Mapping[str, np.ndarray]) -> None:
        self._chunks.append(parse_flushed(chunk, f"<memory> flush {len(self._chunks) + 1}"))

    def close(self, final: Mapping[str, Any]) -> None:
        self.log = merge_flushed(self._meta, self._chunks, final=final, path="<memory>")
        self._chunks = []


__all__ = [
    "CaptureError",
    "Dispatcher",
    "EMIT_CALLS",
    "EMIT_CALL_WIDTH",
    "EMIT_HANDLES",
    "Flush",
    "MemorySink",
    "PartsSink",
    "Sink",
    "build_chunk",
    "call_sink",
    "expand_emissions",
]
