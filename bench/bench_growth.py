"""How cost grows with the input: time and peak memory of merge (2 -> 2,000 process logs),
trace (4 k -> 40 k API-server windows), TTFT (1 k -> 100 k prefill rows in one step) and
export + fleet (10 -> 2,000 runs), each at a small and a large size, in this process.

Prints per surface: size, wall time, peak traced memory (tracemalloc: numpy's arrays
included), and the growth ratios time(large)/time(small) and mem(large)/mem(small) next to
the size ratio. Near linear is the goal: a time ratio near the size ratio (x10 or x100),
not its square. Each size is timed `--repeat` times (interleaved small, large, small, ...)
and the median and [min-max] printed.

    python bench/bench_growth.py            # a few minutes on a shared 2-core machine
    python bench/bench_growth.py --quick    # smaller large sizes, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

# the tests' own recorder of a server run (tests/log/test_merge.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "log"))


def measure(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, peak traced MB) of one call."""
    tracemalloc.start()
    t = time.perf_counter()
    fn()
    dt = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return dt, peak / 1e6


def report(name: str, small: int, large: int, make: Callable[[int], Callable[[], object]],
           repeat: int) -> None:  # fmt: skip
    runs = {small: [], large: []}
    fns = {small: make(small), large: make(large)}
    for _ in range(repeat):  # interleaved, so load on the machine hits both alike
        for n in (small, large):
            runs[n].append(measure(fns[n]))

    def med(n: int, i: int) -> tuple[float, float, float]:
        xs = [r[i] for r in runs[n]]
        return statistics.median(xs), min(xs), max(xs)

    ts, tl = med(small, 0), med(large, 0)
    ms, ml = med(small, 1), med(large, 1)
    print(f"{name}: x{large / small:g} input")
    for n, t, m in ((small, ts, ms), (large, tl, ml)):
        print(f"  {n:>7,}: {t[0] * 1e3:9.1f} ms [{t[1] * 1e3:.1f}-{t[2] * 1e3:.1f}]  "
              f"peak {m[0]:8.1f} MB")  # fmt: skip
    print(f"  growth: time x{tl[0] / ts[0]:.1f} [{tl[1] / ts[2]:.1f}-{tl[2] / ts[1]:.1f}], "
          f"memory x{ml[0] / max(ms[0], 1e-9):.1f}  (linear: x{large / small:g})")  # fmt: skip
    sys.stdout.flush()


# -- merge: one engine core and N-1 API servers -------------------------------------------


def process_dir(n_procs: int) -> str:
    """An engine core and `n_procs - 1` API servers (copies of one, each its own pid), from
    the recorder the tests use (tests/log/test_merge.py record_pair: 30 requests)."""
    from pathlib import Path

    from test_merge import record_pair

    d = Path(tempfile.mkdtemp(prefix=f"growth-merge-{n_procs}-"))
    record_pair(d, n=30)
    fe = d / "api_server-2.npz"
    with np.load(fe) as z:
        arrays = {k: z[k] for k in z.files}
    cfg = json.loads(str(arrays["config"]))
    fe.unlink()
    for k in range(n_procs - 1):
        cfg["process"]["pid"] = 100 + k
        arrays["config"] = np.array(json.dumps(cfg))
        np.savez(d / f"api_server-{100 + k}.npz", **arrays)
    return str(d)


def make_merge(n: int) -> Callable[[], object]:
    from tracekit.analysis.run import merge_run as merge_dir

    d = process_dir(n)
    return lambda: merge_dir(d)


# -- trace: API-server windows ------------------------------------------------------------


