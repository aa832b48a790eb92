"""A run read in slices (docs/reports.md, "Reading a long run in slices"): the same figures
as the whole run's analysis, whatever the slices' size; exact percentiles from pieces."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tracekit
from tracekit.analysis.figures import analyze
from tracekit.analysis.overtime import over_time
from tracekit.analysis.quantiles import ExactQuantiles, GroupQuantiles
from tracekit.analysis.stream import analyze_sliced
from tracekit.analysis.stream_overtime import over_time_sliced, over_time_window
from tracekit.analysis.window import WindowOptions
from tracekit.attribution.itl import partition
from tracekit.errors import UsageError
from tracekit.log.flush import UNKNOWN_TICK
from tracekit.log.slices import SlicedRun, parts_holding
from tracekit.render.perfetto import PID_REQUESTS, TID_REQUESTS

REPO = Path(__file__).resolve().parents[2]
STEP_NS = 10_000_000  # 10 ms


def _differences(x, y, path=""):
    """Where two analysis records differ: floats beyond float rounding (1e-9 relative; sums
    add in another order in slices), anything else at all."""
    if isinstance(x, dict) and isinstance(y, dict):
        if list(x) != list(y):
            return [f"{path}: keys {list(x)} != {list(y)}"]
        return [d for k in x for d in _differences(x[k], y[k], f"{path}.{k}")]
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return [f"{path}: {len(x)} != {len(y)} items"]
        return [d for i, (a, b) in enumerate(zip(x, y, strict=True))
                for d in _differences(a, b, f"{path}[{i}]")]  # fmt: skip
    if isinstance(x, float) and isinstance(y, float):
        same = x == y or abs(x - y) <= 1e-9 * max(1.0, abs(x))
        return [] if same else [f"{path}: {x!r} != {y!r}"]
    return [] if x == y else [f"{path}: {x!r} != {y!r}"]


# exact figures: compared with ==, never a tolerance
EXACT = ("gaps", "tokens", "requests", "steps", "itl_p50", "itl_p90", "itl_p99", "itl_p999",
         "itl_max", "tail_count", "all_count", "hist", "fwd_share_clean_median",
         "fwd_share_tail_median", "ttft_p50", "ttft_p99", "preemptions", "eager_steps")  # fmt: skip


def _assert_same(whole: dict, sliced: dict) -> None:
    assert _differences(whole, sliced) == []
    for k in EXACT:
        assert json.dumps(whole[k]) == json.dumps(sliced[k]), k


class FakeClock:
    """Moves only when told."""

    def __init__(self) -> None:
        self.t = 10**12

    def __call__(self) -> int:
        return self.t


def _recorder(
    out: Path, clock: FakeClock, os_evidence: bool | None = None, **more: Any
) -> tracekit.Recorder:
    """A recorder on `clock` (1 ns ticks) that flushes only when asked (`flush_soon` after
    each step, then `_wait_for_parts`: a part a step); `more`: its other arguments."""
    return tracekit.Recorder(str(out), clock=clock, seconds_per_tick=1e-9, gc=False,
                             os_evidence=os_evidence, handle_signals=False,
                             flush_interval_s=3600.0, **more)  # fmt: skip


def _hand_run(
    out: Path, extra: str | None = None, *, clock: FakeClock | None = None,
    os_evidence: bool | None = None, lead_ns: int = 0,
) -> None:  # fmt: skip
    """30 steps of 10 ms (a `decode` segment each); request "alive" emits at every step's
    end, "long" at steps 0 and 23 only: evicted at step 2's end, readmitted at step 22's
    end (swap). A part per step: no flush of its own (an hour's interval), one asked after
    each step and waited for, so no part holds two steps and none is empty but the stop's.
    `extra`: a segment of that label, 1 ms, before each step's decode; `lead_ns`: time no
    segment covers there; `clock`, `os_evidence`: the recorder's (`_recorder`)."""
    clock = clock or FakeClock()
    rec = _recorder(out, clock, os_evidence)
    with rec:
        rec.request("alive")
        rec.request("long")
        for k in range(30):
            with rec.step():
                clock.t += lead_ns
                if extra is not None:
                    with rec.segment(extra):
                        clock.t += 1_000_000
                with rec.segment("decode"):
                    clock.t += STEP_NS
                rec.emit(["alive", "long"] if k in (0, 23) else ["alive"])
                if k == 2:
                    rec.evict("long", mode="swap")
                if k == 22:
                    rec.readmit("long")
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def _retained_run(out: Path, n: int = 400) -> None:
    """A run recorded with retention (`retain_s`: its first parts removed as it records):
    requests that live ~10 steps each, on a clock that moves 1 us a reading."""

    class TickClock:
        def __init__(self) -> None:
            self.t = 10**12

        def __call__(self) -> int:
            self.t += 1000
            return self.t

    rec = tracekit.Recorder(out, clock=TickClock(), gc=False, handle_signals=False,
                            flush_interval_s=2e-6, retain_s=100e-6)  # fmt: skip
    with rec:
        for i in range(n):
            rec.request(f"r{i}", prompt_tokens=3)
            with rec.step():
                rec.admit(f"r{i}")
                rec.prefill(f"r{i}", 3)
                with rec.segment("decode"):
                    pass
                rec.emit([f"r{j}" for j in range(max(0, i - 9), i + 1)])


def _wait_for_parts(out: Path, n: int) -> None:
    """Until the writer has put `n` parts on disk (a part per step: the slices are parts)."""
    import time

    folder = Path(str(out) + ".parts")
    deadline = time.monotonic() + 60.0
    while len(list(folder.glob("part-*.tkp"))) < n:
        assert time.monotonic() < deadline, f"the writer wrote no part {n} in 60 s"
        time.sleep(0.005)
    assert len(list(folder.glob("part-*.tkp"))) == n  # exactly one part per step


def test_a_gap_across_twenty_slices_and_its_eviction_read_as_the_whole_run(tmp_path):
    """Hand case (docs/partition.md rules 1-3): "long"'s one gap runs from step 0's end
    (10 ms) to step 23's end (240 ms): 230 ms, the run's longest. Of it, 30..230 ms it was
    evicted (preempt, 200 ms); the rest (10..30, 230..240) is decode: forward 30 ms.
    "alive" has 29 gaps of 10 ms, all decode. Total gap time 29 x 10 + 230 = 520 ms.
    Read one part a slice, the long gap's slice reaches back 23 parts."""
    out = tmp_path / "run.npz"
    _hand_run(out)
    run = SlicedRun(str(out) + ".parts")
    run.index()
    assert len(run.parts) == 31  # a part per step, and the stop's (no rows)
    bounds = run.bounds(1)
    assert all(b == a + 1 for _, a, b in bounds)  # one part owned by each slice
    assert min(c for c, _, _ in bounds) == 0 and max(a - c for c, a, _ in bounds) >= 20
    whole = analyze(tracekit.load(out)).to_dict()
    sliced = analyze_sliced(str(out) + ".parts", max_emissions=1, path=whole["path"]).to_dict()
    _assert_same(whole, sliced)
    assert sliced["gaps"] == 30 and sliced["itl_max"] == pytest.approx(230.0)
    total = 29 * 10 + 230
    assert sliced["all_share"]["preempt"] == pytest.approx(200 / total)
    assert sliced["all_share"]["forward"] == pytest.approx((29 * 10 + 30) / total)
    # p99 of 29 x 10 ms and one 230 ms: numpy's linear rank 0.99 x 29 = 28.71, between
    # the 29th (10) and the 30th (230) value: 10 + 0.71 x 220
    assert sliced["itl_p99"] == pytest.approx(10 + 0.71 * 220)
    assert sliced["tail_count"]["preempt"] == 1  # the one gap >= p99


@settings(max_examples=8, deadline=None)
@given(budget=st.integers(min_value=1, max_value=20_000))
def test_any_slice_size_gives_the_whole_runs_figures(demo_run, budget):
    whole = analyze(tracekit.load(demo_run)).to_dict()
    parts = demo_run + ".parts"
    assert len(SlicedRun(parts).paths) >= 3
    sliced = analyze_sliced(parts, max_emissions=budget, path=whole["path"]).to_dict()
    _assert_same(whole, sliced)
    assert sliced["evictions"]["num_evictions"] > 0 and sliced["gc_counts"]["0"] > 0


def test_analyze_reads_a_run_in_slices_when_it_is_longer_than_one(demo_run):
    """The command: a run over the slice budget (`TRACEKIT_SLICE_EMISSIONS`) is read in
    slices, with the whole run's figures."""

    def run(env_extra):
        env = {**os.environ, **env_extra}
        r = subprocess.run([sys.executable, "-m", "tracekit", "analyze", demo_run, "--format",
                            "jsonl"], capture_output=True, text=True, cwd=REPO, env=env,
                           timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), r.stderr

    whole, err_whole = run({"TRACEKIT_SLICE_EMISSIONS": "100000000"})
    sliced, err_sliced = run({"TRACEKIT_SLICE_EMISSIONS": "500"})
    assert "in slices" in err_sliced and "in slices" not in err_whole
    _assert_same(whole, sliced)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=1,
                    max_size=300),
    cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=5),
)  # fmt: skip
def test_exact_quantiles_are_numpys_bit_for_bit(values, cuts):
    a = np.array(values)
    qs = [0.0, 50.0, 90.0, 99.0, 99.9, 100.0]
    q = ExactQuantiles(qs)
    pieces = np.split(a, sorted({min(c, len(a)) for c in cuts}))
    for p in pieces:
        q.count(p)
    q.wanted()
    for p in reversed(pieces):  # any order
        q.keep(p)
    assert q.percentiles() == [float(x) for x in np.percentile(a, qs)]
    assert q.median() == float(np.median(a))


