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
interned once and resolved when the run is saved. Completed rows go to numbered parts on
disk at a bounded interval, from a background writer thread (see `tracekit.stream`), so a
killed run keeps what was flushed; `stop()` (also on exceptions, SIGTERM and interpreter
exit) merges them into one `.npz`.

A disabled recorder (`enabled=False`) costs next to nothing: `step`/`segment` decorators
hand back the original function, context managers are a shared no-op, and `emit`,
`evict`, ... return at once.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import threading
import time
from array import array
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from functools import wraps
from typing import Any, TypeVar

import numpy as np

from .device import DeviceTimer
from .labels import DEFAULT_CAUSE_MAP, colour
from .rawlog import MODES, WAIT_REASON_CODES, RawLog
from .stream import (
    EVENT_COLS,
    EVICT,
    READMIT,
    TABLE_COLS,
    UNKNOWN_TICK,
    PartWriter,
    merge_parts,
    parts_dir_for,
)

F = TypeVar("F", bound=Callable[..., Any])

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

    __slots__ = ("_rec", "_label", "_is_device", "_name", "_color")

    def __init__(self, rec: Recorder, label: int, name: str, is_device: bool) -> None:
        self._rec = rec
        self._label = label
        self._is_device = is_device
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
            t0 = rec._tls_stack().pop()
            rec._append_segment(self._label, t0, t1, int(self._is_device))
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
    """A segment of device work on a recorder with a device timer (`tracekit.device`): the
    host window of the launch (is_device=0) as for any segment, plus a pair of device
    events around it whose execution window the timer resolves later and appends as a
    device segment (is_device=1) of the same label and step."""

    __slots__ = ()

    def __enter__(self) -> _DeviceSegment:
        rec = self._rec
        if rec._nvtx is not None:
            rec._nvtx.push_range(message=self._name, color=self._color, domain=NVTX_DOMAIN)
        rec._tls_stack().append(rec._clock())
        rec._tls_stack().append(rec._device.begin())  # type: ignore[union-attr]
        return self

    def __exit__(self, *exc: object) -> None:
        rec = self._rec
        try:
            stack = rec._tls_stack()
            start = stack.pop()
            rec._device.end(start, self._label, rec._step_here(), rec._thread_id())  # type: ignore[union-attr]
            t1 = rec._clock()
            rec._append_segment(self._label, stack.pop(), t1, 0)
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

    out: where the run's `.npz` goes (parts stream to ``OUT.parts/`` meanwhile); None keeps
        the run in memory (`log()` returns it).
    config: JSON-able metadata saved with the run (`rung`, `seed`, engine settings...).
    enabled: False makes every hook a no-op.
    gc: time collections with `gc.callbacks` (installed at start, removed at stop).
    nvtx: also open an NVTX range per step and segment (needs the `nvtx` package), in the
        `tracekit` domain, one colour per label; imported at start, only when asked for.
    device_timer: a `tracekit.device.DeviceTimer` (`CudaEventTimer`, or `FakeDeviceTimer`
        in tests): `segment(label, device=True)` then also records the device execution
        window of the launch, resolved lazily; without one it records the host window only.
    clock: a function returning integer ticks (default `time.perf_counter_ns`); pass a fake
        clock in tests. `seconds_per_tick` converts them.
    flush_interval_s: completed rows reach disk at least this often (crash safety).
    cause_map: segment label -> cause, on top of the defaults (`swap` -> `preempt`, ...).
    handle_signals: turn SIGTERM into a clean stop, and keep it and Ctrl-C (SIGINT, still
        a KeyboardInterrupt) from being lost in a GC pause or a flush (re-sent once those
        end); installed at start and restored at stop, main thread only.
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
        self._flush_ticks = int(flush_interval_s / seconds_per_tick)
        self._handle_signals = handle_signals
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
        self._step_t0 = 0
        self._step_attrs: dict[str, int] = {}
        self._step_evictions = 0
        self._step_readmissions = 0
        self._step_emit_rows = 0
        self._gc_t0 = 0
        self._writer: PartWriter | None = None
        self._mem_parts: list[dict[str, np.ndarray]] = []
        self._last_flush = 0
        self._t0_tick = 0
        self._prev_sigterm: Any = None
        self._prev_sigint: Any = None
        self._on_flush: list[Callable[[dict[str, np.ndarray]], None]] = []
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
        self._last_flush = self._t0_tick
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
        if self._device is not None:
            meta["device_calibration"] = self._device.attach(
                self._clock, self._seconds_per_tick, self._t0_tick
            )
        self._meta = meta
        if self.out is not None:
            self._writer = PartWriter(parts_dir_for(self.out), _json_safe(meta))
        if self._use_gc:
            gc.callbacks.append(self._on_gc)
        if self._handle_signals and threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                self._prev_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._prev_sigint = signal.signal(signal.SIGINT, _sigint_to_interrupt)
        atexit.register(self.stop)
        self._running = True
        _ACTIVE.add(self)
        return self

    def stop(self) -> RawLog | None:
        """Stop the run: remove every hook, flush, and write the one `.npz` (if `out`)."""
        if not self._running:
            return self._log
        self._running = False
        _ACTIVE.discard(self)
        device_meta: dict[str, Any] = {}
        if self._device is not None:  # one synchronize: the run ends when the device does
            device_meta = self._device.finish(self._append_device_window)
        stop_tick = self._clock()
        try:
            if self._on_gc in gc.callbacks:
                gc.callbacks.remove(self._on_gc)
                _IN_GC[0] = False
            if self._prev_sigterm is not None:
                with contextlib.suppress(ValueError):  # not the main thread any more
                    signal.signal(signal.SIGTERM, self._prev_sigterm)
                self._prev_sigterm = None
            if self._prev_sigint is not None:
                with contextlib.suppress(ValueError):
                    signal.signal(signal.SIGINT, self._prev_sigint)
                self._prev_sigint = None
            atexit.unregister(self.stop)
            self._flush(stop_tick=stop_tick)
        finally:
            self._stopped = True
            if self._writer is not None:
                self._writer.close()
        final = {"config": self.config, **device_meta}
        if self.out is not None:
            parts = parts_dir_for(self.out)
            log = merge_parts(parts, final=final)
            if self._extras:
                log = replace(log, extras={**log.extras, **self._extras})
            log.save(self.out)
            import shutil

            shutil.rmtree(parts, ignore_errors=True)
            self._log = log.with_path(self.out)
        else:
            self._log = _merge_memory(self._meta, self._mem_parts, final)
            if self._extras:
                self._log = replace(self._log, extras={**self._log.extras, **self._extras})
        return self._log

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

    def add_flush_listener(self, fn: Callable[[dict[str, np.ndarray]], None]) -> None:
        """Call `fn(chunk)` with every flushed chunk of rows (e.g. a live Chrome trace)."""
        self._on_flush.append(fn)

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
        self._step_t0 = self._clock()

    def _end_step(self) -> None:
        t1 = self._clock()
        a = self._step_attrs
        n_dec = a.get("num_decode", self._step_emit_rows)
        graph = a.get("graph_size", n_dec if n_dec > 0 else -1)
        row = (
            self._step_t0,
            t1,
            n_dec,
            a.get("num_prefill_tokens", 0),
            graph,
            a.get("num_preempted", self._step_evictions),
            a.get("num_swapped_in", self._step_readmissions),
        )
        self._in_step = False
        with self._lock:
            self._buf["steps"].extend(row)
        dev = self._device
        if dev is not None and dev._pending:  # lazily: only what has finished, no sync
            dev.poll(self._append_device_window)
        if t1 - self._last_flush >= self._flush_ticks:
            self._flush()

    # -- segments --------------------------------------------------------------------
    def segment(self, label: str, *, device: bool = False) -> Any:
        """A labelled window: `with rec.segment("prefill"):` or `@rec.segment("tok")`.

        Works from any thread; a window outside a step is recorded with step -1.
        `device=True`: the body launches device work; with a device timer its execution
        window is recorded too (is_device=1, see `tracekit.device`), without one only the
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
                        seg = _DeviceSegment(self, self._label_id(label), label, False)
                    else:  # nothing measures the device: the host window is what we have
                        seg = _Segment(self, self._label_id(label), label, False)
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
            self._tls.stack = []
            return self._tls.stack

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
        if self._in_step or now - self._last_flush < self._flush_ticks:
            return
        with self._lock:
            if not self._in_step and self._running:
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
        of `tracekit.rawlog.WAIT_REASONS` (`kv_blocks`, `max_num_seqs`, `token_budget`,
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

    def counter(self, name: str, value: float) -> None:
        """Sample an engine counter (batch size, free KV blocks...) now."""
        if not self.enabled:
            return
        t = self._clock()
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
            _IN_GC[0] = True  # first, before any call: see _sigterm_to_exit
            self._gc_t0 = self._clock()
        else:
            try:
                t1 = self._clock()
                with self._lock:
                    self._buf["gc_pauses"].extend((self._gc_t0, t1, info.get("generation", -1)))
            finally:
                _IN_GC[0] = False

    # -- buffers ---------------------------------------------------------------------
    def _new_buffers(self) -> None:
        self._buf: dict[str, array] = {k: array("q") for k in TABLE_COLS}
        self._buf["counters"] = array("d")

    def _flush(self, *, stop_tick: int | None = None, poll_device: bool = True) -> None:
        """Hand the completed rows to the writer (a swap of buffers; no disk I/O here)."""
        dev = self._device
        if poll_device and dev is not None and dev._pending and stop_tick is None:
            dev.poll(self._append_device_window)
        _IN_FLUSH[0] += 1  # from the swap until the writer has the rows: see _sigterm_to_exit
        try:
            with self._lock:
                buf = self._buf
                self._new_buffers()
                now = self._clock()
                self._last_flush = now
                new_ids = self._req_names[self._req_flushed :]
                start = self._req_flushed
                self._req_flushed = len(self._req_names)
                labels = list(self._labels)
                counter_names = list(self._counter_index)
            chunk: dict[str, np.ndarray] = {
                k: np.frombuffer(b, dtype=np.float64 if k == "counters" else np.int64).copy()
                for k, b in buf.items()
            }
            chunk["labels"] = np.array(labels, dtype=str)
            chunk["counter_names"] = np.array(counter_names, dtype=str)
            chunk["request_ids"] = np.array(new_ids, dtype=str)
            chunk["request_ids_start"] = np.array(start, dtype=np.int64)
            chunk["config"] = np.array(_dumps(self.config))
            chunk["flush_tick"] = np.array(now, dtype=np.int64)
            chunk["t0_tick"] = np.array(self._t0_tick, dtype=np.int64)
            chunk["seconds_per_tick"] = np.array(self._seconds_per_tick)
            if stop_tick is not None:
                chunk["stop_tick"] = np.array(stop_tick, dtype=np.int64)
            if self._writer is not None:
                self._writer.submit(chunk)
            else:
                self._mem_parts.append(chunk)
        finally:
            _IN_FLUSH[0] -= 1
        for fn in self._on_flush:
            fn(chunk)


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


#: True between a recorder's gc "start" and "stop" callbacks (a collection is running).
_IN_GC = [False]
#: Flushes between their buffer swap and the hand-over to the writer.
_IN_FLUSH = [0]


def _sigterm_to_exit(signum: int, frame: Any) -> None:
    """SIGTERM -> SystemExit, so `with rec:` blocks and atexit flush like a normal exit.

    Not during a collection: a SIGTERM that lands in one is handled inside a gc callback,
    where the collector swallows any exception ("Exception ignored in ...") and the run
    would go on as if never signalled. Nor during a flush, between the buffer swap and the
    hand-over to the writer, where it would drop that interval's rows. Then the signal is
    sent again from a helper thread, to be handled once that is over."""
    if not _deferred(signum, frame):
        raise SystemExit(128 + signum)


def _sigint_to_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C: Python's KeyboardInterrupt, deferred the same way as SIGTERM (see there)."""
    if not _deferred(signum, frame):
        raise KeyboardInterrupt


