"""Device time: CUDA events around each launch, resolved lazily, mapped onto the host clock.

On a GPU a host timer around a launch measures the launch, not the work: kernels run later,
asynchronously. A segment opened with ``device=True`` on a recorder that has a device timer
therefore records two windows of the same label and step:

- the *host window* (``is_device=0``): what the host timer saw, i.e. the launch;
- the *device window* (``is_device=1``): from its start event to its end event as the
  device's stream executed them, mapped onto the recorder's clock.

    timer = tracekit.capture.device.CudaEventTimer()      # torch.cuda.Event(enable_timing=True)
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

import math
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from tracekit.errors import one_line

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
    #: re-anchor: when a device segment opens on an idle device (every pair resolved) and
    #: the chain has run this long since the device last finished tracekit's work, or its
    #: rounding bound has grown this large, a fresh calibration point starts a new chain
    reanchor_after_ms = 1000.0
    reanchor_err_ms = 0.001
    #: a re-anchor never synchronises: it spins on `query()` at most this long (the device
    #: may be busy with work tracekit did not launch), then gives up and keeps the chain
    reanchor_max_spin_ms = 0.2
    #: timestamp resolution of one event (quantisation; it does not accumulate along a chain)
    event_resolution_ms = 0.0

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
        self._calib_tick = 0.0  # the current chain's calibration point
        self._calib_half_ms = 0.0
        self._round_ms = 0.0  # rounding bound of the anchor's position along the chain
        self._chain_round_max_ms = 0.0  # the largest such bound of a window in this chain
        self._chain_dt_max_ms = 0.0  # the furthest a window of this chain lies from its start
        self._max_err_ms = 0.0  # the placement bound over closed chains
        self._drift_mismatch_ms = 0.0  # sums over closed chains: predicted - observed
        self._drift_span_ms = 0.0  # ... and their lengths
        self._chains: list[dict[str, float]] = []  # closed chains, for the run's meta
        self.num_reanchors = 0
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
        self._round_ms = self._chain_round_max_ms = self._chain_dt_max_ms = 0.0
        self._start_meta = {
            "timer": self.kind,
            "start_host_s": self._seconds(tick),
            "start_uncertainty_ms": self._calib_half_ms,
        }
        return dict(self._start_meta)

    def begin(self) -> Any:
        """A device segment opens: record its start event (before the launch). On an idle
        device whose chain has grown long (an idle stretch), re-anchor first."""
        if not self._pending and self._clock is not None:
            idle_ms = (self._clock() - self._anchor_tick) / self._ticks_per_ms
            if idle_ms > self.reanchor_after_ms or self._round_ms > self.reanchor_err_ms:
                self._reanchor()
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
            with self._lock:
                err_ms = self._close_chain(ev, observed, half)
                self._free.append(ev)
            drift_ppm = (
                self._drift_mismatch_ms / self._drift_span_ms * 1e6
                if self._drift_span_ms > 0
                else 0.0
            )
            cal.update(
                stop_host_s=self._seconds(observed),
                stop_uncertainty_ms=half / self._ticks_per_ms,
                stop_predicted_minus_observed_ms=err_ms,
                # a bound on every window's placement error (docs/gpu.md, "Onto the host
                # clock"): per chain, both calibration brackets, float32 rounding along it,
                # and the drift it showed at its end
                max_placement_err_ms=self._max_err_ms,
                num_reanchors=self.num_reanchors,
                chains=self._chains[-self.max_chains_in_meta :],
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
    #: closed chains listed in the run's meta (the most recent ones)
    max_chains_in_meta = 1000

    def _close_chain(self, ev: Any, observed: float, half: float) -> float:
        """A calibration event `ev` (host tick `observed` +- `half`) ends the current chain:
        compare it with where the chain places it and fold the chain's bound into the run's.
        Returns predicted - observed, ms. Call with the lock held."""
        tpm = self._ticks_per_ms
        el = self._elapsed_ms(self._anchor, ev)
        predicted = self._anchor_tick + el * tpm
        mismatch_ms = (predicted - observed) / tpm
        span_ms = (observed - self._calib_tick) / tpm
        end_half_ms = half / tpm
        close_round_ms = self._round_ms + _f32_half_ulp(el)
        # A window's error: start bracket + rounding so far + drift * (its time since the
        # calibration). With a steady drift, |drift| * span <= |mismatch| + both brackets +
        # the closing rounding, and no window lies further than `dt_max` into the span.
        drift_ms = abs(mismatch_ms) + self._calib_half_ms + end_half_ms + close_round_ms
        share = min(1.0, self._chain_dt_max_ms / span_ms) if span_ms > 0 else 1.0
        bound = (
            self._calib_half_ms
            + self._chain_round_max_ms
            + drift_ms * share
            + 2 * self.event_resolution_ms
        )
        self._max_err_ms = max(self._max_err_ms, bound)
        if span_ms > 0:
            self._drift_mismatch_ms += mismatch_ms
            self._drift_span_ms += span_ms
        self._chains.append(
            {
                "start_host_s": self._seconds(self._calib_tick),
                "end_host_s": self._seconds(observed),
                "predicted_minus_observed_ms": mismatch_ms,
                "max_placement_err_ms": bound,
            }
        )
        return mismatch_ms

    def _reanchor(self) -> None:
        """Start a new chain at a fresh calibration point, without synchronising: record an
        event on the (idle) device and spin on `query()` for at most `reanchor_max_spin_ms`.
        A device busy with other work keeps the old chain (the event is dropped)."""
        clock = self._clock
        assert clock is not None
        limit = self.reanchor_max_spin_ms * self._ticks_per_ms
        ev = self._event()
        h0 = t_record = clock()
        self._record(ev, False)
        while True:
            q = clock()
            if self._query(ev):
                h1 = clock()
                break
            h0 = q  # not done when this was read
            if q - t_record > limit:
                return
        observed, half = (h0 + h1) / 2, (h1 - h0) / 2
        with self._lock:
            self._close_chain(ev, observed, half)
            self._free.append(self._anchor)
            self._anchor, self._anchor_tick = ev, observed
            self._calib_tick, self._calib_half_ms = observed, half / self._ticks_per_ms
            self._round_ms = self._chain_round_max_ms = self._chain_dt_max_ms = 0.0
            self.num_reanchors += 1

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
                el0 = self._elapsed_ms(self._anchor, start)
                el1 = self._elapsed_ms(start, end)
                t0 = self._anchor_tick + el0 * tpm
                t1 = t0 + el1 * tpm
                # each elapsed time is float32 ms: its rounding is carried along the chain
                self._round_ms += _f32_half_ulp(el0) + _f32_half_ulp(el1)
                self._chain_round_max_ms = max(self._chain_round_max_ms, self._round_ms)
                dt_ms = max(abs(t0 - self._calib_tick), abs(t1 - self._calib_tick)) / tpm
                self._chain_dt_max_ms = max(self._chain_dt_max_ms, dt_ms)
                free.append(self._anchor)
                free.append(start)
                self._anchor, self._anchor_tick = end, t1
                rows.append((step, label, round(t0), round(t1), thread))
        return rows


def _f32_half_ulp(ms: float) -> float:
    """Half the float32 spacing at `ms`: how far CUDA's float32 elapsed time can be off."""
    if ms == 0 or not math.isfinite(ms):
        return 0.0
    _, e = math.frexp(abs(ms))  # |ms| = m * 2**e, 0.5 <= m < 1: float32 spacing 2**(e - 24)
    return math.ldexp(1.0, e - 25)


class CudaEventTimer(DeviceTimer):
    """Device windows from `torch.cuda.Event(enable_timing=True)` on the current stream.

    One device per timer (events of different devices have no common clock). torch is
    imported here, when a timer is made, never by `import tracekit`."""

    kind = "cuda-events"
    event_resolution_ms = 0.0005  # CUDA's documented event resolution, about 0.5 us

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
    float32_elapsed: elapsed times come back as float32 milliseconds, as CUDA's do.
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
        float32_elapsed: bool = False,
    ) -> None:
        super().__init__()
        self.fake_clock = clock
        self.float32_elapsed = float32_elapsed
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
        ms = (b.at_ns - a.at_ns) * (1.0 + self.drift_ppm * 1e-6) / 1e6
        return _to_float32(ms) if self.float32_elapsed else ms

    def _synchronize(self) -> None:
        self.num_synchronizes += 1
        self.fake_clock.t = max(self.fake_clock.t, self.tail_ns)


def _to_float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


__all__ = ["CudaEventTimer", "DeviceTimer", "FakeClock", "FakeDeviceTimer", "Sink"]
