"""Crash safety: a run keeps what it recorded however it ends.

Real recording subprocesses, killed for real: `kill -9` leaves a parts folder that
`tracekit recover` turns into a log holding every part flushed before the kill; SIGTERM,
SIGINT, a normal exit without `stop()`, `sys.exit` and an uncaught exception all end as the
one `.npz` with every step. Each test takes a second or two.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import logfiles
import numpy as np
import pytest
from procs import python, run_cli

import tracekit
from tracekit.log.parts import merge_parts, read_part

#: A small engine loop. Step i records prefill tokens = i (so a log shows which steps it
#: holds), a decode segment and one emission; it stops as argv[3] says.
RECORDER_SCRIPT = r"""
import sys, time
import tracekit

out, flush_s, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rec = tracekit.Recorder(out, config={"rung": "crash-test"}, flush_interval_s=flush_s)

def step(i):
    with rec.step():
        rec.step_info(num_prefill_tokens=i)
        with rec.segment("decode"):
            time.sleep(0.0005)
        rec.emit(["r%d" % (i % 4)])

if how in ("loop", "sigint"):  # until signalled; say how many steps ran
    i = 0
    try:
        with rec:
            print("started", flush=True)
            while True:
                step(i)
                i += 1
    except KeyboardInterrupt:
        print("steps", i, flush=True)
        sys.exit(130)
    finally:
        print("steps", i, flush=True)
else:  # 200 steps, then end without stop(): atexit must write the log
    rec.start()
    for i in range(200):
        step(i)
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise RuntimeError("the engine crashed")
"""


def wait_for(predicate, timeout: float = 20.0, what: str = "") -> None:
    t_end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > t_end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def part_files(parts: Path) -> list[Path]:
    return logfiles.part_files(parts) if parts.is_dir() else []


def steps_in_parts(paths: list[Path]) -> int:
    return sum(len(read_part(str(p)).table("steps")) for p in paths)


def assert_steps_are_a_prefix(log: tracekit.RawLog, *, signalled: bool = False) -> int:
    """Steps 0..n-1, each once and in order: nothing lost in the middle, nothing doubled.
    A signal can land inside the last step: it is recorded, maybe before its step_info
    (prefill tokens 0) or its emission."""
    n = len(log.steps)
    ids = log.steps.num_prefill_tokens
    assert np.array_equal(ids[: n - signalled], np.arange(n - signalled))
    assert np.all(np.diff(log.steps.t_start_s) > 0)
    assert len(log.emissions) == n or (signalled and len(log.emissions) == n - 1)
    return n


def test_kill_9_leaves_parts_that_recover_into_a_log_with_every_flushed_part(tmp_path):
    out = tmp_path / "run.npz"
    parts = tmp_path / "run.npz.parts"
    proc = python(RECORDER_SCRIPT, str(out), "0.05", "loop")
    try:
        wait_for(lambda: len(part_files(parts)) >= 4, what="four parts")
        seen = part_files(parts)
        steps_seen = steps_in_parts(seen)
        proc.kill()  # SIGKILL: no handler, no atexit, no flush
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and parts.is_dir()
    left = part_files(parts)
    assert set(seen) <= set(left)

    # the parts folder is read in place, as an interrupted run (nothing written)
    in_place = tracekit.load(parts)
    assert in_place.meta["interrupted"] is True
    assert any("interrupted recording" in w for w in in_place.warnings)
    assert not out.exists()

    r = run_cli("recover", str(parts))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"recovered {out}: ")
    log = tracekit.load(out)
    n = assert_steps_are_a_prefix(log)
    assert n == steps_in_parts(left) >= steps_seen > 0
    assert len(in_place.steps) == n
    assert log.meta["interrupted"] is True
    assert any("interrupted recording" in w for w in log.warnings)
    assert log.config["rung"] == "crash-test"
    assert log.request_ids == ("r0", "r1", "r2", "r3")
    # the recovered wall time runs to the last flush, so it covers every recovered step
    assert log.steps.t_end_s.max() <= log.wall_s

    r = run_cli("analyze", str(out), "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["gaps"] == n - 4
    assert "interrupted recording" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_flush_every_step_into_one_npz(tmp_path, sig):
    out = tmp_path / "run.npz"
    proc = python(RECORDER_SCRIPT, str(out), "0.05", "loop")
    try:
        assert proc.stdout.readline() == "started\n"
        wait_for(lambda: len(part_files(tmp_path / "run.npz.parts")) >= 2, what="two parts")
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else 130), stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    steps_run = int(stdout.split()[-1])
    assert out.exists() and (tmp_path / "run.npz.parts" / "final.json").exists()
    log = tracekit.load(out)
    n = assert_steps_are_a_prefix(log, signalled=True)
    # the signal may land inside a step: that step is recorded, its loop count not yet
    assert n - steps_run in (0, 1), (n, steps_run)
    # a signal that landed inside a step leaves it open: stop() closes it at the stop time
    # and says so (docs/capture.md); no other warning
    assert log.meta["interrupted"] is False
    assert all(re.fullmatch(r"step \d+ was still open at stop\(\): it is closed at the stop time",
                            w) for w in log.warnings), log.warnings  # fmt: skip


@pytest.mark.parametrize("how", ["end", "exit", "raise"])
def test_a_run_never_stopped_is_written_at_interpreter_exit(tmp_path, how):
    out = tmp_path / "run.npz"
    proc = python(RECORDER_SCRIPT, str(out), "1.0", how)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == {"end": 0, "exit": 3, "raise": 1}[how], stderr
    assert ("RuntimeError: the engine crashed" in stderr) == (how == "raise")
    assert out.exists() and (tmp_path / "run.npz.parts" / "final.json").exists()
    log = tracekit.load(out)
    assert assert_steps_are_a_prefix(log) == 200
    assert log.meta["interrupted"] is False


#: Long collections with short gaps between them, as a big heap gives: a SIGTERM most
#: likely lands inside one, where it is handled in a gc callback.
GC_SCRIPT = r"""
import gc, sys, time
import tracekit

