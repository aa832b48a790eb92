"""Does a structural change keep tracekit's speed? This tree against the previous main, in
one process, as ratios; and this tree against the published method.

    python bench/bench_house.py [--baseline /work/base] [--rounds 7]
    python bench/bench_house.py --baseline '' --rounds 9     # the published method only

Both checkouts' packages are imported side by side (`bench/base_main.py`) and timed in
interleaved rounds, so a busy patch of a shared machine hits both alike:

- analysis in process: ``analyze(load(path))`` on a log of ~112,000 gaps in the published
  layout (the synthetic busy engine of `bench/synthetic.py`, saved as the published method
  wrote its logs), wall time per call;
- recording, per engine step at batch 512: a step with 10 segments and one `emit_handles`
  of the whole batch, on an in-memory recorder, the loop thread's CPU time
  (`time.thread_time`: what the engine thread spends, whatever else runs).

Printed: each side's median [min-max] over the rounds and the ratio of medians (this tree /
the baseline: below 1 is faster).

Against the published method (bench/published_method.py, its per-gap Python loop), on the
same published-layout file:

- in process: ``analyze(load(path))`` against ``published_analysis(path)``, the thread's
  CPU time of each (`time.thread_time`: on a shared machine, what one core spends), in
  interleaved rounds (ours: the median of 5 calls a round; the loop: one call);
- whole process: ``python -m tracekit analyze PATH --format jsonl`` against a fresh
  interpreter running the published loop on the same file, start to exit, wall time
  (interleaved; the wall clock also counts waiting for a core), beside the floor every
  Python process pays here (an interpreter that imports numpy and exits). Each side's
  bytecode is compiled once and cached first, as an installed package's is.

Benchmarks live outside the tests: nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from base_main import DEFAULT_CHECKOUT, BaseMain  # noqa: E402
from published_method import published_analysis  # noqa: E402
from synthetic import synthetic_log  # noqa: E402

from tracekit.allocator import keep_freed_memory  # noqa: E402
from tracekit.analysis.figures import analyze  # noqa: E402
from tracekit.capture.recorder import Recorder  # noqa: E402
from tracekit.log.published import save_published  # noqa: E402
from tracekit.log.reader import load  # noqa: E402

LABELS = ("schedule", "prepare", "prefill", "decode", "sample", "detokenize", "update",
          "draft", "verify", "output")  # fmt: skip


def record_steps(recorder_cls: Any, batch: int, steps: int) -> float:
    """Thread CPU seconds per step of a recorded loop: 10 segments, one emit_handles."""
    import numpy as np

    rec = recorder_cls(None, gc=False, handle_signals=False, flush_interval_s=1e9)
    rec.start()
    handles = np.array([rec.request(f"r{i}") for i in range(batch)], dtype=np.int64)
    t = time.thread_time()
    for _ in range(steps):
        with rec.step():
            for lb in LABELS:
                with rec.segment(lb):
                    pass
            rec.emit_handles(handles)
    dt = time.thread_time() - t
    rec.stop()
    return dt / steps


def rounds(ours: Callable[[], float], theirs: Callable[[], float], n: int):
    a, b = [], []
    for i in range(n):  # ABBA: neither side always goes first
        if i % 2 == 0:
            a.append(ours())
            b.append(theirs())
        else:
            b.append(theirs())
            a.append(ours())
    return a, b


def line(what: str, unit: str, scale: float, a: list[float], b: list[float]) -> str:
    ma, mb = statistics.median(a), statistics.median(b)
    return (
        f"{what}: this tree {ma * scale:.2f} {unit} [{min(a) * scale:.2f}-{max(a) * scale:.2f}], "
        f"baseline {mb * scale:.2f} {unit} [{min(b) * scale:.2f}-{max(b) * scale:.2f}]: "
        f"ratio {ma / mb:.3f} ({len(a)} interleaved rounds)"
    )


def spread(xs: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return (f"{statistics.median(xs) * scale:.{digits}f} [{min(xs) * scale:.{digits}f}-"
            f"{max(xs) * scale:.{digits}f}]")  # fmt: skip


def against_published(path: str, n_gaps: int, n: int) -> None:
    """This tree against the published method on the same file: in process (thread CPU
    time) and as whole processes (wall time, start to exit)."""

    def ours() -> float:
        times = []
        for _ in range(5):
            t = time.thread_time()
            analyze(load(path))
            times.append(time.thread_time() - t)
        return statistics.median(times)

    def theirs() -> float:
        t = time.thread_time()
        published_analysis(path)
        return time.thread_time() - t

    ours(), theirs()  # warm both
    a, b = rounds(ours, theirs, n)
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    print(f"analysis in process vs the published method, {n_gaps:,} gaps, thread CPU time, "
          f"{n} interleaved rounds: this tree {spread(a, 1e3)} ms "
          f"({n_gaps / statistics.median(a) / 1e6:.2f} M gaps/s), the published loop "
          f"{spread(b, 1e3, 0)} ms ({n_gaps / statistics.median(b) / 1e3:.0f} k gaps/s): "
          f"{spread(ratios, digits=1)}x")  # fmt: skip
    # As a user's interpreter runs it: modules compiled once and their bytecode cached (a
    # shell with PYTHONDONTWRITEBYTECODE set would time compiling tracekit's sources on
    # every start instead). The cache goes to a temporary folder, never into the tree.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env |= {"PYTHONPATH": os.path.dirname(HERE),
            "PYTHONPYCACHEPREFIX": tempfile.mkdtemp(prefix="tk-pycache-")}  # fmt: skip
    cmds = {
        "tracekit analyze": [sys.executable, "-m", "tracekit", "analyze", path, "--format",
                             "jsonl"],
        "the published loop": [sys.executable, "-c", "import sys; sys.path.insert(0, "
                               f"{HERE!r}); from published_method import published_analysis; "
                               f"published_analysis({path!r})"],
        "python + numpy": [sys.executable, "-c", "import numpy"],
    }  # fmt: skip
    for cmd in cmds.values():  # compile and cache each side's modules once
        subprocess.run(cmd, check=True, capture_output=True, env=env)
    walls: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(n):
        for name, cmd in cmds.items():
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True, env=env)
            walls[name].append(time.perf_counter() - t)
    ratios = [y / x for x, y in zip(walls["tracekit analyze"], walls["the published loop"],
                                    strict=True)]  # fmt: skip
    print(f"whole process, start to exit, wall time, {n} interleaved rounds: "
          + ", ".join(f"{k} {spread(v, 1e3, 0)} ms" for k, v in walls.items())
          + f": {spread(ratios, digits=1)}x")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_CHECKOUT,
                    help="the previous main's checkout ('': published only)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2000, help="recorded steps per round")
    args = ap.parse_args()
    keep_freed_memory()  # as tracekit's analysis commands do (tracekit.allocator)
    path = os.path.join(tempfile.mkdtemp(prefix="tk-house-"), "published.npz")
    save_published(synthetic_log(3500, batch=32, seed=1), path)
    n_gaps = analyze(load(path)).gaps
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    against_published(path, n_gaps, args.rounds)
    if not args.baseline:
        return
    base = BaseMain(
        args.baseline,
        modules=("tracekit.analysis.figures", "tracekit.log.reader", "tracekit.capture.recorder"),
    )
    base_analyze = base.mods["tracekit.analysis.figures"].analyze
    base_load = base.mods["tracekit.log.reader"].load

    def ours_analysis() -> float:
        t = time.perf_counter()
        analyze(load(path))
        return time.perf_counter() - t

    def their_analysis() -> float:
        def run() -> float:
            t = time.perf_counter()
            base_analyze(base_load(path))
            return time.perf_counter() - t

        return base.call(run)

    ours_analysis(), their_analysis()  # warm both: imports, page cache
    a, b = rounds(ours_analysis, their_analysis, args.rounds)
    print(line(f"analysis in process, published layout, {n_gaps:,} gaps", "ms", 1e3, a, b))

    base_rec = base.mods["tracekit.capture.recorder"].Recorder
    a, b = rounds(
        lambda: record_steps(Recorder, 512, args.steps),
        lambda: base.call(record_steps, base_rec, 512, args.steps),
        args.rounds,
    )
    print(line("recording per step, batch 512, 10 segments", "us", 1e6, a, b))


if __name__ == "__main__":
    main()
