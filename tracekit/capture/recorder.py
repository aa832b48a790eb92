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
`array.array` (no Python object kept per event or per token). Label and request names are
interned once and resolved when the run is saved. The recorder is the producer only: at a
bounded interval it swaps its buffers and hands the completed rows to its sinks
(`tracekit.capture.sinks`) on a dispatcher thread: numbered parts on disk for `out=PATH` (so a
killed run keeps what was flushed), memory for `out=None`, and any `sinks=[...]` given (a
live Chrome trace, live metrics). `stop()` (also on exceptions, SIGTERM and interpreter
exit, see `tracekit.capture.signals`) closes them: the parts become one `.npz`.

A disabled recorder (`enabled=False`) costs next to nothing: `step`/`segment` decorators
hand back the original function, context managers are a shared no-op, and `emit`,
`evict`, ... return at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import struct
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from functools import wraps
from numbers import Integral
from typing import Any, TypeVar

import numpy as np

from tracekit.capture import signals
from tracekit.capture.checks import as_int, as_int_vector, as_tick, small_ints
from tracekit.capture.device import DeviceTimer
from tracekit.capture.osstats import ThreadStats, unavailable_reason
from tracekit.capture.sinks import (
    EMIT_CALLS,
    EMIT_HANDLES,
    Dispatcher,
    Flush,
    MemorySink,
    PartsSink,
    Sink,
    call_sink,
)
from tracekit.labels import DEFAULT_CAUSE_MAP, colour
from tracekit.log.clocks import STEADY_CLOCKS
from tracekit.log.flush import DTYPES, EVICT, READMIT, TABLES, UNKNOWN_TICK
from tracekit.log.rawlog import (
    MODES,
    OS_SEGMENT_END,
    OS_SEGMENT_START,
    OS_STEP_END,
    OS_STEP_START,
    WAIT_REASON_CODES,
    RawLog,
)
from tracekit.log.validate import MAX_ABS_TIME_S, MAX_COUNT

F = TypeVar("F", bound=Callable[..., Any])

_NULL_CM = contextlib.nullcontext()
NVTX_DOMAIN = "tracekit"
NVTX_STEP = "step"


def _nvtx_colour(label: str) -> int:
    """The label's colour (`tracekit.labels.colour`) as the opaque ARGB integer NVTX takes."""
    return 0xFF000000 | int(colour(label).lstrip("#"), 16)


#: One row of a table as bytes, for `array.frombytes` (about twice as fast as `extend`
#: with a tuple, the hot path's largest cost).
_SEG_ROW = struct.Struct("6q").pack
_STEP_ROW = struct.Struct("7q").pack
_ROW6 = struct.Struct("6q").pack
_ROW4 = struct.Struct("4q").pack
_ROW3 = struct.Struct("3q").pack
_ROW2 = struct.Struct("2q").pack
_OS_ROW = struct.Struct("8q").pack  # an os_samples row: thread, kind, tick, the five totals

#: Up to this many handles in a list, a call is checked and packed in Python: for a few
#: values that is cheaper than numpy's fixed cost per operation.
_SMALL = 8

#: The most table values a recorder keeps in its buffer while the writer is behind
#: (160 MB), before it hands them over anyway (see `tracekit.capture.sinks.Dispatcher`).
BACKLOG_VALUES = 20_000_000

#: A tick never reached: a request not yet admitted, emitted or evicted.
_NEVER = np.iinfo(np.int64).max


