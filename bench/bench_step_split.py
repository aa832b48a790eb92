"""Where the recorder's per-step CPU goes, this tree against the previous main, in one
process: the loop of `bench/bench_house.py` (batch 512, 10 segments, one `emit_handles`
of the batch, an in-memory recorder) taken apart.

    python bench/bench_step_split.py [--baseline /tmp/base-main] [--rounds 5] [--steps 2000]

Each part is a loop of its own, on the loop thread's CPU clock (`time.thread_time_ns`),
in interleaved rounds of both checkouts (`bench/base_main.py`):

- ``full``: the whole step, OS evidence on (the default on Linux with the default clock);
- ``full, no OS``: the same with ``os_evidence=False``;
- ``step``: an empty step, OS evidence on (its two OS samples) and off;
- ``10 segments`` and ``emit_handles``: each alone in a step, OS evidence off.

Per part: median [min-max] over the rounds, the ratio of medians (this tree / baseline),
and the page faults a step (``ru_minflt`` of the thread: a buffer growing into fresh
memory takes one every 4 KB written). The parts' differences give the split: OS samples
= step - step without OS, a segment = (10 segments - step without OS) / 10, and so on.
Benchmarks live outside the tests: nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from base_main import DEFAULT_CHECKOUT, BaseMain  # noqa: E402

from tracekit.capture.recorder import Recorder  # noqa: E402

LABELS = ("schedule", "prepare", "prefill", "decode", "sample", "detokenize", "update",
          "draft", "verify", "output")  # fmt: skip

#: part -> (OS evidence, segments, emit_handles)
PARTS = {
    "full": (None, True, True),
    "full, no OS": (False, True, True),
    "step": (None, False, False),
    "step, no OS": (False, False, False),
    "10 segments, no OS": (False, True, False),
    "emit_handles 512, no OS": (False, False, True),
}


def part(recorder_cls: Any, os_evidence: Any, segs: bool, emit: bool, steps: int):
    """(thread CPU seconds, page faults) per step of one part's loop."""
    import numpy as np

    rec = recorder_cls(None, gc=False, handle_signals=False, flush_interval_s=1e9,
                       os_evidence=os_evidence)  # fmt: skip
    rec.start()
    handles = np.array([rec.request(f"r{i}") for i in range(512)], dtype=np.int64)
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t = time.thread_time_ns()
    for _ in range(steps):
        with rec.step():
            if segs:
                for lb in LABELS:
                    with rec.segment(lb):
                        pass
            if emit:
                rec.emit_handles(handles)
    dt = time.thread_time_ns() - t
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0
    rec.stop()
    return dt / 1e9 / steps, faults / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=DEFAULT_CHECKOUT, help="the previous main's checkout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2000, help="recorded steps per part and round")
    args = ap.parse_args()
    base = BaseMain(args.baseline, modules=("tracekit.capture.recorder",))
    theirs = base.mods["tracekit.capture.recorder"].Recorder
    ours: dict[str, list[tuple[float, float]]] = {k: [] for k in PARTS}
    base_: dict[str, list[tuple[float, float]]] = {k: [] for k in PARTS}
    for i in range(args.rounds):
        for name, spec in PARTS.items():
            sides = [
                (ours[name], Recorder, lambda f, *a: f(*a)),
                (base_[name], theirs, base.call),
            ]
            for out, cls, call in sides if i % 2 == 0 else sides[::-1]:  # ABBA
                out.append(call(part, cls, *spec, args.steps))
    print(f"per step, thread CPU, {args.rounds} interleaved rounds of {args.steps} steps")
    for name in PARTS:
        a = [x * 1e6 for x, _ in ours[name]]
        b = [x * 1e6 for x, _ in base_[name]]
        fa = statistics.median(f for _, f in ours[name])
        fb = statistics.median(f for _, f in base_[name])
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"{name:24s} this {ma:6.2f} us [{min(a):.2f}-{max(a):.2f}] {fa:.2f} faults   "
              f"baseline {mb:6.2f} us [{min(b):.2f}-{max(b):.2f}] {fb:.2f} faults   "
              f"ratio {ma / mb:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
