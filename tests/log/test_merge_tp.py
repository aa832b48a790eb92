"""The merge's tensor-parallel rule on synthetic per-process logs (docs/adapters.md):
at each collective the ranks that entered first wait until the last one enters; the last
rank's lateness goes to its stalls since its forward call began (at most their length),
the rest to what it was doing during the wait, labelled with its rank, carved out of the
engine core's forward window of the step."""

from __future__ import annotations

import re

import numpy as np
import pytest
from logfiles import one_file_arrays

import tracekit
from tracekit.analysis.run import merge_run as merge_dir
from tracekit.attribution.itl import partition

SHARED = "clock_gettime(CLOCK_MONOTONIC)"


class Clock:
    def __init__(self) -> None:
        self.true_s = 0.0

    def __call__(self) -> int:
        return round((100.0 + self.true_s) * 1e9)


def _rec(path, clock, role, pid, **ident):
    config = {"process": {"role": role, "pid": pid, "host": "h", "name": role,
                          "boot_id": "b", "clock": SHARED, **ident}}  # fmt: skip
    rec = tracekit.Recorder(str(path), clock=clock, gc=False, handle_signals=False,
                            flush_interval_s=1e9, config=config)  # fmt: skip
    rec.start()
    return rec


def record_tp(tmp_path, n_steps=6, stall_step=3):
    """An engine core and two TP workers on one clock, times in ms from 0: step k runs
    [10k, 10k+8], its forward window (the core waits for the workers) [10k+1, 10k+7], one
    request emits at 10k+7.5. Both workers' forward runs [10k+1.2, 10k+6.8]; one collective
    per step: rank 0 enters at 10k+2, rank 1 at 10k+2.1 (0.1 ms late, in its forward).
    In `stall_step` rank 1 stalls [10k+1.5, 10k+3.5] (an injected window) and enters at
    10k+3.9."""
    clk = Clock()
    core = _rec(tmp_path / "engine_core-1.npz", clk, "engine_core", 1, dp_rank=0)
    w = [_rec(tmp_path / f"worker-{10 + r}.npz", clk, "worker", 10 + r, tp_rank=r, rank=r)
         for r in (0, 1)]  # fmt: skip
    ms = 1e-3

    def at(t_ms):
        clk.true_s = t_ms * ms

    def tick(t_ms):
        return round((100.0 + t_ms * ms) * 1e9)

    at(0.5)
    core.request("r0")
    for k in range(n_steps):
        b = 10.0 * k + 1.0
        at(b - 1.0)
        with core.step():
            core.add_segment("decode", tick(b), tick(b + 6.0))
            at(b + 6.5)
            core.emit(["r0"])
        for r, rec in enumerate(w):
            rec.add_segment("forward", tick(b + 0.2), tick(b + 5.8))
            enter = b + 1.0 + (0.1 if r else 0.0)
            if r == 1 and k == stall_step:
                rec.add_segment("injected", tick(b + 0.5), tick(b + 2.5))
                enter = b + 2.9
            rec.add_segment("collective", tick(enter), tick(b + 3.0))
    at(10.0 * n_steps + 1)
    for rec in (core, *w):
        rec.stop()
    return str(tmp_path)


def test_the_wait_on_the_last_rank_is_charged_to_its_own_cause(tmp_path):
    run = merge_dir(record_tp(tmp_path))
    p = partition(run)
    assert p.reconcile_max_err_ms < 1e-6
    by = {lb: p.column(lb) for lb in ("rank1:injected", "rank1:forward")}
    # gaps: between emissions at 10k+7.5; gap k-1 -> k holds step k
    # the stalled step 3: rank 0 entered at 32.0, rank 1 at 33.9: rank 1 was 1.9 ms late;
    # since its forward began (31.2) it stalled 2.0 ms (31.5-33.5), which explains all of
    # it (without the stall it would have entered at 31.9): 1.9 ms to its stall, none to
    # its forward
    g3 = int(np.flatnonzero(np.isclose(p.t1_s, 37.5e-3))[0])
    assert by["rank1:injected"][g3] == pytest.approx(1.9, abs=1e-6)
    assert by["rank1:forward"][g3] == pytest.approx(0.0, abs=1e-6)
    # every other gap: rank 1 was 0.1 ms late, in its forward
    others = np.arange(len(p)) != g3
    assert np.allclose(by["rank1:forward"][others], 0.1, atol=1e-6)
    assert np.allclose(by["rank1:injected"][others], 0.0)
    # carved out of the forward window, never added: each gap is still 10 ms
    assert np.allclose(p.gap_ms, 10.0)
    rep = run.meta["tensor_parallel"]
    assert rep["ranks"] == [1]
    assert rep["charged_s"]["rank1:injected"] == pytest.approx(1.9e-3)