def test_exact_quantiles_of_nothing_and_bad_values():
    q = ExactQuantiles([50.0])
    q.wanted()
    assert all(math.isnan(x) for x in q.percentiles()) and math.isnan(q.median())
    with pytest.raises(ValueError):
        ExactQuantiles([50.0]).count(np.array([1.0, -1.0]))
    with pytest.raises(ValueError):
        ExactQuantiles([50.0]).count(np.array([np.nan]))


@pytest.mark.parametrize(
    "args",
    [
        ("analyze", "--window", "0.15..0.3", "--format", "jsonl"),
        ("analyze", "--around", "worst", "--width", "0.07", "--format", "jsonl"),
        ("analyze", "--around", "p99", "--width", "0.04", "--format", "jsonl"),
        ("gaps", "--window", "0.3..", "--format", "jsonl"),
        ("gaps", "--around", "p50", "--width", "0.03", "--format", "jsonl"),
        ("ttft", "--window", "..0.2", "--format", "jsonl"),
        ("trace", "--window", "0.15..0.22"),
        ("analyze", "--by", "0.5s", "--format", "jsonl"),
        ("analyze", "--by", "1s", "--format", "jsonl"),
        ("analyze", "--by", "0.5s", "--window", "0.15..0.4", "--format", "jsonl"),
        ("analyze", "--by", "0.25s", "--around", "worst", "--width", "0.14", "--format", "jsonl"),
    ],
)  # fmt: skip
def test_a_window_read_in_slices_is_the_whole_runs_window(demo_run, demo_span, tmp_path, args):
    """The window of a run read in slices (only the parts its gaps and TTFTs need) is the
    window of the run read whole: records, figures and trace events. Windows and widths
    are fractions of the run's span (`demo_span`)."""
    to_s = {"--window": demo_span.window, "--width": lambda a: demo_span.width(float(a))}
    flags = ("", *args[:-1])  # what each argument follows
    args = tuple(to_s[f](a) if f in to_s else a for f, a in zip(flags, args, strict=True))

    def run(budget: str, name: str):
        env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": budget}
        out = ["-o", str(tmp_path / name)] if args[0] == "trace" else []
        r = subprocess.run([sys.executable, "-m", "tracekit", args[0], demo_run, *args[1:],
                            *out], capture_output=True, text=True, cwd=REPO, env=env,
                           timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr
        if args[0] == "trace":
            doc = json.loads((tmp_path / name).read_text())
            return [e for e in doc["traceEvents"] if e.get("ph") != "M" or "source" not in
                    json.dumps(e)]  # fmt: skip
        return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]

    whole, sliced = run("100000000", "whole.json"), run("500", "sliced.json")
    assert whole and _differences(whole, sliced) == []