with tracekit.Recorder(sys.argv[1], gc=True):
    junk = [[i] for i in range(400_000)]
    print("collecting", flush=True)
    t_end = time.monotonic() + 30.0
    while time.monotonic() < t_end:
        gc.collect()
        time.sleep(0.02)
    print("the SIGTERM was lost", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_a_gc_pause_still_stops_the_run(tmp_path, sig):
    """Regression: the collector swallows exceptions raised in its callbacks, so a SIGTERM
    (SystemExit) or Ctrl-C (KeyboardInterrupt) handled in tracekit's gc callback used to
    print "Exception ignored" and be lost."""
    out = tmp_path / "run.npz"
    for attempt in range(2):  # each one lands in a collection with probability ~0.8
        proc = python(GC_SCRIPT, str(out))
        try:
            assert proc.stdout.readline() == "collecting\n"
            time.sleep(0.25 + 0.05 * attempt)
            proc.send_signal(sig)
            stdout, stderr = proc.communicate(timeout=20)
        finally:
            proc.kill()
        assert "Exception ignored" not in stderr, stderr
        assert stdout == "", stdout
        # SystemExit(143), or an uncaught KeyboardInterrupt: Python exits by SIGINT
        assert proc.returncode == (128 + sig if sig == signal.SIGTERM else -signal.SIGINT)
        log = tracekit.load(out)
        assert (log.gc_pauses.generation == 2).sum() >= 3


def test_a_sigterm_inside_a_flush_loses_no_rows(tmp_path):
    """Regression: a SIGTERM handled between a flush's buffer swap and its hand-over to the
    writer raised there and dropped every row of that flush interval."""
    armed = [False]

    def clock() -> int:  # the flush reads the clock right after swapping the buffers
        t = time.perf_counter_ns()
        if armed[0]:
            armed[0] = False
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once, inside the flush
        return t

    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, clock=clock, gc=False, flush_interval_s=3600.0)
    with pytest.raises(SystemExit):
        with rec:
            for i in range(100):
                with rec.step():
                    rec.step_info(num_prefill_tokens=i)
                    rec.emit(["a"])
            armed[0] = True
            rec._flush()
            t_end = time.monotonic() + 30
            while time.monotonic() < t_end:  # the deferred SIGTERM arrives here
                time.sleep(0.001)
    assert assert_steps_are_a_prefix(tracekit.load(out)) == 100


