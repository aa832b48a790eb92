"""Device segments without a GPU: `FakeDeviceTimer` drives the same code as the CUDA one.

The fake simulates one in-order stream on the recorder's fake clock: work recorded at host
time h runs no earlier than h + lag and no earlier than what is queued before it; each
device segment queues `exec_ms` of work after its start event; an event reports done
`resolve_delay_ms` after the stream passed it. Times below are in ms; tolerances are the
calibration bracket (the fake clock advances 1 us per read).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
from logbuilder import LogBuilder

import tracekit
from tracekit.attribution.itl import drift_corrected, partition
from tracekit.attribution.reference import partition_reference
from tracekit.capture.device import FakeClock, FakeDeviceTimer
from tracekit.capture.recorder import Recorder, active_recorders

IMPLS = [partition, partition_reference]
TOL_MS = 0.02  # the calibration bracket and a few clock reads (1 us each)


def recorder(*, lag_ms=0.05, exec_ms=5.0, resolve_delay_ms=0.0, drift_ppm=0.0, **kw):
    clock = FakeClock(step_ns=1_000)
    dev = FakeDeviceTimer(
        clock,
        lag_ms=lag_ms,
        exec_ms=exec_ms,
        resolve_delay_ms=resolve_delay_ms,
        drift_ppm=drift_ppm,
    )
    return Recorder(clock=clock, gc=False, device_timer=dev, **kw), clock, dev


def windows(log, *, device):
    sg = log.segments
    sel = np.flatnonzero(sg.is_device == int(device))
    sel = sel[np.argsort(sg.t_start_s[sel], kind="stable")]
    return [
        (int(sg.step[i]), log.labels[sg.label[i]], sg.t_start_s[i] * 1e3, sg.t_end_s[i] * 1e3)
        for i in sel
    ]


def parts_of(p, i):
    return {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[i], strict=True) if abs(v) > 1e-3}


def assert_parts(got: dict, want: dict, tol=TOL_MS):
    """Every label within `tol` of what is wanted (labels not named: ~0)."""
    for k in set(got) | set(want):
        assert got.get(k, 0.0) == pytest.approx(want.get(k, 0.0), abs=tol), (k, got, want)


# -- launch vs execution ------------------------------------------------------------------


def test_host_window_is_the_launch_and_device_window_the_execution():
    rec, clock, dev = recorder(lag_ms=0.2, exec_ms=8.0)
    with rec:
        with rec.step():
            clock.advance(1.0)
            with rec.segment("decode", device=True):
                clock.advance(0.5)  # the launch takes 0.5 ms of host time
            rec.emit(["a"])
    log = rec.log()
    ((hs, hl, h0, h1),) = windows(log, device=False)
    ((ds, dl, d0, d1),) = windows(log, device=True)
    assert (hs, hl) == (ds, dl) == (0, "decode")
    assert h1 - h0 == pytest.approx(0.5, abs=0.01)
    assert d0 == pytest.approx(h0 + 0.2, abs=TOL_MS)  # starts one lag after the launch
    assert d1 - d0 == pytest.approx(8.0, abs=1e-6)  # the execution, not the launch
    cal = log.meta["device_calibration"]
    assert cal["timer"] == "fake" and cal["start_uncertainty_ms"] < TOL_MS
    assert cal["num_windows"] == 1
    assert log.meta["device_clock_drift_ppm"] == pytest.approx(0.0, abs=1.0)


def test_without_a_device_timer_device_segments_record_the_host_window_only():
    rec = Recorder(clock=FakeClock(), gc=False)
    with rec:
        with rec.step(), rec.segment("decode", device=True):
            pass
    log = rec.log()
    assert log.segments.is_device.tolist() == [0]
    assert "device_calibration" not in log.meta


def test_a_disabled_recorder_never_touches_the_device():
    clock = FakeClock()
    dev = FakeDeviceTimer(clock)
    rec = Recorder(enabled=False, device_timer=dev, clock=clock)
    with rec, rec.step(), rec.segment("decode", device=True):
        pass
    assert dev.num_events_made == 0 and dev.num_synchronizes == 0


# -- lazy resolution ----------------------------------------------------------------------


def test_windows_resolve_lazily_without_a_synchronize_on_the_hot_path():
    # The device falls behind (5 ms of work per 1 ms host step) and events report done
    # 2 ms late: each step end resolves only what has finished; stop resolves the rest.
    rec, clock, dev = recorder(exec_ms=5.0, resolve_delay_ms=2.0)
    resolved_at_step_end = []
    with rec:
        syncs = dev.num_synchronizes
        for _ in range(12):
            with rec.step():
                with rec.segment("decode", device=True):
                    clock.advance(0.2)
                clock.advance(0.8)
            resolved_at_step_end.append(dev.num_resolved_lazily)
        assert dev.num_synchronizes == syncs  # never on the hot path
        assert dev.num_pending > 0
    log = rec.log()
    assert resolved_at_step_end[0] == 0  # nothing is done when the first step ends
    assert 0 < resolved_at_step_end[-1] < 12  # some resolved lazily, in launch order
    assert resolved_at_step_end == sorted(resolved_at_step_end)
    cal = log.meta["device_calibration"]
    assert cal["num_resolved_lazily"] + cal["num_resolved_at_stop"] == cal["num_windows"] == 12
    dev_w = windows(log, device=True)
    assert [s for s, *_ in dev_w] == list(range(12))  # the launch's step, resolved later
    starts = np.array([w[2] for w in dev_w])
    ends = np.array([w[3] for w in dev_w])
    np.testing.assert_allclose(ends - starts, 5.0, atol=1e-6)
    np.testing.assert_allclose(starts[1:], ends[:-1], atol=1e-6)  # queued back to back
    # the run ends when the device does: the last window is inside the wall time
    assert ends[-1] <= log.wall_s * 1e3


def test_events_are_reused_once_resolved():
    rec, clock, dev = recorder(exec_ms=0.5)
    with rec:
        for _ in range(200):
            with rec.step():
                with rec.segment("decode", device=True):
                    pass
                clock.advance(1.0)
    assert len(windows(rec.log(), device=True)) == 200
    assert dev.num_events_made <= 16  # a small pool, not two events per segment


def test_windows_from_another_thread_keep_their_thread_and_no_step():
    import threading

    rec, clock, dev = recorder(exec_ms=1.0)
    with rec:
        with rec.step():
            t = threading.Thread(
                target=lambda: rec.segment("swap", device=True).__enter__().__exit__()
            )
            t.start()
            t.join()
    dev_w = windows(rec.log(), device=True)
    sg = rec.log().segments
    assert [w[:2] for w in dev_w] == [(-1, "swap")]
    assert sg.thread.tolist() == [1, 1]


def test_the_engine_raising_inside_a_device_segment_still_closes_both_windows(tmp_path):
    rec, clock, dev = recorder(exec_ms=3.0)
    rec.out = str(tmp_path / "run.npz")
    with pytest.raises(RuntimeError, match="engine died"):
        with rec:
            with rec.step(), rec.segment("decode", device=True):
                raise RuntimeError("engine died")
    assert not active_recorders()
    log = tracekit.load(tmp_path / "run.npz")
    assert sorted(log.segments.is_device.tolist()) == [0, 1]
    assert log.meta["device_calibration"]["num_windows"] == 1


def test_a_device_error_at_stop_keeps_the_host_log():
    rec, clock, dev = recorder(exec_ms=3.0)

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with rec:
        with rec.step(), rec.segment("decode", device=True):
            pass
        dev._synchronize = broken  # type: ignore[method-assign]
    log = rec.log()
    cal = log.meta["device_calibration"]
    assert "illegal memory access" in cal["error"] and cal["num_windows_lost"] == 1
    assert log.segments.is_device.tolist() == [0] and len(log.steps) == 1


def test_the_start_calibration_is_on_disk_before_the_run_ends(tmp_path):
    import json

    rec, clock, dev = recorder()
    rec.out = str(tmp_path / "run.npz")
    with rec:
        meta = json.loads((tmp_path / "run.npz.parts" / "meta.json").read_text())
        assert meta["device_calibration"]["timer"] == "fake"


# -- clocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("drift_ppm", [0.0, 150.0, -80.0])
def test_drift_between_the_clocks_is_measured(drift_ppm):
    rec, clock, dev = recorder(lag_ms=0.0, exec_ms=9.0, drift_ppm=drift_ppm)
    with rec:
        for _ in range(30):
            with rec.step():
                with rec.segment("decode", device=True):
                    pass
                clock.t = max(clock.t, dev.busy_until_ns)  # read the results: wait
    log = rec.log()
    # ~270 ms of run, calibration brackets of ~1 us: a few ppm of noise
    assert log.meta["device_clock_drift_ppm"] == pytest.approx(drift_ppm, abs=10.0)
    cal = log.meta["device_calibration"]
    assert cal["max_placement_err_ms"] == pytest.approx(abs(drift_ppm) * 1e-6 * 270, abs=0.01)
    # windows are 9 ms of device time, read on the device's (drifting) clock
    w = windows(log, device=True)
    assert w[0][3] - w[0][2] == pytest.approx(9.0 * (1 + drift_ppm * 1e-6), abs=1e-6)
    # and the run's analysis reports them
    from tracekit.analysis.figures import analyze
    from tracekit.render.text import run_details

    a = analyze(log)
    assert a.device_windows == 30
    assert a.device_clock_drift_ppm == log.meta["device_clock_drift_ppm"]
    assert a.device_max_placement_err_ms == cal["max_placement_err_ms"]
    assert "device clock drift" in run_details(a)


class _TruthTimer(FakeDeviceTimer):
    """The fake, also keeping where the stream really passed each segment's two events."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.truth_ns: list[list[int]] = []

    def _record(self, event, opens):
        super()._record(event, opens)
        if opens:
            self.truth_ns.append([event.at_ns])
        elif self.truth_ns and len(self.truth_ns[-1]) == 1:
            self.truth_ns[-1].append(event.at_ns)  # a segment's end (calibrations: not)


