"""The operating system's account of the calling thread: CPU time, run-queue wait, switches.

    reader = ThreadStats.open()            # None where the platform has no such counters
    cpu_ns, runqueue_ns, nvcsw, nivcsw, majflt = reader.read()
    cpu_ns, runqueue_ns, -1, -1, -1 = reader.read(switches=False)

On Linux, for the thread that calls `read`:

- ``cpu_ns``: ``clock_gettime(CLOCK_THREAD_CPUTIME_ID)``, the time it ran on a CPU, up to
  this instant. schedstat's first field (``sum_exec_runtime``) would come with the read
  below for free, but for a running thread the kernel brings it up to date only at a
  tick, a switch, or such a clock read: measured on Linux 6.18, two reads 0.25 ms of
  computing apart often show the same value (`bench/bench_os.py` prints how often);
- ``runqueue_ns``: the second field of ``/proc/thread-self/schedstat``, the time it was
  runnable but waited on a run queue (exact when read: the thread is running, so every
  wait has ended). The file is opened once per thread and re-read with ``pread``: one
  system call, no open;
- ``num_voluntary_switches`` (it blocked: I/O, a lock, a sleep), ``num_involuntary_switches``
  (the scheduler took the CPU away) and ``num_major_faults`` (page faults that read the
  disk): ``getrusage(RUSAGE_THREAD)``; -1 with ``switches=False`` (the recorder reads them
  at step and segment ends only: the partition uses CPU time and run-queue wait).

Every value is the thread's total since it started; differences between two reads bound
what happened in between. Where a source is missing (no ``schedstat`` without
``CONFIG_SCHEDSTATS``, no ``RUSAGE_THREAD`` off Linux) its values are -1, and `describe`
says which sources a platform has; off Linux nothing is recorded at all (`open` returns
None with the reason in `unavailable_reason`).
"""

from __future__ import annotations

import functools
import os
import resource
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: What each sample holds, after the tick: the raw log's `os_samples` columns.
FIELDS = (
    "cpu_ns",
    "runqueue_ns",
    "num_voluntary_switches",
    "num_involuntary_switches",
    "num_major_faults",
)
SCHEDSTAT_PATH = "/proc/thread-self/schedstat"

_CPU_CLOCK = getattr(time, "CLOCK_THREAD_CPUTIME_ID", None)
RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def _thread_cpu_clock() -> Callable[[], int]:
    """The calling thread's CPU time in ns: `time.thread_time_ns` where it is
    ``clock_gettime(CLOCK_THREAD_CPUTIME_ID)`` (Linux: the same value, without the clock
    id's argument parsing, ~60 ns less a read), else that clock read by its id."""
    if _CPU_CLOCK is None:
        return time.thread_time_ns  # never read: no OS evidence without this clock
    impl = time.get_clock_info("thread_time").implementation
    if impl == "clock_gettime(CLOCK_THREAD_CPUTIME_ID)":
        return time.thread_time_ns
    return functools.partial(time.clock_gettime_ns, _CPU_CLOCK)


#: The system calls of a sample. `ThreadStats.read` looks them up at each call; the loop
#: thread's step path (`tracekit.capture.segments.Probes`) binds them once at start. A test
#: may put a fake kernel here before a recorder starts.
thread_cpu_ns = _thread_cpu_clock()
pread = os.pread
getrusage = resource.getrusage
#: An `os_samples` row as bytes: thread, kind, tick, then `FIELDS`.
_OS_ROW = struct.Struct("8q").pack


def unavailable_reason() -> str | None:
    """Why this platform records no OS evidence (None: it does)."""
    if not sys.platform.startswith("linux"):
        return f"OS evidence is recorded on Linux only (this is {sys.platform})"
    if _CPU_CLOCK is None:
        return "no CLOCK_THREAD_CPUTIME_ID on this platform"
    return None


class ThreadStats:
    """Reads the counters of whichever thread calls `read` (one schedstat fd per thread,
    opened on its first read, closed by `close`)."""

    def __init__(self) -> None:
        self._tls = threading.local()
        self._fds: list[int] = []
        self._lock = threading.Lock()
        self.has_schedstat = os.path.exists(SCHEDSTAT_PATH)
        self.has_rusage = RUSAGE_THREAD is not None

    @classmethod
    def open(cls) -> ThreadStats | None:
        return None if unavailable_reason() is not None else cls()

    def describe(self) -> dict[str, Any]:
        """The sources this platform has (saved in the log's meta)."""
        return {
            "platform": sys.platform,
            "cpu_ns": "CLOCK_THREAD_CPUTIME_ID",
            "runqueue_ns": SCHEDSTAT_PATH if self.has_schedstat else None,
            "switches_and_faults": "getrusage(RUSAGE_THREAD), at step and segment ends"
            if self.has_rusage
            else None,
        }

    def fd(self) -> int:
        """The calling thread's schedstat fd (-1: none), opened on its first call."""
        try:
            return self._tls.fd
        except AttributeError:
            pass
        fd = -1
        if self.has_schedstat:
            try:  # thread-self resolves now: this fd names this thread for good
                fd = os.open(SCHEDSTAT_PATH, os.O_RDONLY)
            except OSError:
                fd = -1
        if fd >= 0:
            with self._lock:
                self._fds.append(fd)
        self._tls.fd = fd
        return fd

    def read(self, switches: bool = True) -> tuple[int, int, int, int, int]:
        """(cpu_ns, runqueue_ns, voluntary switches, involuntary switches, major faults)
        of the calling thread; -1 for what this platform does not have, and for the last
        three with ``switches=False``."""
        cpu = thread_cpu_ns()
        try:
            fd = self._tls.fd
        except AttributeError:  # this thread's first read
            fd = self.fd()
        runq = -1
        if fd >= 0:
            try:
                runq = int(pread(fd, 96, 0).split()[1])
            except (OSError, ValueError, IndexError):
                runq = -1
        if not switches or RUSAGE_THREAD is None:
            return cpu, runq, -1, -1, -1
        ru = getrusage(RUSAGE_THREAD)
        return cpu, runq, ru.ru_nvcsw, ru.ru_nivcsw, ru.ru_majflt

    def sample_row(
        self, tid: int, kind: int, clock: Callable[[], int], switches: bool
    ) -> tuple[int, bytes]:
        """One `os_samples` row of the calling thread and its tick: the counters first
        (`read`, the one place they are read), then the clock, with nothing between
        (docs/partition.md, "When the counters are read"); the row packed once."""
        cpu, runq, nvcsw, nivcsw, majflt = self.read(switches)
        t = clock()
        return t, _OS_ROW(tid, kind, t, cpu, runq, nvcsw, nivcsw, majflt)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def kernel_runqueue_ns(tid: int | None = None) -> int:
    """The run-queue wait of a thread (default: the calling thread), read once from
    ``/proc``: what the kernel reports, to compare a partition with (tests, bench)."""
    path = SCHEDSTAT_PATH if tid is None else f"/proc/self/task/{tid}/schedstat"
    with open(path, "rb") as fh:
        return int(fh.read().split()[1])


__all__ = [
    "FIELDS",
    "RUSAGE_THREAD",
    "ThreadStats",
    "getrusage",
    "kernel_runqueue_ns",
    "pread",
    "thread_cpu_ns",
    "unavailable_reason",
]
