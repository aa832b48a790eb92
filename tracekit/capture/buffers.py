"""The recorder's rows between two flushes, and their hand-over to the sinks' dispatcher.

Every table is a flat `array.array` of integer ticks and interned ids (a float one for
counters), appended to by the hooks. A flush swaps the whole set for empty ones under the
recorder's lock and hands the full set to the dispatcher (`tracekit.capture.sinks`), which
builds chunks and writes them on its own thread: the engine's thread never does disk I/O.
While the writer is behind, the rows stay here (the backlog) up to two intervals or
`BACKLOG_VALUES`; past either, the flush waits for the writer.
"""

from __future__ import annotations

import os
import threading
from array import array
from collections.abc import Callable

import numpy as np

from tracekit.capture import signals
from tracekit.capture.sinks import EMIT_CALLS, EMIT_HANDLES, Dispatcher, Flush
from tracekit.log.flush import DTYPES, TABLES

#: The most table values a recorder keeps in its buffer while the writer is behind
#: (160 MB), before it hands them over anyway (see `tracekit.capture.sinks.Dispatcher`).
BACKLOG_VALUES = 20_000_000

#: Values in one row of the steps table.
_STEP_WIDTH = len(TABLES["steps"])


def new_tables() -> dict[str, array]:
    """One empty array per table, and the two of the compact emissions."""
    tables = {k: array("d" if DTYPES[k] is np.float64 else "q") for k in TABLES}
    tables[EMIT_CALLS] = array("q")  # emissions, compact (`sinks.expand_emissions`)
    tables[EMIT_HANDLES] = array("i")  # int32: handles and counts are below 2**31
    return tables


class RowBuffers:
    """The rows recorded since the last flush, and what the flushes have handed over.

    `lock` is the recorder's lock: every append outside the loop thread's open step holds
    it, and so does the swap. `segments` and `os_samples` are those tables (the segment
    hooks' and the step samples', one lookup less); the swap replaces them with the rest."""

    __slots__ = (
        "lock", "tables", "segments", "os_samples", "dispatcher", "interval_ticks",
        "last_flush_tick", "num_flushes", "num_steps_flushed", "num_requests_flushed",
        "is_flush_asked",
    )  # fmt: skip

    def __init__(self, interval_ticks: int) -> None:
        self.lock = threading.RLock()
        self.tables = new_tables()
        self.segments = self.tables["segments"]
        self.os_samples = self.tables["os_samples"]
        self.dispatcher: Dispatcher | None = None
        self.interval_ticks = interval_ticks  # a flush at least this often
        self.last_flush_tick = 0
        self.num_flushes = 0  # handed to the dispatcher
        self.num_steps_flushed = 0  # step rows handed to the dispatcher
        self.num_requests_flushed = 0  # request names handed to the dispatcher
        self.is_flush_asked = False  # flush_soon(): the writer's next idle call flushes

    def swap(self) -> dict[str, array]:
        """The rows so far (under the lock), replaced by empty tables."""
        full = self.tables
        self.tables = new_tables()
        self.segments = self.tables["segments"]
        self.os_samples = self.tables["os_samples"]
        self.is_flush_asked = False  # the rows so far are in this flush
        self.num_steps_flushed += len(full["steps"]) // _STEP_WIDTH
        return full

    def flush(
        self,
        clock: Callable[[], int],
        open_tick: Callable[[], int | None],
        chunk: Callable[..., Flush],
        pid: int,
        stop_tick: int | None,
        is_clock_only: bool,
    ) -> None:
        """Swap the buffers and hand the rows to the dispatcher (no disk I/O and no chunk
        building here): `chunk(rows, now, stop_tick, open_tick, is_clock_only,
        first_request, first_step)` makes what is handed over. Signals wait from the swap until the
        hand-over (`tracekit.capture.signals`); `pid`: the process that started the run
        (a forked child swaps, and hands nothing over)."""
        signals.IN_FLUSH[0] += 1
        try:
            with self.lock:  # hand-overs in swap order: chunks name request ids in order
                # the flush's tick and what is open then, before the swap: a row that lands
                # in the next buffer (a collection triggered by the swap itself) starts
                # after `now`, or is announced open
                now = clock()
                t_open = open_tick()
                first_step = self.num_steps_flushed  # the number of this flush's first step
                full = self.swap()
                now = clock()
                self.last_flush_tick = now
                if pid != os.getpid():  # a forked child: the run is the parent's
                    return
                first = self.num_requests_flushed
                flush = chunk(full, now, stop_tick, t_open, is_clock_only, first, first_step)
                self.num_requests_flushed += len(flush.new_request_ids)
                if self.dispatcher is not None:
                    self.dispatcher.submit(flush)
                    self.num_flushes += 1
        finally:
            signals.IN_FLUSH[0] -= 1

    def add_segment(self, row: bytes) -> None:
        """Append one segments row from any thread."""
        with self.lock:
            self.segments.frombytes(row)

    def has_rows(self) -> bool:
        return any(len(b) for b in self.tables.values())

    def num_steps_recorded(self) -> int:
        """Step rows so far, flushed or not (under the lock)."""
        return self.num_steps_flushed + len(self.tables["steps"]) // _STEP_WIDTH

    def backlogged(self, now: int) -> bool:
        """Keep the rows in this buffer (the backlog) for a later flush: the writer is
        behind (a flush already waits for it, `Dispatcher.waiting`), the backlog is under
        two intervals old and within `BACKLOG_VALUES`; past either, the flush is handed
        over and waits for the writer (`tracekit.capture.sinks.Dispatcher`)."""
        d = self.dispatcher
        if d is None or not d.waiting():
            return False
        if (
            now - self.last_flush_tick < 2 * self.interval_ticks
            and sum(len(b) for b in self.tables.values()) < BACKLOG_VALUES
        ):
            return True
        # the writer is two intervals behind: wait until it takes the waiting flush, with
        # signals deferred (one raised inside a Condition's wait can leave its lock held)
        signals.IN_FLUSH[0] += 1
        try:
            d.wait_taken()
        finally:
            signals.IN_FLUSH[0] -= 1
        return False