def _idle_hours_run(**timer_settings):
    """Windows separated by two idle stretches of about an hour, elapsed times in float32
    ms (as CUDA returns them: 0.25 ms steps at an hour). Returns (worst real placement
    error, the reported bound, the calibration meta), in ms."""
    clock = FakeClock(step_ns=1_000)
    dev = _TruthTimer(clock, lag_ms=0.01, exec_ms=2.0, float32_elapsed=True)
    for k, v in timer_settings.items():
        setattr(dev, k, v)
    rec = Recorder(clock=clock, gc=False, device_timer=dev)
    with rec:
        for idle_ms in (0.0, 3_600_000.0625, 3_600_000.15):
            clock.advance(idle_ms)
            for _ in range(3):
                with rec.step():
                    with rec.segment("decode", device=True):
                        pass
                    clock.t = max(clock.t, dev.busy_until_ns)  # read the results
    log = rec.log()
    origin = log.meta["t0_tick"]
    placed = np.array(windows(log, device=True))[:, 2:].astype(float)  # ms from origin
    truth = (np.array(dev.truth_ns, dtype=float) - origin) / 1e6
    assert placed.shape == truth.shape == (9, 2)
    cal = log.meta["device_calibration"]
    return float(np.abs(placed - truth).max()), cal["max_placement_err_ms"], cal


