"""A run's what-if read in slices (docs/reports.md, "Reading a long run in slices";
docs/whatif.md): the whole run's what-if, whatever the slices' size."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sliced import FakeClock, _hand_run, _wait_for_parts

import tracekit
from tracekit.analysis.quantiles import GroupQuantiles, group_counts, group_kept
from tracekit.analysis import stream_whatif
from tracekit.analysis.stream_replay import LateWindow
from tracekit.analysis.stream_whatif import whatif_sliced
from tracekit.analysis.whatif import FIRST, SECOND, WhatIf
from tracekit.analysis.whatif import whatif as whatif_whole
from tracekit.analysis.workers import partitions
from tracekit.capture import osstats
from tracekit.log.slices import SlicedRun

REPO = Path(__file__).resolve().parents[2]
MS = 1_000_000  # ticks (1 ns each)


def _same_records(whole: list[dict], sliced: list[dict]) -> None:
    """Every field equal; `removed_ms`, a sum over every gap, to float rounding (it adds up
    in another order in slices). Percentiles, counts and labels exactly."""
    assert [(r["removal"], r["model"]) for r in whole] == [
        (r["removal"], r["model"]) for r in sliced
    ]
    for a, b in zip(whole, sliced, strict=True):
        assert list(a) == list(b)
        for k in a:
            if k == "removed_ms" and a[k] is not None and b[k] is not None:
                assert abs(a[k] - b[k]) <= 1e-9 * max(1.0, abs(a[k])), (a["removal"], k)
            else:
                assert a[k] == b[k], (a["removal"], a["model"], k, a[k], b[k])


def _same(whole: WhatIf, sliced: WhatIf) -> None:
    assert sliced.measured == whole.measured and sliced.num_gaps == whole.num_gaps
    assert sliced.warnings == whole.warnings and sliced.config == whole.config
    _same_records(whole.to_records(), sliced.to_records())


def _whole(path: str, names=None) -> WhatIf:
    log, part, tpart = partitions(path)
    return whatif_whole(log, part, tpart, names)


def _gc_run(out: Path) -> None:
    """Six steps of 10 ms (a `decode` segment each), a part per step (as `test_sliced`'s
    hand run). Request "a" emits at every step's end, "b" at steps 0 and 3 only. Between
    steps 1 and 2 one collection takes 5 ms (the clock moves inside it: our callback runs
    after the recorder's, which stamped the start). Times (ms from the start): steps
    [0,10] [10,20], GC [20,25], steps [25,35] [35,45] [45,55] [55,65]."""
    clock = FakeClock()
    armed = [False]

    def pause(phase: str, _info: dict) -> None:
        if phase == "start" and armed[0]:
            clock.t += 5 * MS

    rec = tracekit.Recorder(str(out), clock=clock, seconds_per_tick=1e-9, gc=True,
                            os_evidence=False, handle_signals=False,
                            flush_interval_s=3600.0)  # fmt: skip
    was_enabled = gc.isenabled()
    gc.disable()  # no collection of its own: only the one we time
    try:
        with rec:
            gc.callbacks.append(pause)  # after the recorder's
            try:
                rec.request("a")
                rec.request("b")
                for k in range(6):
                    if k == 2:
                        armed[0] = True
                        gc.collect()
                        armed[0] = False
                    with rec.step():
                        with rec.segment("decode"):
                            clock.t += 10 * MS
                        rec.emit(["a", "b"] if k in (0, 3) else ["a"])
                    rec.flush_soon()
                    _wait_for_parts(out, k + 1)
            finally:
                gc.callbacks.remove(pause)
    finally:
        if was_enabled:
            gc.enable()


def test_a_gc_pause_inside_a_gap_across_slices_by_hand(tmp_path):
    """docs/whatif.md, both models: "a"'s gaps are 10, 15 (its step-1-to-2 gap holds the
    5 ms pause: gc), 10, 10, 10 ms; "b"'s one gap runs from 10 to 45 ms: 35 ms, 5 of them
    gc. ITL [10, 10, 10, 10, 15, 35]: numpy's linear p50 (rank 2.5) 10, p99 (rank 4.95)
    15 + 0.95 x 20 = 34, p99.9 (rank 4.995) 15 + 0.995 x 20 = 34.9, max 35.
    Without gc, first order: each gap loses its gc part; second order: the pause is under
    no other window, so its whole 5 ms go from every gap over it. Either way the gaps are
    [10, 10, 10, 10, 10, 30]: p50 10, p99 10 + 0.95 x 20 = 29, p99.9 29.9, max 30; 10 ms
    removed. The TTFTs (arrival at 0, first token at 10) hold no pause: 10 ms, unchanged.
    Read one part a slice, "b"'s gap is owned by step 3's slice, which reaches back to
    step 0's part over the pause's."""
    out = tmp_path / "run.npz"
    _gc_run(out)
    parts = str(out) + ".parts"
    run = SlicedRun(parts)
    run.index()
    bounds = run.bounds(1)
    assert all(b == a + 1 for _, a, b in bounds) and len(bounds) >= 6
    assert any(c == 0 and a == 3 for c, a, _ in bounds)  # "b"'s gap: back to step 0's part
    whole = _whole(str(out))
    sliced = whatif_sliced(parts, path=whole.path, max_emissions=1)
    _same(whole, sliced)
    m = sliced.measured
    assert sliced.num_gaps == 6
    assert (m["itl_p50_ms"], m["itl_max_ms"]) == pytest.approx((10.0, 35.0))
    assert (m["itl_p99_ms"], m["itl_p999_ms"]) == pytest.approx((34.0, 34.9))
    for model in (FIRST, SECOND):
        p = sliced.get("gc", model)
        assert p is not None and p.num_gaps == 6
        assert p.removed_ms == pytest.approx(10.0)
        f = p.figures
        assert (f["itl_p50_ms"], f["itl_p99_ms"]) == pytest.approx((10.0, 29.0))
        assert (f["itl_p999_ms"], f["itl_max_ms"]) == pytest.approx((29.9, 30.0))
        assert (f["ttft_p50_ms"], f["ttft_p99_ms"]) == pytest.approx((10.0, 10.0))


def test_an_eviction_over_twenty_slices_and_a_stall_each_step_by_hand(tmp_path):
    """docs/whatif.md, both models, on `test_sliced`'s hand run with a 1 ms `tok` before
    each 10 ms decode: step k runs [11k, 11k + 11] ms, its `tok` [11k, 11k + 1], its tokens
    at its end. "alive": 29 gaps of 11 ms, each over one `tok`. "long": one gap from 11 to
    264 (253 ms), evicted at step 2's end (33) until step 22's (253): 220 ms preempt, its
    live stretches [11, 33] and [253, 264] over the `tok` of steps 1, 2 and 23 (3 ms).
    Read one part a slice, "long"'s gap and the replayed timeline it reads cross 23
    slices' edges. numpy's linear p99 of 30 values: rank 28.71, between the 29th and 30th.

    - `tok`, first order: "alive" 10 each, "long" 253 - 3 = 250; removed 29 + 3 = 32 ms;
      p99 10 + 0.71 x 240 = 180.4. Second order: the 23 `tok` windows in "long"'s gap are
      under no other window and go: 230; removed 29 + 23 = 52 ms; p99 10 + 0.71 x 220 =
      166.2. The TTFTs (arrival 0, first token 11 over step 0's `tok`): 10 in both.
    - `preempt`, first order: "long" keeps its live 22 + 11 = 33 ms; removed 220; p99
      11 + 0.71 x 22 = 26.62. Second order: no window is removable, and "long"'s gap is
      split at the 19 step ends strictly inside its eviction (44, 55, ..., 242): 33, 18
      of 11, 22. 49 gaps: 47 of 11, 22, 33; p99 at rank 0.99 x 48 = 47.52: 22 + 0.52 x
      11 = 27.72; max 33; nothing removed."""
    out = tmp_path / "run.npz"
    _hand_run(out, extra="tok")
    parts = str(out) + ".parts"
    whole = _whole(str(out))
    sliced = whatif_sliced(parts, path=whole.path, max_emissions=1)
    _same(whole, sliced)
    assert sliced.num_gaps == 30 and sliced.measured["itl_max_ms"] == pytest.approx(253.0)
    want = {  # (removal, model): (gaps, removed ms, p50, p99, max)
        ("tok", FIRST): (30, 32.0, 10.0, 180.4, 250.0),
        ("tok", SECOND): (30, 52.0, 10.0, 166.2, 230.0),
        ("preempt", FIRST): (30, 220.0, 11.0, 26.62, 33.0),
        ("preempt", SECOND): (49, 0.0, 11.0, 27.72, 33.0),
    }
    for (name, model), (n, removed, p50, p99, top) in want.items():
        p = sliced.get(name, model)
        assert p is not None and p.num_gaps == n, (name, model)
        f = p.figures
        got = (p.removed_ms, f["itl_p50_ms"], f["itl_p99_ms"], f["itl_max_ms"])
        assert got == pytest.approx((removed, p50, p99, top), abs=1e-9), (name, model)
    for model in (FIRST, SECOND):
        tok = sliced.get("tok", model)
        assert tok is not None and tok.figures["ttft_p50_ms"] == pytest.approx(10.0)


class _Kernel:
    """The loop thread's counters on `clock`: it ran 80% of every instant since the run
    began and waited on a run queue the other 20% (`tracekit.capture.osstats`' calls)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.t0 = clock, clock.t

    def cpu_ns(self) -> int:
        return (self.clock.t - self.t0) * 4 // 5

    def pread(self, _fd: int, _n: int, _offset: int) -> bytes:
        return b"0 %d 0\n" % ((self.clock.t - self.t0) // 5)

    def getrusage(self, _who: int) -> SimpleNamespace:
        return SimpleNamespace(ru_nvcsw=0, ru_nivcsw=0, ru_majflt=0)


@pytest.mark.skipif(osstats.unavailable_reason() is not None
                    or not os.path.exists(osstats.SCHEDSTAT_PATH),
                    reason="OS evidence needs Linux with schedstat")  # fmt: skip
def test_removing_the_os_beside_other_causes_in_slices_by_hand(tmp_path, monkeypatch):
    """docs/whatif.md, "Removing the OS", on `test_sliced`'s hand run with 1 ms that no
    segment covers (`residual`) before each step's 10 ms decode: step k runs [11k, 11k +
    11] ms, its tokens at its end; "alive" emits at every step's end, "long" at steps 0
    and 23, evicted over [33, 253]. OS evidence from `_Kernel`: each step is an OS
    interval with R = 20% of it, so `os_runqueue` owns 0.2 of every live instant
    (docs/partition.md, "OS evidence", rule 1; the eviction stays `preempt`, rule 3).
    Gaps: 29 of 11 ms and "long"'s 253. Sorted, p99 (rank 28.71) is 11 + 0.71 x 242 =
    182.82, p99.9 (28.971) 245.982.
    Without os_runqueue, first order: each gap loses its part, 2.2 ms or (33 live ms)
    6.6: 29 of 8.8 and one of 246.4, 70.4 ms removed: p99 8.8 + 0.71 x 237.6 = 177.496.
    Second order: the run's time goes at rate 0.2 everywhere (no window removed: f = 0,
    so f + (1 - f) o = 0.2), so every gap loses a fifth of its span: 29 of 8.8 and 253 -
    50.6 = 202.4, 114.4 ms removed: p99 8.8 + 0.71 x 193.6 = 146.256. The TTFTs
    (arrival 0, first token 11) lose 2.2 ms in both.
    The run's other removals (preempt, decode's) replay on the windows' ends alone; this
    one also on the OS samples' ticks, each step's start 1 ms before its decode window.
    Read one part a slice, each removal must keep its own bounds."""
    clock = FakeClock()
    kernel = _Kernel(clock)
    for name in ("thread_cpu_ns", "pread", "getrusage"):
        monkeypatch.setattr(osstats, name, getattr(kernel, name.replace("thread_", "")))
    out = tmp_path / "run.npz"
    _hand_run(out, clock=clock, os_evidence=True, lead_ns=1 * MS)
    whole = _whole(str(out))
    sliced = whatif_sliced(str(out) + ".parts", path=whole.path, max_emissions=1)
    _same(whole, sliced)
    m = sliced.measured
    assert (m["itl_p50_ms"], m["itl_p99_ms"]) == pytest.approx((11.0, 182.82))
    assert (m["itl_p999_ms"], m["itl_max_ms"]) == pytest.approx((245.982, 253.0))
    want = {FIRST: (70.4, 8.8, 177.496, 246.4), SECOND: (114.4, 8.8, 146.256, 202.4)}
    for model, (removed, p50, p99, top) in want.items():
        p = sliced.get("os_runqueue", model)
        assert p is not None and p.num_gaps == 30, model
        f = p.figures
        got = (p.removed_ms, f["itl_p50_ms"], f["itl_p99_ms"], f["itl_max_ms"])
        assert got == pytest.approx((removed, p50, p99, top), abs=1e-9), model
        assert (f["ttft_p50_ms"], f["ttft_p99_ms"]) == pytest.approx((8.8, 8.8)), model
    assert sliced.get("preempt", SECOND) is not None


@pytest.fixture(scope="module")
def demo_whole(demo_run) -> WhatIf:
    return _whole(demo_run)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(budget=st.integers(min_value=1, max_value=20_000))
def test_any_slice_size_gives_the_whole_runs_whatif(demo_run, demo_whole, budget):
    parts = demo_run + ".parts"
    assert len(SlicedRun(parts).paths) >= 3
    sliced = whatif_sliced(parts, path=demo_whole.path, max_emissions=budget)
    _same(demo_whole, sliced)
    names = {p.removal.name for p in sliced.predictions}
    assert {"preempt", "gc", "graph"} <= names and sliced.victim_policy is not None


def test_named_removals_in_slices(demo_run):
    want = _whole(demo_run, ["preempt", "host"])
    got = whatif_sliced(demo_run + ".parts", ["preempt", "host"], path=want.path,
                        max_emissions=700)  # fmt: skip
    _same(want, got)


@pytest.mark.parametrize("late_after", [0, 3])
def test_a_window_recorded_late_restarts_the_first_pass(demo_run, demo_whole, monkeypatch,
                                                        late_after):  # fmt: skip
    """A window found late while `R` is built part by part (`LateWindow`), here after
    `late_after` stretches of the first pass, some slices already counted: the first pass
    is made again from the run's log without emissions, counted once, and the second pass
    reads `R` the same way: the whole run's what-if."""
    real = stream_whatif.replay_stretches
    calls = []

    def late(*a, **kw):
        calls.append(1)
        for k, piece in enumerate(real(*a, **kw)):
            if k == late_after:
                raise LateWindow("a window starts before the parts replayed")
            yield piece

    monkeypatch.setattr(stream_whatif, "replay_stretches", late)
    sliced = whatif_sliced(demo_run + ".parts", path=demo_whole.path, max_emissions=700)
    _same(demo_whole, sliced)
    assert len(calls) == 1  # streamed once, then never again


def _cli(args: list[str], budget: int) -> tuple[str, str]:
    env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": str(budget)}
    r = subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout, r.stderr


def test_whatif_and_compare_read_a_long_run_in_slices(demo_run):
    """The commands: over the slice budget the run is read in slices and says so, with the
    whole run's records; `-j 2` runs its slices in two processes, byte for byte the same."""
    whole, err_whole = _cli(["whatif", demo_run, "--format", "jsonl"], 100_000_000)
    sliced, err_sliced = _cli(["whatif", demo_run, "--format", "jsonl"], 500)
    assert "in slices" in err_sliced and "in slices" not in err_whole
    _same_records([json.loads(x) for x in whole.splitlines()],
                  [json.loads(x) for x in sliced.splitlines()])  # fmt: skip
    two, _ = _cli(["whatif", demo_run, "--format", "jsonl", "-j", "2"], 500)
    assert two == sliced
    # compare's verdict opens with what to fix first, from the run's what-if
    c_whole, _ = _cli(["compare", demo_run], 100_000_000)
    c_sliced, err = _cli(["compare", demo_run], 500)
    assert "in slices" in err and "What to fix first" in c_sliced
    assert c_sliced == c_whole


def test_group_quantiles_counted_in_pieces_are_numpys():
    """The slices count each removal's values where they are (`group_counts`,
    `group_kept`: one group a piece, or several): the percentiles are numpy's, bit for
    bit, as when the values are counted in one place."""
    rng = np.random.default_rng(7)
    qs = (50.0, 99.0, 99.9, 100.0)
    for trial in range(12):
        n = int(rng.integers(1, 2000))
        vals = [np.round(rng.exponential(10, n), trial % 3) for _ in range(3)]
        one, pieces, mixed = GroupQuantiles(qs), GroupQuantiles(qs), GroupQuantiles(qs)
        all_g = np.concatenate([np.full(len(v), g) for g, v in enumerate(vals)])
        all_v = np.concatenate(vals)
        for g, v in enumerate(vals):
            for piece in np.array_split(v, 4):
                one.count(np.full(len(piece), g), piece)
                pieces.add_counts(*group_counts(np.full(len(piece), g), piece))
        mixed.add_counts(*group_counts(all_g, all_v))
        for q in (one, pieces, mixed):
            q.wanted()
        for g, v in enumerate(vals):
            for piece in np.array_split(v, 3):
                one.keep(np.full(len(piece), g), piece)
                pieces.add_kept(*group_kept(np.full(len(piece), g), piece, pieces.keep_keys))
        mixed.add_kept(*group_kept(all_g, all_v, mixed.keep_keys))
        for g, v in enumerate(vals):
            want = [float(x) for x in np.percentile(v, qs)]
            assert one.percentiles(g) == pieces.percentiles(g) == mixed.percentiles(g) == want
