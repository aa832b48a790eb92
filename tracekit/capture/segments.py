"""Steps and segments: the recorder's context managers and the state their hot path reads.

    OpenStep     the open (or last) step: its number, whether it is open, on which thread
    Threads      per thread: its number in the log and its stack of open segments
    Probes       the optional instruments: the NVTX module, the OS counters reader
    Segment      `rec.segment(label)`: a clock read and a push on enter; a clock read, a
                 pop and one row on exit (the recording cost of a segment,
                 `bench/bench_recording.py`)
    DeviceSegment  the same plus a pair of device events (`tracekit.capture.device`)
    StepContext  `rec.step()`: the recorder's step begin and end, inside an NVTX range

Each object is made once per recorder (a segment once per label) and holds what its hot
path needs in its own slots, so a segment reads about as many attributes as when it read
the recorder's.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from tracekit.capture import osstats
from tracekit.capture.buffers import RowBuffers
from tracekit.capture.device import DeviceTimer
from tracekit.capture.osstats import RUSAGE_THREAD, ThreadStats, unavailable_reason
from tracekit.labels import colour
from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START, OS_STEP_END, OS_STEP_START

F = TypeVar("F", bound=Callable[..., Any])

NVTX_DOMAIN = "tracekit"
NVTX_STEP = "step"


def nvtx_colour(label: str) -> int:
    """The label's colour (`tracekit.labels.colour`) as the opaque ARGB integer NVTX takes."""
    return 0xFF000000 | int(colour(label).lstrip("#"), 16)


#: One row of a table as bytes, for `array.frombytes` (about twice as fast as `extend`
#: with a tuple, the hot path's largest cost).
SEG_ROW = struct.Struct("6q").pack
STEP_ROW = struct.Struct("7q").pack
OS_ROW = struct.Struct("8q").pack  # an os_samples row: thread, kind, tick, the five totals


class OpenStep:
    """The open step (or the last one): its number (-1 before the first), whether it is
    open, the thread it runs on (the engine loop's), its start tick, the attributes
    `step_info` gave and what the step's calls counted.

    `open_ident` is the loop thread's identity while the step is open, else 0 (no thread
    has it): the segment hooks' one comparison for "inside this thread's open step"."""

    __slots__ = (
        "no", "is_open", "loop_ident", "open_ident", "t0_tick", "attrs", "num_evictions",
        "num_readmissions", "num_emit_rows",
    )  # fmt: skip

    def __init__(self) -> None:
        self.no = -1  # index of the open (or last) step
        self.is_open = False
        self.loop_ident = -1
        self.open_ident = 0
        self.t0_tick = 0
        self.attrs: dict[str, int] = {}
        self.num_evictions = 0
        self.num_readmissions = 0
        self.num_emit_rows = 0

    def begin(self, t0: int) -> None:
        """The next step opens at `t0` on this thread (under the recorder's lock); its
        number moves on last."""
        self.t0_tick = t0
        if self.attrs:
            self.attrs = {}
        self.num_evictions = self.num_readmissions = self.num_emit_rows = 0
        self.loop_ident = self.open_ident = threading.get_ident()
        self.no += 1
        self.is_open = True

    def close(self) -> None:
        """The step is over (its row is in, under the recorder's lock)."""
        self.is_open = False
        self.open_ident = 0

    def row(self, t1: int) -> bytes:
        """The step's row, ending at `t1`: unset attributes default (`Recorder.step_info`)."""
        a = self.attrs
        t0 = self.t0_tick
        if not a:  # no step_info: every attribute defaults
            n_dec = self.num_emit_rows
            return STEP_ROW(
                t0, t1 if t1 > t0 else t0, n_dec, 0, n_dec if n_dec > 0 else -1,
                self.num_evictions, self.num_readmissions,
            )  # fmt: skip
        n_dec = a.get("num_decode", self.num_emit_rows)
        graph = a.get("graph_size", n_dec if n_dec > 0 else -1)
        return STEP_ROW(
            t0,
            max(t1, t0),
            n_dec,
            a.get("num_prefill_tokens", 0),
            graph,
            a.get("num_preempted", self.num_evictions),
            a.get("num_swapped_in", self.num_readmissions),
        )

    def is_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_ident

    def here(self) -> int:
        """The step a window opened on this thread now belongs to (-1: outside any step)."""
        return self.no if self.is_open and threading.get_ident() == self.loop_ident else -1