#: Steps of `record_tp_plan`: (length ms, [(late rank, late ms, cause), ...] one per
#: collective of the step): the late rank enters that much after the other; `injected`:
#: the lateness is a stall window just before it enters, `forward`: it was in its forward.
SMALL = (10, [(1, 0.1, "forward")])
PLAN = [SMALL] * 252
PLAN[2] = (30, [(1, 20.0, "injected")])
PLAN[3] = (10, [(0, 0.2, "forward")])
PLAN[4] = (31, [(0, 15.0, "forward")])
PLAN[6] = (32, [(0, 3.0, "forward"), (1, 5.0, "injected")])
PLAN[7] = (10, [(0, 0.1, "forward")])


def record_tp_plan(tmp_path, plan=PLAN):
    """An engine core and two TP workers on one clock. Step k starts at b (the previous
    step's end), runs [b, b+L-2], its forward window [b+1, b+L-3]; request r0 emits at
    b+L-2.5, so the gap closed by step k is L long. Each worker's forward runs
    [b+1.2, b+L-3.2]; the i-th collective of a step: the on-time rank enters at c, the late
    one at c + late, both leave 0.5 ms later; the next collective starts 0.5 ms after."""
    clk = Clock()
    core = _rec(tmp_path / "engine_core-1.npz", clk, "engine_core", 1, dp_rank=0)
    w = [_rec(tmp_path / f"worker-{10 + r}.npz", clk, "worker", 10 + r, tp_rank=r, rank=r)
         for r in (0, 1)]  # fmt: skip

    def at(t_ms):
        clk.true_s = t_ms * 1e-3

    def tick(t_ms):
        return round((100.0 + t_ms * 1e-3) * 1e9)

    at(0.5)
    core.request("r0")
    b = 1.0
    for length, calls in plan:
        at(b)
        with core.step():
            core.add_segment("decode", tick(b + 1.0), tick(b + length - 3.0))
            at(b + length - 2.5)
            core.emit(["r0"])
            at(b + length - 2.0)
        for rec in w:
            rec.add_segment("forward", tick(b + 1.2), tick(b + length - 3.2))
        c = b + 2.0
        for late_rank, late, cause in calls:
            for r, rec in enumerate(w):
                enter = c + (late if r == late_rank else 0.0)
                if r == late_rank and cause == "injected":
                    rec.add_segment("injected", tick(c), tick(enter))
                rec.add_segment("collective", tick(enter), tick(c + late + 0.5))
            c += late + 1.0
        b += length
    at(b + 1.0)
    for rec in (core, *w):
        rec.stop()
    return str(tmp_path)