def test_placement_bound_holds_and_reanchoring_keeps_it_tight_after_idle_hours():
    err, bound, cal = _idle_hours_run()
    # each idle stretch ends in a re-anchor: no window is placed across an hour's float32
    # elapsed time, and the reported bound (brackets of a few 1 us clock reads) holds
    assert cal["num_reanchors"] == 2
    assert err <= bound
    assert bound < 0.01


def test_placement_bound_holds_without_reanchoring():
    # the same run chained across both hours: float32 rounding of a 3.6e6 ms elapsed time
    # is up to 0.125 ms (spacing 0.25 ms) and every later window inherits it. The bound
    # carries that rounding, so it still holds (the stop calibration alone can show almost
    # nothing when the two hours' rounding errors cancel).
    err, bound, cal = _idle_hours_run(reanchor_after_ms=math.inf, reanchor_err_ms=math.inf)
    assert cal["num_reanchors"] == 0
    assert err > 0.05  # the rounding is real
    assert err <= bound
    # here the two hours' rounding errors largely cancel by the stop calibration: what it
    # shows (its mismatch and both brackets) is far below the real error
    stop_only = (
        abs(cal["stop_predicted_minus_observed_ms"])
        + cal["start_uncertainty_ms"]
        + cal["stop_uncertainty_ms"]
    )
    assert stop_only < err / 2
    # the bound: rounding carried, two hour-long elapsed times of up to 0.125 each (0.25),
    # plus what the stop calibration cannot tell apart from drift: its mismatch (at most that
    # same rounding, 0.25) and the rounding again (0.25); brackets of a few us on top
    assert bound <= 3 * 0.25 + 0.01


def test_reanchoring_never_synchronises_and_gives_up_on_a_busy_device():
    # the device is busy with work tracekit did not launch (10 ms queued) when a segment
    # opens after an idle stretch: the re-anchor spins at most reanchor_max_spin_ms, gives
    # up, and the chain goes on; the placement bound still holds
    clock = FakeClock(step_ns=1_000)
    dev = _TruthTimer(clock, lag_ms=0.01, exec_ms=2.0, float32_elapsed=True)
    rec = Recorder(clock=clock, gc=False, device_timer=dev)
    with rec:
        with rec.step():
            with rec.segment("decode", device=True):
                pass
            clock.t = max(clock.t, dev.busy_until_ns)
        clock.advance(5_000.0)
        dev.launch(10.0)  # someone else's kernels
        syncs = dev.num_synchronizes
        t_open = clock.t
        with rec.step():
            with rec.segment("decode", device=True):
                assert clock.t - t_open < 0.3e6  # spun at most ~0.2 ms
            clock.t = max(clock.t, dev.busy_until_ns)
        assert dev.num_synchronizes == syncs
        assert dev.num_reanchors == 0
    log = rec.log()
    origin = log.meta["t0_tick"]
    placed = np.array(windows(log, device=True))[:, 2:].astype(float)
    truth = (np.array(dev.truth_ns, dtype=float) - origin) / 1e6
    assert np.abs(placed - truth).max() <= log.meta["device_calibration"]["max_placement_err_ms"]