def _jsonl(budget: str, *args: str) -> list[dict]:
    """`tracekit ARGS`' JSON lines, its run read in slices of `budget` emissions (whole
    where it holds fewer)."""
    env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": budget}
    r = subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def _recompute_run(out: Path) -> None:
    """30 steps of 10 ms, a part each; "a" emits at every step's end. "v" emits at steps
    0, 1 and 4 only: evicted (recompute) at step 1's end, readmitted at step 3's end. "w"
    emits at steps 0..16 and 20: evicted (recompute) at step 16's end, readmitted at step
    19's end; step 20 re-prefills it in a `recompute` segment (4 ms, then 6 ms of decode)."""
    clock = FakeClock()
    rec = _recorder(out, clock)
    with rec:
        for r in ("a", "v", "w"):
            rec.request(r)
        for k in range(30):
            with rec.step():
                if k == 20:
                    with rec.segment("recompute"):
                        clock.t += 4_000_000
                with rec.segment("decode"):
                    clock.t += STEP_NS - (4_000_000 if k == 20 else 0)
                rec.emit(["a"] + (["v"] if k in (0, 1, 4) else [])
                         + (["w"] if k <= 16 or k == 20 else []))  # fmt: skip
                if k in (1, 16):
                    rec.evict("v" if k == 1 else "w", mode="recompute")
                if k in (3, 19):
                    rec.readmit("v" if k == 3 else "w")
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def test_a_window_knows_whose_re_prefill_a_step_is_from_victims_emissions_outside_it(tmp_path):
    """docs/partition.md, "The re-prefill in the partition", rule 1. "w"'s gap 170 -> 210
    ms is the run's longest; its window (parts 16..21) holds none of "v"'s emissions. In
    the whole run "v" emitted at 50 ms, after its readmission (40 ms) and before step 20
    (200 ms): step 20's re-prefill is "w"'s alone, so of "w"'s gap the evicted 170..200 ms
    and the 4 ms re-prefill are `preempt` (34 ms), none `prefill`. A window that took "v"
    for a victim still re-prefilling would split those 4 ms equally: 2 ms `prefill`."""
    out = tmp_path / "run.npz"
    _recompute_run(out)

    args = ("gaps", str(out), "--around", "worst", "--width", "0.01", "--format", "jsonl")
    whole, sliced = _jsonl("100000000", *args), _jsonl("1", *args)
    assert _differences(whole, sliced) == []
    (w,) = [g for g in sliced if g["request"] == "w"]
    assert w["gap_ms"] == pytest.approx(40.0)
    assert w["parts"]["preempt"] == pytest.approx(34.0)
    assert w["parts"]["prefill"] == 0.0