def test_which_rank_held_each_slow_step_by_hand(tmp_path):
    """The rule (docs/adapters.md, "Which rank held each slow step") on `PLAN`, by hand.

    252 steps, 251 gaps (closed by steps 1-251): 248 of 10 ms, and 30, 31, 32 ms closed by
    steps 2, 4, 6. p99 (numpy's linear: sorted, position 0.99 * 250 = 247.5, halfway
    between the 248th gap, 10, and the 249th, 30) = 20 ms, so the tail is the three long
    gaps and the slow steps are 2, 4 and 6. Waits: step 2 rank 1 20 ms (injected), step 4
    rank 0 15 ms (forward), step 6 rank 0 3 ms (forward) and rank 1 5 ms (injected): held
    by rank 1, rank 0, rank 1. Rank 0: 1 slow step held, 15 + 3 = 18 ms in slow steps, all
    forward; in the run 0.2 (step 3) + 15 + 3 + 0.1 (step 7) = 18.3 ms. Rank 1: 2 held,
    20 + 5 = 25 ms in slow steps, all injected; in the run 25 + 0.1 in each of the other
    247 steps = 49.7 ms."""
    from tracekit.analysis.figures import analyze
    from tracekit.render.html import tp_ranks_html

    run = merge_dir(record_tp_plan(tmp_path))
    p = partition(run)
    assert p.reconcile_max_err_ms < 1e-6
    assert np.allclose(np.sort(p.gap_ms), [10] * 248 + [30, 31, 32])
    a = analyze(run, p)
    v = a.tp_ranks.to_dict()
    assert v["itl_p99_ms"] == pytest.approx(20.0)
    steps = {s["step"]: s for s in v["slow_steps"]}
    assert sorted(steps) == [2, 4, 6]
    assert [steps[s]["holder"] for s in (2, 4, 6)] == [1, 0, 1]
    assert [steps[s]["holder_cause"] for s in (2, 4, 6)] == ["injected", "forward", "injected"]
    assert steps[6]["wait_ms"] == pytest.approx({"0": 3.0, "1": 5.0})
    r0, r1 = v["ranks"]
    assert (r0["rank"], r0["slow_steps_held"], r0["top_cause"]) == (0, 1, "forward")
    assert r0["charged_slow_ms"] == pytest.approx(18.0)
    assert r0["top_cause_ms"] == pytest.approx(18.0)
    assert r0["charged_run_ms"] == pytest.approx(18.3)
    assert (r1["rank"], r1["slow_steps_held"], r1["top_cause"]) == (1, 2, "injected")
    assert r1["charged_slow_ms"] == pytest.approx(25.0)
    assert r1["charged_run_ms"] == pytest.approx(49.7)
    # the report's table says the same, cell by cell
    page = tp_ranks_html([a], ["tp"])
    table = page[page.index('<table class="ranks">') :].split("</table>")[0]
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in table.split("<tr>")[2:]]
    assert [c[:4] for c in cells] == [["rank 0", "1", "18.00", "18.30"],
                                      ["rank 1", "2", "25.00", "49.70"]]  # fmt: skip
    assert "rank0:forward" in cells[0][4] and cells[0][4].endswith(" 18.00")
    assert "rank1:injected" in cells[1][4] and cells[1][4].endswith(" 25.00")
    # and analyze's text
    from tracekit.render.text import analyze_report

    text = analyze_report([a])
    assert "tensor parallel: 3 slow steps" in text
    assert "rank1:injected 25.00 ms" in text and "rank0:forward 18.00 ms" in text


def test_the_trace_has_one_track_per_rank_with_the_slow_steps_it_held(tmp_path):
    from tracekit.render.perfetto import TID_RANKS, chrome_trace_events, validate_trace

    run = merge_dir(record_tp_plan(tmp_path))
    events = chrome_trace_events(run, partition(run))
    validate_trace(events)
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] >= TID_RANKS
             and e["tid"] < TID_RANKS + 100}  # fmt: skip
    assert names == {TID_RANKS: "tp rank 0", TID_RANKS + 1: "tp rank 1"}
    held = {e["tid"] - TID_RANKS: e["args"]["step"] for e in events
            if e["ph"] == "X" and e["name"] == "held slow step"
            and e["args"]["step"] == 4}  # fmt: skip
    assert held == {0: 4}
    held_by = sorted((e["args"]["step"], e["tid"] - TID_RANKS) for e in events
                     if e["ph"] == "X" and e["name"] == "held slow step")  # fmt: skip
    assert held_by == [(2, 1), (4, 0), (6, 1)]
    # each rank's track holds exactly its own waits
    waits = [(e["tid"] - TID_RANKS, e["name"]) for e in events
             if e["ph"] == "X" and e.get("tid", 0) in (TID_RANKS, TID_RANKS + 1)
             and e["name"] != "held slow step"]  # fmt: skip
    assert sorted(set(waits)) == [(0, "rank0:forward"), (1, "rank1:forward"),
                                  (1, "rank1:injected")]  # fmt: skip
    assert sum(1 for r, _ in waits if r == 0) == 4  # steps 3, 4, 6, 7
    assert sum(1 for r, _ in waits if r == 1) == 249  # every step but 3, 4, 7


