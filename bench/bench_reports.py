"""How big and how fast are the trace and the report of a run?

    python bench/bench_reports.py [RUN.npz ...]     (default: a synthetic 60 s run)

For each run: load + partition time, then `tracekit trace` (events, MB, seconds, also
gzipped) and `tracekit report` of that one run (MB, seconds). The trace's goal is a 60 s
demo run in under 3 s and 100 MB; the report's, seconds not minutes.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tracekit.analysis.compare import compare  # noqa: E402
from tracekit.analysis.figures import analyze  # noqa: E402
from tracekit.analysis.gaps import worst_gaps  # noqa: E402
from tracekit.attribution.itl import partition  # noqa: E402
from tracekit.log.reader import load  # noqa: E402
from tracekit.render.html import ReportRun, render_report  # noqa: E402
from tracekit.render.perfetto import chrome_trace_events, write_trace  # noqa: E402


def bench(path: str, out_dir: str) -> None:
    t0 = time.perf_counter()
    log = load(path)
    part = partition(log)
    t_load = time.perf_counter() - t0
    print(f"{path}: {len(log.steps)} steps, {len(part)} gaps, {log.wall_s:.1f} s of serving")
    print(f"  load + partition     {t_load:6.2f} s")
    for name in ("trace.json", "trace.json.gz"):
        t0 = time.perf_counter()
        events = chrome_trace_events(log, part)
        size = write_trace(events, os.path.join(out_dir, name))
        dt = time.perf_counter() - t0
        print(f"  {name:<20} {dt:6.2f} s  {size / 1e6:7.1f} MB  {len(events)} events")
    t0 = time.perf_counter()
    run = ReportRun(analyze(log, part), worst_gaps(log, part, 10))
    page = render_report([run], compare([run.analysis]))
    dt = time.perf_counter() - t0
    print(f"  report.html          {dt:6.2f} s  {len(page) / 1e6:7.1f} MB")


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="tracekit-bench-") as d:
        paths = argv
        if not paths:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from synthlog import synthetic_log

            p = os.path.join(d, "synthetic-60s.npz")
            synthetic_log(duration_s=60.0, seed=1).save(p)
            paths = [p]
        for p in paths:
            bench(p, d)


if __name__ == "__main__":
    main(sys.argv[1:])
