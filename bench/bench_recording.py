"""Recording at GPU speed: what the recorder costs per engine step at batch 64, 256, 512.

    python bench/bench_recording.py [--rounds 7] [--steps 300] [--batches 64,256,512]

A synthetic engine loop, the shape of a decode step on a GPU: 10 segments, the TTFT calls
(4 arrivals per step: `request`, `admit_handle`, `prefill_handles`; `wait_handles` for
32 waiting requests), `step_info`, and one `emit_handles` of the whole batch. No work
inside the segments: what is measured is the recording alone. Four arms, interleaved
round by round in one process (drift on a shared machine hits them alike):

- disabled: the same loop on `Recorder(enabled=False)` (what an engine pays with
  tracekit off: a few attribute lookups and no-op calls);
- floor: the least any recorder can do for the same rows: two `perf_counter_ns` reads
  and one array append per segment, one clock read and one copy of the emission rows
  (prebuilt), the same for the step row and the TTFT rows;
- handles: the recorder on, in memory (`out=None`), the hot path on request handles;
- ids: the same recorder calls on request ids (`emit(ids)`, `admit(id)`, ...).

Printed: per arm and batch size, the recording cost per step in us (arm - disabled),
median over rounds with [min-max], as a share of a 5 ms decode step, and the ratio to
the floor's cost; measured on the loop thread's CPU clock (`time.thread_time`: what the
engine thread spends, unaffected by other processes taking the CPU away on a shared
machine), and on the wall clock beside it (`wall`: the same, plus any preemption).
Then per event: a segment (enter+exit) and emission per token, each net
of the disabled loop, against the floor. The goal (issue 27): a step at batch 512 under
50 us (1% of 5 ms); a segment within 2x of the floor.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from array import array
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tracekit  # noqa: E402

LABELS = (
    "schedule", "prepare", "embed", "attn", "mlp", "norm", "lm_head", "sample", "update", "detok",
)  # fmt: skip
NUM_ARRIVALS, NUM_WAITING = 4, 32
STEP_MS = 5.0
pc = time.perf_counter_ns


def run_recorder(
    rec: tracekit.Recorder, batch: int, steps: int, *, by_handle: bool
) -> tuple[float, float]:
    """Seconds (CPU time of this thread, wall) for `steps` steps of the synthetic loop on
    `rec` (started, stopped here)."""
    rec.start()
    try:
        ids = [f"r{i}" for i in range(batch + NUM_WAITING)]
        handles = [rec.request(i, prompt_tokens=128, max_new_tokens=256) for i in ids]
        run = np.array(handles[:batch], dtype=np.int64)
        waiting = np.array(handles[batch:], dtype=np.int64)
        run_ids, wait_ids = ids[:batch], ids[batch:]
        chunk = np.full(NUM_ARRIVALS, 128, dtype=np.int64)
        segs = [rec.segment(lb) for lb in LABELS]
        n_next = len(ids)
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            new = [f"r{n_next + j}" for j in range(NUM_ARRIVALS)]
            n_next += NUM_ARRIVALS
            new_h = [rec.request(r, prompt_tokens=128, max_new_tokens=256) for r in new]
            with rec.step():
                if by_handle:
                    for h in new_h:
                        rec.admit_handle(h)
                    rec.prefill_handles(new_h, chunk)
                    rec.wait_handles(waiting, "kv_blocks")
                else:
                    for r in new:
                        rec.admit(r)
                        rec.prefill(r, 128)
                    rec.wait(wait_ids, "kv_blocks")
                for s in segs:
                    with s:
                        pass
                if by_handle:
                    rec.emit_handles(run)
                else:
                    rec.emit(run_ids)
                rec.step_info(num_decode=batch, graph_size=batch)
            if by_handle:  # the 4 new requests replace 4 finished ones
                run[:NUM_ARRIVALS] = new_h
            else:
                run_ids[:NUM_ARRIVALS] = new
        return time.thread_time() - c0, time.perf_counter() - t0
    finally:
        rec.stop()


def run_floor(batch: int, steps: int) -> tuple[float, float]:
    """The same rows, recorded the cheapest way: clock reads and appends of prebuilt rows."""
    seg = array("q")
    em = array("q")
    other = array("q")
    em_rows = memoryview(np.zeros((batch, 5), dtype=np.int64)).cast("B")
    ttft_rows = memoryview(np.zeros((NUM_ARRIVALS + NUM_WAITING, 3), dtype=np.int64)).cast("B")
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        ts = pc()
        for _ in range(NUM_ARRIVALS):
            other.extend((0, pc(), 128, 256))  # the arrivals
            other.extend((0, pc()))  # the admissions
        other.frombytes(ttft_rows)  # prefill chunks and waits
        for _ in LABELS:
            a = pc()
            seg.extend((0, 0, a, pc(), 0, 0))
        pc()
        em.frombytes(em_rows)
        other.extend((ts, pc(), batch, 0, batch, 0, 0))
    return time.thread_time() - c0, time.perf_counter() - t0


def interleaved(
    arms: dict[str, Callable[[], tuple[float, float]]], rounds: int
) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
    order = list(arms)
    for r in range(rounds):
        for k in order if r % 2 == 0 else order[::-1]:  # ABBA: drift hits every arm alike
            gc.collect()
            out[k].append(arms[k]())
    return out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def per_step(batch: int, steps: int, rounds: int) -> None:
    def rec(enabled: bool) -> tracekit.Recorder:
        return tracekit.Recorder(None, enabled=enabled, handle_signals=False)

    arms = {
        "disabled": lambda: run_recorder(rec(False), batch, steps, by_handle=True),
        "floor": lambda: run_floor(batch, steps),
        "handles": lambda: run_recorder(rec(True), batch, steps, by_handle=True),
        "ids": lambda: run_recorder(rec(True), batch, steps, by_handle=False),
    }
    t = interleaved(arms, rounds)

    def cost_us(arm: str, clock: int) -> list[float]:
        """The arm's cost per step over the disabled loop of the same round, in us."""
        pairs = zip(t[arm], t["disabled"], strict=True)
        return [(a[clock] - d[clock]) / steps * 1e6 for a, d in pairs]

    floor = cost_us("floor", 0)
    print(f"batch {batch}: recording cost per step, us (thread CPU time), median [min-max] "
          f"of {rounds} rounds; wall clock median beside it")  # fmt: skip
    print(f"  {'floor':8} {spread(floor)} us  {statistics.median(floor) / (STEP_MS * 10):6.2f}%"
          f"  (wall {statistics.median(cost_us('floor', 1)):.2f})")  # fmt: skip
    for arm in ("handles", "ids"):
        cost = cost_us(arm, 0)
        share = statistics.median(cost) / (STEP_MS * 1e3) * 100
        ratio = statistics.median(cost) / max(statistics.median(floor), 1e-9)
        wall = statistics.median(cost_us(arm, 1))
        print(f"  {arm:8} {spread(cost)} us  {share:6.2f}% of a {STEP_MS:g} ms step, "
              f"{ratio:.1f}x the floor  (wall {wall:.2f})")  # fmt: skip