def _add_os_samples(path, rows_ms):
    """Give a saved worker log OS samples of its thread 0: rows (t ms, cpu ms, run-queue
    ms), totals since the thread started, as the recorder reads them at segment ends."""
    arrays = one_file_arrays(path)
    cols = {
        "thread": [0] * len(rows_ms),
        "kind": [2 + (i % 2) for i in range(len(rows_ms))],  # segment starts and ends
        "t_s": [t * 1e-3 for t, _, _ in rows_ms],
        "cpu_ns": [round(c * 1e6) for _, c, _ in rows_ms],
        "runqueue_ns": [round(q * 1e6) for _, _, q in rows_ms],
        "num_voluntary_switches": [0] * len(rows_ms),
        "num_involuntary_switches": [0] * len(rows_ms),
        "num_major_faults": [0] * len(rows_ms),
    }
    for k, v in cols.items():
        arrays[f"os_samples.{k}"] = np.array(v, dtype=np.float64 if k == "t_s" else np.int64)
    np.savez(path, **arrays)


def test_a_late_ranks_os_pile_is_charged_to_that_rank(tmp_path):
    """OS rules 1-2 (docs/partition.md) on a rank's own counters, by hand. `record_tp`
    without a stall: rank 1 enters each step's collective 0.1 ms late, in its forward
    ([10k+2.0, 10k+2.1] ms), and waits in it until 10k+4.0 (1.9 ms). Rank 1's thread is
    sampled at 0, 10, ..., 60 ms: each 10 ms interval holds 6 ms of CPU; interval 2 also
    1.9 ms of run-queue wait. Its waits in each interval: the collective, W = 1.9 ms, so
    the time outside them is 8.1 ms. Off-CPU B = L - C - R: 4 ms (2.1 in interval 2);
    `os_blocked` takes max(0, B - W) / 8.1 of each instant outside the waits, 2.1/8.1
    (0.2/8.1 in interval 2), `os_runqueue` min(R, 8.1) / 8.1, 1.9/8.1 in interval 2.
    So the 0.1 ms lateness of step k: rank1:os_blocked 0.1 x 2.1/8.1, rank1:forward the
    rest (0.1 x 6/8.1); step 2: rank1:os_runqueue 0.1 x 1.9/8.1, rank1:os_blocked
    0.1 x 0.2/8.1, rank1:forward 0.1 x 6/8.1."""
    d = record_tp(tmp_path, stall_step=99)
    rows, cpu, rq = [], 0.0, 0.0
    for k in range(7):
        rows.append((10.0 * k, cpu, rq))
        cpu += 6.0
        rq += 1.9 if k == 2 else 0.0
    _add_os_samples(tmp_path / "worker-11.npz", rows)
    run = merge_dir(d)
    p = partition(run)
    assert p.reconcile_max_err_ms < 1e-6
    col = {lb: p.column(lb) if lb in p.labels else np.zeros(len(p))
           for lb in ("rank1:forward", "rank1:os_runqueue", "rank1:os_blocked")}  # fmt: skip
    # gap k-1 -> k (closed at 10k+7.5) holds step k's wait
    for k in range(1, 6):
        g = int(np.flatnonzero(np.isclose(p.t1_s, (10.0 * k + 7.5) * 1e-3))[0])
        want_rq = 0.1 * 1.9 / 8.1 if k == 2 else 0.0
        want_bl = 0.1 * (0.2 if k == 2 else 2.1) / 8.1
        assert col["rank1:os_runqueue"][g] == pytest.approx(want_rq, abs=1e-9), k
        assert col["rank1:os_blocked"][g] == pytest.approx(want_bl, abs=1e-9), k
        assert col["rank1:forward"][g] == pytest.approx(0.1 * 6 / 8.1, abs=1e-9), k
    assert np.allclose(p.gap_ms, 10.0)  # carved out of the forward window, never added
    # rank 0 was never late: its samples are not needed, and nothing is charged to it
    assert not [lb for lb in p.labels if lb.startswith("rank0:")]