def _two_victims_run(out: Path) -> None:
    """10 steps of 10 ms, a part each; "a" emits at every step's end. "v" emits at steps
    0, 1 and 8: evicted (recompute) at step 1's end. "w" emits at steps 0..5 and 8:
    evicted (recompute) at step 5's end. Both are readmitted at step 6's end, and step 7
    is one 10 ms `recompute` segment (no prefill chunk rows)."""
    clock = FakeClock()
    rec = _recorder(out, clock)
    with rec:
        for r in ("a", "v", "w"):
            rec.request(r)
        for k in range(10):
            with rec.step():
                with rec.segment("recompute" if k == 7 else "decode"):
                    clock.t += STEP_NS
                rec.emit(["a"] + (["v"] if k in (0, 1, 8) else [])
                         + (["w"] if k <= 5 or k == 8 else []))  # fmt: skip
                if k in (1, 5):
                    rec.evict("v" if k == 1 else "w", mode="recompute")
                if k == 6:
                    rec.readmit("v")
                    rec.readmit("w")
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def test_a_slice_knows_the_victims_re_prefilling_in_it_that_were_evicted_before_it(tmp_path):
    """docs/partition.md, "The re-prefill in the partition": step 7 (70..80 ms) is the
    re-prefill of "v" and "w", both readmitted by its end (70 ms) and not emitting again
    before it; with no chunk rows they share it equally. "a"'s gap 70 -> 80 ms is all
    others' re-prefill: `prefill` 10 ms, named 5 ms "v"'s and 5 ms "w"'s. "v"'s gap 20 ->
    90: evicted 20..70 and its own half of step 7, `preempt` 55 ms; "w"'s half, `prefill`
    5 ms. "w"'s 60 -> 90: `preempt` 10 + 5 ms, `prefill` 5 ms. Read a part a slice, "a"'s
    gap is owned by step 7's part and reaches back to step 6's: the evictions, in steps
    1's and 5's parts, are known only if the index sends its slice back to them."""
    out = tmp_path / "run.npz"
    _two_victims_run(out)

    args = ("gaps", str(out), "--format", "jsonl")
    whole, sliced = _jsonl("100000000", *args), _jsonl("1", *args)
    assert _differences(whole, sliced) == []
    (a,) = [g for g in sliced if g["request"] == "a" and g["t1_s"] == pytest.approx(0.08)]
    assert a["parts"]["prefill"] == pytest.approx(10.0)
    named = sorted((c["victim"], c["ms"]) for c in a["recompute_causes"])
    assert named == [("v", pytest.approx(5.0)), ("w", pytest.approx(5.0))]
    for name, preempt in (("v", 55.0), ("w", 15.0)):
        (g,) = [g for g in sliced if g["request"] == name and g["t1_s"] == pytest.approx(0.09)]
        assert (g["parts"]["preempt"], g["parts"]["prefill"]) == pytest.approx((preempt, 5.0))


def _late_arrival_run(out: Path) -> None:
    """6 steps of 10 ms, a part each; "a" decodes and emits in every step but step 3.
    "late" arrives 15 ms in (inside step 1) and is tokenised off the loop: steps 1 and 2
    state it waits (`tokenizing`); the engine adds it at step 3's start with that arrival,
    admits it and prefills it for the whole step, and it emits at step 3's end (40 ms)."""
    clock = FakeClock()
    start = clock.t
    rec = _recorder(out, clock)
    with rec:
        rec.request("a")
        for k in range(6):
            if k == 3:
                rec.request("late", arrival_tick=start + 15_000_000)
            with rec.step():
                if k == 3:
                    rec.admit("late")
                    rec.prefill("late", 8)
                with rec.segment("prefill" if k == 3 else "decode"):
                    clock.t += STEP_NS
                if k in (1, 2):
                    rec.wait(["late"], "tokenizing")
                rec.emit(["late"] if k == 3 else ["a"])
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def test_a_ttft_reaches_back_to_its_arrivals_time_not_to_its_arrival_row(tmp_path):
    """docs/ttft.md, rule 3: a wait row covers its step from the arrival on. "late"'s TTFT
    is 15 -> 40 ms: held by `tokenizing` waits 15..30 ms (step 1 from the arrival, step 2
    whole), then its own prefill 30..40 ms: wait_tokenizing 15 ms, prefill_own 10 ms.
    Its arrival row lies in part 3 (written when the engine added it), the wait of step 1
    in part 1: a slice that read back only to the row's part would miss 5 ms of the wait."""
    out = tmp_path / "run.npz"
    _late_arrival_run(out)

    args = ("ttft", str(out), "--format", "jsonl")
    whole, sliced = _jsonl("100000000", *args), _jsonl("1", *args)
    assert _differences(whole, sliced) == []
    (late,) = [t for t in sliced if t["request"] == "late"]
    assert late["ttft_ms"] == pytest.approx(25.0)
    assert late["parts"]["wait_tokenizing"] == pytest.approx(15.0)
    assert late["parts"]["prefill_own"] == pytest.approx(10.0)
    assert late["parts"]["residual"] == pytest.approx(0.0, abs=1e-9)


