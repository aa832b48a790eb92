"""What the OS did to a recording thread between its consecutive samples (the raw log's
`os_samples`, docs/partition.md "OS evidence"): the intervals the partitions
(`tracekit.attribution.timeline`) and the tensor-parallel rule
(`tracekit.attribution.tp.tp_waits`) take the OS's shares from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START, RawLog


@dataclass(frozen=True)
class OsIntervals:
    """What the OS did to a thread between its consecutive samples (the loop thread's at
    step starts and ends, another thread's at its segments'): interval ``[t0_s, t1_s]``
    held `runqueue_s` of run-queue wait and `offcpu_s` of other off-CPU time (blocked:
    I/O, locks, sleeps, page faults), both within it."""

    t0_s: np.ndarray
    t1_s: np.ndarray
    runqueue_s: np.ndarray
    offcpu_s: np.ndarray

    def __len__(self) -> int:
        return len(self.t0_s)


def intervals_of(sel: np.ndarray, log: RawLog) -> OsIntervals:
    """The OS intervals between consecutive samples `sel` (rows of `log.os_samples`) of one
    thread, in time order. An interval is used only where both samples have CPU time and
    run-queue wait (not -1) and the counters did not go back; its run-queue wait is at
    most its length, its off-CPU time is what is left after CPU time and run-queue wait
    (never negative)."""
    sel = sel[np.argsort(log.os_samples.t_s[sel], kind="stable")]
    return _between(log, sel[:-1], sel[1:])[0]


def side_thread_intervals(log: RawLog, thread: int) -> tuple[OsIntervals, np.ndarray]:
    """A side thread's OS intervals (consecutive samples of `thread`, sampled at its
    segments' ends, used as `intervals_of` says) and, per interval, whether the thread was
    inside one of its segments all along (its segment nesting after the interval's first
    sample is above 0). Between its segments a thread may sit idle (an event loop in its
    poll), which its counters cannot tell from being blocked."""
    os_ = log.os_samples
    sel = np.flatnonzero(os_.thread == thread)
    sel = sel[np.argsort(os_.t_s[sel], kind="stable")]
    kind = os_.kind[sel]
    depth = np.cumsum((kind == OS_SEGMENT_START).astype(np.int64) - (kind == OS_SEGMENT_END))
    osi, ok = _between(log, sel[:-1], sel[1:])
    return osi, (depth[:-1] > 0)[ok]


def _between(log: RawLog, i: np.ndarray, j: np.ndarray) -> tuple[OsIntervals, np.ndarray]:
    """The OS intervals from samples `i` to samples `j` (rows of `log.os_samples`, pairwise),
    as `intervals_of` says, and which of the pairs they are (the usable ones)."""
    os_ = log.os_samples
    t0, t1 = os_.t_s[i], os_.t_s[j]
    cpu0, cpu1, runq0, runq1 = os_.cpu_ns[i], os_.cpu_ns[j], os_.runqueue_ns[i], os_.runqueue_ns[j]
    d_cpu, d_runq = cpu1 - cpu0, runq1 - runq0
    ok = (cpu0 >= 0) & (cpu1 >= 0) & (runq0 >= 0) & (runq1 >= 0)
    ok &= (d_cpu >= 0) & (d_runq >= 0) & (t1 > t0)
    width = np.where(ok, t1 - t0, 0.0)
    rq = np.minimum(d_runq * 1e-9, width)
    off = np.maximum(width - d_cpu * 1e-9 - rq, 0.0)
    return OsIntervals(t0[ok], t1[ok], rq[ok], off[ok]), ok


def thread_os_intervals(log: RawLog, thread: int) -> OsIntervals:
    """One thread's OS intervals: consecutive samples of `thread`, whatever their kind (a
    vLLM worker samples at its segments), used as `intervals_of` says."""
    return intervals_of(np.flatnonzero(log.os_samples.thread == thread), log)


__all__ = ["OsIntervals", "intervals_of", "side_thread_intervals", "thread_os_intervals"]
