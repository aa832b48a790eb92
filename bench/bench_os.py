"""What does recording OS evidence cost?

    python bench/bench_os.py [--rounds 8] [--steps 20000]

1. Per read, on this thread: one whole sample (`ThreadStats.read`: CPU time, run-queue
   wait, switches and faults, as at a step's end), one without switches and faults (as
   at a step's start) and each system call alone (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`,
   `pread` of ``/proc/thread-self/schedstat``, `getrusage(RUSAGE_THREAD)`), net of an
   empty call; median of the rounds, with the spread (min-max) of the rounds.
   Then why CPU time is not taken from schedstat's first field (one system call fewer):
   how often that field did not move over 0.25 ms of computing (it is brought up to date
   at a tick, a switch or a CPU-clock read, not when read).
2. Per step: an empty `rec.step()` on an in-memory recorder with `os_evidence=True`
   against one with `os_evidence=False`, in interleaved ABBA rounds in this same process
   (drift on a shared machine hits both alike): ns per step for each, their ratio and the
   difference (two samples: the step's start and end), median and spread of the rounds.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tracekit  # noqa: E402
from tracekit.capture.osstats import ThreadStats, unavailable_reason  # noqa: E402


def per_call_ns(fn, n: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n


def per_step_ns(os_evidence: bool, steps: int) -> float:
    rec = tracekit.Recorder(None, gc=False, handle_signals=False, os_evidence=os_evidence)
    with rec:
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            with rec.step():
                pass
        dt = time.perf_counter_ns() - t0
    return dt / steps


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.0f} ns  [{min(xs):.0f}-{max(xs):.0f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--reads", type=int, default=50_000)
    args = ap.parse_args()
    why = unavailable_reason()
    if why is not None:
        print(f"no OS evidence here: {why}")
        return
    reader = ThreadStats()
    reader.read()  # opens this thread's schedstat fd
    sched_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    calls = {
        "sample at a step end (all three)": reader.read,
        "sample at a step start (no rusage)": lambda: reader.read(False),
        "clock_gettime(THREAD_CPUTIME)": lambda: time.clock_gettime_ns(
            time.CLOCK_THREAD_CPUTIME_ID
        ),
        "pread schedstat + parse": lambda: int(os.pread(sched_fd, 96, 0).split(None, 2)[1]),
        "getrusage(RUSAGE_THREAD)": lambda: resource.getrusage(resource.RUSAGE_THREAD),
    }
    empty = []
    got: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.rounds):
        empty.append(per_call_ns(lambda: None, args.reads))
        for k, fn in calls.items():
            got[k].append(per_call_ns(fn, args.reads))
    base = statistics.median(empty)
    print(f"1. per read, net of an empty call ({base:.0f} ns), {args.rounds} rounds:")
    for k, xs in got.items():
        print(f"   {k:32s} {spread([x - base for x in xs])}")
    stale, trials = 0, 200
    for _ in range(trials):
        a = int(os.pread(sched_fd, 96, 0).split(None, 1)[0])
        sum(range(20_000))  # ~0.25 ms of computing
        stale += int(os.pread(sched_fd, 96, 0).split(None, 1)[0]) == a
    print(
        f"   schedstat's CPU field did not move over ~0.25 ms of computing in {stale} of "
        f"{trials} trials (CLOCK_THREAD_CPUTIME_ID always does)"
    )
    os.close(sched_fd)
    reader.close()

    on: list[float] = []
    off: list[float] = []
    for r in range(args.rounds):  # ABBA
        order = (True, False) if r % 2 == 0 else (False, True)
        for flag in order:
            (on if flag else off).append(per_step_ns(flag, args.steps))
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    diffs = [a - b for a, b in zip(on, off, strict=True)]
    print(f"2. per empty step, {args.rounds} interleaved rounds of {args.steps} steps:")
    print(f"   os_evidence=False {spread(off)}")
    print(f"   os_evidence=True  {spread(on)}")
    print(
        f"   ratio on/off {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        f"; the two samples of a step (the start's without rusage) add "
        f"{statistics.median(diffs):.0f} ns [{min(diffs):.0f}-{max(diffs):.0f}] "
        f"({statistics.median(diffs) / 2:.0f} ns a sample)"
    )


if __name__ == "__main__":
    main()
