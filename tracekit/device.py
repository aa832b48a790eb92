"""Device time: CUDA events around each launch, resolved lazily, mapped onto the host clock.

On a GPU a host timer around a launch measures the launch, not the work: kernels run later,
asynchronously. A segment opened with ``device=True`` on a recorder that has a device timer
therefore records two windows of the same label and step:

- the *host window* (``is_device=0``): what the host timer saw, i.e. the launch;
- the *device window* (``is_device=1``): from its start event to its end event as the
  device's stream executed them, mapped onto the recorder's clock.

    timer = tracekit.device.CudaEventTimer()      # torch.cuda.Event(enable_timing=True)
    rec = tracekit.Recorder("raw/run.npz", device_timer=timer)
    with rec:
        with rec.step():
            with rec.segment("decode", device=True):
                logits = model(x)                  # launched here, executed later

The hot path never synchronises. `begin`/`end` record an event on the current stream and
queue the pair; `poll` (the recorder calls it at every step end and flush) asks the oldest
pending pair's end event whether it has completed (`event.query()`, which never blocks) and
resolves, in launch order, what has; `finish` (at stop) synchronises once and resolves the
rest.

Clock mapping. At start a calibration event is recorded on an idle device and waited for;
the host ticks read just before the record and just after the wait bracket it: their
midpoint is its host time and half their distance its uncertainty (the tightest of a few
tries is kept). Each resolved event is then placed at ``host tick of an anchor +
elapsed_time(anchor, event)``, the anchor being the last resolved end event (the calibration
event at first). Chaining keeps every `elapsed_time` short, so its float32 milliseconds stay
sub-microsecond in a run of hours. At stop a second calibration point is taken and compared
with where the chain predicts it: the device clock's drift against the host clock over the
run, ``device_clock_drift_ppm`` in `RawLog.meta` (the rest under ``device_calibration``).

What a device window is: the stream's time from its start event to its end event. It
includes any bubble between the kernels launched inside the segment (a launch-bound step,
or a host stall between two launches, shows as device time); see docs/gpu.md.

`CudaEventTimer` and `FakeDeviceTimer` share all of the above (`DeviceTimer`); they differ
only in five primitives: make an event, record it, query it, the elapsed time between two
events, synchronise. The fake simulates one stream against a fake host clock, with a
launch-to-execution lag, an execution time per device segment, a resolution delay and a
clock drift, so tests without a GPU drive the very same code.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from .errors import one_line

#: `sink(step, label, t_start_tick, t_end_tick, thread)`: where resolved device windows go.
Sink = Callable[[int, int, int, int, int], None]


class DeviceTimer:
    """The shared logic: event pairs, lazy resolution, calibration, drift.

    Subclasses supply the five primitives (`_new_event`, `_record`, `_query`,
    `_elapsed_ms`, `_synchronize`) and a `kind` for the raw log's meta."""

    kind = "abstract"
    #: calibration brackets tried at start and at stop; the tightest one is kept
    num_calibration_tries = 5
    #: a calibration event not done after this many queries (or ms) is waited for instead
    calibration_max_spins = 100_000
    calibration_timeout_ms = 100.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (start event, end event, label id, step, thread), in launch order
        self._pending: deque[tuple[Any, Any, int, int, int]] = deque()
        self._free: list[Any] = []  # resolved events, recorded again by later segments
        self._clock: Callable[[], int] | None = None
        self._ticks_per_ms = 1e6
        self._origin_tick = 0
        self._anchor: Any = None
        self._anchor_tick = 0.0  # float: chained positions keep sub-tick precision
        self._calib_tick = 0.0
        self._calib_half_ms = 0.0
        self._start_meta: dict[str, Any] = {"timer": self.kind}
        self.num_windows = 0
        self.num_resolved_lazily = 0
        self.num_resolved_at_stop = 0

    # -- the five primitives ----------------------------------------------------------
    def _new_event(self) -> Any:
        raise NotImplementedError

    def _record(self, event: Any, opens: bool) -> None:
        """Record `event` on the current stream now (host side: enqueue it). `opens`: it is
        a segment's start event (the fake queues the segment's work after it)."""
        raise NotImplementedError

    def _query(self, event: Any) -> bool:
        """Has the device passed `event`? Never blocks."""
        raise NotImplementedError

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        """Device milliseconds from completed event `a` to completed event `b`."""
        raise NotImplementedError

    def _synchronize(self) -> None:
        """Wait until the device has finished all queued work (start and stop only)."""
        raise NotImplementedError

    # -- the recorder's side -----------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def attach(self, clock: Callable[[], int], seconds_per_tick: float, origin_tick: int) -> dict:
        """A run starts: take the first calibration point. Returns it for the run's meta."""
        self._clock = clock
        self._ticks_per_ms = 1e-3 / seconds_per_tick
        self._origin_tick = origin_tick
        ev, tick, half = self._calibrate()
        self._anchor, self._anchor_tick = ev, tick
        self._calib_tick = tick
        self._calib_half_ms = half / self._ticks_per_ms
        self._start_meta = {
            "timer": self.kind,
            "start_host_s": self._seconds(tick),
            "start_uncertainty_ms": self._calib_half_ms,
        }
        return dict(self._start_meta)

    def begin(self) -> Any:
        """A device segment opens: record its start event (before the launch)."""
        ev = self._event()
        self._record(ev, True)
        return ev

    def end(self, start: Any, label: int, step: int, thread: int) -> None:
        """The segment closes: record its end event (after the launch) and queue the pair."""
        ev = self._event()
        self._record(ev, False)
        with self._lock:
            self._pending.append((start, ev, label, step, thread))
            self.num_windows += 1

    def poll(self, sink: Sink) -> int:
        """Resolve the pairs whose end event has completed, oldest first; never blocks."""
        rows = self._resolve(wait=False)
        self.num_resolved_lazily += len(rows)
        for row in rows:
            sink(*row)
        return len(rows)

    def finish(self, sink: Sink) -> dict:
        """The run stops: synchronise once, resolve every pending pair, take the second
        calibration point and measure the drift. Returns the meta entries for the run."""
        out: dict[str, Any] = {}
        cal: dict[str, Any] = dict(self._start_meta)
        try:
            self._synchronize()
            rows = self._resolve(wait=True)
            self.num_resolved_at_stop += len(rows)
            for row in rows:
                sink(*row)
            ev, observed, half = self._calibrate()
            # where the chain of elapsed times puts the stop event, vs where the host saw it
            predicted = self._anchor_tick + self._elapsed_ms(self._anchor, ev) * self._ticks_per_ms
            self._free.append(ev)
            span = observed - self._calib_tick
            drift_ppm = (predicted - observed) / span * 1e6 if span > 0 else 0.0
            err_ms = (predicted - observed) / self._ticks_per_ms
            cal.update(
                stop_host_s=self._seconds(observed),
                stop_uncertainty_ms=half / self._ticks_per_ms,
                stop_predicted_minus_observed_ms=err_ms,
                # worst placement error of a window: the drift at the end of the run plus
                # both calibration brackets
                max_placement_err_ms=abs(err_ms) + self._calib_half_ms + half / self._ticks_per_ms,
            )
            out["device_clock_drift_ppm"] = drift_ppm
        except Exception as e:  # a device error at stop must not lose the host log
            with self._lock:
                lost = len(self._pending)
                self._pending.clear()
            cal["error"] = one_line(f"{type(e).__name__}: {e}")
            cal["num_windows_lost"] = lost
        cal.update(
            num_windows=self.num_windows,
            num_resolved_lazily=self.num_resolved_lazily,
            num_resolved_at_stop=self.num_resolved_at_stop,
        )
        out["device_calibration"] = cal
        return out

    # -- internals ---------------------------------------------------------------------
    def _event(self) -> Any:
        """A resolved event to record again, or a new one (pop is atomic: any thread)."""
        try:
            return self._free.pop()
        except IndexError:
            return self._new_event()

    def _seconds(self, tick: float) -> float:
        return (tick - self._origin_tick) / self._ticks_per_ms * 1e-3

    def _calibrate(self) -> tuple[Any, float, float]:
        """(event, host tick, half-width in ticks) of the tightest bracket of a few tries.

        On an idle stream, record an event and spin on `query()`, reading the host clock
        before each query: the event completed after the last reading whose query said
        "not yet" and before the reading after the query that said "done". (Start and stop
        only; a device that never answers falls back to one synchronize.)"""
        assert self._clock is not None, "attach() first"
        clock = self._clock
        self._synchronize()  # an idle stream: the event completes as soon as it is recorded
        limit = round(self.calibration_timeout_ms * self._ticks_per_ms)
        best: tuple[Any, int, int] | None = None
        for _ in range(self.num_calibration_tries):
            ev = self._event()
            h0 = t_record = clock()
            self._record(ev, False)
            h1 = None
            for _spin in range(self.calibration_max_spins):
                q = clock()
                if self._query(ev):
                    h1 = clock()
                    break
                h0 = q  # not done when this was read
                if q - t_record > limit:
                    break
            if h1 is None:
                self._synchronize()
                h1 = clock()
            if best is None or h1 - h0 < best[2] - best[1]:
                if best is not None:
                    self._free.append(best[0])
                best = (ev, h0, h1)
            else:
                self._free.append(ev)
        assert best is not None
        ev, h0, h1 = best
        return ev, (h0 + h1) / 2, (h1 - h0) / 2

    def _resolve(self, *, wait: bool) -> list[tuple[int, int, int, int, int]]:
        """Map finished pairs onto the host clock, chaining from the anchor. With `wait`,
        every pending pair (the caller has synchronised)."""
        rows: list[tuple[int, int, int, int, int]] = []
        tpm = self._ticks_per_ms
        with self._lock:
            pending, free = self._pending, self._free
            while pending:
                start, end, label, step, thread = pending[0]
                if not wait and not self._query(end):
                    break  # one stream: nothing queued after it has finished either
                pending.popleft()
                t0 = self._anchor_tick + self._elapsed_ms(self._anchor, start) * tpm
                t1 = t0 + self._elapsed_ms(start, end) * tpm
                free.append(self._anchor)
                free.append(start)
                self._anchor, self._anchor_tick = end, t1
                rows.append((step, label, round(t0), round(t1), thread))
        return rows


