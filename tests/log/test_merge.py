"""`tracekit.log.merge` on synthetic per-process logs: clocks (one clock; injected offset and
drift between hosts), request identity, and directories with killed processes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import tracekit
import tracekit.capture.signals
from tracekit.analysis.run import merge_run as merge_dir
from tracekit.errors import LogError
from tracekit.log.clocks import estimate_offset
from tracekit.log.request_identity import last_stamps

SEP = "\x1f"
SHARED = "clock_gettime(CLOCK_MONOTONIC)"


class Clock:
    """A host clock in ns: ``offset_s + (1 + drift) * true_s`` (true time set by the test)."""

    def __init__(self, offset_s: float = 0.0, drift: float = 0.0) -> None:
        self.true_s = 0.0
        self.offset_s, self.drift = offset_s, drift

    def __call__(self) -> int:
        return round((self.offset_s + (1 + self.drift) * self.true_s) * 1e9)


def _ident(role: str, pid: int, boot: str) -> dict:
    return {"role": role, "pid": pid, "host": "h-" + boot, "name": role, "boot_id": boot,
            "clock": SHARED}  # fmt: skip


def record_pair(tmp_path, *, fe_offset_s=0.0, fe_drift=0.0, fe_boot="b1", n=300, seed=0,
                kill_core=False, kill_core_at=None, fe_from=0):  # fmt: skip
    """An engine core and an API server exchanging `n` requests on a true timeline: each
    request is sent (API server), added 50-400 us later (core), emits one token per step
    (core), whose outputs arrive 100-600 us later (API server) and are written as a chunk
    0.2 ms after that. Returns the directory and the true times of the chunk writes.

    `kill_core_at=i`: the core's last flush is taken as request i is sent (true time
    `record_pair.kill_s`), then it records on but is killed before flushing again (its
    later rows are lost, as after a SIGKILL); `fe_from=i`: the API server's recorder starts
    as request i is sent (the requests before it reach the core unrecorded there)."""
    rng = np.random.default_rng(seed)
    core_clk, fe_clk = Clock(100.0), Clock(100.0 + fe_offset_s, fe_drift)
    core = tracekit.Recorder(str(tmp_path / "engine_core-1.npz"), clock=core_clk, gc=False,
                             handle_signals=False, flush_interval_s=1e9,
                             config={"process": _ident("engine_core", 1, "b1")})  # fmt: skip
    fe = tracekit.Recorder(str(tmp_path / "api_server-2.npz"), clock=fe_clk, gc=False,
                           handle_signals=False, flush_interval_s=1e9,
                           config={"process": _ident("api_server", 2, fe_boot)})  # fmt: skip
    core.start()
    if not fe_from:
        fe.start()
    writes = []

    def at(t):
        core_clk.true_s = fe_clk.true_s = t

    t = 0.01
    for i in range(n):
        eid = f"cmpl-{i}-0-abcd{i:04d}"
        at(t)
        if kill_core_at == i:
            core._flush()
            record_pair.kill_s = t
        if fe_from and i == fe_from:
            fe.start()
            record_pair.fe_start_s = t
        on = not fe_from or i >= fe_from  # the API server records this request
        idx = fe.request(f"cmpl-{i}-0{SEP}{eid}") if on else -1
        if on:
            fe.counter("serve.sent", idx)
        at(t + rng.uniform(50e-6, 400e-6))
        cidx = core.request(eid)
        core.counter("serve.added", cidx)
        t_step = t + 1e-3
        for _k in range(2):
            at(t_step)
            with core.step():
                at(t_step + 2e-3)
                core.emit([eid])
                ts = 1000.0 + t_step  # vLLM's outputs timestamp: a key, any clock
                core.counter("serve.out", ts)
            recv = t_step + 2e-3 + rng.uniform(100e-6, 600e-6)
            at(recv)
            if on:
                fe.counter("serve.recv", ts)
            at(recv + 0.2e-3)
            if on:
                fe.emit([f"cmpl-{i}-0{SEP}{eid}"])
            writes.append(recv + 0.2e-3)
            t_step += 3e-3
        t = t_step + rng.uniform(0, 5e-3)
    at(t + 0.01)
    fe.stop()
    if kill_core or kill_core_at is not None:
        if kill_core_at is None:
            core._flush()  # what the flush interval would have written; then no stop()
        core._rows.dispatcher.close()  # every flushed row is in its part, as after a SIGKILL
        core._running = False
        tracekit.capture.recorder._ACTIVE.pop(core, None)
        tracekit.capture.signals.cancel_at_exit(core.stop)
    else:
        core.stop()
    return str(tmp_path), np.array(writes), core_clk


def test_one_clock_merges_exactly_and_the_stamps_prove_it(tmp_path):
    d, writes, core_clk = record_pair(tmp_path)
    log = merge_dir(d)
    fe = next(p for p in log.meta["processes"] if p["role"] == "api_server")
    fit = fe["clock_fit"]
    assert fit["method"].startswith("one clock")
    assert fit["correction_s"] == 0 and fit["uncertainty_s"] == 0
    assert fit["violations"] == 0 and fit["pairs"] == 300 + 600
    # the bound: the API server's clock is between -(min receipt delay) and +(min add delay)
    lo, hi = fit["bound_s"]
    assert -600e-6 < lo < -100e-6 + 1e-9 and 50e-6 - 1e-9 < hi < 400e-6
    # chunk writes land at their true times on the core's clock (true + 100 s - core t0)
    t0_core = log.meta["t0_tick"] * 1e-9
    expect = writes + 100.0 - t0_core
    assert np.allclose(np.sort(log.client_emissions.t_s), np.sort(expect), atol=2e-9)
    assert log.request_ids[:3] == ("cmpl-0-0", "cmpl-1-0", "cmpl-2-0")


def test_a_wrong_one_clock_claim_is_caught_by_the_stamps(tmp_path):
    # same boot id claimed, but the API server's clock runs 3 ms ahead
    d, _, _ = record_pair(tmp_path, fe_offset_s=3e-3)
    log = merge_dir(d)
    fit = next(p for p in log.meta["processes"] if p["role"] == "api_server")["clock_fit"]
    assert fit["violations"] > 0
    assert any("violate causality" in w for w in log.warnings)


@pytest.mark.parametrize(("offset_s", "drift"), [(5.0, 0.0), (-12.345, 50e-6), (0.7, -200e-6)])
def test_offset_and_drift_between_hosts_are_estimated(tmp_path, offset_s, drift):
    d, writes, _ = record_pair(tmp_path, fe_offset_s=offset_s, fe_drift=drift, fe_boot="b2")
    log = merge_dir(d)
    fit = next(p for p in log.meta["processes"] if p["role"] == "api_server")["clock_fit"]
    assert fit["method"] == "estimated from paired stamps"
    assert fit["drift_ppm"] == pytest.approx(-drift * 1e6 / (1 + drift), abs=5)
    # the delays are 50-600 us, so the midpoint of the tightest bounds is within ~300 us
    assert fit["uncertainty_s"] < 1e-3
    t0_core = log.meta["t0_tick"] * 1e-9
    err = np.sort(log.client_emissions.t_s) - np.sort(writes + 100.0 - t0_core)
    assert np.abs(err).max() <= fit["uncertainty_s"]
    assert fit["violations"] == 0
    # both recorders started at true time 0: the pair's offset (start to start) is 0
    (pair,) = log.meta["clock_pairs"]
    assert (pair["a"], pair["b"]) == ("engine_core-1", "api_server-2")
    assert abs(pair["offset_s"]) <= pair["uncertainty_s"] == fit["uncertainty_s"]


def test_estimate_offset_recovers_a_line_from_bounds():
    rng = np.random.default_rng(1)
    t = np.sort(rng.uniform(0, 100, 400))
    theta = 0.25 + 30e-6 * t
    lo = theta - rng.uniform(20e-6, 300e-6, len(t))
    hi = theta + rng.uniform(20e-6, 300e-6, len(t))
    a, b, unc = estimate_offset(t, lo, t, hi)
    assert abs(a - 0.25) < unc and abs(b - 30e-6) < 1e-6
    assert np.all(np.abs(a + b * t - theta) <= unc)


def test_killed_process_parts_are_read_in_place(tmp_path):
    d, _, _ = record_pair(tmp_path, n=20, kill_core=True)
    assert os.path.isdir(os.path.join(d, "engine_core-1.npz.parts"))
    log = merge_dir(d)
    core = next(p for p in log.meta["processes"] if p["role"] == "engine_core")
    assert core["recovered"] and log.meta["interrupted"]
    assert len(log.steps) == 40 and len(log.client_emissions) == 40
    assert os.path.isdir(os.path.join(d, "engine_core-1.npz.parts"))  # never removed
    assert any("recovered from parts" in w for w in log.warnings)


def test_merge_cli_writes_a_run_analyze_reads_the_directory(tmp_path):
    d, _, _ = record_pair(tmp_path / "run" if (tmp_path / "run").mkdir() is None else tmp_path,
                          n=10)  # fmt: skip
    out = str(tmp_path / "merged.npz")
    cli = [sys.executable, "-m", "tracekit"]
    r = subprocess.run([*cli, "merge", d, "-o", out], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "api_server" in r.stdout and "one clock" in r.stdout
    log = tracekit.load(out)
    assert len(log.client_emissions) == 20 and log.meta["processes"][1]["role"] == "api_server"
    r = subprocess.run([*cli, "analyze", d], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_directory_without_an_engine_core_is_one_line_exit_2(tmp_path):
    rec = tracekit.Recorder(str(tmp_path / "api_server-9.npz"), gc=False, handle_signals=False,
                            config={"process": _ident("api_server", 9, "b1")})  # fmt: skip
    with rec:
        rec.request("x")
    with pytest.raises(LogError, match="engine core"):
        merge_dir(str(tmp_path))
    r = subprocess.run(
        [sys.executable, "-m", "tracekit", "merge", str(tmp_path), "-o", str(tmp_path / "o.npz")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "engine core" in r.stderr


def test_a_merged_run_with_a_bad_client_table_is_refused_naming_the_field(tmp_path):
    from dataclasses import replace

    from tracekit.log.rawlog import ClientEmissions

    d, _, _ = record_pair(tmp_path / "r" if (tmp_path / "r").mkdir() is None else tmp_path, n=5)
    log = merge_dir(d)
    ce = log.client_emissions
    bad = replace(log, client_emissions=ClientEmissions.from_columns(
        **{**ce.columns(), "request": ce.request + 1000}))  # fmt: skip
    path = bad.save(str(tmp_path / "bad.npz"))
    with pytest.raises(LogError, match="client_emissions.request"):
        tracekit.load(path)
    good = log.save(str(tmp_path / "good.npz"))
    assert len(tracekit.load(good).client_emissions) == 10  # and it round-trips


def test_an_api_servers_os_intervals_inside_its_event_loops_segments_reach_the_run(tmp_path):
    """proc_os (docs/partition.md, "Unrecorded windows", rule 5): the OS intervals between
    consecutive samples of the thread that recorded most of the API server's segments, on
    the run's clock, marked inside a segment or between segments; another thread's, and an
    interval with a counter -1: none."""
    from dataclasses import replace

    from tracekit.attribution.client import client_partition
    from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START, OsSamples, Segments

    d, _, _ = record_pair(tmp_path, n=20)
    path = os.path.join(d, "api_server-2.npz")
    fe = tracekit.load(path)
    lab = len(fe.labels)
    # the API server's own clock (both recorders started at true time 0: the run's clock)
    segments = Segments.from_columns(
        step=[-1] * 3, label=[lab] * 3, t_start_s=[0.10, 0.15, 0.20],
        t_end_s=[0.11, 0.16, 0.21], thread=[0, 1, 0], is_device=[0] * 3,
    )  # fmt: skip
    s, e = OS_SEGMENT_START, OS_SEGMENT_END
    rows = [  # thread, kind, t, cpu_ns, runqueue_ns
        (0, s, 0.10, 1_000_000, 0),
        (0, e, 0.11, 7_000_000, 2_000_000),  # L 10 ms: CPU 6, run queue 2, off CPU 2
        (0, s, 0.20, 8_000_000, 9_000_000),  # [0.11, 0.20] between segments: 90 ms, CPU
        # 1, run queue 7, off CPU 82 (the loop idle, or blocked: not told apart)
        (0, e, 0.21, 9_000_000, -1),  # run queue not available: not used
        (1, s, 0.15, 0, 0),  # another thread's segment: not the event loop's
        (1, e, 0.16, 1_000_000, 5_000_000),
    ]
    os_samples = OsSamples.from_columns(
        thread=[r[0] for r in rows], kind=[r[1] for r in rows], t_s=[r[2] for r in rows],
        cpu_ns=[r[3] for r in rows], runqueue_ns=[r[4] for r in rows],
        num_voluntary_switches=[0] * 6, num_involuntary_switches=[0] * 6,
        num_major_faults=[0] * 6,
    )  # fmt: skip
    replace(fe, labels=(*fe.labels, "output"), segments=segments, os_samples=os_samples).save(path)
    log = merge_dir(d)
    k = next(i for i, p in enumerate(log.meta["processes"]) if p["role"] == "api_server")
    po = log.proc_os
    assert po.process.tolist() == [k, k]
    assert po.in_segment.tolist() == [1, 0]
    assert np.allclose(po.t_start_s, [0.10, 0.11], atol=1e-12)
    assert np.allclose(po.t_end_s, [0.11, 0.20], atol=1e-12)
    assert np.allclose(po.runqueue_s, [0.002, 0.007], atol=1e-12)
    assert np.allclose(po.offcpu_s, [0.002, 0.082], atol=1e-12)
    # written and read back whole; the client partition has the OS columns
    back = tracekit.load(log.save(str(tmp_path / "run.npz")))
    assert np.array_equal(back.proc_os.offcpu_s, po.offcpu_s)
    assert client_partition(back).labels[-2:] == ("frontend_os_runqueue", "frontend_os_blocked")


def test_a_handler_stamp_names_its_request_by_its_values_integer_part_and_the_last_wins():
    # serve.handler stamps (time, value): the value is a request index of the API server's
    # log, its integer part as int() takes it (toward zero); the last stamp of a request wins
    t = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    v = np.array([0.0, 2.7, 0.0, -0.5, 9.0, np.nan])
    # request 0: stamps at 1, 3 and 4 (-0.5 -> 0), the last: 4; request 2: 2.7 -> 2, at 2;
    # 9 names no request of 4, NaN none at all (no error)
    got = last_stamps(t, v, 4)
    assert np.array_equal(got, [4.0, np.nan, 2.0, np.nan], equal_nan=True)
