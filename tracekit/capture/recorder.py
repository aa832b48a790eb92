"""Recording hooks: what an engine calls to say what every step did.

    rec = tracekit.Recorder("raw/run.npz", config={"rung": "baseline", "seed": 1})
    with rec:                                   # installs gc.callbacks; flushes on stop
        rec.request(rid, prompt_tokens=812, max_new_tokens=300)
        with rec.step():                        # or @rec.step on the engine's step()
            rec.admit(rid)                      # the scheduler took it (first time),
            rec.prefill(rid, num_tokens=256)    # this step computes a prompt chunk,
            rec.wait(waiting_ids, "kv_blocks")  # the rest wait: why (docs/ttft.md)
            with rec.segment("prefill"):        # or @rec.segment("tok") on a function
                ...
            rec.evict(victim, mode="swap")      # explicit, timestamped, counted in the step
            with rec.segment("decode"):
                ...
            rec.emit(decoded_ids)               # one emission time for the whole step
            rec.step_info(num_decode=8, graph_size=8, num_prefill_tokens=256)

Hot path: each event is one row of integer clock ticks and interned ids appended to a flat
`array.array` (no Python object per event or token); names are interned once. At a bounded
interval the recorder swaps its buffers and hands the rows to its sinks on a writer thread
(`tracekit.capture.sinks`): numbered parts on disk for `out=PATH` (a killed run keeps what
was flushed), memory for `out=None`, any `sinks=[...]` (live trace, metrics). `stop()` (also
on exceptions, SIGTERM and exit, `tracekit.capture.signals`) closes them: the parts stay
the log and `PATH` points to them (docs/design.md).

A disabled recorder (`enabled=False`) costs next to nothing: `step`/`segment` decorators
hand back the original function, context managers are a shared no-op, and `emit`,
`evict`, ... return at once.

The recorder is the run's lifecycle and its hooks; each part of a run's state is its own
object: the rows and their flushes (`tracekit.capture.buffers`), the requests and the
checks of the calls that name them (`tracekit.capture.requests`), the open step, the
threads, the segments and the NVTX and OS probes (`tracekit.capture.segments`), the
collections (`tracekit.capture.gcpauses`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from functools import wraps
from numbers import Integral
from typing import Any, TypeVar

import numpy as np

from tracekit.capture import signals
from tracekit.capture.buffers import RowBuffers
from tracekit.capture.checks import (
    as_int,
    as_int_vector,
    as_tick,
    check_label,
    check_recorder_args,
    engine_label,
    small_ints,
    step_attrs,
    wait_code,
)
from tracekit.capture.device import DeviceTimer
from tracekit.capture.gcpauses import GcPauses
from tracekit.capture.requests import RequestBook, eviction_cause, few, in_range
from tracekit.capture.segments import (
    NULL_SEGMENT,
    NVTX_DOMAIN,
    SEG_ROW,
    DeviceSegment,
    OpenStep,
    Probes,
    Segment,
    StepContext,
    Threads,
)
from tracekit.capture.sinks import Dispatcher, Flush, MemorySink, PartsSink, Sink, call_sink
from tracekit.labels import DEFAULT_CAUSE_MAP
from tracekit.log.clocks import STEADY_CLOCK_FUNCTIONS
from tracekit.log.flush import UNKNOWN_TICK
from tracekit.log.rawlog import MODES, RawLog
from tracekit.log.reader import load
from tracekit.log.validate import MAX_ABS_TIME_S, MAX_COUNT

F = TypeVar("F", bound=Callable[..., Any])

_NULL_CM = contextlib.nullcontext()


#: Recorders that are running, so tests (and atexit) can check none is left behind; each
#: with its fork hooks (hold its lock, release it in the parent, switch it off in the child).
_ACTIVE: dict[Recorder, tuple[Callable[[], None], Callable[[], None], Callable[[], None]]] = {}


def active_recorders() -> frozenset[Recorder]:
    return frozenset(_ACTIVE)


class Recorder:
    """Records one run. See the module docstring for the whole API in one example.

    out: where the run goes: its parts stream to ``OUT.parts/`` and, at stop, ``OUT``
        names them (`tracekit.capture.sinks.PartsSink`; docs/design.md,
        "The run's log on disk"; a path another recorder uses, or holding an unrecovered
        run, is refused at start); None keeps the run in memory, never on disk (`log()`
        returns it either way).
    config: JSON-able metadata saved with the run (`rung`, `seed`, engine settings...).
    enabled: False makes every hook a no-op.
    gc: time collections with `gc.callbacks` (installed at start, removed at stop).
    nvtx: also open an NVTX range per step and segment (needs the `nvtx` package), in the
        `tracekit` domain, one colour per label; imported at start, only when asked for.
    device_timer: a `tracekit.capture.device.DeviceTimer` (`CudaEventTimer`, or `FakeDeviceTimer`
        in tests): `segment(label, device=True)` then also records the device execution
        window of the launch, resolved lazily; without one it records the host window only.
    clock: a function returning integer ticks (default `time.perf_counter_ns`); pass a fake
        clock in tests. `seconds_per_tick` converts them.
    flush_interval_s: completed rows reach the sinks (the disk) at least this often, while
        the engine steps and while it is idle (crash safety); a part never splits a step.
    sinks: more `tracekit.capture.sinks.Sink`s to receive every flushed chunk (a live Chrome trace,
        live metrics); one that raises is logged and detached, the run goes on.
    cause_map: segment label -> cause, on top of the defaults (`swap` -> `preempt`, ...).
    os_evidence: read the loop thread's CPU time, run-queue wait, context switches and
        major faults at every step's start and end, and another thread's at its
        segments' start and end (`tracekit.capture.osstats`; about
        2 µs a sample on Linux, see bench/bench_os.py), so the partition can name time the
        OS took (`os_runqueue`, `os_blocked`). None (the default): on where the platform
        has the counters and the clock is wall time (the default clock), else off; the
        log's ``meta["os_evidence"]`` says which, and why not.
    retain_s: keep only the parts of about the last `retain_s` seconds on disk (older ones
        are removed as new ones are written: a server that runs for days keeps a bounded
        folder); every reader starts at the oldest part left (docs/design.md,
        "The run's log on disk"). None (the default): keep every part.
    handle_signals: turn SIGTERM into a clean stop, and keep it and Ctrl-C (SIGINT, still
        a KeyboardInterrupt) from being lost in a GC pause or a flush (re-sent once those
        end); installed at start and restored at stop, main thread only
        (`tracekit.capture.signals`).

    A recorder belongs to the process that started it: in a forked child it is switched off
    (the child neither records into the parent's run nor stops it).
    """

    def __init__(
        self,
        out: str | os.PathLike[str] | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        enabled: bool = True,
        gc: bool = True,
        nvtx: bool = False,
        clock: Callable[[], int] = time.perf_counter_ns,
        seconds_per_tick: float = 1e-9,
        flush_interval_s: float = 1.0,
        cause_map: Mapping[str, str] | None = None,
        handle_signals: bool = True,
        device_timer: DeviceTimer | None = None,
        sinks: Iterable[Sink] = (),
        os_evidence: bool | None = None,
        retain_s: float | None = None,
    ) -> None:
        check_recorder_args(out, seconds_per_tick, os_evidence, retain_s)
        self.out = None if out is None else os.fspath(out)
        self._retain_s = retain_s
        self.config: dict[str, Any] = dict(config or {})
        self.enabled = enabled
        self.cause_map = {**DEFAULT_CAUSE_MAP, **(cause_map or {})}
        self._use_gc = gc
        self._want_nvtx = nvtx
        self._device = device_timer if enabled else None
        self._clock = clock
        self._seconds_per_tick = float(seconds_per_tick)
        self._max_ticks = int(MAX_ABS_TIME_S / self._seconds_per_tick)
        self._flush_interval_s = flush_interval_s
        self._handle_signals = handle_signals
        self._want_os = os_evidence
        self._running = False
        self._stopped = False
        self._log: RawLog | None = None
        # the run's state, each part its own object: the rows since the last flush (and
        # the recorder's lock), the open step, the threads, the optional probes, the requests
        self._rows = RowBuffers(int(flush_interval_s / seconds_per_tick))
        self._lock = self._rows.lock
        self._step = OpenStep()
        self._threads = Threads(self._step, self._rows)
        self._probes = self._threads.probes = Probes(self._threads, self._rows, clock)
        self._book = RequestBook(self._rows, self._step)
        self._step_cm = StepContext(self._begin_step, self._end_step, self._probes)
        # interned vocabularies (request names: `_book`)
        self._labels: list[str] = []
        self._label_index: dict[str, int] = {}  # label -> its index in `_labels`
        self._segments: dict[tuple[str, bool], Segment] = {}
        self._host_segments: dict[str, Segment] = {}  # the same, device=False, by label
        self._counter_index: dict[str, int] = {}
        self._gc = GcPauses(clock, self._rows)
        self._on_gc = self._gc.on_gc  # what goes into gc.callbacks while the run records
        # where the rows go: the run's own sink (parts on disk, or memory), then the others
        self._own: PartsSink | MemorySink = MemorySink()  # chosen at start, from `out`
        self._sinks: list[Sink] = list(sinks)
        self._t0_tick = 0
        self._pid = -1  # the process that started the run
        self._signals = False
        self._extras: dict[str, np.ndarray] = {}

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> Recorder:
        """Start the run: stamp the clock origin, install gc callbacks and signal handling."""
        if not self.enabled or self._running:
            return self
        if self._stopped:
            raise RuntimeError("a Recorder records one run; make a new one for the next run")
        if self._want_nvtx:
            self._probes.open_nvtx()
        t0 = self._clock()
        if isinstance(t0, bool) or not isinstance(t0, Integral):
            raise TypeError(
                f"Recorder(clock=): the clock returned {type(t0).__name__} {t0!r:.80}; it must "
                "return integer ticks (seconds_per_tick converts them)"
            )
        self._t0_tick = int(t0)
        self._max_ticks = int(MAX_ABS_TIME_S / self._seconds_per_tick)
        self._rows.last_flush_tick = self._t0_tick
        self._pid = os.getpid()
        self._threads.tid()  # the starting thread is thread 0
        meta = {
            "schema": "tracekit.parts",
            "t0_tick": self._t0_tick,
            "seconds_per_tick": self._seconds_per_tick,
            "clock": getattr(self._clock, "__qualname__", repr(self._clock)),
            "pid": os.getpid(),
            "started_unix_s": time.time(),
            "config": self.config,
            "cause_map": self.cause_map,
            "source": "tracekit",
        }
        meta["os_evidence"] = self._probes.open_os(
            self._want_os, is_wall_clock=self._clock in STEADY_CLOCK_FUNCTIONS
        )
        if self._device is not None:
            meta["device_calibration"] = self._device.attach(
                self._clock, self._seconds_per_tick, self._t0_tick
            )
        self._meta = meta
        self._own = (
            MemorySink() if self.out is None else PartsSink(self.out, retain_s=self._retain_s)
        )
        self._own.open(meta)  # the run's own output: refusing a path in use raises here
        self._sinks = [s for s in self._sinks if call_sink(s, "open", meta)]
        self._rows.dispatcher = Dispatcher(
            [self._own, *self._sinks],
            t0_tick=self._t0_tick,
            seconds_per_tick=self._seconds_per_tick,
            interval_s=self._flush_interval_s,
            idle=self._idle_flush,
        )
        if self._use_gc:
            gc.callbacks.append(self._on_gc)
        if self._handle_signals:
            self._signals = signals.acquire()
        signals.stop_at_exit(self.stop)
        self._running = True
        _ACTIVE[self] = (self._hold_for_fork, self._release_after_fork, self._in_child)
        return self

    def add_sink(self, sink: Sink) -> None:
        """Send every flushed chunk to `sink` too (before `start()`)."""
        if self._running or self._stopped:
            raise RuntimeError("add sinks before start(): a sink sees the whole run")
        self._sinks.append(sink)

    def stop(self) -> RawLog | None:
        """Stop the run: remove every hook, flush, close the sinks (on disk: the last part
        and what only the stop knows; nothing is merged, so it costs the same whatever the
        run's length). Returns the run kept in memory (``out=None``), else None: `log()`
        reads the run back from disk when asked.

        Safe whatever instant the engine was stopped at: a step begun and not ended is
        closed at the stop time (a warning says so), so every row that names it stays
        valid; SIGTERM and SIGINT landing during `stop()` are acted on after it."""
        signals.IN_FLUSH[0] += 1  # first: a signal from here on waits for the run's end
        try:
            return self._stop()
        finally:
            signals.IN_FLUSH[0] -= 1

    def _stop(self) -> RawLog | None:
        if not self._running:
            return self._log
        self._running = False
        _ACTIVE.pop(self, None)
        device_meta: dict[str, Any] = {}
        warnings = self._unclosed()
        try:
            if self._device is not None:  # one synchronize: the run ends when the device does
                device_meta = self._device.finish(self._append_device_window)
            stop_tick = self._clock()
        finally:
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)
                signals.IN_GC[0] = False
            if self._signals:
                signals.release()
                self._signals = False
            signals.cancel_at_exit(self.stop)
            self._probes.close_os()
        warnings = self._close_open_step(stop_tick) + warnings
        try:
            self._flush(stop_tick=stop_tick)
        finally:
            self._stopped = True
            if self._rows.dispatcher is not None:
                self._rows.dispatcher.close()
        final: dict[str, Any] = {"config": self.config, **device_meta}
        if self._extras:
            final["extras"] = dict(self._extras)
        if warnings:
            final["warnings"] = warnings
        dispatcher = self._rows.dispatcher
        attached = dispatcher.sinks if dispatcher is not None else []
        for sink in self._sinks:  # a sink detached after a failure is not called again
            if sink in attached:
                call_sink(sink, "close", final)
        try:
            self._own.close(final)
        finally:
            self._log = self._own.log
        return self._log

    def _unclosed(self) -> list[str]:
        """Warnings for what was still open at stop() (not in the log)."""
        out = []
        out += [f"{n} {what}" for what, n in self._book.notes.items()]
        threads = self._threads.num_with_open()
        if threads:
            out.append(
                f"a segment was still open at stop() on {threads} thread(s) (entered, never "
                "exited): not in the log"
            )
        return out

    def attach(self, name: str, array: Any) -> None:
        """Keep a numeric array with the run (saved as ``extra.NAME``: an arrival trace, a
        workload description). Written at stop, so an interrupted run does not have it."""
        if not self.enabled:
            return
        a = np.asarray(array)
        if a.dtype.kind not in "biuf":
            raise TypeError(f"attach({name!r}): numeric arrays only, got dtype {a.dtype}")
        self._extras[name] = a

    def log(self) -> RawLog:
        """The recorded run (after `stop`; a run on disk is read back at the first call)."""
        if self._log is None:
            if not self._stopped:
                raise RuntimeError("the run has not stopped yet: call stop() first")
            if self.out is None:
                raise RuntimeError("the run was lost at stop (see the error stop() raised)")
            self._log = load(self.out)
        return self._log

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running

    @property
    def current_step(self) -> int:
        """Index of the open step (or the last one; -1 before the first): what an async
        engine passes back as `emit(..., reads_step=)` when it reads that step's results."""
        return self._step.no

    @property
    def t0_tick(self) -> int:
        """The clock reading at `start()`: engine time zero, in ticks."""
        return self._t0_tick

    @property
    def seconds_per_tick(self) -> float:
        return self._seconds_per_tick

    # -- steps -----------------------------------------------------------------------
    def step(self, fn: F | None = None) -> Any:
        """A step: `@rec.step` on the engine's step function, or `with rec.step():`."""
        if fn is not None:
            if not self.enabled:
                return fn
            cm = self._step_cm

            @wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with cm:
                    return fn(*args, **kwargs)

            return wrapper
        return self._step_cm if self.enabled else _NULL_CM

    def step_info(
        self,
        *,
        num_decode: int | None = None,
        num_prefill_tokens: int | None = None,
        graph_size: int | None = None,
        num_preempted: int | None = None,
        num_swapped_in: int | None = None,
    ) -> None:
        """Attributes of the open step. Unset ones default at step end: decode rows = the
        step's emission rows; prefill tokens 0; graph size -1 with no decode rows, else the
        decode rows (no graph miss recorded; pass 0 for an eager step); preemptions and
        swap-ins = the `evict`/`readmit` calls made during the step.

        Counts are integers in [0, 2**31 - 1] (graph size from -1); all are checked before
        any is kept, so a wrong one raises and sets none."""
        if not self.enabled:
            return
        a = step_attrs(num_decode, num_prefill_tokens, graph_size, num_preempted, num_swapped_in)
        self._step.attrs.update(a)

    def _begin_step(self) -> None:
        """Where a step begins: its start tick, then (under the lock, last) its number.

        The order makes every instant safe to stop at (a signal, an exception): until the
        step's number (`OpenStep.begin`) moves on, nothing names the new step; from then on
        `stop()` finds it open (no row yet, `_open_step_no`) and closes it at stop time."""
        st = self._step
        if st.is_open:
            raise RuntimeError("steps do not nest: the previous step is still open")
        t0 = self._clock()
        with self._lock:  # an idle flush on another thread must see the step open
            st.begin(t0)
        probes = self._probes
        if probes.os is not None:
            probes.os_step_start()

    def _end_step(self) -> None:
        """Where a step ends: its row, then the device poll and the flush."""
        t1 = self._clock()
        probes = self._probes
        if probes.os is not None:
            probes.os_step_end()
        st = self._step
        row = st.row(t1)
        rows = self._rows
        with self._lock:  # with the row: an idle flush never sees the step half-ended
            rows.tables["steps"].frombytes(row)
            st.close()
        dev = self._device
        if dev is not None and dev.num_pending:  # lazily: only what has finished, no sync
            dev.poll(self._append_device_window)
        if rows.is_flush_asked or (  # flush_soon(): now, writer behind or not
            t1 - rows.last_flush_tick >= rows.interval_ticks and not rows.backlogged(t1)
        ):
            self._flush()

    def _open_step_no(self) -> int | None:
        """The step begun but without a row (the engine was stopped inside it), if any:
        what the rows say, whatever instant a signal or an exception stopped at."""
        with self._lock:
            no = self._step.no
            return no if no >= self._rows.num_steps_recorded() else None

    def _close_open_step(self, stop_tick: int) -> list[str]:
        """At stop: close a step still open at the stop time, so that the segments,
        emissions, prefill chunks and waits that name it stay valid."""
        n = self._open_step_no()
        if n is None:
            return []
        with self._lock:
            self._rows.tables["steps"].frombytes(self._step.row(stop_tick))
            self._step.close()
        return [f"step {n} was still open at stop(): it is closed at the stop time"]

    # -- segments --------------------------------------------------------------------
    def segment(self, label: str, *, device: bool = False) -> Any:
        """A labelled window: `with rec.segment("prefill"):` or `@rec.segment("tok")`.

        Works from any thread; a window outside a step is recorded with step -1.
        `device=True`: the body launches device work; with a device timer its execution
        window is recorded too (is_device=1, see `tracekit.capture.device`), without one only the
        host window is."""
        if not self.enabled:
            return NULL_SEGMENT
        seg = None if device else self._host_segments.get(label)  # the common case: one lookup
        if seg is not None:
            return seg
        key = (label, device)
        seg = self._segments.get(key)
        if seg is None:
            label = check_label(label, "segment(label)")
            with self._lock:
                seg = self._segments.get(key)
                if seg is None:
                    idx = self._label_id(label)
                    if device and self._device is not None:
                        seg = DeviceSegment(
                            idx, label, self._clock, self._threads, self._probes, self._device
                        )
                    else:  # nothing measures the device: the host window is what we have
                        seg = Segment(idx, label, self._clock, self._threads, self._probes)
                    self._segments[key] = seg
                    if not device:
                        self._host_segments[label] = seg
        return seg

    def add_segment(self, label: str, t0: int, t1: int, *, device: bool = False) -> None:
        """Record a window measured elsewhere (ticks of this recorder's clock)."""
        if not self.enabled:
            return
        if not (  # the common case, checked at once: a str, two int ticks of this run, in order
            type(label) is str
            and type(t0) is int
            and type(t1) is int
            and t0 <= t1
            and self._running
            and t1 - self._t0_tick <= self._max_ticks
            and self._t0_tick - t0 <= self._max_ticks
        ):
            label = check_label(label, "add_segment(label)")
            t0 = self._check_tick(t0, "add_segment(t0)")
            t1 = self._check_tick(t1, "add_segment(t1)")
            if t1 < t0:
                raise ValueError(
                    f"add_segment({label!r:.80}): ends (t1={t1}) before it starts ({t0})"
                )
        label_id = self._label_id(label)
        row = SEG_ROW(self._step.here(), label_id, t0, t1, self._threads.tid(), 1 if device else 0)
        self._rows.add_segment(row)

    def _label_id(self, label: str) -> int:
        idx = self._label_index.get(label)
        if idx is not None:
            return idx
        with self._lock:
            idx = self._label_index.get(label)
            if idx is None:
                self._labels.append(engine_label(label))  # once per label: off the hot path
                idx = self._label_index[label] = len(self._labels) - 1
            return idx

    def _append_device_window(self, step: int, label: int, t0: int, t1: int, thread: int) -> None:
        """A device execution window resolved by the device timer, after its step ended."""
        self._rows.add_segment(SEG_ROW(step, label, t0, t1, thread, 1))

    def _check_tick(self, value: Any, name: str) -> int:
        """A tick of this recorder's clock, within what a log accepts of engine time."""
        t = as_tick(value, name)
        # before start() there is no start tick yet: the clock's reading now stands for it
        ref = self._t0_tick if self._running else int(self._clock())
        if abs(t - ref) > self._max_ticks:
            what = "the run's start" if self._running else "this clock's reading now"
            raise ValueError(
                f"{name}: tick {t} is {abs(t - ref) * self._seconds_per_tick:.3g} s from "
                f"{what} (more than {MAX_ABS_TIME_S:g} s: not this clock's tick)"
            )
        return t

    # -- requests: ids and handles -----------------------------------------------------
    def request(
        self,
        request_id: Any,
        *,
        prompt_tokens: int = -1,
        max_new_tokens: int = -1,
        arrival_tick: int | None = None,
    ) -> int:
        """A request arrived (now, or at `arrival_tick` of this recorder's clock).

        Returns its handle: the integer that `emit_handles`, `admit_handle`,
        `prefill_handles` and `wait_handles` take instead of the id (resolve the id once,
        here, and keep the handle with the request). Once per request, before its first
        admission and emission: a second call keeps the first arrival; an arrival after
        the request's admission (or after now) is taken as that tick, one told after its
        first emission is kept unknown (NaN); the log's warnings count each. -1 when the
        recorder is disabled."""
        if not self.enabled:
            return -1
        prompt = as_int(prompt_tokens, "request(prompt_tokens=)", -1)
        max_new = as_int(max_new_tokens, "request(max_new_tokens=)", -1)
        now = self._clock()
        t = now
        if arrival_tick is not None:
            t = self._check_tick(arrival_tick, "request(arrival_tick=)")
            if t > now:  # another clock's reading, a little ahead: it arrived by now
                self._book.note(
                    "request arrival tick(s) after the request() call, taken as the call's"
                )
                t = now
        idx, kept = self._book.arrive(request_id, t, prompt, max_new)
        if kept is None:
            return idx
        t = kept
        if arrival_tick is None:
            self._flush_if_idle(t)
        return idx

    def handle(self, request_id: Any) -> int:
        """The handle of `request_id` (interned now if this recorder has not seen it),
        without recording an arrival; -1 when the recorder is disabled."""
        if not self.enabled:
            return -1
        book = self._book
        idx = book.index.get(request_id)
        return book.intern(request_id, "handle") if idx is None else idx

    def finish(self, request_id: Any) -> None:
        """The engine is done with `request_id` (finished or aborted: vLLM's `finish_reason`):
        its id leaves the recorder's book (flat memory over any run), no row is written.
        Its handle stays its own; a later call naming the id, an unknown id and a second
        finish raise (docs/capture.md, "Finished requests")."""
        if self.enabled:
            self._book.finish(request_id)

    def finish_handle(self, handle: int) -> None:  # `finish` on a request handle
        if self.enabled:
            self._book.finish_handle(handle)

    def _flush_if_idle(self, now: int) -> None:
        """Keep the flush interval while no step runs (an idle engine still takes
        arrivals): only between steps (a part never splits one), and by the step's rule
        for a writer behind (`RowBuffers.backlogged`: at most one flush waits for it)."""
        rows = self._rows
        if self._step.is_open or now - rows.last_flush_tick < rows.interval_ticks:
            return
        if rows.backlogged(now):
            return
        with self._lock:
            if not self._step.is_open and self._running:
                self._flush(poll_device=False)

    def flush_soon(self) -> None:
        """Hand every completed row to the sinks as soon as a part may be cut: at the end of
        the open step, or, between steps, at once from the writer thread (a flush even with
        no new row: the log says it was complete then). For a process that may be killed
        next (a SIGTERM handler: it swaps no buffer, so it is safe wherever a signal lands)."""
        if not self._running:
            return
        self._rows.is_flush_asked = True  # cleared by the flush that takes the rows so far
        d = self._rows.dispatcher
        if d is not None and not signals.IN_FLUSH[0]:  # else a flush is being handed over
            d.wake()

    def _idle_flush(self) -> None:
        """From the dispatcher, when no flush came for a whole interval: flush what was
        recorded since (arrivals, emissions outside steps, rows from just before the engine
        went idle), unless a step is open (a part never splits a step)."""
        with self._lock:
            if self._step.is_open or not self._running or self._pid != os.getpid():
                return
            rows = self._rows
            if (
                rows.is_flush_asked
                or rows.has_rows()
                or rows.num_requests_flushed < self._book.count
            ):
                self._flush(poll_device=False)
            elif rows.dispatcher is not None and rows.dispatcher.follows_idle_clock():
                self._flush(poll_device=False, is_clock_only=True)  # a live sink's watermark

    # -- emissions ---------------------------------------------------------------------
    def emit(
        self,
        request_ids: Iterable[Any],
        num_tokens: Iterable[int] | None = None,
        *,
        at_tick: int | None = None,
        reads_step: int | None = None,
    ) -> None:
        """Tokens left the engine now (or at `at_tick` of this recorder's clock, for an
        adapter that learns of them later), one or more per request (`num_tokens`), all
        sharing one emission time: call it right after the forward pass returns.

        `reads_step`: under async scheduling, the step whose device results these tokens
        are (the previous step's, read while this one runs); default: the open step. The
        partition charges a gap only with the device work its emission read.

        On the per-step path prefer `emit_handles` (no id lookup); both record the same."""
        if not self.enabled:
            return
        if num_tokens is not None and not isinstance(num_tokens, np.ndarray):
            num_tokens = list(num_tokens)
        t, dstep = self._emit_when(at_tick, reads_step)  # every scalar checked first
        counts = self._emit_counts(num_tokens)
        ids = request_ids if isinstance(request_ids, (list, tuple)) else list(request_ids)
        if counts is not None and len(counts) != len(ids):
            raise ValueError(f"emit: {len(ids)} request ids but {len(counts)} num_tokens")
        book = self._book
        book.emit_rows(book.intern_all(ids, "emit"), counts, t, dstep)

    def emit_handles(
        self,
        handles: Any,
        num_tokens: Any = None,
        *,
        at_tick: int | None = None,
        reads_step: int | None = None,
    ) -> None:
        """`emit` on request handles (what `request`/`handle` return): one vectorised call
        for a whole batch, checked once for the vector (the engine's hot path). `handles`
        and `num_tokens`: an int array (best) or a sequence of ints."""
        if not self.enabled:
            return
        if at_tick is None and reads_step is None:  # the per-step call: `_emit_when` inlined
            t = self._clock()
            st = self._step
            dstep = st.no if st.is_open else -1
        else:
            t, dstep = self._emit_when(at_tick, reads_step)
        book = self._book
        if num_tokens is None:
            lo = book.base
            rel = in_range(handles, lo, book.count - 1)  # a batch's int64 array, in range
            if rel is not None:
                book.emit_rows(handles, None, t, dstep, rel, lo)
                return
        if few(handles) and (
            num_tokens is None or few(num_tokens)
        ):  # a few ints: checked and copied in Python (numpy's fixed costs are more)
            hs = small_ints(handles, book.base, book.count - 1)
            ks = None if num_tokens is None else small_ints(num_tokens, 1)
            if hs is not None and (num_tokens is None or (ks is not None and len(ks) == len(hs))):
                book.emit_few(hs, ks, t, dstep)
                return
        h = book.check_handles(handles, "emit_handles(handles)")
        counts = self._emit_counts(num_tokens)
        if counts is not None and len(counts) != len(h):
            raise ValueError(f"emit_handles: {len(h)} handles but {len(counts)} num_tokens")
        book.emit_rows(h, counts, t, dstep)

    def emit_chunk(
        self, handle: int, t_ready: int, t_sent: int, num_tokens: int = 1, *,
        label: str = "sse_write",
    ) -> None:  # fmt: skip
        """One response chunk of one request, as a streaming server writes it: the write's
        window (`t_ready` to `t_sent`, ticks of this recorder's clock) as a segment
        `label`, and the chunk's `num_tokens` tokens as an emission at `t_sent` on request
        `handle`. The rows of `add_segment(label, t_ready, t_sent)` then
        `emit_handles([handle], [num_tokens], at_tick=t_sent)`, in one call checked once:
        a server's per-chunk path (`engine_adapters.vllm_serve`). A bad argument raises
        before anything is recorded."""
        if not self.enabled:
            return
        t0 = self._t0_tick
        book = self._book
        if not (  # the common case, checked at once
            type(handle) is int
            and type(t_ready) is int
            and type(t_sent) is int
            and type(num_tokens) is int
            and book.base <= handle < book.count
            and 1 <= num_tokens <= MAX_COUNT
            and t_ready <= t_sent
            and self._running
            and t_sent - t0 <= self._max_ticks
            and t0 - t_ready <= self._max_ticks
            and type(label) is str
        ):
            label = check_label(label, "emit_chunk(label)")
            handle = book.check_handle(handle, "emit_chunk(handle)")
            t_ready = self._check_tick(t_ready, "emit_chunk(t_ready)")
            t_sent = self._check_tick(t_sent, "emit_chunk(t_sent)")
            num_tokens = as_int(num_tokens, "emit_chunk(num_tokens)", 1)
            if t_sent < t_ready:
                raise ValueError(
                    f"emit_chunk: written (t_sent={t_sent}) before it was ready ({t_ready})"
                )
        label_id = self._label_index.get(label)
        if label_id is None:
            label_id = self._label_id(label)
        seg = SEG_ROW(self._step.here(), label_id, t_ready, t_sent, self._threads.tid(), 0)
        step = self._step.no if self._step.is_open else -1
        ks = None if num_tokens == 1 else [num_tokens]
        book.emit_few([handle], ks, t_sent, step, segment_row=seg)

    def _emit_when(self, at_tick: Any, reads_step: Any) -> tuple[int, int]:
        t = self._clock() if at_tick is None else self._check_tick(at_tick, "emit(at_tick=)")
        st = self._step
        step = st.no if st.is_open else -1
        if reads_step is None:
            return t, step
        # the step read must exist by the time the log is written: this one or an earlier one
        return t, as_int(reads_step, "emit(reads_step=)", -1, st.no)

    @staticmethod
    def _emit_counts(num_tokens: Any) -> np.ndarray | None:
        if num_tokens is None:
            return None
        return as_int_vector(num_tokens, "emit(num_tokens)", 1)

    def evict(
        self, request_id: Any, *, mode: str = "swap", reason: str | None = None,
        by: Iterable[Any] | None = None, num_computed_tokens_lost: int | None = None,
        num_free_blocks: int | None = None, num_used_blocks: int | None = None,
    ) -> None:  # fmt: skip
        """The scheduler evicted `request_id` now (`swap` or `recompute`); where it decides, why
        (docs/capture.md, "Eviction causes"): `reason` (kv_full, priority, other), `by` (the
        ids whose need took the blocks), computed tokens lost, free and used KV blocks."""
        if not self.enabled:
            return
        code = MODES.get(mode) if isinstance(mode, str) else None
        if code is None:
            raise ValueError(f"evict(mode=): {mode!r:.80} is not one of {list(MODES)}")
        if reason is by is num_computed_tokens_lost is num_free_blocks is num_used_blocks is None:
            self._book.evict(self._book.intern(request_id, "evict"), self._clock(), code)
            return  # no cause told: the plain eviction, as cheap as before causes existed
        step = self._step.no if self._step.is_open else -1
        counts = (num_computed_tokens_lost, num_free_blocks, num_used_blocks)
        cause, by = eviction_cause(request_id, reason, by, step, counts)
        self._book.evict_with_cause(request_id, by, self._clock(), code, cause)

    def readmit(self, request_id: Any) -> None:
        """The scheduler readmitted an evicted `request_id` now."""
        if not self.enabled:
            return
        idx = self._book.intern(request_id, "readmit")
        self._book.readmit(idx, self._clock())

    # -- TTFT events: admission, prefill chunks, wait reasons ---------------------------
    def admit(self, request_id: Any, *, at_tick: int | None = None) -> None:
        """The scheduler took `request_id` into a running batch for the first time, now (or
        at `at_tick` of this recorder's clock: say, the start of the scheduling call).

        Call it once per request, where the scheduler takes it off its waiting queue (a
        readmission after an eviction is `readmit`), before its first emission and
        eviction. Ends the request's `queued` phase."""
        if not self.enabled:
            return
        t = self._clock() if at_tick is None else self._check_tick(at_tick, "admit(at_tick=)")
        self._book.admit(self._book.intern(request_id, "admit"), t)

    def admit_handle(self, handle: int, *, at_tick: int | None = None) -> None:
        """`admit` on a request handle."""
        if not self.enabled:
            return
        t = self._clock() if at_tick is None else self._check_tick(at_tick, "admit(at_tick=)")
        book = self._book
        if type(handle) is not int or not book.base <= handle < book.count:
            handle = book.check_handle(handle, "admit_handle(handle)")  # converts, or raises
        book.admit(handle, t)

    def prefill(self, request_id: Any, num_tokens: int) -> None:
        """The open step computes `num_tokens` of `request_id`'s prompt in its `prefill`
        segments (one call per request and step; the TTFT partition splits the step's
        prefill time by these token counts)."""
        if not self.enabled:
            return
        n = as_int(num_tokens, "prefill(num_tokens)")
        step = self._open_step("prefill")
        self._book.prefill(step, self._book.intern(request_id, "prefill"), n)

    def prefill_handles(self, handles: Any, num_tokens: Any) -> None:
        """`prefill` for several requests in one call: `num_tokens[i]` of the prompt of
        request handle `handles[i]`."""
        if not self.enabled:
            return
        step = self._open_step("prefill")
        self._book.prefill_handles(handles, num_tokens, step)

    def wait(self, request_ids: Iterable[Any], reason: str) -> None:
        """The open step's scheduler left `request_ids` waiting because of `reason`, one
        of `tracekit.log.rawlog.WAIT_REASONS` (`kv_blocks`, `max_num_seqs`, `token_budget`,
        `preempted_first`, `other`). One reason per request and step."""
        if not self.enabled:
            return
        code = wait_code(reason)
        step = self._open_step("wait")
        self._book.wait(request_ids, code, step)

    def wait_handles(self, handles: Any, reason: str) -> None:
        """`wait` on request handles."""
        if not self.enabled:
            return
        code = wait_code(reason)
        step = self._open_step("wait")
        book = self._book
        book.wait_rows(book.check_handles(handles, "wait_handles(handles)"), code, step)

    def _open_step(self, what: str) -> int:
        st = self._step
        if not (st.is_open and st.is_loop_thread()):
            raise RuntimeError(f"rec.{what}() describes a step: call it inside rec.step()")
        return st.no

    def counter(self, name: str, value: float, *, at_tick: int | None = None) -> None:
        """Sample an engine counter (batch size, free KV blocks...) now (or at `at_tick` of
        this recorder's clock, for a stamp taken before the recorder could be reached)."""
        if not self.enabled:
            return
        name = check_label(name, "counter(name)")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"counter({name!r:.80}): value {value!r:.80} is not a number") from None
        t = self._clock() if at_tick is None else self._check_tick(at_tick, "counter(at_tick=)")
        idx = self._counter_index.get(name)
        with self._lock:
            if idx is None:
                idx = self._counter_index.setdefault(name, len(self._counter_index))
            self._rows.tables["counters"].extend((float(idx), float(t), v))

    def now(self) -> int:
        """The recorder's clock, in ticks (for `add_segment` and `arrival_tick`)."""
        return self._clock()

    # -- flushing --------------------------------------------------------------------
    def _flush(
        self, *, stop_tick: int | None = None, poll_device: bool = True, is_clock_only: bool = False
    ) -> None:
        """Hand the completed rows to the sinks' dispatcher (a swap of buffers; no disk
        I/O and no chunk building here). `is_clock_only`: an idle flush with no rows, for
        the sinks that follow the clock (`tracekit.capture.sinks.Dispatcher`)."""
        dev = self._device
        if poll_device and dev is not None and dev.num_pending and stop_tick is None:
            dev.poll(self._append_device_window)
        self._rows.flush(
            self._clock, self._earliest_open_tick, self._chunk, self._pid, stop_tick, is_clock_only
        )

    def _chunk(
        self, buf: dict[str, array], now: int, stop_tick: int | None, open_tick: int | None,
        is_clock_only: bool, first_request: int, first_step: int,
    ) -> Flush:  # fmt: skip
        """What a flush hands over: the swapped-out rows, with the vocabularies so far
        (the request names from `first_request` on, the ones not handed over yet: none is
        None, a finished request's name goes only once handed over)."""
        names = self._book.hand_over(first_request)
        return Flush(
            buf,
            list(self._labels),
            list(self._counter_index),
            names,  # type: ignore[arg-type]
            first_request,
            dict(self.config),
            now,
            stop_tick,
            open_tick,
            is_clock_only,
            first_step,
        )

    def _earliest_open_tick(self) -> int | None:
        """The start of the earliest window still open: a segment on any thread, or a
        collection under way on another thread (None: none)."""
        out = self._gc.open_tick()
        t = self._threads.earliest_open_tick()
        if t is not None and (out is None or t < out):
            out = t
        return out

    # -- fork ------------------------------------------------------------------------
    def _hold_for_fork(self) -> None:
        """Before fork(): no lock held by another thread across it."""
        self._lock.acquire()

    def _release_after_fork(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._lock.release()

    def _in_child(self) -> None:
        """After fork(), in the child: this run is the parent's. Switch the recorder off
        (no hook records, stop() and atexit do nothing); the child may start its own."""
        # the parent's may be held by a thread not here
        self._lock = self._rows.lock = threading.RLock()
        self.enabled = False
        self._running = False
        self._stopped = True
        self._rows.dispatcher = None
        self._signals = False
        self._probes.os = None  # the parent's schedstat fds name the parent's threads
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        signals.cancel_at_exit(self.stop)


def _before_fork() -> None:
    for hold, _, _ in list(_ACTIVE.values()):  # no lock held by another thread across fork()
        hold()


def _after_fork_parent() -> None:
    for _, release, _ in list(_ACTIVE.values()):
        release()


def _after_fork_child() -> None:
    for _, _, in_child in list(_ACTIVE.values()):
        in_child()
    _ACTIVE.clear()


signals.on_fork(_before_fork, _after_fork_parent, _after_fork_child)


__all__ = ["Recorder", "active_recorders", "UNKNOWN_TICK", "NVTX_DOMAIN"]