# -- the partition of recorded runs -----------------------------------------------------------


def sync_run(*, exec_ms, schedule_ms=1.0, launch_ms=0.5, lag_ms=0.2, num_steps=6):
    """Synchronous engine: schedule, launch, wait for the results, emit."""
    rec, clock, dev = recorder(lag_ms=lag_ms, exec_ms=exec_ms)
    with rec:
        for _ in range(num_steps):
            with rec.step():
                with rec.segment("schedule"):
                    clock.advance(schedule_ms)
                with rec.segment("decode", device=True):
                    clock.advance(launch_ms)
                clock.t = max(clock.t, dev.busy_until_ns)  # .cpu(): wait for the device
                rec.emit(["a"])
    return rec.log()


@pytest.mark.parametrize("impl", IMPLS)
def test_sync_engine_gap_is_schedule_launch_and_device_time(impl):
    # Each gap: schedule 1, host launch until the device starts (lag 0.2: forward), device
    # 8 (forward). The host decode timer says 0.5 ms; the device ran 8.
    log = sync_run(exec_ms=8.0)
    p = impl(log)
    for i in range(len(p)):
        assert_parts(parts_of(p, i), {"schedule": 1.0, "forward": 8.2})
        assert p.gap_ms[i] == pytest.approx(9.2, abs=TOL_MS)
    host = windows(log, device=False)
    dev = windows(log, device=True)
    host_dec = [b - a for s, lb, a, b in host if lb == "decode"]
    dev_dec = [b - a for s, lb, a, b in dev]
    assert np.allclose(host_dec, 0.5, atol=0.01) and np.allclose(dev_dec, 8.0)


def async_run(*, exec_ms, hidden_tok_ms=0.0, stall_at=-1, num_steps=8):
    """Async scheduling: iteration k schedules and launches step k while the device runs
    k - 1, then reads k - 1's results and emits them. In iteration `stall_at` the host also
    tokenizes for `hidden_tok_ms` after the launch."""
    rec, clock, dev = recorder(lag_ms=0.05, exec_ms=exec_ms)
    done_at: list[int] = []
    with rec:
        for k in range(num_steps + 1):
            with rec.step():
                if k < num_steps:
                    with rec.segment("schedule"):
                        clock.advance(1.0)
                    with rec.segment("decode", device=True):
                        clock.advance(0.3)
                    done_at.append(dev.busy_until_ns)
                if k == stall_at:
                    with rec.segment("tok"):
                        clock.advance(hidden_tok_ms)
                if k >= 1:
                    clock.t = max(clock.t, done_at[k - 1])  # read step k - 1's results
                    rec.emit(["a"], reads_step=k - 1)
    return rec.log()


@pytest.mark.parametrize("impl", IMPLS)
def test_async_scheduling_hides_host_work_under_device_time(impl):
    # The device is the bottleneck (6 ms per step vs 1.3 ms of host work): in steady state
    # every gap is 6 ms of back-to-back device work, all forward; the host's schedule,
    # launch and a 3 ms tokenizer call in iteration 4 ran while the device computed and
    # are charged nothing.
    log = async_run(exec_ms=6.0, hidden_tok_ms=3.0, stall_at=4)
    p = impl(log)
    for i in range(1, len(p)):  # the first gap includes the pipeline's fill
        assert_parts(parts_of(p, i), {"forward": 6.0})
    assert p.reconcile_max_err_ms < 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_async_scheduling_host_bound_gap_is_the_host_iteration(impl):
    # The host is the bottleneck (1 ms of device work per step, 1.3 ms of host work): step
    # k's device work runs under iteration k + 1's schedule and finishes 0.25 ms before the
    # host reads it. The emission waited for the host, not the device (the host was busy
    # when the device finished): each gap is schedule 1 + launch 0.3 (forward). The last
    # gap drains the pipeline: the host only waits for step 7, so it is device-bound.
    log = async_run(exec_ms=1.0)
    p = impl(log)
    for i in range(1, len(p) - 1):
        assert_parts(parts_of(p, i), {"schedule": 1.0, "forward": 0.3})
        assert p.gap_ms[i] == pytest.approx(1.3, abs=TOL_MS)
    assert_parts(parts_of(p, len(p) - 1), {"forward": p.gap_ms[-1]})