class CudaEventTimer(DeviceTimer):
    """Device windows from `torch.cuda.Event(enable_timing=True)` on the current stream.

    One device per timer (events of different devices have no common clock). torch is
    imported here, when a timer is made, never by `import tracekit`."""

    kind = "cuda-events"

    def __init__(self, device: Any = None) -> None:
        import torch  # the `gpu` extra

        if not torch.cuda.is_available():
            raise RuntimeError("CudaEventTimer needs a CUDA device (torch.cuda.is_available())")
        super().__init__()
        self._torch = torch
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else torch.device(device)
        )
        self._Event = torch.cuda.Event

    def _new_event(self) -> Any:
        return self._Event(enable_timing=True)

    def _record(self, event: Any, opens: bool) -> None:
        event.record()  # the current stream of the current device

    def _query(self, event: Any) -> bool:
        return bool(event.query())

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        return float(a.elapsed_time(b))

    def _synchronize(self) -> None:
        self._torch.cuda.synchronize(self._device)


class FakeClock:
    """An integer nanosecond clock for tests: every read advances `step_ns`; `t` is the
    last tick handed out (peek at it without advancing)."""

    def __init__(self, start_ns: int = 1_000_000_000, step_ns: int = 1_000) -> None:
        self.t = start_ns
        self.step_ns = step_ns

    def __call__(self) -> int:
        self.t += self.step_ns
        return self.t

    def advance(self, ms: float) -> None:
        self.t += round(ms * 1e6)


