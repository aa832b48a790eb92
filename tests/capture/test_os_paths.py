"""The loop thread's step samples (`Probes.os_step_start`, `os_step_end`) and the generic
sample every other thread takes (`Probes.os_sample`) write the same rows, on a fake kernel:
the system calls of `tracekit.capture.osstats` replaced, before the probes bind them, by
counters that log every call (docs/capture.md, "OS evidence"; docs/partition.md, "When the
counters are read").

The rules the expected rows come from: a sample is (thread, kind, tick, CPU ns, run-queue
ns, voluntary switches, involuntary switches, major faults); the counters are read first
(CPU time, then schedstat, then at an end getrusage) and the tick right after, nothing
between; a start reads no switches or faults (-1); the thread's number is its order of
first recording (the recorder's thread is 0) and its schedstat file is its own."""

from __future__ import annotations

import itertools
import os
import struct
import threading
from types import SimpleNamespace

import pytest

from tracekit.capture import osstats
from tracekit.capture.buffers import RowBuffers
from tracekit.capture.recorder import Recorder
from tracekit.capture.segments import OpenStep, Probes, Threads
from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START, OS_STEP_END, OS_STEP_START

pytestmark = pytest.mark.skipif(
    osstats.unavailable_reason() is not None or not os.path.exists(osstats.SCHEDSTAT_PATH),
    reason="OS evidence needs Linux with schedstat",
)

ROW = struct.Struct("8q")


class FakeKernel:
    """CPU time 10, 20, ...; run-queue wait 1000, 2000, ... (schedstat's second field);
    switches and faults 1, 2, ... (one counter for all three); a clock 0, 1, 2, ...; every
    call logged as (what, value, the calling thread's identity), and each schedstat read's
    fd per thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fds: dict[int, set[int]] = {}
        self._cpu = itertools.count(10, 10)
        self._runq = itertools.count(1000, 1000)
        self._ru = itertools.count(1)
        self._tick = itertools.count(0)

    def _log(self, what: str, v: int) -> int:
        self.calls.append((what, v, threading.get_ident()))
        return v

    def cpu_ns(self) -> int:
        return self._log("cpu", next(self._cpu))

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        assert (n, offset) == (96, 0)
        self.fds.setdefault(threading.get_ident(), set()).add(fd)
        return b"7 %d 3\n" % self._log("runq", next(self._runq))

    def getrusage(self, who: int) -> SimpleNamespace:
        assert who == osstats.RUSAGE_THREAD
        k = self._log("rusage", next(self._ru))
        return SimpleNamespace(ru_nvcsw=k, ru_nivcsw=100 + k, ru_majflt=200 + k)

    def clock(self) -> int:
        return self._log("clock", next(self._tick))


@pytest.fixture
def kernel(monkeypatch):
    k = FakeKernel()
    monkeypatch.setattr(osstats, "thread_cpu_ns", k.cpu_ns)
    monkeypatch.setattr(osstats, "pread", k.pread)
    monkeypatch.setattr(osstats, "getrusage", k.getrusage)
    return k


def _rows(buf: bytes) -> list[tuple[int, ...]]:
    return [ROW.unpack_from(buf, i) for i in range(0, len(buf), ROW.size)]


def test_the_step_path_and_the_generic_path_write_the_same_rows(kernel):
    rows = RowBuffers(10**9)
    threads = Threads(OpenStep(), rows)
    probes = threads.probes = Probes(threads, rows, kernel.clock)
    probes.open_os(True, is_wall_clock=True)
    try:
        probes.os_step_start()
        probes.os_step_end()
        fast = bytes(rows.os_samples)
        fast_order = [what for what, _, _ in kernel.calls]
        del rows.os_samples[:]
        kernel.__init__()  # the same kernel state again, for the generic path
        assert probes.os_sample(OS_STEP_START) == 0  # the tick it returns
        assert probes.os_sample(OS_STEP_END) == 1
        assert bytes(rows.os_samples) == fast
        # by hand: the start reads CPU 10 and run queue 1000, then the clock (tick 0); the
        # end reads CPU 20, run queue 2000, switches 1 / 101 and faults 201, then tick 1
        assert _rows(fast) == [
            (0, OS_STEP_START, 0, 10, 1000, -1, -1, -1),
            (0, OS_STEP_END, 1, 20, 2000, 1, 101, 201),
        ]
        # nothing between the counters and the tick, on both paths
        order = ["cpu", "runq", "clock", "cpu", "runq", "rusage", "clock"]
        assert fast_order == order and [what for what, _, _ in kernel.calls] == order
    finally:
        probes.close_os()
    # stopped from another thread meanwhile: the reader is gone, no sample, no call
    n = len(kernel.calls)
    probes.os_step_start()
    probes.os_step_end()
    assert len(rows.os_samples) == 2 * 8 and len(kernel.calls) == n


def test_each_thread_that_runs_steps_samples_with_its_own_number_and_file(kernel):
    rec = Recorder(None, gc=False, handle_signals=False, clock=kernel.clock, os_evidence=True)
    main = threading.get_ident()
    with rec:
        with rec.step():
            pass

        def side() -> None:
            with rec.segment("tok"):  # not the loop thread: its segment is sampled
                pass
            with rec.step():  # now it runs the steps: its steps are sampled
                with rec.segment("tok"):  # and no longer its segments
                    pass

        t = threading.Thread(target=side)
        t.start()
        t.join()
        with rec.step():  # back on the first thread
            pass
    log = rec.log()
    s = log.os_samples
    assert list(zip(s.thread.tolist(), s.kind.tolist(), strict=True)) == [
        (0, OS_STEP_START), (0, OS_STEP_END),
        (1, OS_SEGMENT_START), (1, OS_SEGMENT_END),
        (1, OS_STEP_START), (1, OS_STEP_END),
        (0, OS_STEP_START), (0, OS_STEP_END),
    ]  # fmt: skip
    # every sample's values are the kernel's, read in order by the thread it names: its
    # CPU time, its run-queue wait, at an end its switches and faults, then the tick
    calls = kernel.calls
    who = {0: main, 1: t.ident}
    at = 0
    for i in range(len(s)):
        # this sample's CPU read (the recorder's other calls read the clock only)
        at = calls.index(("cpu", int(s.cpu_ns[i]), who[int(s.thread[i])]), at)
        reads = [(what, v) for what, v, ident in calls[at + 1 : at + 4] if ident == calls[at][2]]
        assert reads[0] == ("runq", int(s.runqueue_ns[i]))
        if int(s.kind[i]) in (OS_STEP_END, OS_SEGMENT_END):
            k = int(s.num_voluntary_switches[i])
            assert reads[1] == ("rusage", k)
            assert (int(s.num_involuntary_switches[i]), int(s.num_major_faults[i])) == (
                100 + k,
                200 + k,
            )
            what, tick = reads[2]
        else:
            assert int(s.num_voluntary_switches[i]) == -1 and int(s.num_major_faults[i]) == -1
            what, tick = reads[1]
        assert what == "clock"
        assert round(float(s.t_s[i]) / rec.seconds_per_tick) + rec.t0_tick == tick
    # one schedstat file per thread, never another thread's
    assert len(kernel.fds[main]) == 1 and len(kernel.fds[t.ident]) == 1
    assert kernel.fds[main] != kernel.fds[t.ident]