@pytest.mark.parametrize("impl", IMPLS)
def test_async_stall_longer_than_the_device_step_is_charged_to_the_stall(impl):
    # docs/gpu.md, "A host stall longer than a device step".
    # Iteration 1 schedules 0.3..1.0 and launches step 1 at 1.0..1.3 (queued behind step 0,
    # which runs 0.05..6.05), then tokenizes 1.3..13.3, then reads step 0 and emits it at
    # 13.3. The emission waited for the host (step 0 was done at 6.05, while the host
    # tokenized): the critical path from the previous emission (0.3) is the host's own:
    # schedule 0.7, launch 0.3 (forward), tok 12. Step 1's device work (6.05..12.05) ran
    # meanwhile, but step 0's emission does not read it, so it owns nothing here.
    b = LogBuilder()
    s0 = b.step(-1.0, 0.3)
    b.seg(s0, "schedule", -1.0, 0.0)
    b.seg(s0, "decode", 0.0, 0.3)
    b.seg(s0, "decode", 0.05, 6.05, device=True)
    b.emit(0, 0.3, s0)  # (the previous token, read at the end of iteration 0)
    s1 = b.step(0.3, 13.3)
    b.seg(s1, "schedule", 0.3, 1.0)
    b.seg(s1, "decode", 1.0, 1.3)
    b.seg(s1, "decode", 6.05, 12.05, device=True)
    b.seg(s1, "tok", 1.3, 13.3)
    b.emit(0, 13.3, s1, reads=s0)
    p = impl(b.build())
    assert_parts(parts_of(p, 0), {"schedule": 0.7, "forward": 0.3, "tok": 12.0}, tol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_another_requests_prefill_only_step_is_on_the_critical_path(impl):
    # An engine that runs prefill and decode batches separately (as SGLang does). Request 0
    # emits at 0; step 1 is request 1's prefill alone: schedule 0..1, launch 1..1.5, device
    # prefill 1.7..11.7, the host waits (unsegmented) and emits request 1's first token at
    # 12; step 2 decodes request 0: schedule 12..13, launch 13..13.5, device decode
    # 13.7..23.7, emission at 24 reading step 2. The device finished step 2 with the host
    # idle: device-bound. Step 1's device work ended before step 2's (one in-order stream),
    # so it is on the gap's critical path too:
    #   schedule 1 + 1 = 2; prefill: launch 0.5 + device 10 = 10.5; forward: launch 0.5 +
    #   device 10 = 10.5; residual 1.5..1.7, 11.7..12, 13.5..13.7, 23.7..24 = 1.0. Sum 24.
    b = LogBuilder()
    b.emit(0, 0, -1)
    s1 = b.step(0, 12, n_decode=0, n_prefill=64, graph=-1)
    b.seg(s1, "schedule", 0, 1)
    b.seg(s1, "prefill", 1, 1.5)
    b.seg(s1, "prefill", 1.7, 11.7, device=True)
    b.emit(1, 12, s1)
    s2 = b.step(12, 24, graph=1)
    b.seg(s2, "schedule", 12, 13)
    b.seg(s2, "decode", 13, 13.5)
    b.seg(s2, "decode", 13.7, 23.7, device=True)
    b.emit(0, 24, s2)
    p = impl(b.build())
    assert len(p) == 1
    assert_parts(
        parts_of(p, 0),
        {"schedule": 2.0, "prefill": 10.5, "forward": 10.5, "residual": 1.0},
        tol=1e-9,
    )
    assert p.primary_names()[0] == "prefill"  # 10.5 >= 1 ms and >= 25% of 24


def _sync_gap_with_a_busy_host_at_the_device_finish(shift_ms: float, busy: str):
    """A synchronous step: schedule 0..1, launch 1..1.5, device decode (1.6..9.3) + shift,
    the host waits (unsegmented) and emits at 10; `busy` ("gc", or "tok" on another
    thread) occupies the host 9.0..9.6, around the device's finish."""
    b = LogBuilder()
    b.emit(0, 0, -1)
    s = b.step(0, 10, graph=1)
    b.seg(s, "schedule", 0, 1)
    b.seg(s, "decode", 1, 1.5)
    b.seg(s, "decode", 1.6 + shift_ms, 9.3 + shift_ms, device=True)
    if busy == "gc":
        b.gc(9.0, 9.6)
    else:
        b.seg(-1, "tok", 9.0, 9.6, thread=1)
    b.emit(0, 10, s)
    return b.build()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("busy", ["gc", "tok"])
def test_a_pause_or_another_threads_call_spanning_the_device_finish_is_charged_from_it_on(
    impl, busy
):
    # The device finishes at 9.3, inside the 9.0..9.6 pause (or the other thread's call).
    # Neither is the loop thread's own work, and the loop thread has none at 9.3 (it waits,
    # unsegmented): device-bound. The window 1.6..9.3 owns all of its time (7.7: the part of
    # the pause before 9.3 is hidden); after 9.3 the host rules: busy 9.3..9.6 = 0.3.
    # schedule 1, forward 0.5 (launch) + 7.7 = 8.2, busy 0.3, residual 1.5..1.6 + 9.6..10 =
    # 0.5. Sum 10.
    p = impl(_sync_gap_with_a_busy_host_at_the_device_finish(0.0, busy))
    assert_parts(
        parts_of(p, 0),
        {"schedule": 1.0, "forward": 8.2, busy: 0.3, "residual": 0.5},
        tol=1e-9,
    )
    # 0.4 ms later the device finishes at 9.7, after the pause: device-bound, the window
    # 2.0..9.7 owns all of its time (the pause is hidden): schedule 1, forward 0.5 + 7.7,
    # residual 1.5..2.0 + 9.7..10 = 0.8
    p = impl(_sync_gap_with_a_busy_host_at_the_device_finish(0.4, busy))
    assert_parts(parts_of(p, 0), {"schedule": 1.0, "forward": 8.2, "residual": 0.8}, tol=1e-9)


@pytest.mark.parametrize("busy", ["gc", "tok"])
def test_what_a_misplaced_device_window_can_move_is_bounded(busy):
    # docs/gpu.md's bound: moving a gap's device windows by e changes its parts by at most
    # 4e per window (in L1: e at each end, taken from one label and given to another) plus
    # twice the loop thread's own work inside its windows. Here one window and no own work
    # inside it (the launch 1..1.5 lies before it; the pause or the other thread's call is
    # not the loop thread's own work): at most 4|e| at every shift.
    base = partition(_sync_gap_with_a_busy_host_at_the_device_finish(0.0, busy)).parts_ms[0]
    worst = 0.0
    for e in np.linspace(-0.5, 0.5, 41):
        got = partition(_sync_gap_with_a_busy_host_at_the_device_finish(e, busy)).parts_ms[0]
        moved = float(np.abs(got - base).sum())
        assert moved <= 4 * abs(e) + 1e-9, (e, moved)
        worst = max(worst, moved)
    # a 20 us shift across the pause's end (finish at 9.58 vs 9.62) moves at most
    # 4 * 0.04 = 0.16 ms, not the pause's 0.6 ms nor the window's 7.7 ms
    a = partition(_sync_gap_with_a_busy_host_at_the_device_finish(0.28, busy)).parts_ms[0]
    c = partition(_sync_gap_with_a_busy_host_at_the_device_finish(0.32, busy)).parts_ms[0]
    assert float(np.abs(a - c).sum()) <= 0.16 + 1e-9
    assert worst > 0  # the shifts did move something: the check is not vacuous


def _drifting_chain_log(with_chains: bool):
    # Gap [45, 62]: schedule 45..46, the host waits (unsegmented), then `sample` 58.9..62 and
    # the emission at 62. The device window is recorded at 50..60, on a chain that started
    # at 0 and was found 2 ms late when it ended at 100 (a steady drift: 0.02 ms per ms).
    import dataclasses

    b = LogBuilder()
    b.emit(0, 45, -1)
    s = b.step(45, 62, graph=1)
    b.seg(s, "schedule", 45, 46)
    b.seg(s, "decode", 46, 46.5)
    b.seg(s, "decode", 50, 60, device=True)
    b.seg(s, "sample", 58.9, 62)
    b.emit(0, 62, s)
    log = b.build(wall_ms=100)
    chains = [{"start_host_s": 0.0, "end_host_s": 0.1, "predicted_minus_observed_ms": 2.0}]
    cal = {"max_placement_err_ms": 2.0, "chains": chains} if with_chains else {}
    return dataclasses.replace(log, meta={"device_calibration": cal})


@pytest.mark.parametrize("impl", IMPLS)
def test_the_measured_drift_moves_device_windows_before_the_partition(impl):
    # Corrected, the window is 0.98 * (50..60) = 49..58.8: it ends before `sample` starts,
    # with the host idle, so the gap is device-bound: schedule 1, forward launch 0.5 +
    # device 9.8 = 10.3, residual 46.5..49 + 58.8..58.9 = 2.6, sample 3.1. Sum 17.
    p = impl(_drifting_chain_log(True))
    assert_parts(
        parts_of(p, 0),
        {"schedule": 1.0, "forward": 10.3, "residual": 2.6, "sample": 3.1},
        tol=1e-9,
    )
    # As recorded (no chains in the meta), it ends at 60, inside `sample`: host-bound, the
    # window owns only the host-idle time inside it, 50..58.9 = 8.9: forward 0.5 + 8.9,
    # residual 46.5..50 = 3.5, schedule 1, sample 3.1.
    p = impl(_drifting_chain_log(False))
    assert_parts(
        parts_of(p, 0),
        {"schedule": 1.0, "forward": 9.4, "residual": 3.5, "sample": 3.1},
        tol=1e-9,
    )


@pytest.mark.parametrize(
    "cal",
    [[1, 2], "chains", {"chains": "x"}, {"chains": [{"start_host_s": None}]}, {"chains": [7]}],
)
def test_a_calibration_meta_not_written_by_the_timer_leaves_windows_as_recorded(cal):
    import dataclasses

    log = _drifting_chain_log(False)
    odd = dataclasses.replace(log, meta={"device_calibration": cal})
    np.testing.assert_array_equal(partition(odd).parts_ms, partition(log).parts_ms)


def test_device_rule_memory_is_linear_in_windows_and_gaps():
    # 20,000 device windows of one step (0.5 ms each, 1 ms apart), read by 20,000 emissions:
    # 10,000 requests, each emitting at 0 and at 20,000 ms, so every gap spans every window.
    # Pairing gaps with windows would be 2e8 pairs (gigabytes); the rule needs only arrays
    # the size of the windows and of the gaps. Each gap: the host is idle throughout, so it
    # is device-bound: forward 20,000 * 0.5 = 10,000 ms, residual the other 10,000.
    import tracemalloc

    from tracekit.log.rawlog import (
        Counters,
        Emissions,
        Evictions,
        GcPauses,
        RawLog,
        Requests,
        Segments,
        Steps,
    )

    n_win, n_req = 20_000, 10_000
    t = np.arange(n_win) * 1e-3
    one = np.ones(1, dtype=np.int64)
    log = RawLog(
        steps=Steps(np.zeros(1), np.full(1, 20.0), one, 0 * one, one, 0 * one, 0 * one),
        segments=Segments(
            step=np.zeros(n_win, dtype=np.int64),
            label=np.full(n_win, 3, dtype=np.int64),
            t_start_s=t,
            t_end_s=t + 0.5e-3,
            thread=np.zeros(n_win, dtype=np.int64),
            is_device=np.ones(n_win, dtype=np.int8),
        ),
        gc_pauses=GcPauses(np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)),
        emissions=Emissions(
            request=np.repeat(np.arange(n_req), 2),
            t_s=np.tile([0.0, 20.0], n_req),
            step=np.tile([-1, 0], n_req),
            num_tokens=np.ones(2 * n_req, dtype=np.int64),
            device_step=np.tile([-1, 0], n_req),
        ),
        evictions=Evictions(
            np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64)
        ),
        requests=Requests(
            arrival_s=np.zeros(n_req),
            prompt_tokens=np.full(n_req, 10),
            max_new_tokens=np.full(n_req, 2),
            first_token_s=np.zeros(n_req),
        ),
        counters=Counters.empty(),
        labels=("tok", "swap", "prefill", "decode"),
        request_ids=tuple(str(i) for i in range(n_req)),
        wall_s=20.0,
    )
    tracemalloc.start()
    try:
        p = partition(log)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    np.testing.assert_allclose(p.column("forward"), 10_000.0, rtol=0, atol=1e-6)
    np.testing.assert_allclose(p.column("residual"), 10_000.0, rtol=0, atol=1e-6)