class ThreadState:
    """What the segment hooks keep per thread: its open segments' start ticks (a stack),
    its thread number in the log, its identity (to tell the engine loop's thread), and
    whether its segments' boundaries are OS samples (a thread other than the loop's, with
    OS evidence on), and whether its segments take the probed path at all (OS samples or
    NVTX ranges: `is_probed`, one check on the hot path)."""

    __slots__ = ("stack", "tid", "ident", "sample_os", "is_probed")

    def __init__(self, tid: int, ident: int) -> None:
        self.stack: list[int] = []
        self.tid = tid
        self.ident = ident
        self.sample_os = False
        self.is_probed = False


class Probes:
    """The optional instruments the hooks call: the `nvtx` module (set at start when asked
    for) and the OS counters reader (`tracekit.capture.osstats`, open while the run is).

    The loop thread's step samples take a path of their own (`os_step_start`,
    `os_step_end`): the thread's number and schedstat fd kept per thread (`loop_tls`), the
    system calls bound once at start, the row packed and appended in place. They write
    the rows `os_sample` would (`tests/capture/test_os_paths.py`), about 0.3 µs sooner a
    sample (of ~0.6 µs of Python beside ~1.9-2.4 µs of system calls: docs/capture.md)."""

    __slots__ = ("nvtx", "os", "threads", "rows", "clock", "loop_tls", "calls")

    def __init__(self, threads: Threads, rows: RowBuffers, clock: Callable[[], int]) -> None:
        self.nvtx: Any = None
        self.os: ThreadStats | None = None
        self.threads = threads
        self.rows = rows
        self.clock = clock
        self.loop_tls = threading.local()  # per thread: (its number, its schedstat fd)
        # the system calls of a sample, bound at start (`open_os`)
        self.calls = (osstats.thread_cpu_ns, osstats.pread, osstats.getrusage)

    def open_nvtx(self) -> None:
        """Import `nvtx` (the `gpu` extra): only a recorder that asks for it does."""
        try:
            import nvtx  # the `gpu` extra; imported only when asked for
        except ImportError as e:
            raise ImportError(
                "Recorder(nvtx=True) needs the nvtx package: pip install 'tracekit[gpu]'"
            ) from e
        self.nvtx = nvtx
        self.threads.probe_all()  # threads that opened a segment before: NVTX ranges now

    def open_os(self, want: bool | None, *, is_wall_clock: bool) -> dict[str, Any]:
        """Start the OS reader if asked for (`want` True), or by default (None) where it
        means something (the clock is wall time). Returns the run's `meta["os_evidence"]`."""
        why = unavailable_reason()
        if want is False:
            why = "switched off (Recorder(os_evidence=False))"
        elif why is None and want is None and not is_wall_clock:
            why = (
                "the recorder's clock is not wall time (OS waits would not lie on it); "
                "pass os_evidence=True to record anyway"
            )
        reader = ThreadStats.open() if why is None else None
        self.loop_tls = threading.local()  # a new reader: new fds
        self.calls = (osstats.thread_cpu_ns, osstats.pread, osstats.getrusage)
        self.os = reader
        if reader is None:
            return {"recorded": False, "reason": why or "unavailable"}
        return {
            "recorded": True,
            "at": "step boundaries (loop thread); segment boundaries (other threads)",
            **reader.describe(),
        }

    def close_os(self) -> None:
        reader = self.os
        if reader is not None:
            reader.close()
            self.os = None

    def _loop_ids(self, reader: ThreadStats) -> tuple[int, int]:
        """The calling thread's number and schedstat fd, kept for its next steps."""
        ids = self.threads.tid(), reader.fd()
        self.loop_tls.ids = ids
        return ids

    def os_step_start(self) -> None:
        """The loop thread's sample at its step's start: `os_sample(OS_STEP_START)` on one
        path (CPU time, run-queue wait, then the tick; switches and faults not read)."""
        reader = self.os
        if reader is None:  # stop() closed it meanwhile, from another thread
            return
        try:
            tid, fd = self.loop_tls.ids
        except AttributeError:  # this thread's first step sample
            tid, fd = self._loop_ids(reader)
        cpu_ns, pread, _ = self.calls
        cpu = cpu_ns()
        runq = -1
        if fd >= 0:
            try:
                runq = int(pread(fd, 96, 0).split()[1])
            except (OSError, ValueError, IndexError):
                runq = -1
        t = self.clock()  # right after the counters (docs/partition.md)
        try:  # no lock: as in `os_sample`
            self.rows.os_samples.frombytes(OS_ROW(tid, OS_STEP_START, t, cpu, runq, -1, -1, -1))
        except BufferError:
            pass

    def os_step_end(self) -> None:
        """The loop thread's sample at its step's end: `os_sample(OS_STEP_END)` on one path
        (CPU time, run-queue wait, switches and faults, then the tick)."""
        reader = self.os
        if reader is None:
            return
        try:
            tid, fd = self.loop_tls.ids
        except AttributeError:
            tid, fd = self._loop_ids(reader)
        cpu_ns, pread, getrusage = self.calls
        cpu = cpu_ns()
        runq = -1
        if fd >= 0:
            try:
                runq = int(pread(fd, 96, 0).split()[1])
            except (OSError, ValueError, IndexError):
                runq = -1
        if RUSAGE_THREAD is None:
            nvcsw = nivcsw = majflt = -1
        else:
            ru = getrusage(RUSAGE_THREAD)
            nvcsw, nivcsw, majflt = ru.ru_nvcsw, ru.ru_nivcsw, ru.ru_majflt
        t = self.clock()
        try:
            self.rows.os_samples.frombytes(
                OS_ROW(tid, OS_STEP_END, t, cpu, runq, nvcsw, nivcsw, majflt)
            )
        except BufferError:
            pass

    def os_sample(self, kind: int) -> int | None:
        """One `os_samples` row for the calling thread: the loop thread's at its open
        step's start and end, another thread's at its segments' (`Segment`). Switches and
        faults are read at ends only (the partition reads CPU time and run-queue wait;
        bench/bench_os.py measures what that saves).

        The counters are read first and the row's tick right after, with nothing between:
        an OS interval (two consecutive samples) then holds on the clock exactly what its
        counters counted, but for a wait inside that one clock read (docs/partition.md,
        "OS evidence", "When the counters are read"). Stamped before the read, a thread
        descheduled between the stamp and the read had its wait counted in one interval
        and placed, by the stamps, in the next (which then showed off-CPU time the kernel
        never saw).

        Returns the row's tick (None: no reader), which a side thread's segment takes as
        its own start or end: its window and its OS interval are then one (`Segment`)."""
        reader = self.os
        if reader is None:  # stop() closed it meanwhile, from another thread
            return None
        ends = kind == OS_STEP_END or kind == OS_SEGMENT_END
        t, row = reader.sample_row(self.threads.tid(), kind, self.clock, ends)
        rows = self.rows
        if kind <= OS_STEP_END:
            # the loop thread inside its open step: no lock, as for its segment rows (only
            # this thread swaps the buffers now, but a stop() from another thread)
            try:
                rows.os_samples.frombytes(row)
            except BufferError:  # handed to the sinks by that stop() meanwhile
                pass
        else:
            with rows.lock:
                rows.os_samples.frombytes(row)
        return t


