"""The index pass spread over workers (`tracekit.analysis.stream_index`, `analyze -j N`
or `--ray` on one long run) gives the index the one-process pass gives, value for value:
the figures, the gaps' exact counts, the eviction rows, each part's entry."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
from test_sliced import REPO, STEP_NS, FakeClock, _hand_run, _wait_for_parts

import tracekit
from tracekit.analysis.stream import index_pass, keep_gap_values
from tracekit.analysis.stream_index import index_pass_spread
from tracekit.log.slices import SlicedRun


def _in_order(fn, items):
    return (fn(x) for x in items)


def _same(a, b, path=""):
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b or (a != a and b != b), (path, a, b)


def _assert_same_index(parts: str, mapper, run_b: SlicedRun | None = None) -> None:
    run_a, run_b = SlicedRun(parts), run_b or SlicedRun(parts)
    a = index_pass(run_a, "all_captured", lambda _m: None, spill=True)
    b = index_pass_spread(run_b, "all_captured", lambda _m: None, mapper, spill=True)
    keep_gap_values(run_a, a)
    keep_gap_values(run_b, b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "spill":
            continue
        if f.name in ("gaps", "extra"):
            _same(x.counts, y.counts, f.name)
            assert x.n == y.n and x.percentiles() == y.percentiles(), f.name
        else:
            _same(x, y, f.name)
    assert run_a.parts == run_b.parts
    _same(run_a.arrival_part, run_b.arrival_part)


@pytest.mark.parametrize("per_task", [1, 3, 8])
def test_the_spread_index_of_a_demo_run_is_the_one_process_index(demo_run, per_task,
                                                                 monkeypatch):  # fmt: skip
    from tracekit.analysis import stream_index

    monkeypatch.setattr(stream_index, "PARTS_PER_TASK", per_task)
    parts = demo_run + ".parts"
    assert len(SlicedRun(parts).paths) > per_task or per_task == 8
    _assert_same_index(parts, _in_order)


def test_the_spread_index_with_a_part_a_slice_and_an_eviction_across_tasks(tmp_path, monkeypatch):
    """The hand run (tests/analysis/test_sliced.py): a part a step, "long" evicted in part
    2 and emitting again in part 23: its debt pends across two tasks' stretches (of 8
    parts each)."""
    from tracekit.analysis import stream_index

    monkeypatch.setattr(stream_index, "PARTS_PER_TASK", 8)
    out = tmp_path / "run.npz"
    _hand_run(out)
    parts = str(out) + ".parts"
    assert len(SlicedRun(parts).paths) > 2 * stream_index.PARTS_PER_TASK
    _assert_same_index(parts, _in_order)
    with ProcessPoolExecutor(max_workers=2) as pool:
        _assert_same_index(parts, lambda fn, items: pool.map(fn, items))


def test_a_debt_whose_request_emits_next_at_an_earlier_tick_is_read_again(tmp_path):
    """An emission learnt late (`emit(at_tick=)`) in a later part, before its request's
    readmission: its first row there is not the first after the readmission (where the
    eviction's debt ends), so the driver reads that part whole for the eviction rows, and
    the index is still the one-process one."""
    out = tmp_path / "run.npz"
    clock = FakeClock()
    rec = tracekit.Recorder(str(out), clock=clock, seconds_per_tick=1e-9, gc=False,
                            handle_signals=False, flush_interval_s=3600.0)  # fmt: skip
    n = 0

    def flushed():
        nonlocal n
        rec.flush_soon()
        n += 1
        _wait_for_parts(out, n)

    with rec:
        rec.request("alive")
        rec.request("late")
        for k in range(6):
            with rec.step():
                with rec.segment("decode"):
                    clock.t += STEP_NS
                rec.emit(["alive", "late"] if k == 0 else ["alive"])
                if k == 1:
                    rec.evict("late", mode="swap")
            flushed()
            if k == 2:
                rec.readmit("late")  # in a part of its own: the debt is pending after it
                t_back = clock.t
                flushed()
                clock.t += 1
                rec.emit(["late"], at_tick=t_back - 5)  # a token learnt late
                clock.t += 1
                rec.emit(["late"])  # its first after the readmission: in the same part
                flushed()
    run = SlicedRun(str(out) + ".parts")
    read = run.read
    again: list[int] = []
    run.read = lambda i: again.append(i) or read(i)  # type: ignore[method-assign]
    _assert_same_index(str(out) + ".parts", _in_order, run)
    assert again == [4]  # the part with the late token, by the driver


def test_analyze_j2_of_a_long_run_is_analyze_j1(demo_run, tmp_path):
    """The command: -j 2 on one run spreads its index pass and its slices; the output is
    the one-process output, byte for byte."""
    run = demo_run

    def analyze(*extra: str) -> str:
        env = {"TRACEKIT_SLICE_EMISSIONS": "700"}
        r = subprocess.run([sys.executable, "-m", "tracekit", "analyze", run, "--format", "jsonl",
                            *extra], capture_output=True, text=True, cwd=REPO, timeout=600,
                           env={**__import__("os").environ, **env})  # fmt: skip
        assert r.returncode == 0 and "read in slices" in r.stderr, r.stderr
        return r.stdout

    one = analyze()
    assert one and analyze("-j", "2") == one