# -- on a real GPU ----------------------------------------------------------------------------


def _has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


needs_cuda = pytest.mark.skipif(not _has_cuda(), reason="needs torch with a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_event_windows_cover_the_kernels_and_never_synchronise_on_the_hot_path(monkeypatch):
    import torch

    from tracekit.capture.device import CudaEventTimer

    x = torch.randn(2048, 2048, device="cuda")
    timer = CudaEventTimer()
    rec = Recorder(gc=False, device_timer=timer)
    with rec:
        real_sync = torch.cuda.synchronize
        calls = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a) or real_sync(*a))
        for _ in range(20):
            with rec.step():
                with rec.segment("decode", device=True):
                    for _ in range(8):
                        x = torch.tanh(x @ x) * 0.5
        hot_path_syncs = len(calls)
        monkeypatch.undo()
    log = rec.log()
    assert hot_path_syncs == 0
    host = windows(log, device=False)
    dev = windows(log, device=True)
    assert len(host) == len(dev) == 20
    dev_ms = np.array([b - a for *_, a, b in dev])
    host_ms = np.array([b - a for *_, a, b in host])
    assert (dev_ms > 0).all()
    assert np.median(dev_ms) > np.median(host_ms)  # the host timer saw the launches only
    starts = np.array([w[2] for w in dev])
    ends = np.array([w[3] for w in dev])
    assert (starts[1:] >= ends[:-1] - 0.01).all()  # one stream, in order
    assert abs(log.meta["device_clock_drift_ppm"]) < 1000
    assert log.meta["device_calibration"]["start_uncertainty_ms"] < 1.0