class Threads:
    """Every thread that recorded: its number in the log (the starting thread is 0) and,
    once it opened a segment, its `ThreadState` (in `tls.th`, and its stack in `stacks`)."""

    __slots__ = ("tls", "ids", "stacks", "states", "step", "probes", "rows")

    def __init__(self, step: OpenStep, rows: RowBuffers) -> None:
        self.tls = threading.local()
        self.ids: dict[int, int] = {}  # thread identity -> its number in the log
        self.stacks: list[list[int]] = []  # every thread's segment stack
        self.states: list[ThreadState] = []  # every thread's segment state
        self.step = step
        self.rows = rows
        self.probes: Probes | None = None

    def tid(self) -> int:
        """The calling thread's number in the log."""
        ident = threading.get_ident()
        tid = self.ids.get(ident)
        if tid is None:
            with self.rows.lock:
                tid = self.ids.setdefault(ident, len(self.ids))
        return tid

    def here(self) -> ThreadState:
        """This thread's segment state, made on its first segment."""
        try:
            return self.tls.th  # type: ignore[no-any-return]
        except AttributeError:
            th = ThreadState(self.tid(), threading.get_ident())
            # a side thread's segments are OS samples (the loop thread's steps are)
            th.sample_os = (
                self.probes is not None
                and self.probes.os is not None
                and th.ident != self.step.loop_ident
            )
            probes = self.probes
            th.is_probed = th.sample_os or (probes is not None and probes.nvtx is not None)
            with self.rows.lock:
                self.stacks.append(th.stack)
                self.states.append(th)
            self.tls.th = th
            return th

    def probe_all(self) -> None:
        """Every thread's segments take the probed path from now on (NVTX switched on)."""
        with self.rows.lock:
            for th in self.states:
                th.is_probed = True

    def earliest_open_tick(self) -> int | None:
        """The start of the earliest segment still open on any thread (None: none)."""
        out = None
        for st in self.stacks:  # other threads' stacks, read without their help:
            try:  # a window closing meanwhile pops its entry (then it is in this flush)
                t = st[0] if st else None
            except IndexError:
                t = None
            if t is not None and (out is None or t < out):
                out = t
        return out

    def num_with_open(self) -> int:
        """Threads with a segment open now."""
        return sum(1 for st in self.stacks if st)