def make_trace(n_windows: int) -> Callable[[], object]:
    """What `tracekit trace` does with a merged server run whose API server recorded
    `n_windows` windows of one label, each open for a quarter of the run (streams written
    to clients concurrently): the engine's events and the process tracks, whose lane layout
    then needs n/4 lanes (the shape that made the old layout quadratic)."""
    import dataclasses

    from tracekit.analysis.run import merge_run as merge_dir
    from tracekit.attribution.itl import partition
    from tracekit.attribution.ttft import ttft_partition
    from tracekit.log.rawlog import ProcSegments
    from tracekit.render import perfetto
    from tracekit.render.client import process_events

    log = merge_dir(process_dir(2))
    assert log.meta.get("processes"), "a merged run: trace draws its process tracks"
    labels = (*log.labels, "sse_write")
    t = np.arange(n_windows) * 2e-5
    ps = ProcSegments.from_columns(
        process=np.ones(n_windows, dtype=np.int64),
        label=np.full(n_windows, len(labels) - 1, dtype=np.int64),
        t_start_s=t, t_end_s=t + n_windows / 4 * 2e-5,
    )  # fmt: skip
    log = dataclasses.replace(log, labels=labels, proc_segments=ps)
    part, tp = partition(log), ttft_partition(log)

    def go() -> None:
        events = perfetto.chrome_trace_events(log, part, ttft=tp)
        extra = process_events(log)
        drawn = sum(e.get("name") == "sse_write" for e in extra)
        assert drawn == n_windows, f"{drawn} of {n_windows} windows drawn"
        events += extra

    return go


# -- ttft: prefill rows in one step -------------------------------------------------------


def make_ttft(n_rows: int) -> Callable[[], object]:
    """`ttft_partition` of a run whose one prefill step takes `n_rows` requests (a token
    each) in `n_rows` prefill segments of 1 ms, request i's first token halfway through
    segment i: a row-by-segment join would make n_rows^2 pieces."""
    from logbuilder import LogBuilder

    from tracekit.attribution.ttft import ttft_partition
    from tracekit.log.validate import validate_log

    b = LogBuilder()
    b.step(0, 2 * n_rows + 10)
    for k in range(n_rows):
        b.seg(0, "prefill", 2 * k + 1, 2 * k + 2)
        b.admit(k, 0)
        b.prefill(0, k, 1)
        b.emit(k, 2 * k + 1.5, 0)
    log = validate_log(b.build(arrivals_ms=[0] * n_rows))
    return lambda: ttft_partition(log)


# -- export + fleet -----------------------------------------------------------------------


def make_export(n_runs: int) -> Callable[[], object]:
    from synthlog import synthetic_log

    from tracekit.analysis.export import export
    from tracekit.analysis.fleet import rollup

    d = tempfile.mkdtemp(prefix=f"growth-export-{n_runs}-")
    base = synthetic_log(seed=1, duration_s=0.2)
    paths = []
    for i in range(n_runs):
        p = os.path.join(d, f"r{i}.npz")
        base.save(p)
        paths.append(p)
    k = [0]

    def go() -> None:
        k[0] += 1
        root = os.path.join(d, f"ds{k[0]}")
        export(paths, root, ("rung",))
        rollup(root, "rung")

    return go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="merge,trace,ttft,export")
    a = ap.parse_args()
    only = set(a.only.split(","))
    sizes = {
        "merge": (2, 200 if a.quick else 2000),
        "trace": (4000, 40000),
        "ttft": (1000, 10000 if a.quick else 100000),
        "export": (10, 100 if a.quick else 2000),
    }
    print(json.dumps({"sizes": sizes, "repeat": a.repeat}))
    if "merge" in only:
        report("merge (process logs)", *sizes["merge"], make_merge, a.repeat)
    if "trace" in only:
        report("trace (API-server windows)", *sizes["trace"], make_trace, a.repeat)
    if "ttft" in only:
        report("ttft (prefill rows in a step)", *sizes["ttft"], make_ttft, a.repeat)
    if "export" in only:
        report("export + fleet (runs)", *sizes["export"], make_export,
               1 if not a.quick else a.repeat)  # fmt: skip


if __name__ == "__main__":
    main()