def per_event(rounds: int, n: int = 100_000) -> None:
    """A segment enter+exit and the emission of one token, net of the disabled loop."""

    def seg_loop(enabled: bool) -> tuple[float, float]:
        rec = tracekit.Recorder(None, enabled=enabled, gc=False, handle_signals=False)
        rec.start()
        s = rec.segment("decode")
        with rec.step():
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(n):
                with s:
                    pass
            dt = time.thread_time() - c0, time.perf_counter() - t0
        rec.stop()
        return dt

    def seg_floor() -> tuple[float, float]:
        buf = array("q")
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(n):
            a = pc()
            buf.extend((0, 0, a, pc(), 0, 0))
        return time.thread_time() - c0, time.perf_counter() - t0

    def emit_loop(enabled: bool, batch: int = 512, calls: int = 400) -> tuple[float, float]:
        rec = tracekit.Recorder(None, enabled=enabled, gc=False, handle_signals=False)
        rec.start()
        h = np.array([rec.request(i) for i in range(batch)], dtype=np.int64)
        if not enabled:
            h = np.arange(batch)
        with rec.step():
            c0, t0 = time.thread_time(), time.perf_counter()
            for _ in range(calls):
                rec.emit_handles(h)
            c1, t1 = time.thread_time(), time.perf_counter()
        rec.stop()
        per = n / (batch * calls)  # per n tokens, like the other arms
        return (c1 - c0) * per, (t1 - t0) * per

    t = interleaved(
        {
            "off": lambda: seg_loop(False),
            "on": lambda: seg_loop(True),
            "floor": seg_floor,
            "emit_off": lambda: emit_loop(False),
            "emit_on": lambda: emit_loop(True),
        },
        rounds,
    )
    seg = [(a[0] - b[0]) / n * 1e6 for a, b in zip(t["on"], t["off"], strict=True)]
    fl = [x[0] / n * 1e6 for x in t["floor"]]
    em = [(a[0] - b[0]) / n * 1e9 for a, b in zip(t["emit_on"], t["emit_off"], strict=True)]
    print("per event (thread CPU time), median [min-max]:")
    ratio = statistics.median(seg) / statistics.median(fl)
    print(f"  segment enter+exit {spread(seg)} us, floor {spread(fl)} us, "
          f"{ratio:.2f}x the floor (goal <= 2x, <= 1 us)")  # fmt: skip
    print(f"  emission per token {spread(em)} ns at batch 512 (goal <= 50 ns)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batches", default="64,256,512")
    a = ap.parse_args()
    print(f"tracekit {tracekit.__version__ if hasattr(tracekit, '__version__') else ''}"
          f" python {sys.version.split()[0]}, numpy {np.__version__}")  # fmt: skip
    for b in (int(x) for x in a.batches.split(",")):
        per_step(b, a.steps, a.rounds)
    per_event(a.rounds)


if __name__ == "__main__":
    main()