def test_a_ranks_waits_are_counted_once_where_they_overlap():
    """The time a rank's waits (collectives, GC, stalls) cover in each OS interval is
    their union's: [0, 2] and [1, 3] overlap (union [0, 3]), [5, 6] apart. Over [0, 10]:
    3 + 1 = 4; over [2.5, 5.5]: 0.5 + 0.5 = 1; over [7, 8]: 0; over [-1, 0.5]: 0.5."""
    from tracekit.attribution.tp import _covered

    w = np.array([[5.0, 6.0], [1.0, 3.0], [0.0, 2.0]])
    got = _covered(w, np.array([0.0, 2.5, 7.0, -1.0]), np.array([10.0, 5.5, 8.0, 0.5]))
    assert got.tolist() == pytest.approx([4.0, 1.0, 0.0, 0.5])
    assert _covered(np.zeros((0, 2)), np.array([0.0]), np.array([1.0])).tolist() == [0.0]


def record_late_rank(tmp_path, shifts_s=(0.0, 0.0), n_steps=6):
    """An engine core and two TP workers whose rank 1 ends each `execute_model` after the
    engine core's wait returned (the engine core waits for rank 0's outputs only). True
    times in ms from 0: step k runs [10k, 10k+8], its forward window [10k+1, 10k+7], one
    request emits at 10k+7.5. Both workers' windows start at 10k+1.5; rank 0's ends at
    10k+6.5, rank 1's at 10k+7.5. Two collectives per step: both enter the first at 10k+3
    and leave at 10k+3.2; rank 0 enters the second at 10k+6.4, rank 1 at 10k+6.5, both leave
    at 10k+6.5. Worker r's clock reads the true time + `shifts_s[r]`: with a shift it has a
    boot id of its own (not one clock with the engine core) and records its output rank
    (as the plugin does); without, neither (as an older log)."""
    core_clk = Clock()
    core = _rec(tmp_path / "engine_core-1.npz", core_clk, "engine_core", 1, dp_rank=0)
    clocks, w = [], []
    for r, shift in enumerate(shifts_s):
        clk = _ShiftedClock(core_clk, shift)
        ident = {"tp_rank": r, "rank": r}
        if shift:
            ident.update(boot_id=f"b{r}", output_rank=0)
        clocks.append(clk)
        w.append(_rec(tmp_path / f"worker-{10 + r}.npz", clk, "worker", 10 + r, **ident))

    def at(t_ms):
        core_clk.true_s = t_ms * 1e-3

    def tick(t_ms, r=None):
        return round((100.0 + (shifts_s[r] if r is not None else 0.0) + t_ms * 1e-3) * 1e9)

    at(0.5)
    core.request("r0")
    for k in range(n_steps):
        b = 10.0 * k
        at(b)
        with core.step():
            core.add_segment("decode", tick(b + 1.0), tick(b + 7.0))
            at(b + 7.5)
            core.emit(["r0"])
            at(b + 8.0)
        for r, rec in enumerate(w):
            rec.add_segment("forward", tick(b + 1.5, r), tick(b + (7.5 if r else 6.5), r))
            rec.add_segment("collective", tick(b + 3.0, r), tick(b + 3.2, r))
            rec.add_segment("collective", tick(b + (6.5 if r else 6.4), r), tick(b + 6.5, r))
    at(10.0 * n_steps + 1)
    for rec in (core, *w):
        rec.stop()
    return str(tmp_path)


class _ShiftedClock:
    """Another process's clock: the true time of `base` plus `shift_s`."""

    def __init__(self, base: Clock, shift_s: float) -> None:
        self.base, self.shift_s = base, shift_s

    def __call__(self) -> int:
        return round((100.0 + self.shift_s + self.base.true_s) * 1e9)