def _idle_arrival_run(out: Path) -> None:
    """6 steps of 10 ms (a `decode` segment each), 4 ms idle after each, the recorder's OS
    samples at every step's start and end; "a" emits at every step's end, a part after
    each step. "late" arrives 2 ms into the idle time after step 2 (its row in part 3) and
    emits first at step 5's end."""
    clock = FakeClock()
    rec = tracekit.Recorder(str(out), clock=clock, seconds_per_tick=1e-9, gc=False,
                            handle_signals=False, flush_interval_s=3600.0,
                            os_evidence=True)  # fmt: skip
    with rec:
        rec.request("a")
        for k in range(6):
            with rec.step():
                with rec.segment("decode"):
                    clock.t += STEP_NS
                rec.emit(["a"] + (["late"] if k == 5 else []))
            rec.flush_soon()
            _wait_for_parts(out, k + 1)
            clock.t += 2_000_000
            if k == 2:
                rec.request("late")
            clock.t += 2_000_000


def test_a_ttft_reaches_back_to_the_os_sample_before_its_arrival():
    """docs/partition.md, "OS evidence": an OS interval runs from one sample of the loop
    thread to the next. An arrival after a part's flush can lie in an interval that began
    before it (between steps: the step's end sample, then the flush): a TTFT from it reads
    back to the part holding that sample. Flushed parts 0, 1, 2 at ticks 100, 200, 300,
    whose first OS samples are at 10, 150, 250: an arrival at 320 (after every flush) reads
    from part 2, one at 210 from part 1 (part 2's samples all come after it), one at 50
    from part 0; an arrival not recorded stays in its row's part, 3."""
    flushed = np.array([100, 200, 300])
    sampled = (np.array([0, 1, 2]), np.array([10, 150, 250]))
    ticks = np.array([320, 210, 50, UNKNOWN_TICK])
    assert parts_holding(flushed, ticks, 3, sampled).tolist() == [2, 1, 0, 3]
    # no OS samples: the part whose time holds the arrival (the first flushed after it)
    none = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert parts_holding(flushed, ticks, 3, none).tolist() == [3, 2, 0, 3]


def test_a_ttft_arriving_between_steps_reads_the_part_of_the_step_before(tmp_path):
    """"late" arrives 2 ms after step 2's end sample, which lies in part 2, and after that
    part's flush: its TTFT starts inside the OS interval from that sample to step 3's
    start, so it reads back to part 2 (its row's part is 3), and read in slices it is the
    whole run's, OS shares included."""
    out = tmp_path / "run.npz"
    _idle_arrival_run(out)
    run = SlicedRun(str(out) + ".parts")
    run.index()
    late = tracekit.load(out).request_ids.index("late")
    assert run.arrival_part[late] == 2
    args = ("ttft", str(out), "--format", "jsonl")
    whole, sliced = _jsonl("100000000", *args), _jsonl("1", *args)
    (t,) = [t for t in whole if t["request"] == "late"]
    assert t["ttft_ms"] == pytest.approx(40.0)  # 2 ms of idle, step 3 to step 5's end: 38 + 2
    assert _differences(whole, sliced) == []


def _evicted_across_run(out: Path) -> None:
    """10 steps of 10 ms, a part each; "a" emits at every step's end. "v" and "x" emit at
    steps 0 and 1 and are evicted at step 2's end (30 ms); "v" is readmitted at step 8's end
    (90 ms) and emits at step 9's (100 ms), "x" never comes back; the run stops at 100 ms."""
    clock = FakeClock()
    rec = _recorder(out, clock)
    with rec:
        for r in ("a", "v", "x"):
            rec.request(r)
        for k in range(10):
            with rec.step():
                with rec.segment("decode"):
                    clock.t += STEP_NS
                rec.emit(["a"] + (["v", "x"] if k <= 1 else []) + (["v"] if k == 9 else []))
                if k == 2:
                    rec.evict("v")
                    rec.evict("x")
                if k == 8:
                    rec.readmit("v")
            rec.flush_soon()
            _wait_for_parts(out, k + 1)