class Segment:
    """A reusable context manager and decorator for one label of one recorder.

    The hot path: a clock read and a push on enter; a clock read, a pop and one row
    appended on exit (the recording cost of a segment, `bench/bench_recording.py`)."""

    __slots__ = ("_label", "_name", "_color", "_clock", "_tls", "_threads", "_step", "_rows",
                 "_probes")  # fmt: skip

    def __init__(
        self,
        label: int,
        name: str,
        clock: Callable[[], int],
        threads: Threads,
        probes: Probes,
    ) -> None:
        self._label = label
        self._name = name
        self._color = nvtx_colour(name)
        self._clock = clock
        self._threads = threads
        self._tls = threads.tls
        self._step = threads.step
        self._rows = threads.rows
        self._probes = probes

    def __enter__(self) -> Segment:
        try:
            th = self._tls.th
        except AttributeError:
            th = self._threads.here()
        if th.is_probed:
            return self._enter_probed(th)
        th.stack.append(self._clock())  # the common case: one clock read and a push
        return self

    def _enter_probed(self, th: ThreadState) -> Segment:
        """`__enter__` with an NVTX range, or on a thread whose segments are OS samples."""
        probes = self._probes
        if probes.nvtx is not None:
            # never conditioned on the return value: the push always has its pop
            probes.nvtx.push_range(message=self._name, color=self._color, domain=NVTX_DOMAIN)
        t0 = None
        if th.sample_os:  # a side thread's segment: its OS counters at both ends
            if th.ident != self._step.loop_ident:
                # the counters first, then one tick: the sample's and the window's start
                # (docs/partition.md, "When the counters are read")
                t0 = probes.os_sample(OS_SEGMENT_START)
            else:  # it became the loop thread: its steps are sampled, not its segments
                th.sample_os = False
                th.is_probed = probes.nvtx is not None
        if t0 is None:
            t0 = self._clock()
        th.stack.append(t0)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            th = self._tls.th
        except AttributeError:  # entered on another thread: nothing to close here
            th = self._threads.here()
        if th.is_probed:
            self._exit_probed(th)
            return
        stack = th.stack
        # popped once its row is in: a flush sees the window open or its row
        try:
            t1 = self._clock()
            step = self._step
            # the segment ends here: its row names the step open on this thread (or -1)
            if th.ident == step.open_ident:
                # no lock: while a step is open only its own thread swaps the buffers (the
                # idle flush waits for the step's end), except a stop() from another
                # thread, after which the row would not be in the run anyway
                try:
                    self._rows.segments.frombytes(
                        SEG_ROW(step.no, self._label, stack[-1], t1, th.tid, 0)
                    )
                except BufferError:  # handed to the sinks by that stop() meanwhile
                    pass
            else:
                rows = self._rows
                with rows.lock:
                    rows.segments.frombytes(SEG_ROW(-1, self._label, stack[-1], t1, th.tid, 0))
        finally:
            stack.pop()

    def _exit_probed(self, th: ThreadState) -> None:
        """`__exit__` with an NVTX range, or on a thread whose segments are OS samples."""
        try:
            step = self._step
            stack = th.stack
            try:
                t1 = None
                if th.sample_os and th.ident != step.loop_ident:
                    # the counters first, then one tick: the sample's and the window's end
                    t1 = self._probes.os_sample(OS_SEGMENT_END)
                if t1 is None:
                    t1 = self._clock()
                t0 = stack[-1]
                if th.ident == step.open_ident:  # no lock: as in `__exit__`
                    try:
                        self._rows.segments.frombytes(
                            SEG_ROW(step.no, self._label, t0, t1, th.tid, 0)
                        )
                    except BufferError:
                        pass
                else:
                    rows = self._rows
                    with rows.lock:
                        rows.segments.frombytes(SEG_ROW(-1, self._label, t0, t1, th.tid, 0))
            finally:
                stack.pop()
        finally:
            nvtx = self._probes.nvtx
            if nvtx is not None:
                nvtx.pop_range(domain=NVTX_DOMAIN)

    def __call__(self, fn: F) -> F:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


