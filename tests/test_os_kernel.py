"""The OS pile against the kernel's own count (docs/partition.md, "OS evidence", "When the
counters are read"): the recorder's loop thread pinned to one CPU beside a busy process
pinned to the same CPU (so the thread waits in the run queue for about half of every
step) and sleeping now and then (real off-CPU time); what the log's OS intervals and the
partition's `os_runqueue` / `os_blocked` hold, against the thread's own
/proc/thread-self/schedstat over the same loop (off the CPU = window - CPU - run queue).

Both must agree in kind, not only in sum: a run-queue wait counted in one interval but
placed, by the stamps, in the next shows as off-CPU time the kernel never saw."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

import tracekit
from tracekit.attribution.itl import partition
from tracekit.log.osintervals import intervals_of
from tracekit.log.rawlog import OS_STEP_END, OS_STEP_START

SCHEDSTAT = "/proc/thread-self/schedstat"
pytestmark = pytest.mark.skipif(
    not (os.path.exists(SCHEDSTAT) and hasattr(os, "sched_setaffinity")),
    reason="needs Linux schedstat and CPU affinity",
)


def kernel_now() -> tuple[float, float, float]:
    """(CPU s, run-queue s, wall s) of this thread, read together."""
    with open(SCHEDSTAT) as f:
        cpu_ns, rq_ns = (int(x) for x in f.read().split()[:2])
    return cpu_ns / 1e9, rq_ns / 1e9, time.perf_counter()


def spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def test_the_os_pile_agrees_with_the_kernel_in_kind_under_a_busy_neighbour():
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    os.sched_setaffinity(0, {cpu})
    try:
        rec = tracekit.Recorder(None, handle_signals=False, gc=False, os_evidence=True)
        rec.start()
        rec.request("r")
        spin(0.05)  # the busy neighbour is on the CPU
        k0 = kernel_now()
        for i in range(200):
            with rec.step():
                with rec.segment("decode"):
                    spin(0.002)
                if i % 10 == 0:
                    with rec.segment("tok"):
                        time.sleep(0.002)  # off the CPU, by the thread's own doing
                rec.emit(["r"])
            spin(0.0002)  # the engine loop between steps
        k1 = kernel_now()
        log = rec.stop()
    finally:
        hog.kill()
        hog.wait()
        os.sched_setaffinity(0, before)
    k_cpu, k_rq, k_win = (b - a for a, b in zip(k0, k1, strict=True))
    k_off = k_win - k_cpu - k_rq
    assert k_rq > 0.2 * k_win  # the neighbour did take the CPU: the case under test
    os_ = log.os_samples
    osi = intervals_of(np.flatnonzero((os_.kind == OS_STEP_START) | (os_.kind == OS_STEP_END)), log)
    tol = 0.05 * k_win + 0.015  # the loop's edges lie outside the first and last sample
    assert abs(osi.runqueue_s.sum() - k_rq) < tol, (osi.runqueue_s.sum(), k_rq, k_win)
    assert abs(osi.offcpu_s.sum() - k_off) < tol, (osi.offcpu_s.sum(), k_off, k_win)
    # the partition: one request emitting at every step, so its gaps tile the loop from
    # the first step's end (about one step less than the kernel's window)
    p = partition(log)
    rq = p.column("os_runqueue").sum() / 1e3
    off = p.column("os_blocked").sum() / 1e3
    assert abs(rq - k_rq) < tol + 0.01, (rq, k_rq, k_win)
    assert abs(off - k_off) < tol + 0.01, (off, k_off, k_win)
