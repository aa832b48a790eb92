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
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from functools import wraps
from typing import Any, TypeVar

import numpy as np

from tracekit.capture import signals
from tracekit.capture.device import DeviceTimer
from tracekit.capture.osstats import ThreadStats, unavailable_reason
from tracekit.capture.sinks import Dispatcher, Flush, MemorySink, PartsSink, Sink, call_sink
from tracekit.labels import DEFAULT_CAUSE_MAP, colour
from tracekit.log.flush import DTYPES, EVICT, READMIT, TABLES, UNKNOWN_TICK
from tracekit.log.rawlog import MODES, OS_STEP_END, OS_STEP_START, WAIT_REASON_CODES, RawLog

F = TypeVar("F", bound=Callable[..., Any])

#: Clocks that count wall time: OS waits lie on them (`os_evidence` defaults on with them).
WALL_CLOCKS = (time.perf_counter_ns, time.monotonic_ns)

_NULL_CM = contextlib.nullcontext()
NVTX_DOMAIN = "tracekit"
NVTX_STEP = "step"


def _nvtx_colour(label: str) -> int:
    """The label's colour (`tracekit.labels.colour`) as the opaque ARGB integer NVTX takes."""
    return 0xFF000000 | int(colour(label).lstrip("#"), 16)


#: Recorders that are running, so tests (and atexit) can check none is left behind.
_ACTIVE: set[Recorder] = set()


def active_recorders() -> frozenset[Recorder]:
    return frozenset(_ACTIVE)


