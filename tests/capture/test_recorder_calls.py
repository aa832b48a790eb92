"""Recorder calls, as careless and hostile code makes them: a wrong argument raises at the
call, naming it, and records nothing of that call; a call that would make an invalid log
is refused; a signal at any instant of a step leaves a log that loads; the handle API
records exactly what the id API does; a `kill -9` under load loses at most about one
flush interval of rows.

Expected values come from the rules: docs/design.md (rows of a run), the rejection list in
`tracekit.log.validate` (what a log must not hold), `tracekit.capture.checks` (what an
argument may be).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from logfiles import one_file_arrays, part_files
from procs import python

import tracekit
from tracekit.log.parts import merge_parts
from tracekit.log.validate import validate_log


class ManualClock:
    """Integer nanoseconds that move only when the test says (a failed call that reads
    the clock cannot shift later ticks)."""

    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now

    def tick(self, ns: int = 1_000_000) -> None:
        self.now += ns


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    """Every array of a saved log (its one-file form) but `meta` (pid, start time: not the
    run's rows)."""
    return {k: v for k, v in one_file_arrays(path).items() if k != "meta"}


def assert_same_log(a: Path, b: Path) -> None:
    x, y = arrays_of(a), arrays_of(b)
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), k


def small_run(rec: tracekit.Recorder, clk: ManualClock, bad=None, *, by_handle=False) -> None:
    """Two requests, three steps (admission, a prompt chunk, a wait, two segments, an
    emission, an eviction and readmission, a counter); `bad(rec)` is called inside the
    second step and must raise; the run goes on as if it had not been made."""
    with rec:
        ha = rec.request("a", prompt_tokens=12, max_new_tokens=3)
        clk.tick()
        hb = rec.request("b", prompt_tokens=5, max_new_tokens=3)
        for i in range(3):
            clk.tick()
            with rec.step():
                if i == 0:
                    if by_handle:
                        rec.admit_handle(ha)
                        rec.prefill_handles([ha], [12])
                        rec.wait_handles(np.array([hb]), "max_num_seqs")
                    else:
                        rec.admit("a")
                        rec.prefill("a", 12)
                        rec.wait(["b"], "max_num_seqs")
                if i == 1:
                    if by_handle:
                        rec.admit_handle(hb)
                        rec.prefill_handles(np.array([hb]), np.array([5]))
                    else:
                        rec.admit("b")
                        rec.prefill("b", 5)
                    if bad is not None:
                        with pytest.raises((TypeError, ValueError)) as e:
                            bad(rec)
                        assert "Traceback" not in str(e.value) and "\n" not in str(e.value)
                with rec.segment("prefill" if i < 2 else "decode"):
                    clk.tick(3_000_000)
                clk.tick()
                rec.add_segment("sample", clk.now - 500_000, clk.now)
                if by_handle:
                    rec.emit_handles(np.array([ha, hb][: min(i + 1, 2)]))
                else:
                    rec.emit(["a", "b"][: min(i + 1, 2)])
                rec.counter("batch", float(i + 1))
                if i == 1:
                    rec.evict("b", mode="recompute")
                    clk.tick()
                    rec.readmit("b")
                rec.step_info(num_prefill_tokens=[12, 5, 0][i])
            clk.tick()


def record(tmp_path: Path, name: str, bad=None, *, by_handle=False) -> Path:
    clk = ManualClock()
    out = tmp_path / f"{name}.npz"
    rec = tracekit.Recorder(out, clock=clk, gc=False, handle_signals=False, config={"x": 1})
    small_run(rec, clk, bad, by_handle=by_handle)
    log = tracekit.load(out)  # every run a recorder writes loads
    assert len(log.steps) == 3 and len(log.emissions) == 1 + 2 + 2  # a; a, b; a, b
    return out


# -- wrong arguments: raise at the call, record nothing ------------------------------------