def _drifting_run_with_reanchors(drift_ppm: float):
    """Three busy stretches of 10 ms device windows (0.4 s each), 1.5 s idle between them
    (each idle stretch ends in a re-anchor), stop right after the last window: returns
    (log, true windows in ms from the log's origin)."""
    clock = FakeClock(step_ns=1_000)
    dev = _TruthTimer(clock, lag_ms=0.01, exec_ms=10.0, drift_ppm=drift_ppm)
    rec = Recorder(clock=clock, gc=False, device_timer=dev)
    with rec:
        for idle_ms in (0.0, 1_500.0, 1_500.0):
            clock.advance(idle_ms)
            for _ in range(40):
                with rec.step():
                    with rec.segment("decode", device=True):
                        pass
                    clock.t = max(clock.t, dev.busy_until_ns)  # read the results
    log = rec.log()
    truth = (np.array(dev.truth_ns, dtype=float) - log.meta["t0_tick"]) / 1e6
    return log, truth


@pytest.mark.parametrize("drift_ppm", [200.0, -200.0])
def test_drift_correction_puts_every_boundary_within_1_us_of_the_truth(drift_ppm):
    # A steady drift of 200 ppm: a window at time t of a chain [c0, c1] that ended m ms off
    # is placed m * (t - c0) / (c1 - c0) late. Corrected, every boundary is within 1 us of
    # where the stream really passed it, including a window end that the chain placed past
    # the chain's observed end (the last window before stop, the last before each
    # re-anchor): both ends of a window take the correction of the chain its start lies in.
    log, truth = _drifting_run_with_reanchors(drift_ppm)
    cal = log.meta["device_calibration"]
    assert cal["num_reanchors"] == 2
    placed = np.array(windows(log, device=True))[:, 2:].astype(float)
    assert np.abs(placed - truth).max() > 0.05  # uncorrected, the drift shows (~80 us)
    sg = drift_corrected(log).segments
    dev = np.flatnonzero(sg.is_device == 1)
    dev = dev[np.argsort(sg.t_start_s[dev], kind="stable")]
    got = np.column_stack([sg.t_start_s[dev], sg.t_end_s[dev]]) * 1e3  # ms from the origin
    assert got.shape == truth.shape == (120, 2)
    err = np.abs(got - truth)
    assert err.max() <= 1e-3, (err.max(), np.unravel_index(err.argmax(), err.shape))