def _traced(out: Path, window: str, budget: str) -> list[dict]:
    """The events of `tracekit trace OUT --window WINDOW`, the run read in slices of
    `budget` emissions (whole where it holds fewer)."""
    env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": budget}
    trace = out.with_name(f"{out.stem}-{budget}.json")
    r = subprocess.run([sys.executable, "-m", "tracekit", "trace", str(out), "--window", window,
                        "-o", str(trace)], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(trace.read_text())["traceEvents"]


def test_a_traced_window_draws_evictions_to_where_the_run_ends_them(tmp_path):
    """`trace --window 0.035..0.045` (docs/reports.md: the events overlapping the window,
    the gaps ending in it): "a"'s gap 30 -> 40 ms (its 20 -> 30 ends before the window,
    in its stretch back to 20 ms: the engine's, not the requests'); "v"'s gap 20 -> 100
    ends after the window, so its eviction is drawn on its own, 30 -> 90 ms (its
    readmission, in a part the window does not read); "x"'s eviction runs to the run's
    end, 30 -> 100 ms. The window's parts end at 40 ms: a trace that took their end for
    the run's drew both evictions to it."""
    out = tmp_path / "run.npz"
    _evicted_across_run(out)

    def requests(budget: str) -> list[tuple]:
        events = _traced(out, "0.035..0.045", budget)
        return [(e["tid"] - TID_REQUESTS, e["ts"], e["dur"], e["name"]) for e in events
                if e["ph"] == "X" and e["pid"] == PID_REQUESTS]  # fmt: skip

    whole, sliced = requests("100000000"), requests("1")
    assert whole == sliced == [
        (0, 30000.0, 10000.0, "clean"),
        (1, 30000.0, 60000.0, "evicted"),
        (2, 30000.0, 70000.0, "evicted"),
    ]


def test_a_traced_window_draws_the_step_running_at_its_end(tmp_path):
    """`trace --window 0..0.025` (docs/reports.md: the events overlapping the window) on
    `_hand_run` (step k runs 10k..10k + 10 ms, a part each, its tokens at its end): steps
    0, 1 and 2 overlap it, step 2 (20..30 ms) to its end. Step 2's rows lie in the part
    with its tokens (30 ms), after the window's end: a window read only up to the parts
    whose tokens came before its end drew steps 0 and 1."""
    out = tmp_path / "run.npz"
    _hand_run(out)

    def steps(budget: str) -> list[tuple]:
        events = _traced(out, "0..0.025", budget)
        return sorted((e["args"]["step"], e["ts"], e["dur"]) for e in events
                      if e["ph"] == "X" and e["name"] == "step")  # fmt: skip

    whole, sliced = steps("100000000"), steps("1")
    assert whole == sliced == [(0, 0.0, 10000.0), (1, 10000.0, 10000.0), (2, 20000.0, 10000.0)]


def test_a_traced_window_leaves_out_what_starts_at_its_end(tmp_path):
    """`trace --window 0..0.02` on `_hand_run`: a window is [FROM, TO) (docs/reports.md,
    "Windows"), so step 2, which starts at 20 ms, is after it, and so is "alive"'s gap
    10 -> 20 ms, which ends at TO: steps 0 and 1, no gap, and both TTFTs (first tokens at
    10 ms), whole and in slices."""
    out = tmp_path / "run.npz"
    _hand_run(out)
    for budget in ("100000000", "1"):
        events = _traced(out, "0..0.02", budget)
        steps = sorted(e["args"]["step"] for e in events if e["ph"] == "X" and e["name"] == "step")
        assert steps == [0, 1], budget
        gaps = [e for e in events if e["ph"] == "X" and e["pid"] == PID_REQUESTS
                and "gap_ms" in e.get("args", {})]  # fmt: skip
        assert gaps == [], budget
        assert sum(e["ph"] == "X" and e["name"] == "ttft" for e in events) == 2, budget


def _of_span(view: WindowOptions, span) -> WindowOptions:
    """The view whose window and width are fractions of the run's span, in seconds."""
    if view.window is not None:
        return WindowOptions(window=span.window(view.window))
    return WindowOptions(around=view.around, width_s=float(span.width(view.width_s)))


@pytest.mark.parametrize(
    "view",
    [WindowOptions(window="0.15..0.4"), WindowOptions(around="worst", width_s=0.14),
     WindowOptions(window="0.32..")],
)  # fmt: skip
def test_the_tail_over_time_of_a_window_read_from_its_parts_is_the_whole_runs(
    demo_run, demo_span, view
):
    """`analyze --by` with a window of a long run reads the window's parts only; its rows
    are the whole run's rows over that window (docs/reports.md, "The tail over time"): the
    run's tail counted against the whole run's p99, not the window's. The view's window and
    width are fractions of the run's span (`demo_span`)."""
    view = _of_span(view, demo_span)
    log = tracekit.load(demo_run)
    part = partition(log)
    whole = over_time(log, part, 0.5, view.resolve(log, part))
    sliced = over_time_window(demo_run + ".parts", 0.5, view, path=log.path)

    def rows(buckets):  # NaN (a bucket without gaps) as None, so it compares
        text = json.dumps([dataclasses.asdict(b) for b in buckets]).replace("NaN", "null")
        return json.loads(text)

    assert whole and _differences(rows(whole), rows(sliced)) == []


def test_the_tail_over_time_in_slices_refuses_too_many_buckets_before_counting(demo_run):
    """A `--by` that cuts the run into more than 100,000 buckets is refused from the index
    pass's span, before any bucket is counted (docs/reports.md, "The tail over time")."""
    with pytest.raises(UsageError) as e:
        over_time_sliced(demo_run + ".parts", 1e-5, path=demo_run, max_emissions=500)
    assert str(e.value).startswith(f"{demo_run}: --by 1e-05 s cuts the ")
    assert "at most 100,000" in str(e.value)


@pytest.mark.parametrize(
    "view", [WindowOptions(window="0.15..0.35"), WindowOptions(around="worst", width_s=0.14)]
)
def test_whatif_compare_and_report_of_a_window_read_only_its_parts(demo_run, demo_span, view,
                                                                   monkeypatch):  # fmt: skip
    """A window of a long run, on `whatif`, `compare` and `report`, is read from the parts
    it needs (reading the whole run is made to fail) and gives the whole run's window:
    the what-if (its victim-policy line the whole run's), the figures and the page. The
    view's window and width are fractions of the run's span (`demo_span`)."""
    view = _of_span(view, demo_span)
    from tracekit.analysis import workers

    def plain(x):  # NaN as None, so that equal pages compare equal
        if dataclasses.is_dataclass(x):
            x = x.to_dict() if hasattr(x, "to_dict") else dataclasses.asdict(x)
        return json.loads(json.dumps(x, default=lambda o: o.to_records()).replace("NaN", "null"))

    def read(budget: str):
        monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", budget)
        w = workers.whatif_path(demo_run, view=view)
        a, w2 = workers.analyze_whatif_path(demo_run, view=view)
        page, w3 = workers.report_path(demo_run, 10, view=view)
        return [w.to_records(), a.to_dict(), w2.to_records(), w3.to_records(),
                {k: plain(v) if k != "buckets" else [plain(b) for b in v]
                 for k, v in page.items()}]  # fmt: skip

    whole = read("100000000")
    assert whole[0] and whole[4]["worst_stalls"]

    def no_whole_run(*_a, **_k):
        raise AssertionError("a window of a long run read the whole run")

    monkeypatch.setattr(workers, "partitions", no_whole_run)
    assert _differences(plain(whole), plain(read("500"))) == []


def test_a_whole_trace_of_a_run_over_the_trace_limit_is_refused_with_its_windows(
    demo_run, tmp_path
):
    """`trace` of a whole run of more emissions than TRACEKIT_TRACE_EMISSIONS exits 2 in
    one line naming the windows that cut it and the setting that allows it; a window of
    the same run is written; a limit that is no number is refused."""
    n = sum(e.num_emissions for e in _indexed(demo_run).parts)

    def trace(limit: str, *extra: str):
        env = {**os.environ, "TRACEKIT_TRACE_EMISSIONS": limit}
        return subprocess.run([sys.executable, "-m", "tracekit", "trace", demo_run, "-o",
                               str(tmp_path / "t.json"), *extra], capture_output=True,
                              text=True, cwd=REPO, env=env, timeout=600)  # fmt: skip

    r = trace(str(n - 1))
    assert r.returncode == 2 and not (tmp_path / "t.json").exists()
    err = r.stderr.strip()
    assert "\n" not in err and f"{n:,} emissions" in err
    assert "--around worst" in err and f"TRACEKIT_TRACE_EMISSIONS to {n} or more" in err
    assert trace(str(n - 1), "--around", "worst").returncode == 0
    assert trace(str(n)).returncode == 0  # at the limit: written whole
    bad = trace("lots")
    assert bad.returncode == 2 and "TRACEKIT_TRACE_EMISSIONS='lots'" in bad.stderr


def _indexed(path: str) -> SlicedRun:
    run = SlicedRun(path + ".parts")
    run.index()
    return run


@pytest.mark.parametrize(
    ("command", "spread"),
    [("analyze", ("-j", "2")), ("analyze", ("--ray",)), ("analyze --by", ("-j", "2")),
     ("report", ("-j", "2")), ("report", ("--ray",))],
)  # fmt: skip
def test_one_runs_slices_in_processes_or_on_ray_give_the_same_bytes(
    demo_run, demo_span, tmp_path, command, spread
):  # fmt: skip
    """A single run read in slices, its slices in two processes or as tasks on a local
    Ray: the output is the one-process output, byte for byte (the sums fold in order):
    `analyze`, its tail over time, and the HTML report (every pass's slices)."""
    if spread[0] == "--ray":
        pytest.importorskip("ray")
    args = {"analyze": ["--format", "jsonl"],
            "analyze --by": ["--by", f"{demo_span.width(0.1)}s", "--format", "jsonl"],
            "report": ["-o", str(tmp_path / "page.html")]}[command]  # fmt: skip

    def run(*extra):
        env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": "2000", "RAY_AUTH_MODE": "disabled"}
        r = subprocess.run([sys.executable, "-m", "tracekit", command.split()[0], demo_run,
                            *args, *extra], capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "read in slices" in r.stderr
        return r.stdout if command != "report" else (tmp_path / "page.html").read_text()

    one = run()
    assert len(one) > 1000
    assert run(*spread) == one


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(0, 5), st.floats(0, 1e4, allow_nan=False)), min_size=1,
                  max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=4),
)  # fmt: skip
def test_grouped_quantiles_are_numpys_per_group(rows, cuts):
    """Each time bucket's percentiles, from pieces in any order, are numpy's of its values."""
    g = np.array([r[0] for r in rows])
    v = np.array([r[1] for r in rows])
    q = GroupQuantiles([50.0, 99.0, 99.9])
    at = sorted({min(c, len(v)) for c in cuts})
    pieces = list(zip(np.split(g, at), np.split(v, at), strict=True))
    for a, b in pieces:
        q.count(a, b)
    q.wanted()
    for a, b in reversed(pieces):
        q.keep(a, b)
    for k in np.unique(g).tolist():
        assert q.percentiles(k) == [float(x) for x in np.percentile(v[g == k], [50, 99, 99.9])]
        assert q.n(k) == int((g == k).sum())
    assert all(math.isnan(x) for x in q.percentiles(99))


