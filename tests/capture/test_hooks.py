"""Recorder tests with a fake clock: exact ticks in, exact rows out."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

import tracekit
from tracekit.capture.recorder import Recorder


class FakeClock:
    """Advances 1 ms per read by the thread that made it unless told otherwise (the
    recorder's writer thread, whenever a busy machine runs it, reads it unmoved); ticks are
    nanoseconds."""

    def __init__(self, start_ns: int = 5_000_000_000, step_ns: int = 1_000_000) -> None:
        self.t = start_ns
        self.step_ns = step_ns
        self.owner = threading.get_ident()

    def __call__(self) -> int:
        if threading.get_ident() == self.owner:
            self.t += self.step_ns
        return self.t

    def advance(self, ms: float) -> None:
        self.t += int(ms * 1e6)


def test_step_segments_emissions_and_evictions_with_a_fake_clock(tmp_path):
    clock = FakeClock()
    out = tmp_path / "run.npz"
    rec = Recorder(out, config={"rung": "baseline", "seed": 3}, clock=clock, gc=False)
    with rec:  # start reads the clock: t=1 ms
        rec.request("a", prompt_tokens=12, max_new_tokens=40)  # 2
        rec.request("b", prompt_tokens=7, max_new_tokens=5)  # 3
        with rec.step():  # 4
            with rec.segment("prefill"):  # 5 .. 6
                pass
            rec.evict("b", mode="recompute")  # 7
            with rec.segment("decode"):  # 8 .. 9
                pass
            rec.emit(["a"])  # 10
            rec.step_info(num_prefill_tokens=19, graph_size=4)
        # end 11
        with rec.step():  # 12
            rec.readmit("b")  # 13
            rec.emit(["a", "b"], num_tokens=[1, 3])  # 14
        # end 15; stop 16
    log = tracekit.load(out)
    ms = 1e-3
    np.testing.assert_allclose(log.steps.t_start_s, [3 * ms, 11 * ms])
    np.testing.assert_allclose(log.steps.t_end_s, [10 * ms, 14 * ms])
    assert log.steps.num_decode.tolist() == [1, 2]  # default: the step's emission rows
    assert log.steps.num_prefill_tokens.tolist() == [19, 0]
    assert log.steps.graph_size.tolist() == [4, 2]
    assert log.steps.num_preempted.tolist() == [1, 0]  # counted from evict() calls
    assert log.steps.num_swapped_in.tolist() == [0, 1]
    assert log.labels == ("prefill", "decode")
    np.testing.assert_allclose(log.segments.t_start_s, [4 * ms, 7 * ms])
    np.testing.assert_allclose(log.segments.t_end_s, [5 * ms, 8 * ms])
    assert log.segments.step.tolist() == [0, 0]
    assert log.request_ids == ("a", "b")
    assert log.emissions.request.tolist() == [0, 0, 1]
    assert log.emissions.num_tokens.tolist() == [1, 1, 3]
    np.testing.assert_allclose(log.emissions.t_s, [9 * ms, 13 * ms, 13 * ms])
    np.testing.assert_allclose(log.evictions.t_evict_s, [6 * ms])
    np.testing.assert_allclose(log.evictions.t_readmit_s, [12 * ms])
    assert log.evictions.mode.tolist() == [1]
    np.testing.assert_allclose(log.requests.arrival_s, [1 * ms, 2 * ms])
    np.testing.assert_allclose(log.requests.first_token_s, [9 * ms, 13 * ms])
    assert log.requests.prompt_tokens.tolist() == [12, 7]
    assert log.wall_s == pytest.approx(15 * ms)
    assert log.config == {"rung": "baseline", "seed": 3}
    # the run is its parts folder, stopped (final.json); run.npz names it
    assert (tmp_path / "run.npz.parts" / "final.json").exists()


def test_decorators_record_and_disabled_recorder_returns_the_original_function():
    rec = Recorder(clock=FakeClock(), gc=False)

    @rec.segment("tok")
    def tokenize(x):
        return x * 2

    @rec.step
    def step():
        return tokenize(21)

    with rec:
        assert step() == 42
    log = rec.log()
    assert len(log.steps) == 1 and log.labels == ("tok",) and log.segments.step.tolist() == [0]

    off = Recorder(enabled=False)

    def f():
        return 1

    assert off.step(f) is f
    assert off.segment("tok")(f) is f
    with off, off.step(), off.segment("decode"):
        off.emit(["x"])
        off.evict("x")
    assert not gc.callbacks or off._on_gc not in gc.callbacks


def test_gc_callbacks_record_real_collections_and_are_removed():
    rec = Recorder(gc=True)
    with rec:
        assert rec._on_gc in gc.callbacks
        gc.collect(0)
        gc.collect(2)
    assert rec._on_gc not in gc.callbacks
    g = rec.log().gc_pauses
    assert {0, 2} <= set(g.generation.tolist())
    assert (g.t_end_s >= g.t_start_s).all()


def test_hooks_are_removed_when_the_engine_raises():
    rec = Recorder(gc=True)
    with pytest.raises(RuntimeError, match="engine died"):
        with rec:
            with rec.step():
                raise RuntimeError("engine died")
    assert rec._on_gc not in gc.callbacks and not rec.running


def test_segments_from_another_thread_are_outside_steps():
    import threading

    rec = Recorder(clock=FakeClock(), gc=False)
    with rec:
        with rec.step():
            t = threading.Thread(target=lambda: rec.segment("tok").__enter__().__exit__())
            t.start()
            t.join()
    log = rec.log()
    assert log.segments.step.tolist() == [-1] and log.segments.thread.tolist() == [1]


def test_flushes_parts_at_the_interval_and_merges_them(tmp_path):
    clock = FakeClock(step_ns=400_000_000)  # 0.4 s per read: flushes every few steps
    out = tmp_path / "r.npz"
    rec = Recorder(out, clock=clock, gc=False, flush_interval_s=1.0)
    with rec:
        for _ in range(10):
            with rec.step():
                rec.emit(["x"])
        flushed = rec._rows.num_flushes  # parts handed to the writer while running
    assert flushed >= 3  # 10 steps x ~1.2 s each at a 1 s interval
    log = tracekit.load(out)
    assert len(log.steps) == 10 and len(log.emissions) == 10


def test_a_recorder_records_one_run():
    rec = Recorder(gc=False)
    with rec:
        pass
    with pytest.raises(RuntimeError, match="one run"):
        rec.start()


def test_steps_do_not_nest():
    rec = Recorder(gc=False, clock=FakeClock())
    with rec:
        with rec.step():
            with pytest.raises(RuntimeError, match="do not nest"):
                rec._begin_step()


def test_attached_arrays_are_saved_with_the_run(tmp_path):
    trace = np.array([[0, 0.5, 1000, 300], [1, 0.9, 800, 120]], dtype=np.float64)
    rec = Recorder(tmp_path / "run.npz", clock=FakeClock(), gc=False)
    with rec:
        rec.attach("trace", trace)
        with pytest.raises(TypeError, match="numeric"):
            rec.attach("notes", np.array(["x"]))
    np.testing.assert_array_equal(tracekit.load(tmp_path / "run.npz").extras["trace"], trace)


def test_an_idle_engine_still_flushes_its_arrivals(tmp_path):
    clock = FakeClock(step_ns=400_000_000)  # 0.4 s per read
    rec = Recorder(tmp_path / "r.npz", clock=clock, gc=False, flush_interval_s=1.0)
    with rec:
        for i in range(10):  # arrivals only: no step ever runs
            rec.request(f"q{i}")
        flushed = rec._rows.num_flushes
        with rec.step():  # a step opened on the loop: arrivals meanwhile do not flush it
            before = rec._rows.num_flushes
            for i in range(10, 15):
                rec.request(f"q{i}")
            assert rec._rows.num_flushes == before
    # the first at 1.2 s; while it waits for the writer, arrivals are kept up to two
    # intervals, then handed over once it is taken (the backlog's rule, as at a step's end)
    assert flushed >= 2
    assert len(tracekit.load(tmp_path / "r.npz").requests) == 15


def test_emit_handles_takes_a_strided_view_of_handles():
    """Every other request of a batch, as a view with a stride (`handles[::2]`): one row per
    handle, in order (the handles were copied through a cast that refuses strided views,
    raising after the batch had been marked as emitted)."""
    rec = Recorder(clock=FakeClock(), gc=False)
    with rec:
        handles = np.array([rec.request(f"r{i}") for i in range(40)], dtype=np.int64)
        with rec.step():
            rec.emit_handles(handles[::2])
            rec.emit_handles(handles[1::2], np.arange(1, 21)[::-1])  # counts: a reversed view
    e = rec.log().emissions
    assert e.request.tolist() == list(range(0, 40, 2)) + list(range(1, 40, 2))
    assert e.num_tokens.tolist() == [1] * 20 + list(range(20, 0, -1))