class _Segment:
    """A reusable context manager and decorator for one label of one recorder."""

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
        rec._tls_stack().append(rec._clock())
        return self

    def __exit__(self, *exc: object) -> None:
        rec = self._rec
        try:
            t1 = rec._clock()
            stack = rec._tls_stack()
            try:  # popped once its row is in: a flush sees the window open or its row
                rec._append_segment(self._label, stack[-1], t1, 0)
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
        major faults at every step's start and end (`tracekit.capture.osstats`; about
        1.5 µs a sample on Linux, see bench/bench_os.py), so the partition can name time the
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
        self._seconds_per_tick = seconds_per_tick
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
        self._segments: dict[tuple[str, bool], _Segment] = {}
        self._req_index: dict[Any, int] = {}
        self._req_names: list[str] = []
        self._req_flushed = 0
        self._counter_index: dict[str, int] = {}
        self._threads: dict[int, int] = {}
        self._step_cm = _Step(self)
        self._new_buffers()
        # the open step
        self._step_no = -1  # index of the open (or last) step
        self._in_step = False
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
        self._t0_tick = self._clock()
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
        elif why is None and self._want_os is None and self._clock not in WALL_CLOCKS:
            why = (
                "the recorder's clock is not wall time (OS waits would not lie on it); "
                "pass os_evidence=True to record anyway"
            )
        if why is None:
            self._os = ThreadStats.open()
        if self._os is None:
            return {"recorded": False, "reason": why or "unavailable"}
        return {"recorded": True, "at": "step boundaries, loop thread", **self._os.describe()}

    def _os_sample(self, kind: int, t: int) -> None:
        """One `os_samples` row for the calling thread, at tick `t`."""
        reader = self._os
        if reader is None:  # stop() closed it meanwhile, from another thread
            return
        row = (self._thread_id(), kind, t, *reader.read())
        with self._lock:
            self._buf["os_samples"].extend(row)

    def add_sink(self, sink: Sink) -> None:
        """Send every flushed chunk to `sink` too (before `start()`)."""
        if self._running or self._stopped:
            raise RuntimeError("add sinks before start(): a sink sees the whole run")
        self._sinks.append(sink)

    def stop(self) -> RawLog | None:
        """Stop the run: remove every hook, flush, close the sinks (write the `.npz`)."""
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
        if self._in_step:
            out.append(f"step {self._step_no} was still open at stop(): it is not in the log")
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
        swap-ins = the `evict`/`readmit` calls made during the step."""
        if not self.enabled:
            return
        a = self._step_attrs
        if num_decode is not None:
            a["num_decode"] = num_decode
        if num_prefill_tokens is not None:
            a["num_prefill_tokens"] = num_prefill_tokens
        if graph_size is not None:
            a["graph_size"] = graph_size
        if num_preempted is not None:
            a["num_preempted"] = num_preempted
        if num_swapped_in is not None:
            a["num_swapped_in"] = num_swapped_in

    def _begin_step(self) -> None:
        if self._in_step:
            raise RuntimeError("steps do not nest: the previous step is still open")
        with self._lock:  # an idle flush on another thread must see the step open
            self._step_no += 1
            self._loop_ident = threading.get_ident()
            self._in_step = True
        self._step_attrs = {}
        self._step_evictions = self._step_readmissions = self._step_emit_rows = 0
        self._step_t0_tick = self._clock()
        if self._os is not None:
            self._os_sample(OS_STEP_START, self._step_t0_tick)

    def _end_step(self) -> None:
        t1 = self._clock()
        if self._os is not None:
            self._os_sample(OS_STEP_END, t1)
        a = self._step_attrs
        n_dec = a.get("num_decode", self._step_emit_rows)
        graph = a.get("graph_size", n_dec if n_dec > 0 else -1)
        row = (
            self._step_t0_tick,
            t1,
            n_dec,
            a.get("num_prefill_tokens", 0),
            graph,
            a.get("num_preempted", self._step_evictions),
            a.get("num_swapped_in", self._step_readmissions),
        )
        with self._lock:  # with the row: an idle flush never sees the step half-ended
            self._in_step = False
            self._buf["steps"].extend(row)
        dev = self._device
        if dev is not None and dev._pending:  # lazily: only what has finished, no sync
            dev.poll(self._append_device_window)
        if t1 - self._last_flush_tick >= self._flush_interval_ticks:
            self._flush()

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
        if self.enabled:
            self._append_segment(self._label_id(label), t0, t1, int(device))

    def _label_id(self, label: str) -> int:
        with self._lock:
            try:
                return self._labels.index(label)
            except ValueError:
                self._labels.append(label)
                return len(self._labels) - 1

    def _tls_stack(self) -> list[int]:
        try:
            return self._tls.stack
        except AttributeError:
            stack: list[int] = []
            with self._lock:
                self._stacks.append(stack)
            self._tls.stack = stack
            return stack

    def _thread_id(self) -> int:
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            with self._lock:
                tid = self._threads.setdefault(ident, len(self._threads))
        return tid

    def _append_segment(self, label: int, t0: int, t1: int, is_device: int) -> None:
        row = (self._step_here(), label, t0, t1, self._thread_id(), is_device)
        with self._lock:
            self._buf["segments"].extend(row)

    def _step_here(self) -> int:
        """The step a window opened on this thread now belongs to (-1: outside any step)."""
        return self._step_no if self._in_step and self._is_loop_thread() else -1

    def _append_device_window(self, step: int, label: int, t0: int, t1: int, thread: int) -> None:
        """A device execution window resolved by the device timer, after its step ended."""
        with self._lock:
            self._buf["segments"].extend((step, label, t0, t1, thread, 1))

    def _is_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_ident

    # -- emissions and requests ------------------------------------------------------
    def request(
        self,
        request_id: Any,
        *,
        prompt_tokens: int = -1,
        max_new_tokens: int = -1,
        arrival_tick: int | None = None,
    ) -> int:
        """A request arrived (now, or at `arrival_tick` of this recorder's clock)."""
        if not self.enabled:
            return -1
        t = self._clock() if arrival_tick is None else arrival_tick
        idx = self._request_index(request_id)
        with self._lock:
            self._buf["requests"].extend((idx, t, prompt_tokens, max_new_tokens))
        if arrival_tick is None:
            self._flush_if_idle(t)
        return idx

    def _flush_if_idle(self, now: int) -> None:
        """Keep the flush interval while no step runs (an idle engine still takes
        arrivals): flush only between steps, so a part never splits an open step."""
        if self._in_step or now - self._last_flush_tick < self._flush_interval_ticks:
            return
        with self._lock:
            if not self._in_step and self._running:
                self._flush(poll_device=False)

    def _idle_flush(self) -> None:
        """From the dispatcher, when no flush came for a whole interval: flush what was
        recorded since (arrivals, emissions outside steps, rows from just before the engine
        went idle), unless a step is open (a part never splits a step)."""
        with self._lock:
            if self._in_step or not self._running or self._pid != os.getpid():
                return
            if any(len(b) for b in self._buf.values()) or self._req_flushed < len(self._req_names):
                self._flush(poll_device=False)

    def _request_index(self, request_id: Any) -> int:
        idx = self._req_index.get(request_id)
        if idx is None:
            with self._lock:
                idx = self._req_index.get(request_id)
                if idx is None:
                    idx = len(self._req_names)
                    self._req_index[request_id] = idx
                    self._req_names.append(str(request_id))
        return idx

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
        partition charges a gap only with the device work its emission read."""
        if not self.enabled:
            return
        t = self._clock() if at_tick is None else at_tick
        step = self._step_no if self._in_step else -1
        dstep = step if reads_step is None else reads_step
        get = self._req_index.get
        rows = array("q")
        if num_tokens is None:
            for rid in request_ids:
                idx = get(rid)
                if idx is None:
                    idx = self._request_index(rid)
                rows.extend((idx, t, step, 1, dstep))
        else:
            for rid, n in zip(request_ids, num_tokens, strict=True):
                idx = get(rid)
                if idx is None:
                    idx = self._request_index(rid)
                rows.extend((idx, t, step, n, dstep))
        self._step_emit_rows += len(rows) // 5
        with self._lock:
            self._buf["emissions"].extend(rows)

    def evict(self, request_id: Any, *, mode: str = "swap") -> None:
        """The scheduler evicted `request_id` now (`swap` or `recompute`)."""
        if not self.enabled:
            return
        t = self._clock()
        idx = self._request_index(request_id)
        self._step_evictions += 1
        with self._lock:
            self._buf["events"].extend((idx, EVICT, t, MODES[mode]))

    def readmit(self, request_id: Any) -> None:
        """The scheduler readmitted an evicted `request_id` now."""
        if not self.enabled:
            return
        t = self._clock()
        idx = self._request_index(request_id)
        self._step_readmissions += 1
        with self._lock:
            self._buf["events"].extend((idx, READMIT, t, -1))

    # -- TTFT events: admission, prefill chunks, wait reasons ---------------------------
    def admit(self, request_id: Any, *, at_tick: int | None = None) -> None:
        """The scheduler took `request_id` into a running batch for the first time, now (or
        at `at_tick` of this recorder's clock: say, the start of the scheduling call).

        Call it once per request, where the scheduler takes it off its waiting queue (a
        readmission after an eviction is `readmit`). Ends the request's `queued` phase."""
        if not self.enabled:
            return
        t = self._clock() if at_tick is None else at_tick
        idx = self._request_index(request_id)
        with self._lock:
            self._buf["admissions"].extend((idx, t))

    def prefill(self, request_id: Any, num_tokens: int) -> None:
        """The open step computes `num_tokens` of `request_id`'s prompt in its `prefill`
        segments (one call per request and step; the TTFT partition splits the step's
        prefill time by these token counts)."""
        if not self.enabled:
            return
        idx = self._req_index.get(request_id)
        if idx is None:
            idx = self._request_index(request_id)
        row = (self._open_step("prefill"), idx, num_tokens)
        with self._lock:
            self._buf["prefill_chunks"].extend(row)

    def wait(self, request_ids: Iterable[Any], reason: str) -> None:
        """The open step's scheduler left `request_ids` waiting because of `reason`, one
        of `tracekit.log.rawlog.WAIT_REASONS` (`kv_blocks`, `max_num_seqs`, `token_budget`,
        `preempted_first`, `other`)."""
        if not self.enabled:
            return
        code = WAIT_REASON_CODES.get(reason)
        if code is None:
            raise ValueError(f"wait reason {reason!r} is not one of {list(WAIT_REASON_CODES)}")
        step = self._open_step("wait")
        ids = request_ids if isinstance(request_ids, list) else list(request_ids)
        get = self._req_index.get
        found = [get(rid) for rid in ids]
        idx: list[int] = (
            found  # type: ignore[assignment]  # no None in it
            if None not in found
            else [  # requests this recorder has not seen yet get an index
                self._request_index(rid) if i is None else i
                for rid, i in zip(ids, found, strict=True)
            ]
        )
        rows = array("q", (step, 0, code)) * len(idx)  # flat (step, request, reason) rows
        rows[1::3] = array("q", idx)
        with self._lock:
            self._buf["waits"].extend(rows)

    def _open_step(self, what: str) -> int:
        if not (self._in_step and self._is_loop_thread()):
            raise RuntimeError(f"rec.{what}() describes a step: call it inside rec.step()")
        return self._step_no

    def counter(self, name: str, value: float, *, at_tick: int | None = None) -> None:
        """Sample an engine counter (batch size, free KV blocks...) now (or at `at_tick` of
        this recorder's clock, for a stamp taken before the recorder could be reached)."""
        if not self.enabled:
            return
        t = self._clock() if at_tick is None else at_tick
        idx = self._counter_index.get(name)
        if idx is None:
            with self._lock:
                idx = self._counter_index.setdefault(name, len(self._counter_index))
        with self._lock:
            self._buf["counters"].extend((float(idx), float(t), float(value)))

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

    def _flush(self, *, stop_tick: int | None = None, poll_device: bool = True) -> None:
        """Hand the completed rows to the sinks' dispatcher (a swap of buffers; no disk
        I/O and no chunk building here)."""
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