class DeviceSegment(Segment):
    """A segment of device work on a recorder with a device timer (`tracekit.capture.device`): the
    host window of the launch (is_device=0) as for any segment, plus a pair of device
    events around it whose execution window the timer resolves later and appends as a
    device segment (is_device=1) of the same label and step."""

    __slots__ = ("_device",)

    def __init__(
        self,
        label: int,
        name: str,
        clock: Callable[[], int],
        threads: Threads,
        probes: Probes,
        device: DeviceTimer,
    ) -> None:
        super().__init__(label, name, clock, threads, probes)
        self._device = device

    def __enter__(self) -> DeviceSegment:
        nvtx = self._probes.nvtx
        if nvtx is not None:
            nvtx.push_range(message=self._name, color=self._color, domain=NVTX_DOMAIN)
        try:
            t0 = self._clock()
            # may raise (a sticky CUDA error fails `event.record()`): then `__exit__` never
            # runs, so the range pushed above is popped here and nothing is left on the stack
            start = self._device.begin()
        except BaseException:
            if self._probes.nvtx is not None:
                self._probes.nvtx.pop_range(domain=NVTX_DOMAIN)
            raise
        stack = self._threads.here().stack
        stack.append(t0)
        stack.append(start)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            threads = self._threads
            stack = threads.here().stack
            start = stack.pop()
            t0 = stack.pop()  # both popped before anything can raise: no stale entry
            try:
                self._device.end(start, self._label, self._step.here(), threads.tid())
            finally:  # the host window happened whether or not the device could record
                t1 = self._clock()
                self._rows.add_segment(
                    SEG_ROW(self._step.here(), self._label, t0, t1, threads.tid(), 0)
                )
        finally:
            nvtx = self._probes.nvtx
            if nvtx is not None:
                nvtx.pop_range(domain=NVTX_DOMAIN)


class StepContext:
    """The reusable context manager for steps (`Recorder.step`): the recorder's `begin`
    and `end` of a step, inside an NVTX range when NVTX is on."""

    __slots__ = ("_begin", "_end", "_probes", "_color")

    def __init__(self, begin: Callable[[], None], end: Callable[[], None], probes: Probes) -> None:
        self._begin = begin
        self._end = end
        self._probes = probes
        self._color = nvtx_colour(NVTX_STEP)

    def __enter__(self) -> StepContext:
        self._begin()
        nvtx = self._probes.nvtx
        if nvtx is not None:  # pushed once the step is open: every push has its pop
            nvtx.push_range(message=NVTX_STEP, color=self._color, domain=NVTX_DOMAIN)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._end()
        finally:
            nvtx = self._probes.nvtx
            if nvtx is not None:
                nvtx.pop_range(domain=NVTX_DOMAIN)


class NullSegment:
    """What a disabled recorder's `segment()` returns: a no-op context manager and decorator."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    def __call__(self, fn: F) -> F:
        return fn


NULL_SEGMENT = NullSegment()