def test_a_window_end_past_its_chain_or_a_reanchor_takes_its_start_chains_correction():
    # Chains [0, 100] ms found 2 ms late at its end and [100, 200] found 1 ms late (a
    # re-anchor at 100). Window A 95..101 starts in the first chain: both ends move by
    # 2 * t / 100: 95 - 1.9 = 93.1 and 101 - 2.02 = 98.98 (not by the second chain's
    # 1 * 1 / 100 at its end). Window B 101..150 starts in the second: 101 - 0.01 = 100.99,
    # 150 - 0.5 = 149.5. Window C 205..206 starts after the second chain's placed end (201):
    # no chain placed it, it stays.
    import dataclasses

    b = LogBuilder()
    s = b.step(90, 210, graph=1)
    b.seg(s, "decode", 95, 101, device=True)
    b.seg(s, "decode", 101, 150, device=True)
    b.seg(s, "decode", 205, 206, device=True)
    b.emit(0, 210, s)
    log = b.build(wall_ms=300)
    chains = [
        {"start_host_s": 0.0, "end_host_s": 0.1, "predicted_minus_observed_ms": 2.0},
        {"start_host_s": 0.1, "end_host_s": 0.2, "predicted_minus_observed_ms": 1.0},
    ]
    log = dataclasses.replace(log, meta={"device_calibration": {"chains": chains}})
    sg = drift_corrected(log).segments
    dev = np.flatnonzero(sg.is_device == 1)
    starts, ends = (sg.t_start_s[dev] * 1e3).tolist(), (sg.t_end_s[dev] * 1e3).tolist()
    got = sorted(zip(starts, ends, strict=True))
    want = [(93.1, 98.98), (100.99, 149.5), (205.0, 206.0)]
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-9)