@pytest.mark.parametrize("shifts_s", [(0.0, 0.0), (2.5, 0.75)])
def test_a_rank_that_ends_after_the_core_stopped_waiting_keeps_its_clock(tmp_path, shifts_s):
    """The worker clock rule (docs/adapters.md, "The merge"), by hand. Each worker's window
    starts 0.5 ms after the engine core's forward window began: lo = -0.5 ms. Rank 0, the
    rank the engine core waits for, ends 0.5 ms before that window closes: hi = +0.5 ms.
    Rank 1 ends 0.5 ms after it closes, so its end is no bound; it entered its last
    collective (10k+6.5) 0.5 ms before: hi = +0.5 ms. So on one clock 0 lies in every
    bound (no violation, no warning); with a shift d, every bound moves by -d, each bin's
    midpoint is -d: correction -d, no drift, uncertainty 0.5 ms, and each worker's times
    land on the engine core's. Rank 1 entered the second collective 0.1 ms late, in its
    forward: rank1:forward 0.1 ms in every gap, whatever the shift."""
    run = merge_dir(record_late_rank(tmp_path, shifts_s))
    assert not [x for x in run.meta["warnings"] if "violate causality" in x]
    workers = [p for p in run.meta["processes"] if p["role"] == "worker"]
    assert [p["tp_rank"] for p in workers] == [0, 1]
    for p, shift in zip(workers, shifts_s, strict=True):
        fit = p["clock_fit"]
        assert fit["violations"] == 0
        assert fit["pairs"] == 12  # 6 steps, a start and an end bound each
        assert fit["bound_s"] == pytest.approx([-0.5e-3 - shift, 0.5e-3 - shift], abs=1e-9)
        assert fit["offset_s"] == pytest.approx(shift, abs=1e-9)  # the start ticks' difference
        assert fit["correction_s"] == pytest.approx(-shift, abs=1e-9)
        assert fit["drift_ppm"] == pytest.approx(0.0, abs=1e-3)
        assert fit["uncertainty_s"] == pytest.approx(0.0 if not shift else 0.5e-3, abs=1e-9)
    p = partition(run)
    assert p.reconcile_max_err_ms < 1e-6
    assert np.allclose(p.column("rank1:forward"), 0.1, atol=1e-6)
    assert np.allclose(p.gap_ms, 10.0)


def test_a_rank_held_by_the_os_after_its_entry_stamp_is_charged_its_run_queue(tmp_path):
    """The rule past the last entry stamp (docs/adapters.md), by hand. `record_tp` without
    a stall: rank 0 enters each step's collective at 10k+2.0, rank 1 stamps its entry at
    10k+2.1, both leave at 10k+4.0. Rank 1 samples its OS counters at each collective's
    entry and exit (as the plugin does): in each collective window (1.9 ms) it is on the
    CPU throughout, except step 2's, where it waits 1.5 ms in the run queue (0.4 ms CPU);
    between collectives (8.1 ms) it is on the CPU throughout. Rank 0 sampled nothing.
    From the last entry stamp (10k+2.1) until the first rank left (10k+4.0), 1.9 ms, rank
    1's share is 1.9 x R / 1.9 = R: step 2, 1.5 ms rank1:os_runqueue, from 22.1 to 23.6;
    every other step, none. The 0.1 ms before the stamp stays rank1:forward (its interval
    [10k-6, 10k+2.1] is all CPU)."""
    d = record_tp(tmp_path, stall_step=99)
    rows, cpu, rq = [], 0.0, 0.0
    for k in range(6):
        rows.append((10.0 * k + 2.1, cpu, rq))  # entry
        cpu, rq = (cpu + 0.4, rq + 1.5) if k == 2 else (cpu + 1.9, rq)
        rows.append((10.0 * k + 4.0, cpu, rq))  # exit
        cpu += 8.1
    _add_os_samples(tmp_path / "worker-11.npz", rows)
    run = merge_dir(d)
    p = partition(run)
    assert p.reconcile_max_err_ms < 1e-6
    assert "rank1:os_runqueue" in p.labels
    col_rq, col_fwd = p.column("rank1:os_runqueue"), p.column("rank1:forward")
    for k in range(1, 6):
        g = int(np.flatnonzero(np.isclose(p.t1_s, (10.0 * k + 7.5) * 1e-3))[0])
        assert col_rq[g] == pytest.approx(1.5 if k == 2 else 0.0, abs=1e-9), k
        assert col_fwd[g] == pytest.approx(0.1, abs=1e-9), k
    assert np.allclose(p.gap_ms, 10.0)  # carved out of the forward window, never added
    assert run.meta["tensor_parallel"]["charged_s"]["rank1:os_runqueue"] == pytest.approx(1.5e-3)
    assert not [lb for lb in p.labels if lb.startswith("rank0:")]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="OS evidence")