def test_recover_stops_at_a_damaged_part_and_says_so(tmp_path):
    """A part damaged on disk (not by a kill: parts are renamed into place whole) ends the
    recovered run at the flush before it: later parts index steps and requests the damaged
    one introduced. The recovered log says which part, and the parts stay on disk."""
    out = tmp_path / "run.npz"
    proc = python(RECORDER_SCRIPT, str(out), "0.05", "loop")
    try:
        wait_for(lambda: len(part_files(tmp_path / "run.npz.parts")) >= 5, what="five parts")
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    parts = tmp_path / "run.npz.parts"
    files = part_files(parts)
    before = steps_in_parts(files[:2])
    data = files[2].read_bytes()
    files[2].write_bytes(data[: len(data) // 2])

    log = merge_parts(str(parts))
    assert len(log.steps) == before
    assert any(files[2].name in w and "left out" in w for w in log.warnings), log.warnings
    r = run_cli("recover", str(parts))
    assert r.returncode == 0, r.stderr
    again = tracekit.load(out)
    assert assert_steps_are_a_prefix(again) == before
    assert any(files[2].name in w for w in again.warnings)
    assert part_files(parts) == files  # nothing deleted


def test_recover_refuses_what_is_not_a_parts_folder(tmp_path):
    r = run_cli("recover", str(tmp_path / "nothing.parts"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    empty = tmp_path / "empty.npz.parts"
    empty.mkdir()
    r = run_cli("recover", str(empty))
    assert r.returncode == 2 and "meta.json" in r.stderr and "Traceback" not in r.stderr
    (empty / "meta.json").write_text("[1, 2]")
    r = run_cli("recover", str(empty))
    assert r.returncode == 2 and "meta.json" in r.stderr and "Traceback" not in r.stderr


def test_the_demo_engine_killed_mid_run_recovers_and_analyses(tmp_path):
    """The real engine, killed with SIGKILL while serving: what it flushed analyses."""
    pytest.importorskip("demo_engine.cli")
    out_dir = tmp_path / "raw"
    proc = subprocess.Popen(
        [
            *__import__("procs").tracekit_cmd(),
            *("demo", "run", "--rung", "baseline", "--seed", "1", "--duration", "20"),
            *("--rate", "4", "--quiet", "--out", str(out_dir)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=__import__("procs").env(),
    )
    parts = out_dir / "baseline__s1.npz.parts"
    try:
        wait_for(lambda: len(part_files(parts)) >= 2, timeout=60, what="two demo parts")
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert not (out_dir / "baseline__s1.npz").exists()
    r = run_cli("recover", str(parts))
    assert r.returncode == 0, r.stderr
    r = run_cli("analyze", str(out_dir / "baseline__s1.npz"), "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    a = json.loads(r.stdout)
    assert a["rung"] == "baseline" and a["gaps"] > 100
    assert a["reconcile_max_err_ms"] < 1e-6
    assert "interrupted recording" in r.stderr


IDLE_SCRIPT = r"""
import sys, time
import tracekit

rec = tracekit.Recorder(sys.argv[1], flush_interval_s=0.05)
with rec:
    for i in range(100000):  # an idle engine: requests arrive, no step ever runs
        rec.request("q%d" % i, prompt_tokens=i)
        time.sleep(0.002)
"""


def test_kill_9_of_an_idle_engine_keeps_the_arrivals_it_flushed(tmp_path):
    out = tmp_path / "idle.npz"
    parts = tmp_path / "idle.npz.parts"
    proc = python(IDLE_SCRIPT, str(out))
    try:
        wait_for(lambda: len(part_files(parts)) >= 3, what="three parts from an idle engine")
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    r = run_cli("recover", str(parts))
    assert r.returncode == 0, r.stderr
    log = tracekit.load(out)
    n = len(log.requests)
    assert n > 0 and len(log.steps) == 0
    # every recovered arrival is whole and in order: q0..q(n-1)
    assert log.request_ids == tuple(f"q{i}" for i in range(n))
    assert log.requests.prompt_tokens.tolist() == list(range(n))