class _FakeEvent:
    __slots__ = ("at_ns",)

    def __init__(self) -> None:
        self.at_ns = -1  # host-clock time at which the simulated stream passes the event


class FakeDeviceTimer(DeviceTimer):
    """One simulated stream on a fake host clock (anything with an integer tick `t`
    attribute, such as `FakeClock`; the fake reads `t` without advancing it).

    lag_ms: launch-to-execution lag: work recorded at host time h runs no earlier than
        h + lag (and no earlier than the work queued before it: one in-order stream).
    exec_ms: device work each device segment queues right after its start event (the
        body's kernels, launched at once); `launch()` inside a segment queues more (set
        exec_ms=0 to describe every kernel explicitly).
    resolve_delay_ms: an event reports done (`query`) this long after the stream passed it.
    drift_ppm: the device clock runs fast by this much against the host clock.
    """

    kind = "fake"

    def __init__(
        self,
        clock: Any,
        *,
        lag_ms: float = 0.05,
        exec_ms: float = 5.0,
        resolve_delay_ms: float = 0.0,
        drift_ppm: float = 0.0,
    ) -> None:
        super().__init__()
        self.fake_clock = clock
        self.lag_ns = round(lag_ms * 1e6)
        self.exec_ns = round(exec_ms * 1e6)
        self.resolve_delay_ns = round(resolve_delay_ms * 1e6)
        self.drift_ppm = drift_ppm
        self.tail_ns = 0  # when the stream finishes what is queued on it
        self.num_queries = 0
        self.num_synchronizes = 0
        self.num_events_made = 0

    def launch(self, exec_ms: float) -> None:
        """Queue a kernel of `exec_ms` at the current host time."""
        self.tail_ns = max(self.fake_clock.t + self.lag_ns, self.tail_ns) + round(exec_ms * 1e6)

    @property
    def busy_until_ns(self) -> int:
        return self.tail_ns

    def _new_event(self) -> Any:
        self.num_events_made += 1
        return _FakeEvent()

    def _record(self, event: Any, opens: bool) -> None:
        event.at_ns = self.tail_ns = max(self.fake_clock.t + self.lag_ns, self.tail_ns)
        if opens:
            self.tail_ns += self.exec_ns  # the segment's own kernels

    def _query(self, event: Any) -> bool:
        self.num_queries += 1
        return self.fake_clock.t >= event.at_ns + self.resolve_delay_ns

    def _elapsed_ms(self, a: Any, b: Any) -> float:
        return (b.at_ns - a.at_ns) * (1.0 + self.drift_ppm * 1e-6) / 1e6

    def _synchronize(self) -> None:
        self.num_synchronizes += 1
        self.fake_clock.t = max(self.fake_clock.t, self.tail_ns)


__all__ = ["CudaEventTimer", "DeviceTimer", "FakeClock", "FakeDeviceTimer", "Sink"]