def test_a_rank_held_after_its_entry_stamp_by_the_recorders_own_samples(tmp_path, monkeypatch):
    """The same rule on what the recorder itself writes (docs/partition.md, "Tensor
    parallel: a rank held after its entry stamp"): rank 1 records its collectives with
    ``rec.segment("collective")`` on its own thread, its OS counters sampled at both ends,
    on a clock that, as a real one, moves while the counters are read (0.01 ms a read here:
    the read's own cost). Times in ms; the thread is on a CPU whenever it is not in the
    run queue (CPU time = time - run-queue wait, so nothing is off-CPU). Step k (b =
    10k + 1): rank 0 is in the collective [b + 1.0, b + 3.0]; rank 1 comes to it at
    b + 1.1 and, in step 2, is held 1.5 ms in the run queue inside its window before the
    call. Each end of rank 1's window is one tick with its sample, taken after the counters
    are read: its window is [b + 1.11, b + 3.01] (1.9 ms, run-queue wait R = 1.5 in step 2,
    0 otherwise). From the last entry stamp (b + 1.11) to the first exit (rank 0's,
    b + 3.0), 1.89 ms, rank 1's share is 1.89 x R / 1.9: step 2's gap has
    rank1:os_runqueue 1.89 x 1.5 / 1.9 ms, the others none; its lateness before the stamp,
    0.11 ms every step, is rank1:forward (its interval from the last exit holds no OS
    wait). A sample stamped apart from the window's own stamp (after it, at each end) left
    the collective's interval ending after the window it measures: nothing charged."""
    from tracekit.capture.osstats import ThreadStats

    clk = Clock()
    ms = 1e-3
    held = {"rq_ms": 0.0}

    def read(self, switches=True):
        clk.true_s += 0.01 * ms  # the read takes time on the recorder's clock
        t_ms = clk.true_s / ms
        rq_ms = held["rq_ms"]
        return round((t_ms - rq_ms) * 1e6), round(rq_ms * 1e6), 0, 0, 0

    monkeypatch.setattr(ThreadStats, "read", read)

    def at(t_ms):
        clk.true_s = t_ms * ms

    def tick(t_ms):
        return round((100.0 + t_ms * ms) * 1e9)

    core = _rec(tmp_path / "engine_core-1.npz", clk, "engine_core", 1, dp_rank=0)
    w0 = _rec(tmp_path / "worker-10.npz", clk, "worker", 10, tp_rank=0, rank=0)
    config = {"process": {"role": "worker", "pid": 11, "host": "h", "name": "worker",
                          "boot_id": "b", "clock": SHARED, "tp_rank": 1, "rank": 1}}  # fmt: skip
    w1 = tracekit.Recorder(str(tmp_path / "worker-11.npz"), clock=clk, gc=False,
                           handle_signals=False, flush_interval_s=1e9, config=config,
                           os_evidence=True)  # fmt: skip
    w1.start()
    at(0.5)
    core.request("r0")
    for k in range(6):
        b = 10.0 * k + 1.0
        at(b - 1.0)
        with core.step():
            core.add_segment("decode", tick(b), tick(b + 6.0))
            for rec in (w0, w1):
                rec.add_segment("forward", tick(b + 0.2), tick(b + 5.8))
            w0.add_segment("collective", tick(b + 1.0), tick(b + 3.0))
            at(b + 1.1)
            with w1.segment("collective"):
                if k == 2:  # held by the OS before the call
                    clk.true_s += 1.5 * ms
                    held["rq_ms"] += 1.5
                at(b + 3.0)
            at(b + 6.5)
            core.emit(["r0"])
    at(61.0)
    for rec in (core, w0, w1):
        rec.stop()
    run = merge_dir(str(tmp_path))
    p = partition(run)
    assert p.reconcile_max_err_ms < 1e-6
    col_rq = p.column("rank1:os_runqueue") if "rank1:os_runqueue" in p.labels else p.t1_s * 0
    col_fwd = p.column("rank1:forward")
    gap = [int(np.flatnonzero(np.isclose(p.t1_s, (10.0 * k + 7.5) * 1e-3))[0])
           for k in range(1, 6)]  # fmt: skip
    want = [1.89 * 1.5 / 1.9 if k == 2 else 0.0 for k in range(1, 6)]
    assert col_rq[gap] == pytest.approx(want, abs=1e-6)
    assert col_fwd[gap] == pytest.approx([0.11] * 5, abs=1e-6)
    assert np.allclose(p.gap_ms, 10.0)