def _bytes_of(rows: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes, without a copy (what `array.frombytes` takes)."""
    return memoryview(rows).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _few(values: Any) -> bool:
    """A list, tuple or 1-D array of at most `_SMALL` values (iterators are not: a check
    would consume them)."""
    if type(values) is np.ndarray:
        return values.ndim == 1 and values.size <= _SMALL
    return isinstance(values, (list, tuple)) and len(values) <= _SMALL


def _check_label(label: Any, name: str) -> str:
    if not isinstance(label, str):
        raise TypeError(f"{name}: expected a str, got {type(label).__name__} {label!r:.80}")
    return label


class _Requests:
    """Per request (by index), what the checks of later calls need: its arrival tick
    (`UNKNOWN_TICK` before `request()`), the ticks of its admission and first eviction
    (`_NEVER` until then), whether `request()` was called and whether it has emitted.

    Each column is an `array.array` (a scalar read or write is a Python int, several times
    cheaper than a numpy element) with a numpy view of the same memory (`arrival_np`,
    `emitted_np`) for the checks of a whole batch in one pass. Grown by doubling."""

    __slots__ = (
        "arrival", "told", "admitted_tick", "emitted", "first_evict", "arrival_np", "emitted_np",
    )  # fmt: skip

    #: column -> (array typecode, initial value)
    COLUMNS = {
        "arrival": ("q", UNKNOWN_TICK),
        "admitted_tick": ("q", _NEVER),
        "first_evict": ("q", _NEVER),
        "told": ("b", 0),  # request() was called
        "emitted": ("b", 0),
    }

    def __init__(self, capacity: int = 1024) -> None:
        self.arrival = self.admitted_tick = self.first_evict = array("q")
        self.told = self.emitted = array("b")
        self._fill(0, capacity)

    def _fill(self, old: int, new: int) -> None:
        for name, (code, init) in self.COLUMNS.items():
            col = array(code, getattr(self, name))  # a copy: the old column keeps its views
            col.extend(array(code, [init]) * (new - old))
            setattr(self, name, col)
        self.arrival_np = np.frombuffer(self.arrival, dtype=np.int64)
        self.emitted_np = np.frombuffer(self.emitted, dtype=np.bool_)

    def grow(self, n: int) -> None:
        cap = len(self.arrival)
        if n > cap:
            self._fill(cap, max(n, 2 * cap))


#: Recorders that are running, so tests (and atexit) can check none is left behind.
_ACTIVE: set[Recorder] = set()


def active_recorders() -> frozenset[Recorder]:
    return frozenset(_ACTIVE)


class _Thread:
    """What the segment hooks keep per thread: its open segments' start ticks (a stack),
    its thread number in the log, its identity (to tell the engine loop's thread), and
    whether its segments' boundaries are OS samples (a thread other than the loop's, with
    OS evidence on)."""

    __slots__ = ("stack", "tid", "ident", "sample_os")

    def __init__(self, tid: int, ident: int) -> None:
        self.stack: list[int] = []
        self.tid = tid
        self.ident = ident
        self.sample_os = False


class _Segment:
    """A reusable context manager and decorator for one label of one recorder.

    The hot path: a clock read and a push on enter; a clock read, a pop and one row
    appended on exit (the recording cost of a segment, `bench/bench_recording.py`)."""

    __slots__ = ("_rec", "_label", "_name", "_color")

    def __init__(self, rec: Recorder, label: int, name: str) -> None:
        self._rec = rec
        self._label = label
        self._name = name
        self._color = _nvtx_colour(name)

    def __enter__(self) -> _Segment:
        rec = self._rec
        if rec._nvtx is not None:
            # never conditioned on the return value: the push always has its pop
            rec._nvtx.push_range(message=self._name, color=self._color, domain=NVTX_DOMAIN)
        try:
            th = rec._tls.th
        except AttributeError:
            th = rec._this_thread()
        t0 = rec._clock()
        th.stack.append(t0)
        if th.sample_os:  # a side thread's segment: its OS counters at both ends
            if th.ident != rec._loop_ident:
                rec._os_sample(OS_SEGMENT_START, t0)
            else:  # it became the loop thread: its steps are sampled, not its segments
                th.sample_os = False
        return self

    def __exit__(self, *exc: object) -> None:
        rec = self._rec
        try:
            t1 = rec._clock()
            try:
                th = rec._tls.th
            except AttributeError:  # entered on another thread: nothing to close here
                th = rec._this_thread()
            stack = th.stack
            t0 = stack[-1]
            # popped once its row is in: a flush sees the window open or its row
            try:
                # the segment ends here: its row names the step open on this thread (or -1)
                if rec._in_step and th.ident == rec._loop_ident:
                    # no lock: while a step is open only its own thread swaps the buffers
                    # (`_idle_flush` waits for the step's end), except a stop() from another
                    # thread, after which the row would not be in the run anyway
                    try:
                        rec._seg_rows.frombytes(
                            _SEG_ROW(rec._step_no, self._label, t0, t1, th.tid, 0)
                        )
                    except BufferError:  # handed to the sinks by that stop() meanwhile
                        pass
                else:
                    if th.sample_os and th.ident != rec._loop_ident:
                        rec._os_sample(OS_SEGMENT_END, t1)
                    with rec._lock:
                        rec._seg_rows.frombytes(_SEG_ROW(-1, self._label, t0, t1, th.tid, 0))
            finally:
                stack.pop()
        finally:
            if rec._nvtx is not None:
                rec._nvtx.pop_range(domain=NVTX_DOMAIN)

    def __call__(self, fn: F) -> F:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class _DeviceSegment(_Segment):
    """A segment of device work on a recorder with a device timer (`tracekit.capture.device`): the
    host window of the launch (is_device=0) as for any segment, plus a pair of device
    events around it whose execution window the timer resolves later and appends as a
    device segment (is_device=1) of the same label and step."""

    __slots__ = ()

    def __enter__(self) -> _DeviceSegment:
        rec = self._rec
        if rec._nvtx is not None:
            rec._nvtx.push_range(message=self._name, color=self._color, domain=NVTX_DOMAIN)
        try:
            t0 = rec._clock()
            # may raise (a sticky CUDA error fails `event.record()`): then `__exit__` never
            # runs, so the range pushed above is popped here and nothing is left on the stack
            start = rec._device.begin()  # type: ignore[union-attr]
        except BaseException:
            if rec._nvtx is not None:
                rec._nvtx.pop_range(domain=NVTX_DOMAIN)
            raise
        stack = rec._tls_stack()
        stack.append(t0)
        stack.append(start)
        return self

    def __exit__(self, *exc: object) -> None:
        rec = self._rec
        try:
            stack = rec._tls_stack()
            start = stack.pop()
            t0 = stack.pop()  # both popped before anything can raise: no stale entry
            try:
                rec._device.end(start, self._label, rec._step_here(), rec._thread_id())  # type: ignore[union-attr]
            finally:  # the host window happened whether or not the device could record
                rec._append_segment(self._label, t0, rec._clock(), 0)
        finally:
            if rec._nvtx is not None:
                rec._nvtx.pop_range(domain=NVTX_DOMAIN)


class _Step:
    """The reusable context manager for steps; see `Recorder.step`."""

    __slots__ = ("_rec",)

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec

    def __enter__(self) -> _Step:
        rec = self._rec
        rec._begin_step()
        if rec._nvtx is not None:  # pushed once the step is open: every push has its pop
            rec._nvtx.push_range(message=NVTX_STEP, color=rec._step_color, domain=NVTX_DOMAIN)
        return self

    def __exit__(self, *exc: object) -> None:
        rec = self._rec
        try:
            rec._end_step()
        finally:
            if rec._nvtx is not None:
                rec._nvtx.pop_range(domain=NVTX_DOMAIN)


class Recorder:
    """Records one run. See the module docstring for the whole API in one example.

    out: where the run's `.npz` goes (parts stream to ``OUT.parts/`` meanwhile,
        `tracekit.capture.sinks.PartsSink`; a path another recorder uses, or holding an unrecovered
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
    ) -> None:
        self.out = None if out is None else os.fspath(out)
        self.config: dict[str, Any] = dict(config or {})
        self.enabled = enabled
        self.cause_map = {**DEFAULT_CAUSE_MAP, **(cause_map or {})}
        self._use_gc = gc
        self._want_nvtx = nvtx
        self._nvtx: Any = None
        self._step_color = _nvtx_colour(NVTX_STEP)
        self._device = device_timer if enabled else None
        self._clock = clock
        if not (isinstance(seconds_per_tick, (int, float)) and 0 < seconds_per_tick < 1e6):
            raise ValueError(f"Recorder(seconds_per_tick=): {seconds_per_tick!r} is not > 0")
        self._seconds_per_tick = float(seconds_per_tick)
        self._max_ticks = int(MAX_ABS_TIME_S / self._seconds_per_tick)
        self._flush_interval_ticks = int(flush_interval_s / seconds_per_tick)
        self._flush_interval_s = flush_interval_s
        self._handle_signals = handle_signals
        self._want_os = os_evidence
        self._os: ThreadStats | None = None
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._running = False
        self._stopped = False
        self._log: RawLog | None = None
        # interned vocabularies
        self._labels: list[str] = []
        self._label_index: dict[str, int] = {}  # label -> its index in `_labels`
        self._segments: dict[tuple[str, bool], _Segment] = {}
        self._req_index: dict[Any, int] = {}  # request id -> index (its handle)
        self._req_by_name: dict[str, int] = {}  # the id's string -> index
        self._req_keys: list[Any] = []  # index -> the id as given
        self._req_names: list[str] = []
        self._req = _Requests()
        self._arrival_max = UNKNOWN_TICK  # the latest arrival tick any request has
        self._admit_max = UNKNOWN_TICK  # the latest admission tick any request has
        self._waited: set[int] = set()  # the handles given a wait reason in step `_waited_no`
        self._waited_no = -1
        self._notes: dict[str, int] = {}  # adjusted ticks, by what: warnings at stop
        self._req_flushed = 0
        self._counter_index: dict[str, int] = {}
        self._threads: dict[int, int] = {}
        self._step_cm = _Step(self)
        self._steps_flushed = 0  # step rows handed to the dispatcher
        self._new_buffers()
        # the open step
        self._step_no = -1  # index of the open (or last) step
        self._in_step = False
        self._flush_asked = False  # flush_soon(): the writer's next idle call flushes
        self._loop_ident = -1
        self._step_t0_tick = 0
        self._step_attrs: dict[str, int] = {}
        self._step_evictions = 0
        self._step_readmissions = 0
        self._step_emit_rows = 0
        self._gc_t0_tick = 0
        self._stacks: list[list[int]] = []  # every thread's segment stack
        # where the rows go: the run's own sink (parts on disk, or memory), then the others
        self._own: PartsSink | MemorySink = MemorySink()  # chosen at start, from `out`
        self._sinks: list[Sink] = list(sinks)
        self._dispatcher: Dispatcher | None = None
        self._last_flush_tick = 0
        self._num_flushes = 0  # handed to the dispatcher
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
            try:
                import nvtx  # the `gpu` extra; imported only when asked for
            except ImportError as e:
                raise ImportError(
                    "Recorder(nvtx=True) needs the nvtx package: pip install 'tracekit[gpu]'"
                ) from e
            self._nvtx = nvtx
        t0 = self._clock()
        if isinstance(t0, bool) or not isinstance(t0, Integral):
            raise TypeError(
                f"Recorder(clock=): the clock returned {type(t0).__name__} {t0!r:.80}; it must "
                "return integer ticks (seconds_per_tick converts them)"
            )
        self._t0_tick = int(t0)
        self._max_ticks = int(MAX_ABS_TIME_S / self._seconds_per_tick)
        self._last_flush_tick = self._t0_tick
        self._pid = os.getpid()
        self._thread_id()  # the starting thread is thread 0
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
        meta["os_evidence"] = self._open_os_evidence()
        if self._device is not None:
            meta["device_calibration"] = self._device.attach(
                self._clock, self._seconds_per_tick, self._t0_tick
            )
        self._meta = meta
        self._own = MemorySink() if self.out is None else PartsSink(self.out)
        self._own.open(meta)  # the run's own output: refusing a path in use raises here
        self._sinks = [s for s in self._sinks if call_sink(s, "open", meta)]
        self._dispatcher = Dispatcher(
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
        _ACTIVE.add(self)
        return self

    def _open_os_evidence(self) -> dict[str, Any]:
        """Start the OS reader if asked for (or by default where it means something)."""
        why = unavailable_reason()
        if self._want_os is False:
            why = "switched off (Recorder(os_evidence=False))"
        elif (
            why is None
            and self._want_os is None
            and getattr(self._clock, "__qualname__", None) not in STEADY_CLOCKS
        ):
            why = (
                "the recorder's clock is not wall time (OS waits would not lie on it); "
                "pass os_evidence=True to record anyway"
            )
        if why is None:
            self._os = ThreadStats.open()
        if self._os is None:
            return {"recorded": False, "reason": why or "unavailable"}
        return {
            "recorded": True,
            "at": "step boundaries (loop thread); segment boundaries (other threads)",
            **self._os.describe(),
        }

    def _os_sample(self, kind: int, t: int) -> None:
        """One `os_samples` row for the calling thread, at tick `t`: the loop thread's at
        its open step's start and end, another thread's at its segments' (`_Segment`).
        Switches and faults are read at ends only (the partition reads CPU time and
        run-queue wait; bench/bench_os.py measures what that saves)."""
        reader = self._os
        if reader is None:  # stop() closed it meanwhile, from another thread
            return
        ends = kind == OS_STEP_END or kind == OS_SEGMENT_END
        row = _OS_ROW(self._thread_id(), kind, t, *reader.read(ends))
        if kind <= OS_STEP_END:
            # the loop thread inside its open step: no lock, as for its segment rows (only
            # this thread swaps the buffers now, but a stop() from another thread)
            try:
                self._buf["os_samples"].frombytes(row)
            except BufferError:  # handed to the sinks by that stop() meanwhile
                pass
        else:
            with self._lock:
                self._buf["os_samples"].frombytes(row)

    def add_sink(self, sink: Sink) -> None:
        """Send every flushed chunk to `sink` too (before `start()`)."""
        if self._running or self._stopped:
            raise RuntimeError("add sinks before start(): a sink sees the whole run")
        self._sinks.append(sink)

    def stop(self) -> RawLog | None:
        """Stop the run: remove every hook, flush, close the sinks (write the `.npz`).

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
        _ACTIVE.discard(self)
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
            if self._os is not None:
                self._os.close()
                self._os = None
        warnings = self._close_open_step(stop_tick) + warnings
        try:
            self._flush(stop_tick=stop_tick)
        finally:
            self._stopped = True
            if self._dispatcher is not None:
                self._dispatcher.close()
        final: dict[str, Any] = {"config": self.config, **device_meta}
        if self._extras:
            final["extras"] = dict(self._extras)
        if warnings:
            final["warnings"] = warnings
        attached = self._dispatcher.sinks if self._dispatcher is not None else []
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
        out += [f"{n} {what}" for what, n in self._notes.items()]
        threads = sum(1 for st in self._stacks if st)
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
        """The recorded run (after `stop`)."""
        if self._log is None:
            raise RuntimeError("the run has not stopped yet: call stop() first")
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
        return self._step_no

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
        # one `if` a keyword, names spelled out: a call per step, no string built per call
        given = {}
        if num_decode is not None:
            given["num_decode"] = as_int(num_decode, "step_info(num_decode=)")
        if num_prefill_tokens is not None:
            given["num_prefill_tokens"] = as_int(
                num_prefill_tokens, "step_info(num_prefill_tokens=)"
            )
        if graph_size is not None:
            given["graph_size"] = as_int(graph_size, "step_info(graph_size=)", -1)
        if num_preempted is not None:
            given["num_preempted"] = as_int(num_preempted, "step_info(num_preempted=)")
        if num_swapped_in is not None:
            given["num_swapped_in"] = as_int(num_swapped_in, "step_info(num_swapped_in=)")
        self._step_attrs.update(given)

    def _begin_step(self) -> None:
        """Where a step begins: its start tick, then (under the lock, last) its number.

        The order makes every instant safe to stop at (a signal, an exception): until
        `_step_no` moves on, nothing names the new step; from then on `stop()` finds it
        open (no row yet, `_open_step_no`) and closes it at the stop time."""
        if self._in_step:
            raise RuntimeError("steps do not nest: the previous step is still open")
        t0 = self._clock()
        with self._lock:  # an idle flush on another thread must see the step open
            self._step_t0_tick = t0
            self._step_attrs = {}
            self._step_evictions = self._step_readmissions = self._step_emit_rows = 0
            self._loop_ident = threading.get_ident()
            self._step_no += 1
            self._in_step = True
        if self._os is not None:
            self._os_sample(OS_STEP_START, t0)

    def _step_row(self, t1: int) -> bytes:
        a = self._step_attrs
        n_dec = a.get("num_decode", self._step_emit_rows)
        graph = a.get("graph_size", n_dec if n_dec > 0 else -1)
        return _STEP_ROW(
            self._step_t0_tick,
            max(t1, self._step_t0_tick),
            n_dec,
            a.get("num_prefill_tokens", 0),
            graph,
            a.get("num_preempted", self._step_evictions),
            a.get("num_swapped_in", self._step_readmissions),
        )

    def _end_step(self) -> None:
        """Where a step ends: its row, then the device poll and the flush."""
        t1 = self._clock()
        if self._os is not None:
            self._os_sample(OS_STEP_END, t1)
        row = self._step_row(t1)
        with self._lock:  # with the row: an idle flush never sees the step half-ended
            self._buf["steps"].frombytes(row)
            self._in_step = False
        dev = self._device
        if dev is not None and dev._pending:  # lazily: only what has finished, no sync
            dev.poll(self._append_device_window)
        if self._flush_asked or (  # flush_soon(): now, writer behind or not
            t1 - self._last_flush_tick >= self._flush_interval_ticks and not self._backlogged(t1)
        ):
            self._flush()

    def _backlogged(self, now: int) -> bool:
        """Keep the rows in this buffer (the backlog) for a later flush: the writer is
        behind (a flush already waits for it, `Dispatcher.waiting`), the backlog is under
        two intervals old and within `BACKLOG_VALUES`; past either, the flush is handed
        over and waits for the writer (`tracekit.capture.sinks.Dispatcher`)."""
        d = self._dispatcher
        if d is None or not d.waiting():
            return False
        if (
            now - self._last_flush_tick < 2 * self._flush_interval_ticks
            and sum(len(b) for b in self._buf.values()) < BACKLOG_VALUES
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

    def _open_step_no(self) -> int | None:
        """The step begun but without a row (the engine was stopped inside it), if any:
        what the rows say, whatever instant a signal or an exception stopped at."""
        with self._lock:
            recorded = self._steps_flushed + len(self._buf["steps"]) // len(TABLES["steps"])
            return self._step_no if self._step_no >= recorded else None

    def _close_open_step(self, stop_tick: int) -> list[str]:
        """At stop: close a step still open at the stop time, so that the segments,
        emissions, prefill chunks and waits that name it stay valid."""
        n = self._open_step_no()
        if n is None:
            return []
        with self._lock:
            self._buf["steps"].frombytes(self._step_row(stop_tick))
            self._in_step = False
        return [f"step {n} was still open at stop(): it is closed at the stop time"]

    # -- segments --------------------------------------------------------------------
    def segment(self, label: str, *, device: bool = False) -> Any:
        """A labelled window: `with rec.segment("prefill"):` or `@rec.segment("tok")`.

        Works from any thread; a window outside a step is recorded with step -1.
        `device=True`: the body launches device work; with a device timer its execution
        window is recorded too (is_device=1, see `tracekit.capture.device`), without one only the
        host window is."""
        if not self.enabled:
            return _NullSegment
        key = (label, device)
        seg = self._segments.get(key)
        if seg is None:
            label = _check_label(label, "segment(label)")
            with self._lock:
                seg = self._segments.get(key)
                if seg is None:
                    if device and self._device is not None:
                        seg = _DeviceSegment(self, self._label_id(label), label)
                    else:  # nothing measures the device: the host window is what we have
                        seg = _Segment(self, self._label_id(label), label)
                    self._segments[key] = seg
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
            label = _check_label(label, "add_segment(label)")
            t0 = self._check_tick(t0, "add_segment(t0)")
            t1 = self._check_tick(t1, "add_segment(t1)")
            if t1 < t0:
                raise ValueError(
                    f"add_segment({label!r:.80}): ends (t1={t1}) before it starts ({t0})"
                )
        self._append_segment(self._label_id(label), t0, t1, 1 if device else 0)

    def _label_id(self, label: str) -> int:
        idx = self._label_index.get(label)
        if idx is not None:
            return idx
        with self._lock:
            idx = self._label_index.get(label)
            if idx is None:
                self._labels.append(label)
                idx = self._label_index[label] = len(self._labels) - 1
            return idx

    def _this_thread(self) -> _Thread:
        """This thread's segment state, made on its first segment."""
        try:
            return self._tls.th  # type: ignore[no-any-return]
        except AttributeError:
            th = _Thread(self._thread_id(), threading.get_ident())
            # a side thread's segments are OS samples (the loop thread's steps are)
            th.sample_os = self._os is not None and th.ident != self._loop_ident
            with self._lock:
                self._stacks.append(th.stack)
            self._tls.th = th
            return th

    def _tls_stack(self) -> list[int]:
        return self._this_thread().stack

    def _thread_id(self) -> int:
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            with self._lock:
                tid = self._threads.setdefault(ident, len(self._threads))
        return tid

    def _append_segment(self, label: int, t0: int, t1: int, is_device: int) -> None:
        row = _SEG_ROW(self._step_here(), label, t0, t1, self._thread_id(), is_device)
        with self._lock:
            self._seg_rows.frombytes(row)

    def _step_here(self) -> int:
        """The step a window opened on this thread now belongs to (-1: outside any step)."""
        return self._step_no if self._in_step and self._is_loop_thread() else -1

    def _append_device_window(self, step: int, label: int, t0: int, t1: int, thread: int) -> None:
        """A device execution window resolved by the device timer, after its step ended."""
        with self._lock:
            self._seg_rows.frombytes(_SEG_ROW(step, label, t0, t1, thread, 1))

    def _is_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_ident

    def _check_tick(self, value: Any, name: str) -> int:
        """A tick of this recorder's clock, within what a log accepts of engine time."""
        t = as_tick(value, name)
        if self._running and abs(t - self._t0_tick) > self._max_ticks:
            raise ValueError(
                f"{name}: tick {t} is {abs(t - self._t0_tick) * self._seconds_per_tick:.3g} s "
                f"from the run's start (more than {MAX_ABS_TIME_S:g} s: not this clock's tick)"
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
                self._note("request arrival tick(s) after the request() call, taken as the call's")
                t = now
        with self._lock:  # one acquisition: interned and told together
            idx = self._req_index.get(request_id)
            if idx is None:
                idx = self._intern_new(request_id, "request")
            r = self._req
            if r.told[idx]:
                self._note("request() call(s) for a request that had arrived: the first is kept")
                return idx
            r.told[idx] = True
            if r.emitted[idx]:  # a first token cannot precede its arrival: not known
                self._note(
                    "request arrival(s) told after the request's first emission: kept "
                    "unknown (NaN), a first token cannot come before its arrival"
                )
                t = UNKNOWN_TICK
            if t > r.admitted_tick[idx]:  # told late: it had arrived by its admission
                self._note("request arrival(s) after the request's admission, taken as it")
                t = r.admitted_tick[idx]
            if t != UNKNOWN_TICK:
                r.arrival[idx] = t
                if t > self._arrival_max:
                    self._arrival_max = t
            self._buf["requests"].frombytes(_ROW4(idx, t, prompt, max_new))
        if arrival_tick is None:
            self._flush_if_idle(t)
        return idx

    def handle(self, request_id: Any) -> int:
        """The handle of `request_id` (interned now if this recorder has not seen it),
        without recording an arrival; -1 when the recorder is disabled."""
        if not self.enabled:
            return -1
        idx = self._req_index.get(request_id)
        return self._intern(request_id, "handle") if idx is None else idx

    def _intern(self, request_id: Any, what: str) -> int:
        """The request's index; a new one gets the next index and its name. Two ids with
        one name (``1`` and ``"1"``) are refused: the log names requests by string."""
        idx = self._req_index.get(request_id)
        if idx is not None:
            return idx
        with self._lock:
            idx = self._req_index.get(request_id)
            return self._intern_new(request_id, what) if idx is None else idx

    def _intern_new(self, request_id: Any, what: str) -> int:
        """Intern a request id not seen yet (under the lock)."""
        name = str(request_id)
        other = self._req_by_name.get(name)
        if other is not None:
            raise ValueError(
                f"{what}: request id {request_id!r:.80} ({type(request_id).__name__}) "
                f"has the same name as the id of request {other} "
                f"({type(self._req_keys[other]).__name__}): the log names requests by "
                "string, so give every request an id of one type"
            )
        idx = len(self._req_names)
        if idx >= len(self._req.arrival):
            self._req.grow(idx + 1)
        self._req_index[request_id] = idx
        self._req_by_name[name] = idx
        self._req_keys.append(request_id)
        self._req_names.append(name)
        return idx

    def _intern_all(self, request_ids: Iterable[Any], what: str) -> np.ndarray:
        """The handles of `request_ids`, interning new ones in order (one dict lookup per
        id, no object per id kept)."""
        ids = request_ids if isinstance(request_ids, (list, tuple)) else list(request_ids)
        get = self._req_index.get
        found = [get(rid) for rid in ids]
        if None in found:
            with self._lock:  # all of them or none: a refused id interns none before it
                n = len(self._req_names)
                try:
                    found = [
                        self._intern(rid, what) if i is None else i
                        for rid, i in zip(ids, found, strict=True)
                    ]
                except BaseException:
                    self._forget_since(n)
                    raise
        return np.array(found, dtype=np.int64)

    def _forget_since(self, n: int) -> None:
        """Undo the interning of requests n.. (a call refused after interning them;
        under the lock, before any row names them)."""
        for key in self._req_keys[n:]:
            self._req_index.pop(key, None)
        for name in self._req_names[n:]:
            self._req_by_name.pop(name, None)
        del self._req_keys[n:], self._req_names[n:]

    def _check_handles(self, handles: Any, name: str) -> np.ndarray:
        """Handles as one int64 vector, every one a request of this recorder."""
        return as_int_vector(handles, name, 0, len(self._req_names) - 1)

    def _check_handle(self, handle: Any, name: str) -> int:
        return as_int(handle, name, 0, len(self._req_names) - 1)

    def _flush_if_idle(self, now: int) -> None:
        """Keep the flush interval while no step runs (an idle engine still takes
        arrivals): flush only between steps, so a part never splits an open step."""
        if self._in_step or now - self._last_flush_tick < self._flush_interval_ticks:
            return
        with self._lock:
            if not self._in_step and self._running:
                self._flush(poll_device=False)

    def flush_soon(self) -> None:
        """Hand every completed row to the sinks as soon as a part may be cut: at the end
        of the open step, or, between steps, at once from the writer thread (a flush even
        with no new row, so the log says it was complete at that time). For a process that
        may be killed next (a SIGTERM handler: it swaps no buffer itself, so it is safe
        wherever the signal lands)."""
        if not self._running:
            return
        self._flush_asked = True  # cleared by the flush that takes the rows so far
        d = self._dispatcher
        if d is not None and not signals.IN_FLUSH[0]:  # else a flush is being handed over
            d.wake()

    def _idle_flush(self) -> None:
        """From the dispatcher, when no flush came for a whole interval: flush what was
        recorded since (arrivals, emissions outside steps, rows from just before the engine
        went idle), unless a step is open (a part never splits a step)."""
        with self._lock:
            if self._in_step or not self._running or self._pid != os.getpid():
                return
            if (
                self._flush_asked
                or any(len(b) for b in self._buf.values())
                or self._req_flushed < len(self._req_names)
            ):
                self._flush(poll_device=False)
            elif self._dispatcher is not None and self._dispatcher.follows_idle_clock():
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
        self._emit_rows(self._intern_all(ids, "emit"), counts, t, dstep)

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
        t, dstep = self._emit_when(at_tick, reads_step)
        if _few(handles) and (
            num_tokens is None or _few(num_tokens)
        ):  # a few ints: checked and copied in Python (numpy's fixed costs are more)
            hs = small_ints(handles, 0, len(self._req_names) - 1)
            ks = None if num_tokens is None else small_ints(num_tokens, 1)
            if hs is not None and (num_tokens is None or (ks is not None and len(ks) == len(hs))):
                self._emit_few(hs, ks, t, dstep)
                return
        h = self._check_handles(handles, "emit_handles(handles)")
        counts = self._emit_counts(num_tokens)
        if counts is not None and len(counts) != len(h):
            raise ValueError(f"emit_handles: {len(h)} handles but {len(counts)} num_tokens")
        self._emit_rows(h, counts, t, dstep)

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
        if not (  # the common case, checked at once
            type(handle) is int
            and type(t_ready) is int
            and type(t_sent) is int
            and type(num_tokens) is int
            and 0 <= handle < len(self._req_names)
            and 1 <= num_tokens <= MAX_COUNT
            and t_ready <= t_sent
            and self._running
            and t_sent - t0 <= self._max_ticks
            and t0 - t_ready <= self._max_ticks
            and type(label) is str
        ):
            label = _check_label(label, "emit_chunk(label)")
            handle = as_int(handle, "emit_chunk(handle)", 0, len(self._req_names) - 1)
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
        seg = _SEG_ROW(self._step_here(), label_id, t_ready, t_sent, self._thread_id(), 0)
        step = self._step_no if self._in_step else -1
        ks = None if num_tokens == 1 else [num_tokens]
        self._emit_few([handle], ks, t_sent, step, segment_row=seg)

    def _emit_when(self, at_tick: Any, reads_step: Any) -> tuple[int, int]:
        t = self._clock() if at_tick is None else self._check_tick(at_tick, "emit(at_tick=)")
        step = self._step_no if self._in_step else -1
        if reads_step is None:
            return t, step
        # the step read must exist by the time the log is written: this one or an earlier one
        return t, as_int(reads_step, "emit(reads_step=)", -1, self._step_no)

    @staticmethod
    def _emit_counts(num_tokens: Any) -> np.ndarray | None:
        if num_tokens is None:
            return None
        return as_int_vector(num_tokens, "emit(num_tokens)", 1)

    def _emit_few(
        self, hs: list[int], ks: list[int] | None, t: int, dstep: int,
        segment_row: bytes | None = None,
    ) -> None:  # fmt: skip
        """`_emit_rows` for a few checked handles (and counts) given as Python ints: the
        same rows, without numpy; `segment_row`, a window's row appended under the same
        lock (`emit_chunk`)."""
        n = len(hs)
        if not n:
            return
        step = self._step_no if self._in_step else -1
        r = self._req
        with self._lock:
            if segment_row is not None:
                self._seg_rows.frombytes(segment_row)
            if self._arrival_max > t:  # some request arrived after `t`: one of these?
                arrival = r.arrival
                latest = max(arrival[x] for x in hs)
                if latest > t:
                    self._note("emission tick(s) before the request's arrival, taken as it")
                    t = latest
            if self._admit_max > t:  # some request was admitted after `t`: one of these?
                admitted = r.admitted_tick
                latest = max((a for a in (admitted[x] for x in hs) if a != _NEVER), default=t)
                if latest > t:
                    self._note("emission tick(s) before the request's admission, taken as it")
                    t = latest
            emitted = r.emitted
            for x in hs:
                emitted[x] = 1
            hb = self._buf[EMIT_HANDLES]
            at = len(hb)
            hb.extend(hs)
            if ks is not None:
                hb.extend(ks)
            # last: the call's row commits it (handles without one are never read)
            self._buf[EMIT_CALLS].frombytes(_ROW6(t, step, dstep, n, ks is not None, at))
            self._step_emit_rows += n

    def _emit_rows(self, h: np.ndarray, counts: np.ndarray | None, t: int, dstep: int) -> None:
        """One emission call: a header row and the handles (and counts), two copies; the
        dispatcher expands them into one emissions row per request
        (`tracekit.capture.sinks.expand_emissions`)."""
        n = len(h)
        if not n:
            return
        step = self._step_no if self._in_step else -1
        r = self._req
        with self._lock:
            # no first token before its arrival: a tick from the caller, or one read before
            # another thread's request() took the lock, may be a little early
            if self._arrival_max > t:  # some request arrived after `t`: one of these?
                latest = int(r.arrival_np[h].max())
                if latest > t:
                    self._note("emission tick(s) before the request's arrival, taken as it")
                    t = latest
            if self._admit_max > t:  # some request was admitted after `t`: one of these?
                adm = np.frombuffer(r.admitted_tick, dtype=np.int64)[h]
                adm = adm[adm != _NEVER]
                if len(adm) and int(adm.max()) > t:
                    self._note("emission tick(s) before the request's admission, taken as it")
                    t = int(adm.max())
            r.emitted_np[h] = True
            hb = self._buf[EMIT_HANDLES]
            at = len(hb)
            hb.frombytes(_bytes_of(h))
            if counts is not None:
                hb.frombytes(_bytes_of(counts))
            # last: the call's row commits it (handles without one are never read)
            self._buf[EMIT_CALLS].frombytes(_ROW6(t, step, dstep, n, counts is not None, at))
            self._step_emit_rows += n

    def evict(self, request_id: Any, *, mode: str = "swap") -> None:
        """The scheduler evicted `request_id` now (`swap` or `recompute`)."""
        if not self.enabled:
            return
        code = MODES.get(mode) if isinstance(mode, str) else None
        if code is None:
            raise ValueError(f"evict(mode=): {mode!r:.80} is not one of {list(MODES)}")
        idx = self._intern(request_id, "evict")
        t = self._clock()
        with self._lock:
            r = self._req
            r.first_evict[idx] = min(r.first_evict[idx], t)
            self._buf["events"].frombytes(_ROW4(idx, EVICT, t, code))
            self._step_evictions += 1

    def readmit(self, request_id: Any) -> None:
        """The scheduler readmitted an evicted `request_id` now."""
        if not self.enabled:
            return
        idx = self._intern(request_id, "readmit")
        t = self._clock()
        with self._lock:
            self._buf["events"].frombytes(_ROW4(idx, READMIT, t, -1))
            self._step_readmissions += 1

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
        self._admit(self._intern(request_id, "admit"), t)

    def admit_handle(self, handle: int, *, at_tick: int | None = None) -> None:
        """`admit` on a request handle."""
        if not self.enabled:
            return
        t = self._clock() if at_tick is None else self._check_tick(at_tick, "admit(at_tick=)")
        if type(handle) is not int or not 0 <= handle < len(self._req_names):
            handle = self._check_handle(handle, "admit_handle(handle)")  # converts, or raises
        self._admit(handle, t)

    def _admit(self, idx: int, t: int) -> None:
        with self._lock:
            r = self._req
            if r.admitted_tick[idx] != _NEVER:
                return  # admitted before: the log keeps the first admission (docs/ttft.md)
            arrival = r.arrival[idx]
            evicted = r.first_evict[idx]
            if arrival != UNKNOWN_TICK and t < arrival:  # another clock's reading, early
                self._note("admission tick(s) before the request's arrival, taken as it")
                t = arrival
            why = (
                "after its first emission"
                if r.emitted[idx]
                else f"after its first eviction (tick {evicted})"
                if t > evicted
                else None
            )
            if why is not None:
                raise ValueError(
                    f"admit: request {self._req_names[idx]!r:.80} admitted at tick {t}, {why}: "
                    "admit a request when the scheduler first takes it"
                )
            r.admitted_tick[idx] = t
            if t > self._admit_max:
                self._admit_max = t
            self._buf["admissions"].frombytes(_ROW2(idx, t))

    def prefill(self, request_id: Any, num_tokens: int) -> None:
        """The open step computes `num_tokens` of `request_id`'s prompt in its `prefill`
        segments (one call per request and step; the TTFT partition splits the step's
        prefill time by these token counts)."""
        if not self.enabled:
            return
        n = as_int(num_tokens, "prefill(num_tokens)")
        step = self._open_step("prefill")
        idx = self._intern(request_id, "prefill")
        with self._lock:
            self._buf["prefill_chunks"].frombytes(_ROW3(step, idx, n))

    def prefill_handles(self, handles: Any, num_tokens: Any) -> None:
        """`prefill` for several requests in one call: `num_tokens[i]` of the prompt of
        request handle `handles[i]`."""
        if not self.enabled:
            return
        step = self._open_step("prefill")
        last = len(self._req_names) - 1
        if isinstance(handles, (list, tuple)) and len(handles) <= _SMALL:  # numpy costs more
            if not isinstance(num_tokens, (list, tuple, np.ndarray)):
                num_tokens = list(num_tokens)
            if len(num_tokens) != len(handles):
                raise ValueError(
                    f"prefill_handles: {len(handles)} handles but {len(num_tokens)} num_tokens"
                )
            hs, ks = small_ints(handles, 0, last), small_ints(num_tokens)
            if hs is not None and ks is not None:  # plain ints in range: one pack
                flat = [step, 0, 0] * len(hs)
                flat[1::3] = hs
                flat[2::3] = ks
                rows = struct.pack(f"{len(flat)}q", *flat)
            else:  # one value at a time: the first wrong one raises, naming itself
                rows = b"".join(
                    _ROW3(
                        step,
                        as_int(x, "prefill_handles(handles)", 0, last),
                        as_int(k, "prefill_handles(num_tokens)"),
                    )
                    for x, k in zip(handles, num_tokens, strict=True)
                )
        else:
            h = self._check_handles(handles, "prefill_handles(handles)")
            n = as_int_vector(num_tokens, "prefill_handles(num_tokens)")
            if len(n) != len(h):
                raise ValueError(f"prefill_handles: {len(h)} handles but {len(n)} num_tokens")
            a = np.empty((len(h), 3), dtype=np.int64)
            a[:, 0] = step
            a[:, 1] = h
            a[:, 2] = n
            rows = _bytes_of(a)  # type: ignore[assignment]
        with self._lock:
            self._buf["prefill_chunks"].frombytes(rows)

    def wait(self, request_ids: Iterable[Any], reason: str) -> None:
        """The open step's scheduler left `request_ids` waiting because of `reason`, one
        of `tracekit.log.rawlog.WAIT_REASONS` (`kv_blocks`, `max_num_seqs`, `token_budget`,
        `preempted_first`, `other`). One reason per request and step."""
        if not self.enabled:
            return
        code = self._wait_code(reason)
        step = self._open_step("wait")
        with self._lock:
            n = len(self._req_names)
            try:
                self._wait_rows(self._intern_all(request_ids, "wait"), code, step)
            except BaseException:
                self._forget_since(n)
                raise

    def wait_handles(self, handles: Any, reason: str) -> None:
        """`wait` on request handles."""
        if not self.enabled:
            return
        code = self._wait_code(reason)
        step = self._open_step("wait")
        self._wait_rows(self._check_handles(handles, "wait_handles(handles)"), code, step)

    @staticmethod
    def _wait_code(reason: Any) -> int:
        code = WAIT_REASON_CODES.get(reason) if isinstance(reason, str) else None
        if code is None:
            raise ValueError(f"wait reason {reason!r:.80} is not one of {list(WAIT_REASON_CODES)}")
        return code

    def _wait_rows(self, h: np.ndarray, code: int, step: int) -> None:
        n = len(h)
        if not n:
            return
        rows = np.empty((n, 3), dtype=np.int64)
        rows[:, 0] = step
        rows[:, 1] = h
        rows[:, 2] = code
        hl = h.tolist()  # a set of a few hundred ints checks faster than numpy's fancy indexing
        with self._lock:
            waited = self._waited
            if self._waited_no != step:  # the first wait call of this step
                waited.clear()
                self._waited_no = step
            if len(set(hl)) != n or not waited.isdisjoint(hl):
                # the first place whose request was given a reason before, or is again later
                i = next(x for k, x in enumerate(hl) if x in waited or x in hl[k + 1 :])
                raise ValueError(
                    f"wait: request {self._req_names[i]!r:.80} has two wait reasons in step "
                    f"{step} (state one reason per request and step)"
                )
            waited.update(hl)
            self._buf["waits"].frombytes(_bytes_of(rows))

    def _open_step(self, what: str) -> int:
        if not (self._in_step and self._is_loop_thread()):
            raise RuntimeError(f"rec.{what}() describes a step: call it inside rec.step()")
        return self._step_no

    def counter(self, name: str, value: float, *, at_tick: int | None = None) -> None:
        """Sample an engine counter (batch size, free KV blocks...) now (or at `at_tick` of
        this recorder's clock, for a stamp taken before the recorder could be reached)."""
        if not self.enabled:
            return
        name = _check_label(name, "counter(name)")
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"counter({name!r:.80}): value {value!r:.80} is not a number") from None
        t = self._clock() if at_tick is None else self._check_tick(at_tick, "counter(at_tick=)")
        idx = self._counter_index.get(name)
        with self._lock:
            if idx is None:
                idx = self._counter_index.setdefault(name, len(self._counter_index))
            self._buf["counters"].extend((float(idx), float(t), v))

    def _note(self, what: str) -> None:
        """Count a call whose tick was adjusted to keep the log valid (a warning at stop)."""
        self._notes[what] = self._notes.get(what, 0) + 1

    def now(self) -> int:
        """The recorder's clock, in ticks (for `add_segment` and `arrival_tick`)."""
        return self._clock()

    # -- gc --------------------------------------------------------------------------
    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            signals.IN_GC[0] = True  # first, before any call: see tracekit.capture.signals
            self._gc_t0_tick = self._clock()
        else:
            try:
                t1 = self._clock()
                with self._lock:
                    self._buf["gc_pauses"].extend(
                        (self._gc_t0_tick, t1, info.get("generation", -1))
                    )
            finally:
                signals.IN_GC[0] = False

    # -- buffers ---------------------------------------------------------------------
    def _new_buffers(self) -> None:
        self._buf: dict[str, array] = {
            k: array("d" if DTYPES[k] is np.float64 else "q") for k in TABLES
        }
        self._buf[EMIT_CALLS] = array("q")  # emissions, compact (`sinks.expand_emissions`)
        self._buf[EMIT_HANDLES] = array("q")
        self._seg_rows = self._buf["segments"]  # the segment hooks' table, one lookup less

    def _flush(
        self, *, stop_tick: int | None = None, poll_device: bool = True, is_clock_only: bool = False
    ) -> None:
        """Hand the completed rows to the sinks' dispatcher (a swap of buffers; no disk
        I/O and no chunk building here). `is_clock_only`: an idle flush with no rows, for
        the sinks that follow the clock (`tracekit.capture.sinks.Dispatcher`)."""
        dev = self._device
        if poll_device and dev is not None and dev._pending and stop_tick is None:
            dev.poll(self._append_device_window)
        signals.IN_FLUSH[0] += 1  # from the swap until the hand-over: see tracekit.capture.signals
        try:
            with self._lock:  # hand-overs in swap order: chunks name request ids in order
                # the flush's tick and what is open then, before the swap: a row that lands
                # in the next buffer (a collection triggered by the swap itself) starts
                # after `now`, or is announced open
                now = self._clock()
                open_tick = self._earliest_open_tick()
                buf = self._buf
                self._new_buffers()
                self._flush_asked = False  # the rows so far are in this flush
                self._steps_flushed += len(buf["steps"]) // len(TABLES["steps"])
                now = self._clock()
                self._last_flush_tick = now
                if self._pid != os.getpid():  # a forked child: the run is the parent's
                    return
                start = self._req_flushed
                self._req_flushed = len(self._req_names)
                flush = Flush(
                    buf,
                    list(self._labels),
                    list(self._counter_index),
                    self._req_names[start:],
                    start,
                    dict(self.config),
                    now,
                    stop_tick,
                    open_tick,
                    is_clock_only,
                )
                if self._dispatcher is not None:
                    self._dispatcher.submit(flush)
                    self._num_flushes += 1
        finally:
            signals.IN_FLUSH[0] -= 1

    def _earliest_open_tick(self) -> int | None:
        """The start of the earliest window still open: a segment on any thread, or a
        collection under way on another thread (None: none)."""
        out = self._gc_t0_tick if signals.IN_GC[0] else None
        for st in self._stacks:  # other threads' stacks, read without their help:
            try:  # a window closing meanwhile pops its entry (then it is in this flush)
                t = st[0] if st else None
            except IndexError:
                t = None
            if t is not None and (out is None or t < out):
                out = t
        return out

    # -- fork ------------------------------------------------------------------------
    def _in_child(self) -> None:
        """After fork(), in the child: this run is the parent's. Switch the recorder off
        (no hook records, stop() and atexit do nothing); the child may start its own."""
        self._lock = threading.RLock()  # the parent's may be held by a thread not here
        self.enabled = False
        self._running = False
        self._stopped = True
        self._dispatcher = None
        self._signals = False
        self._os = None  # the parent's schedstat fds name the parent's threads
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        signals.cancel_at_exit(self.stop)


class _NullSegmentType:
    """What a disabled recorder's `segment()` returns: a no-op context manager and decorator."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, fn: F) -> F:
        return fn


_NullSegment = _NullSegmentType()


#: The collection and flush flags (`tracekit.capture.signals`), under their old names.
_IN_GC = signals.IN_GC
_IN_FLUSH = signals.IN_FLUSH


def _before_fork() -> None:
    for rec in list(_ACTIVE):  # no lock held by another thread across fork()
        rec._lock.acquire()


def _after_fork_parent() -> None:
    for rec in list(_ACTIVE):
        with contextlib.suppress(RuntimeError):
            rec._lock.release()


def _after_fork_child() -> None:
    for rec in list(_ACTIVE):
        rec._in_child()
    _ACTIVE.clear()


signals.on_fork(_before_fork, _after_fork_parent, _after_fork_child)


__all__ = ["Recorder", "active_recorders", "UNKNOWN_TICK"]

signals.defer_in(Recorder._on_gc.__code__)