def test_the_index_keeps_a_row_an_eviction_not_the_victims_tokens(demo_run):
    """Of the victims' emissions the index keeps only each eviction's next one (where its
    debt ends): memory by evictions, never by the tokens a victim emits afterwards."""
    from tracekit.analysis.stream import index_pass

    run = SlicedRun(demo_run + ".parts")
    ix = index_pass(run, "all-captured", lambda _m: None)
    kept = sum(len(p["tables"].get("emissions", ())) for p in ix.sparse)
    log = tracekit.load(demo_run)
    assert 0 < kept <= len(log.evictions)
    victims = np.isin(log.emissions.request, log.evictions.request)
    assert kept < int(victims.sum())  # the victims emitted far more than that


def _unadmitted_run(out: Path, admitted: int) -> None:
    """30 requests, one after another, each emitting 4 tokens in 4 steps; a part every 5
    requests (6 parts); only the first `admitted` requests are admitted (`Recorder.admit`)."""

    class Clock:
        t = 10**9

        def __call__(self) -> int:
            return self.t

    clk = Clock()
    rec = tracekit.Recorder(out, clock=clk, gc=False, handle_signals=False,
                            flush_interval_s=3600)  # fmt: skip
    rec.start()
    for i in range(30):
        clk.t += 10**6
        h = rec.request(f"r{i}", prompt_tokens=4)
        for _ in range(4):
            clk.t += 10**6
            with rec.step():
                if i < admitted:
                    rec.admit_handle(h)
                with rec.segment("decode"):
                    clk.t += 10**6
                rec.emit_handles([h])
        if i % 5 == 4:
            rec.flush_soon()
            _wait_for_parts(out, (i + 1) // 5)
    rec.stop()


@pytest.mark.parametrize("admitted", [0, 3])
def test_the_unsplit_requests_note_counts_the_whole_run_in_slices(tmp_path, admitted):
    """docs/ttft.md: a request without an admission row is unsplit, and the note counts them
    over the run and says why: with no admission row in the log, the log has none; with
    some (the first 3 requests, in the first part only), none was recorded for them. In
    slices of 8 emissions (two requests), every slice but the first has no admission row;
    the note is still the whole run's: 30 or 27 requests, and the run's reason."""
    out = tmp_path / "run.npz"
    _unadmitted_run(out, admitted)
    whole = analyze(tracekit.load(out)).to_dict()
    sliced = analyze_sliced(str(out) + ".parts", max_emissions=8, path=whole["path"]).to_dict()
    _assert_same(whole, sliced)
    why = "no admission event was recorded for them" if admitted else "the log has no admission"
    notes = [n for n in json.dumps(sliced).split('"') if "request(s) unsplit" in n]
    assert len(notes) == 1 and notes[0].startswith(f"{30 - admitted} request(s) unsplit: {why}")


def test_slices_read_the_parts_the_index_pass_listed_whatever_the_folder_holds_since(tmp_path):
    """A slice's worker reads the parts its task names, as the index pass listed them,
    never the folder listed again: retention removes a long run's oldest parts while it is
    read (and a day's folder holds ~50,000 names to list per slice). Parts removed once the
    tasks are made: every slice partitions the same gaps as on the untouched folder. (The
    hand run of a part a step: a demo run's parts are as many as its flushes in real time,
    as few as 4 on an idle machine.)"""
    from tracekit.analysis.stream import index_pass, keep_gap_values, slice_partition, slice_tasks
    from tracekit.log.parts import part_paths

    out = tmp_path / "run.npz"
    _hand_run(out)
    parts = str(out) + ".parts"
    run = SlicedRun(parts)
    ix = index_pass(run, "all-captured", lambda _m: None)
    keep_gap_values(run, ix)
    tasks = slice_tasks(run, ix, 1, ix.gaps.percentiles()[2])  # a part a slice
    late = [t for t in tasks if t.c >= 1]  # the slices that never read the first part
    assert len(late) >= 3
    before = [slice_partition(t) for t in late]
    for path in part_paths(parts)[:1]:  # what retention removes first
        os.remove(path)
    for t, p in zip(late, before, strict=True):
        q = slice_partition(t)
        assert np.array_equal(q.p.gap_ms, p.p.gap_ms)
        assert np.array_equal(q.numbers[q.p.request], p.numbers[p.p.request])
