"""Overlapping windows in `tracekit trace`: lanes in O(n log n), not O(n * lanes).

    python bench/bench_trace_lanes.py [N]      (default N = 4000)

N windows of 1 s, starting 1 ms apart, each overlapping the next 999 without nesting (the
shape of 20k overlapping segments or GC pauses that made `trace` take 23 s and 49 s).
Prints, from interleaved A/B pairs in this process, the time of the slow reference lane
assignment (`_lanes_reference`, what `trace` used) over the fast one (`_lanes`), and how
the fast one and the whole `chrome_trace_events` scale from N to 2N windows (about 2x is
linear, 4x quadratic). Ratios, not seconds: the machine may be busy.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

from logbuilder import LogBuilder  # noqa: E402

from tracekit.attribution.itl import partition  # noqa: E402
from tracekit.render import perfetto  # noqa: E402


def staggered(n: int) -> tuple[list[int], list[int]]:
    starts = [i * 1_000_000 for i in range(n)]  # ns: 1 ms apart
    return starts, [a + 1_000_000_000 for a in starts]  # 1 s long


def staggered_log(n: int, gc: bool):
    b = LogBuilder()
    s = b.step(0, 2 * n + 1000)
    for i in range(n):
        if gc:
            b.gc(i, i + 1000)
        else:
            b.seg(-1, "decode", i, i + 1000)
    b.emit(0, 0, s)
    b.emit(0, 2 * n + 1000, s)
    return b.build()


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main(n: int) -> None:
    starts, ends = staggered(n)
    assert perfetto._lanes(starts, ends) == perfetto._lanes_reference(starts, ends)
    ratios = []
    for _ in range(3):  # interleaved pairs: reference, then fast
        slow = timed(perfetto._lanes_reference, starts, ends)
        fast = timed(perfetto._lanes, starts, ends)
        ratios.append(slow / fast)
    print(f"{n} overlapping windows: reference / fast lanes = {statistics.median(ratios):.0f}x "
          f"(pairs: {', '.join(f'{r:.0f}' for r in ratios)})")  # fmt: skip
    s2, e2 = staggered(2 * n)
    growth = [
        timed(perfetto._lanes, s2, e2) / timed(perfetto._lanes, starts, ends) for _ in range(3)
    ]
    print(f"fast lanes, {2 * n} over {n} windows: {statistics.median(growth):.2f}x")
    for gc in (False, True):
        what = "gc pauses" if gc else "segments"
        small, big = staggered_log(n, gc), staggered_log(2 * n, gc)
        ps, pb = partition(small), partition(big)
        g = [
            timed(perfetto.chrome_trace_events, big, pb)
            / timed(perfetto.chrome_trace_events, small, ps)
            for _ in range(3)
        ]
        print(
            f"chrome_trace_events, {2 * n} over {n} overlapping {what}: {statistics.median(g):.2f}x"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4000)