BAD_CALLS = {
    "prompt_tokens fraction": lambda r: r.request("c", prompt_tokens=12.5),
    "prompt_tokens None": lambda r: r.request("c", prompt_tokens=None),
    "prompt_tokens str": lambda r: r.request("c", prompt_tokens="12"),
    "prompt_tokens bool": lambda r: r.request("c", prompt_tokens=True),
    "prompt_tokens -2": lambda r: r.request("c", prompt_tokens=-2),
    "max_new_tokens nan": lambda r: r.request("c", max_new_tokens=float("nan")),
    "max_new_tokens 2**40": lambda r: r.request("c", max_new_tokens=2**40),
    "arrival_tick float": lambda r: r.request("c", arrival_tick=1.5e9 + 0.25),
    "arrival_tick absurd": lambda r: r.request("c", arrival_tick=2**62),
    "step_info fraction": lambda r: r.step_info(num_prefill_tokens=256.5),
    "step_info negative": lambda r: r.step_info(num_decode=-1),
    "step_info graph -2": lambda r: r.step_info(graph_size=-2),
    "step_info one bad of two": lambda r: r.step_info(num_decode=3, num_preempted="x"),
    "prefill np.float32 fraction": lambda r: r.prefill("a", np.float32(128.5)),
    "prefill negative": lambda r: r.prefill("a", -1),
    "prefill None": lambda r: r.prefill("a", None),
    "emit zero tokens": lambda r: r.emit(["a"], [0]),
    "emit fraction tokens": lambda r: r.emit(["a"], [1.5]),
    "emit lengths differ": lambda r: r.emit(["a", "b"], [1]),
    "emit float tick": lambda r: r.emit(["a"], at_tick=1.0e9 + 0.5),
    "emit future step": lambda r: r.emit(["a"], reads_step=7),
    "emit a new id then a bad count": lambda r: r.emit(["new"], [None]),
    "emit_handles out of range": lambda r: r.emit_handles([0, 99]),
    "emit_handles negative": lambda r: r.emit_handles(np.array([-1])),
    "emit_handles floats": lambda r: r.emit_handles(np.array([0.5])),
    "emit_handles strings": lambda r: r.emit_handles(["a"]),
    "emit_handles 2-D": lambda r: r.emit_handles(np.zeros((2, 2), dtype=np.int64)),
    # a few handles in a list take the Python path: the same refusals as numpy's
    "emit_handles a few, a bool": lambda r: r.emit_handles([True]),
    "emit_handles a few, count 0": lambda r: r.emit_handles([0, 1], [1, 0]),
    "emit_handles a few, lengths differ": lambda r: r.emit_handles([0, 1], [1]),
    "emit_handles a few, a float count": lambda r: r.emit_handles([0], [1.5]),
    "emit_handles 0-d array": lambda r: r.emit_handles(np.array(0)),
    "emit_handles a few in an array, out of range": lambda r: r.emit_handles(np.array([0, 9])),
    # a batch (over 8 handles) takes the vectorised check: one past the last, and -1
    "emit_handles a batch, one out of range": lambda r: r.emit_handles(np.array([0] * 9 + [2])),
    "emit_handles a batch, one negative": lambda r: r.emit_handles(np.array([1] * 9 + [-1])),
    "admit_handle out of range": lambda r: r.admit_handle(2),
    "prefill_handles lengths": lambda r: r.prefill_handles([0, 1], [3]),
    "prefill_handles negative": lambda r: r.prefill_handles(np.array([0]), np.array([-4])),
    "wait bad reason": lambda r: r.wait(["a"], "because"),
    "wait reason not str": lambda r: r.wait(["a"], 3),
    "wait twice in a call": lambda r: r.wait(["zz", "zz"], "kv_blocks"),
    "wait_handles twice in a call": lambda r: r.wait_handles([0, 0], "kv_blocks"),
    "emit_chunk handle out of range": lambda r: r.emit_chunk(2, r.now(), r.now()),
    "emit_chunk bool handle": lambda r: r.emit_chunk(True, r.now(), r.now()),
    "emit_chunk fraction handle": lambda r: r.emit_chunk(0.5, r.now(), r.now()),
    "emit_chunk written before ready": lambda r: r.emit_chunk(0, r.now(), r.now() - 5),
    "emit_chunk zero tokens": lambda r: r.emit_chunk(0, r.now(), r.now(), 0),
    "emit_chunk float tick": lambda r: r.emit_chunk(0, 1.0e9 + 0.5, r.now()),
    "emit_chunk absurd tick": lambda r: r.emit_chunk(0, r.now(), 2**62),
    "emit_chunk label int": lambda r: r.emit_chunk(0, r.now(), r.now(), label=3),
    "add_segment reversed": lambda r: r.add_segment("x", 10_000, 5_000),
    "add_segment label int": lambda r: r.add_segment(3, 1, 2),
    "add_segment float tick": lambda r: r.add_segment("x", 1.5, 2),
    "segment label None": lambda r: r.segment(None),
    # labels only the partitions produce (docs/input-validation.md, "Labels")
    "segment produced label": lambda r: r.segment("residual"),
    "add_segment produced label": lambda r: r.add_segment("os_runqueue", r.now(), r.now()),
    "add_segment produced wait label": lambda r: r.add_segment("wait_kv_blocks", r.now(), r.now()),
    "emit_chunk produced label": lambda r: r.emit_chunk(0, r.now(), r.now(), label="hop"),
    "counter name int": lambda r: r.counter(5, 1.0),
    "counter value str": lambda r: r.counter("c", "x"),
    "evict bad mode": lambda r: r.evict("zz", mode="bogus"),
    "same name, other type": lambda r: r.emit([1, "1"]),
    "a new id, then a refused one": lambda r: r.wait(["new", "a", "a"], "kv_blocks"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_wrong_call_raises_and_records_nothing(tmp_path, name):
    """The run with the failed call is the run without it, array for array (the call
    interned no request id, appended no partial row), and it loads."""
    good = record(tmp_path, "good")
    bad = record(tmp_path, "bad", BAD_CALLS[name])
    assert_same_log(good, bad)


def test_a_wrong_call_leaves_the_parts_recoverable(tmp_path):
    """Regression (issue 21): `request(prompt_tokens=12.5)` appended half a row, so every
    later part failed `recover` ("requests: 6 values do not make rows of 4")."""
    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, gc=False, handle_signals=False, flush_interval_s=0.0)
    rec.start()
    try:
        rec.request("a", prompt_tokens=3)
        with pytest.raises(TypeError, match=r"request\(prompt_tokens=\)"):
            rec.request("b", prompt_tokens=12.5)
        with rec.step():
            rec.emit(["a"])
        t_end = time.monotonic() + 20
        while not part_files(tmp_path / "run.npz.parts"):
            assert time.monotonic() < t_end, "no part reached the disk"
            time.sleep(0.01)
        time.sleep(0.05)
        log = validate_log(merge_parts(str(tmp_path / "run.npz.parts")))  # as recover does
        assert log.request_ids == ("a",) and len(log.emissions) == 1
    finally:
        rec.stop()
    assert tracekit.load(out).request_ids == ("a",)


@pytest.mark.parametrize(
    "value, expected",
    [(12.0, 12), (np.float64(12), 12), (np.int32(12), 12), (np.uint8(12), 12), (12, 12)],
)
def test_integral_floats_and_numpy_integers_are_taken_as_ints(value, expected):
    rec = tracekit.Recorder(None, gc=False, handle_signals=False)
    with rec:
        h = rec.request("a", prompt_tokens=value, max_new_tokens=value)
        with rec.step():
            rec.prefill("a", value)
            rec.prefill_handles(np.array([h], dtype=np.float64), [value])
            rec.step_info(num_prefill_tokens=value)
            rec.emit(["a"], [value])
            rec.emit_handles(np.array([h], dtype=np.uint16), np.array([value]))
    log = rec.log()
    assert log.requests.prompt_tokens.tolist() == [expected]
    assert log.requests.max_new_tokens.tolist() == [expected]
    assert log.prefill_chunks.num_tokens.tolist() == [expected, expected]
    assert log.steps.num_prefill_tokens.tolist() == [expected]
    assert log.emissions.num_tokens.tolist() == [expected, expected]


# -- calls that would make an invalid log ----------------------------------------------------


def test_two_ids_with_one_name_are_refused():
    """Regression (issue 21): `1` and `"1"` became two requests named "1", and the log was
    rejected at load ("request_ids: duplicate id")."""
    rec = tracekit.Recorder(None, gc=False, handle_signals=False)
    with rec:
        rec.request(1)
        with pytest.raises(ValueError, match="same name"):
            rec.request("1")
        with pytest.raises(ValueError, match="same name"):
            rec.emit(["1"])
    assert validate_log(rec.log()).request_ids == ("1",)


def test_admission_after_the_first_emission_or_eviction_is_refused():
    """Regression (issue 21): the log was rejected at load ("admitted ... after its first
    token", "evicted before its admission")."""
    rec = tracekit.Recorder(None, gc=False, handle_signals=False)
    with rec:
        rec.request("a")
        rec.request("b")
        with rec.step():
            rec.emit(["a"])
            rec.evict("b")
        with rec.step():
            with pytest.raises(ValueError, match="after its first emission"):
                rec.admit("a")
            with pytest.raises(ValueError, match="after its first eviction"):
                rec.admit("b")
    log = validate_log(rec.log())
    assert len(log.admissions) == 0


def test_a_second_wait_reason_in_a_step_is_refused():
    rec = tracekit.Recorder(None, gc=False, handle_signals=False)
    with rec:
        h = rec.request("a")
        with rec.step():
            rec.wait(["a"], "kv_blocks")
            with pytest.raises(ValueError, match="two wait reasons"):
                rec.wait_handles([h], "max_num_seqs")
        with rec.step():  # a new step: a new reason is fine
            rec.wait_handles([h], "max_num_seqs")
    log = validate_log(rec.log())
    assert log.waits.step.tolist() == [0, 1] and log.waits.reason.tolist() == [0, 1]


def test_ticks_from_another_clock_are_kept_in_order_and_counted():
    """An arrival tick after the request() call, an admission before the arrival and an
    emission before it (another thread's clock reading, a little off): each is taken as
    the tick that keeps the TTFT window in order, and the log's warnings count them."""
    clk = ManualClock()
    rec = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
    with rec:
        t_call = clk.now
        rec.request("a", arrival_tick=t_call + 5_000)  # ahead of now: arrives now
        clk.tick()
        rec.request("b", arrival_tick=clk.now)
        with rec.step():
            rec.admit("a", at_tick=t_call - 1_000)  # before its arrival: at its arrival
            rec.admit("b")
            clk.tick()
            rec.emit(["b"], at_tick=clk.now - 3_000_000)  # before b's arrival: at it
    log = validate_log(rec.log())
    t0 = rec.t0_tick
    assert log.requests.arrival_s[0] == pytest.approx((t_call - t0) * 1e-9)
    assert log.admissions.t_s[0] == pytest.approx((t_call - t0) * 1e-9)
    assert log.emissions.t_s[0] == log.requests.arrival_s[1]
    w = " ".join(log.warnings)
    assert "1 request arrival tick(s) after the request() call" in w
    assert "1 admission tick(s) before the request's arrival" in w
    assert "1 emission tick(s) before the request's arrival" in w


def test_a_request_told_after_its_first_emission_has_an_unknown_arrival():
    rec = tracekit.Recorder(None, gc=False, handle_signals=False)
    with rec:
        rec.request("c")
        with rec.step():
            rec.emit(["a"])
            rec.admit("c")  # with an admission, a first token before an arrival is rejected
        rec.request("a", prompt_tokens=4)  # told late: its arrival is not known
        rec.request("b")
        rec.request("b")  # twice: the first arrival is kept, counted in the warnings
    log = validate_log(rec.log())
    assert log.request_ids == ("c", "a", "b")
    assert np.isnan(log.requests.arrival_s[1]) and log.requests.prompt_tokens[1] == 4
    assert np.isfinite(log.requests.arrival_s[[0, 2]]).all()
    w = " ".join(log.warnings)
    assert "1 request() call(s) for a request that had arrived" in w
    assert "1 request arrival(s) told after the request's first emission" in w


def test_a_clock_that_returns_floats_is_refused_at_start():
    rec = tracekit.Recorder(None, clock=time.perf_counter, gc=False, handle_signals=False)
    with pytest.raises(TypeError, match="integer ticks"):
        rec.start()
    assert not rec.running


# -- handles and ids record the same log ---------------------------------------------------


def test_handle_calls_and_id_calls_write_byte_identical_logs(tmp_path):
    by_id = record(tmp_path, "ids")
    by_handle = record(tmp_path, "handles", by_handle=True)
    assert_same_log(by_id, by_handle)


def test_emit_handles_with_counts_matches_emit_row_for_row():
    """One call with counts, one without, in one flush: the rows one `emit` per request
    makes, in call order (the compact form is expanded on the writer thread)."""
    clk = ManualClock()

    def run(by_handle: bool) -> tracekit.RawLog:
        rec = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
        with rec:
            hs = [rec.handle(f"r{i}") for i in range(5)]
            with rec.step():
                clk.tick()
                if by_handle:
                    rec.emit_handles(np.array(hs[::-1]), np.array([1, 2, 3, 4, 5]))
                    rec.emit_handles(hs[:2])
                else:
                    for rid, n in zip(
                        [f"r{i}" for i in range(5)][::-1], [1, 2, 3, 4, 5], strict=True
                    ):
                        rec.emit([rid], [n])
                    rec.emit(["r0", "r1"])
        return rec.log()

    a, b = run(False), run(True)
    assert a.emissions.request.tolist() == [4, 3, 2, 1, 0, 0, 1]
    assert a.emissions.num_tokens.tolist() == [1, 2, 3, 4, 5, 1, 1]
    for col in ("request", "t_s", "step", "num_tokens", "device_step"):
        assert np.array_equal(getattr(a.emissions, col), getattr(b.emissions, col)), col


def test_emit_chunk_records_a_write_window_and_its_tokens():
    """A streaming server's chunk (`emit_chunk`): request `a` arrives at t0; its chunk of
    2 tokens is ready at t0 + 1 ms and written at t0 + 3 ms, then a one-token chunk ready
    and written at t0 + 4 ms: two `sse_write` windows outside any step (step -1), [1, 3]
    and [4, 4] ms, and two emissions at 3 and 4 ms of 2 and 1 tokens. The same rows as
    `add_segment` then `emit_handles`, array for array."""
    clk = ManualClock()

    def run(one_call: bool) -> tracekit.RawLog:
        rec = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
        with rec:
            t0 = clk.now
            h = rec.request("a")
            for ready, sent, k in ((1, 3, 2), (4, 4, 1)):
                t_ready, t_sent = t0 + ready * 1_000_000, t0 + sent * 1_000_000
                if one_call:
                    rec.emit_chunk(h, t_ready, t_sent, k)
                else:
                    rec.add_segment("sse_write", t_ready, t_sent)
                    rec.emit_handles([h], [k], at_tick=t_sent)
            clk.tick(5_000_000)
        return rec.log()

    a = run(True)
    t0 = a.requests.arrival_s[0]
    seg = a.segments
    assert [a.labels[i] for i in seg.label] == ["sse_write", "sse_write"]
    assert (seg.t_start_s - t0).tolist() == pytest.approx([0.001, 0.004], abs=1e-9)
    assert (seg.t_end_s - t0).tolist() == pytest.approx([0.003, 0.004], abs=1e-9)
    assert seg.step.tolist() == [-1, -1]
    assert (a.emissions.t_s - t0).tolist() == pytest.approx([0.003, 0.004], abs=1e-9)
    assert a.emissions.num_tokens.tolist() == [2, 1]
    assert a.emissions.request.tolist() == [0, 0]
    b = run(False)
    for table in ("segments", "emissions"):
        x, y = getattr(a, table), getattr(b, table)
        for col in x.DTYPES:
            assert np.array_equal(getattr(x, col), getattr(y, col)), (table, col)


def test_a_few_handles_record_what_the_id_call_records():
    """Up to 8 handles (a list or a 1-D array) are checked and copied without numpy: the
    same rows as `emit` by id (numpy's path), including an emission stamped before a
    request's arrival (taken as the arrival, docs/design.md) and counts."""
    clk = ManualClock()

    def run(how: str) -> tracekit.RawLog:
        rec = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
        with rec:
            early = clk.now  # t0
            hs = [rec.request(f"r{i}") for i in range(3)]  # arrive at t0
            clk.tick()
            late = rec.request("late")  # arrives at t0 + 1 ms
            with rec.step():
                clk.tick()  # t0 + 2 ms
                if how == "ids":
                    rec.emit(["r2", "r0"], [2, 1])
                    rec.emit(["late"], at_tick=early)
                else:
                    wrap = list if how == "list" else np.array
                    rec.emit_handles(wrap([hs[2], hs[0]]), wrap([2, 1]))
                    rec.emit_handles(wrap([late]), at_tick=early)
        return rec.log()

    a = run("ids")
    t0 = a.emissions.t_s[0] - 0.002  # the first call's tick is t0 + 2 ms
    assert a.emissions.request.tolist() == [2, 0, 3]
    assert a.emissions.num_tokens.tolist() == [2, 1, 1]
    # the late request's emission, stamped at t0, is taken as its arrival: t0 + 1 ms
    assert a.emissions.t_s[2] == pytest.approx(t0 + 0.001, abs=1e-9)
    assert a.warnings == ("1 emission tick(s) before the request's arrival, taken as it",)
    for b in (run("list"), run("array")):
        for col in ("request", "t_s", "step", "num_tokens", "device_step"):
            assert np.array_equal(getattr(a.emissions, col), getattr(b.emissions, col)), col
        assert b.warnings == a.warnings


# -- a signal at any instant of a step -------------------------------------------------------

#: Runs the same small engine loop once per point: the k-th line the recorder executes
#: inside step 3 sends SIGTERM to this process (from a trace function, so the signal lands
#: at that line, deterministically). Each run's log must load; prints one JSON line.
SIGNAL_POINTS_SCRIPT = r"""
import json, os, signal, sys, time
import numpy as np
import tracekit
from tracekit.capture import recorder as recorder_module, sinks
from tracekit.log.validate import validate_log

HERE = os.path.dirname(recorder_module.__file__)
OURS = {os.path.join(HERE, f) for f in ("recorder.py", "sinks.py", "checks.py", "requests.py",
                                        "buffers.py", "segments.py", "gcpauses.py")}
tmp = sys.argv[1]

class Clock:
    t = 10**9
    def __call__(self):
        Clock.t += 1000
        return Clock.t

def run(kill_at):
    state = {"n": 0, "armed": False}
    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in OURS:
            return None
        if event == "line" and state["armed"]:
            state["n"] += 1
            if state["n"] == kill_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return tracer
    rec = tracekit.Recorder(None, clock=Clock(), gc=False, flush_interval_s=0.0)
    landed = None
    try:
        with rec:
            ids = [f"r{i}" for i in range(4)]
            for rid in ids:
                rec.request(rid)
            for i in range(3000):  # a signal deferred out of a flush lands a little later
                state["armed"] = i == 3
                sys.settrace(tracer if i == 3 else None)
                with rec.step():
                    if i == 0:
                        for rid in ids:
                            rec.admit(rid)
                    rec.prefill("r0", 8)
                    rec.wait(["r3"], "kv_blocks")
                    with rec.segment("decode"):
                        pass
                    rec.emit(ids)
                    rec.step_info(num_prefill_tokens=8)
                sys.settrace(None)
                if i > 3:
                    time.sleep(0.0002)  # between steps: the re-sending thread may run
    except SystemExit as e:
        sys.settrace(None)
        landed = e.code
    sys.settrace(None)
    try:
        log = validate_log(rec.log())  # what load checks
        return {"k": kill_at, "exit": landed, "steps": len(log.steps), "ok": True,
                "lines": state["n"],
                "closed": any("closed at the stop time" in w for w in log.warnings)}
    except Exception as e:
        return {"k": kill_at, "exit": landed, "ok": False, "error": str(e)[:200]}

total = run(0)["lines"]  # the number of recorder lines in step 3: a run that never fires
print(json.dumps({"lines": total}), flush=True)
for k in range(1, total + 1):
    print(json.dumps(run(k)), flush=True)
"""


def test_a_sigterm_at_every_line_of_a_step_leaves_a_log_that_loads(tmp_path):
    """Regression (issue 21): a SIGTERM landing between a step's clock read and its row
    left the step's segments pointing at a step the log did not have ("segments.step:
    row 190: index 190 outside [-1, 189]"). Here the signal lands at each line the
    recorder runs in a step (begin, the TTFT calls, the segment, the emission, the end,
    the flush), one run per line; every run ends as SIGTERM's exit and its log loads."""
    proc = python(SIGNAL_POINTS_SCRIPT, str(tmp_path))
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    lines = [json.loads(x) for x in stdout.splitlines()]
    total = lines[0]["lines"]
    runs = lines[1:]
    assert total >= 40 and len(runs) == total, (total, len(runs))
    bad = [r for r in runs if not r["ok"]]
    assert not bad, bad[:5]
    assert "Traceback" not in stderr and "flush failed" not in stderr, stderr[-3000:]
    # Python drops an exception raised in a weakref callback ("Exception ignored"): a
    # signal landing in one of the interpreter's is lost, whatever tracekit does
    stopped = [r for r in runs if r["exit"] == 128 + signal.SIGTERM]
    assert len(stopped) >= 0.9 * len(runs), [r for r in runs if r["exit"] != 143][:3]
    # it landed at every instant of step 3: before it began (3 steps), inside it (closed at
    # the stop time: 4), after its row (4), or deferred out of its flush into step 4 (5)
    assert min(r["steps"] for r in stopped) >= 3
    assert {3, 4} <= {r["steps"] for r in stopped}
    assert any(r["closed"] for r in stopped)


# -- kill -9 under load: the rows lost are at most about one flush interval's -----------------

#: An engine loop emitting about a million tokens a second (512 per step, spinning between
#: steps: a busy engine thread), flushing every 0.2 s; each step writes (monotonic ns,
#: emissions recorded) to a ring in a shared file, so the parent knows what was recorded
#: when it kills the process.
LOAD_SCRIPT = r"""
import mmap, os, struct, sys
import tracekit
out, prog = sys.argv[1], sys.argv[2]
# the engine's own clock: 0.5 ms a step, moved only by a step (never while the engine
# waits for the writer), so the bound below is counted in steps, whatever the disk does
STEP_NS, k = 500_000, [0]
mm = mmap.mmap(os.open(prog, os.O_RDWR), 8)
rec = tracekit.Recorder(out, flush_interval_s=0.2, gc=False,
                        clock=lambda: 1_000_000_000 + k[0] * STEP_NS)
rec.start()
ids = [f"r{i}" for i in range(512)]
for rid in ids:
    rec.request(rid)
print("started", flush=True)
while True:  # as fast as Python goes: millions of emissions a second, the writer behind
    k[0] += 1
    with rec.step():
        with rec.segment("decode"):
            pass
        rec.emit(ids)
    mm[:8] = struct.pack("q", k[0])  # steps whose rows are all recorded
"""


def test_kill_9_under_millions_of_emissions_a_second_loses_at_most_six_intervals(tmp_path):
    """Issue 21: with flush_interval_s=0.2 on a busy machine a kill lost up to 1.4 s of
    rows (0 of 1.07 M emissions on disk after 2.84 s). The engine here emits for 512
    requests a step as fast as it can, faster than a part is written, so the writer falls
    behind and the recorder keeps a backlog. The bound (`tracekit.capture.sinks.Dispatcher`),
    counted in the engine's own steps (400 to an interval): a flush is handed over at
    the first step end an interval after the last, or, while one waits for the writer,
    two intervals after it (800 steps) once the writer took the waiting one; so the
    flush being written, the one waiting and the backlog hold at most 3 x 800 steps'
    rows. The parts hold exactly the first steps' rows, whole."""
    import mmap
    import struct

    steps_per_interval, per_step = 400, 512  # 0.2 s / 0.5 ms; requests
    out, prog = tmp_path / "run.npz", tmp_path / "progress"
    prog.write_bytes(bytes(8))
    proc = python(LOAD_SCRIPT, str(out), str(prog))
    with open(prog, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
    try:
        assert proc.stdout.readline() == "started\n", proc.stderr.read()[-2000:]
        # kill once it has recorded 25 intervals (the bound is 6), however long that takes
        while struct.unpack("q", mm[:8])[0] < 25 * steps_per_interval:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)
    finally:
        proc.kill()
    # every step up to this one is recorded; the one after it may be (killed before the
    # progress write)
    steps_recorded = struct.unpack("q", mm[:8])[0] + 1
    log = validate_log(merge_parts(str(tmp_path / "run.npz.parts")))
    steps_on_disk = len(log.steps)
    # whole steps, the first ones: each with its 512 emissions, nothing torn or skipped
    assert len(log.emissions) == steps_on_disk * per_step
    # the engine's clock stamps step k at k x 0.5 ms from the start
    assert log.steps.t_start_s == pytest.approx(np.arange(1, steps_on_disk + 1) * 5e-4)
    lost = steps_recorded - steps_on_disk
    assert 0 <= lost <= 3 * 2 * steps_per_interval, (
        f"{lost} steps' rows lost of {steps_recorded} (bound {6 * steps_per_interval})"
    )


def test_arrivals_between_busy_steps_never_queue_a_second_flush_for_a_slow_writer(tmp_path):
    """A writer slower than the engine (a sink taking 20 ms a part) and a request arriving
    between every two steps. The bound of `tracekit.capture.sinks.Dispatcher`: at most one
    flush waits for the writer, each at most two intervals and a step of the engine's
    clock, so a kill loses at most six intervals. Arrivals used to hand a flush of their
    own each interval whatever the writer's lag, and the writer merged the flushes waiting
    into one part: parts of tens of intervals (a simulated busy hour: one of 67 s at a 1 s
    interval). Every part but the stop's (which takes what waits) spans at most two
    intervals and a step; the log holds every step."""
    from tracekit.log.parts import read_index

    class SlowSink:
        def open(self, meta):
            pass

        def write(self, chunk):
            time.sleep(0.02)

        def close(self, final):
            pass

    clk = ManualClock()
    step_ns, interval_ns, n = 10_000_000, 100_000_000, 300
    rec = tracekit.Recorder(tmp_path / "run.npz", clock=clk, seconds_per_tick=1e-9, gc=False,
                            handle_signals=False, flush_interval_s=interval_ns * 1e-9,
                            sinks=[SlowSink()])  # fmt: skip
    with rec:
        running = [rec.request(f"r{i}") for i in range(8)]
        for k in range(n):
            rec.request(f"new{k}")  # between two steps: the arrival path
            with rec.step():
                clk.tick(step_ns)
                rec.emit_handles(running)
    entries, _ = read_index(str(tmp_path / "run.npz.parts"))
    spans = np.diff([e.flush_tick for e in entries])[:-1]
    assert len(entries) >= n * step_ns // (2 * interval_ns + step_ns)
    assert spans.max() <= 2 * interval_ns + step_ns, spans.tolist()
    assert len(tracekit.load(tmp_path / "run.npz").steps) == n


@pytest.mark.parametrize("how", ["ids", "few", "many"])
def test_an_emission_stamped_before_its_admission_is_taken_at_the_admission(how):
    """A first token before its request's admission would make a log `load` refuses
    (docs/ttft.md: an admission lies between arrival and first token), losing the whole
    recording. Like an emission before the arrival, it is taken at the admission and
    counted in the log's warnings; both emission paths (a few handles without numpy, a
    batch through numpy) do the same."""
    clk = ManualClock()
    rec = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
    n = 12 if how == "many" else 2  # the few-handles path takes at most 8
    with rec:
        hs = [rec.request(f"r{i}") for i in range(n)]  # arrive at t0
        t_early = clk.now  # t0
        with rec.step():
            clk.tick()  # t0 + 1 ms
            rec.admit("r1")  # admitted at t0 + 1 ms
            clk.tick()  # t0 + 2 ms
            if how == "ids":
                rec.emit([f"r{i}" for i in range(n)], at_tick=t_early)
            else:
                rec.emit_handles(np.array(hs) if how == "many" else hs, at_tick=t_early)
    log = rec.log()
    t0 = log.requests.arrival_s[0]
    # the call's tick, t0, is before r1's admission at t0 + 1 ms: the call is taken there
    assert log.emissions.t_s.tolist() == pytest.approx([t0 + 0.001] * n, abs=1e-9)
    assert log.admissions.t_s.tolist() == pytest.approx([t0 + 0.001], abs=1e-9)
    assert log.warnings == ("1 emission tick(s) before the request's admission, taken as it",)
    tracekit.partition(log)  # the log is valid: it loads and partitions


@pytest.mark.parametrize(
    "kw",
    [{"os_evidence": "false"}, {"os_evidence": 2}, {"os_evidence": "yes"},
     {"seconds_per_tick": True}, {"seconds_per_tick": "1e-9"}],
    ids=repr,
)  # fmt: skip
def test_recorder_arguments_of_the_wrong_type_are_refused(kw):
    # "false" is truthy and True is 1: taken as given, each meant something else
    with pytest.raises(TypeError, match=next(iter(kw))):
        tracekit.Recorder(None, handle_signals=False, **kw)


def test_a_tick_from_another_clock_before_start_is_refused_not_kept(tmp_path):
    """Before start() the run has no start tick; a window's ticks are checked against the
    clock's reading instead, so one absurd call cannot make the saved log fail `check`."""
    clk = ManualClock()
    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, clock=clk, gc=False, handle_signals=False)
    with pytest.raises(ValueError, match="not this clock's tick"):
        rec.add_segment("x", 10**18, 10**18 + 5)
    rec.add_segment("x", clk(), clk() + 5)  # a window of this clock before start: kept
    rec.start()
    with rec.step():
        clk.tick()
    rec.stop()
    log = tracekit.load(out)
    assert list(log.labels) == ["x"] and len(log.segments) == 1


def test_handles_given_to_emit_as_ids_are_warned_about_at_the_call_and_in_the_log():
    """`request()` returns handles; `emit()` takes ids. New integer ids that are other
    requests' handles are recorded as asked (new requests), with a warning at the engine's
    call, once, and a count in the log's warnings; ids that are the run's own are quiet."""
    clk = ManualClock()
    rec = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
    rec.start()
    handles = [rec.request(f"r{i}") for i in range(4)]
    with pytest.warns(UserWarning, match="emit_handles takes the handles") as got:
        with rec.step():
            clk.tick()
            rec.emit(handles)
    assert [w.filename for w in got] == [__file__]  # the engine's line, not tracekit's
    with rec.step():  # the same ids again: known now, no warning
        clk.tick()
        rec.emit(handles)
    log = rec.stop()
    assert len(log.requests) == 8  # four named requests, four recorded from the ints
    assert any(w.startswith("4 new integer request id(s) given to emit()") for w in log.warnings)
    quiet = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
    quiet.start()
    quiet.request(7)
    with quiet.step():
        clk.tick()
        quiet.emit([7, 8])  # 7 is its own id; 8 is no request's handle (one request): quiet
    assert not [w for w in quiet.stop().warnings if "emit()" in w]