def _deferred(signum: int, frame: Any) -> bool:
    """True (and the signal re-sent later) if it landed in a collection or a flush."""
    f = frame
    while f is not None and f.f_code is not _ON_GC_CODE:
        f = f.f_back
    if _IN_GC[0] or _IN_FLUSH[0] or f is not None:
        threading.Thread(target=_signal_again, args=(signum,), daemon=True).start()
        return True
    return False


def _signal_again(signum: int) -> None:
    time.sleep(0.001)  # let the callback return first
    while _IN_GC[0] or _IN_FLUSH[0]:  # and the collection or flush end
        time.sleep(0.001)
    os.kill(os.getpid(), signum)


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(_json_safe(obj), sort_keys=True)


def _json_safe(obj: Any) -> Any:
    from .rawlog import _jsonable

    return _jsonable(obj)


def _merge_memory(
    meta: dict[str, Any], parts: list[dict[str, np.ndarray]], final: dict[str, Any]
) -> RawLog:
    """The in-memory twin of `stream.merge_parts` (same code path, through a temp dir)."""
    import tempfile

    from .stream import _atomic_write

    with tempfile.TemporaryDirectory(prefix="tracekit-") as d:
        _atomic_write(os.path.join(d, "meta.json"), _dumps(meta).encode())
        for i, chunk in enumerate(parts, 1):
            np.savez(os.path.join(d, f"part-{i:06d}.npz"), **chunk)  # type: ignore[arg-type]
        log = merge_parts(d, final=final)
    return log.with_path("<memory>")


__all__ = ["Recorder", "active_recorders", "EVENT_COLS", "UNKNOWN_TICK"]

_ON_GC_CODE = Recorder._on_gc.__code__
