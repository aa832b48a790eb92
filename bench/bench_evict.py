"""What recording an eviction's cause costs, against a plain eviction.

    python bench/bench_evict.py [--rounds 7] [--calls 2000] [--plain-only]

Three arms, interleaved round by round in one process, each on a fresh in-memory recorder
(`out=None`) inside one open step, `calls` evictions of known requests (each readmitted
right after, so every call evicts a running request):

- plain: `evict(rid, mode="recompute")` (what every eviction paid before causes existed);
- cause: `evict(rid, mode="recompute", reason="kv_full", by=[evictor],
  num_computed_tokens_lost=..., num_free_blocks=..., num_used_blocks=...)`;
- cause x4: the same with four evictors.

The readmission is in every arm and taken off with the plain arm's cost: printed is the
cost per eviction in us (median [min-max] over rounds, on the loop thread's CPU clock,
`time.thread_time`), and the cause's extra cost over a plain eviction. A preemption is
rare (a few per hundred steps under KV pressure), so what matters per step is that the
steps without one pay nothing new: `bench/bench_recording.py` (no evictions) measures
that. Benchmarks live outside the tests: nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tracekit  # noqa: E402

NUM_REQUESTS = 64


def one_arm(arm: str, calls: int) -> float:
    """CPU seconds of this thread for `calls` evictions and readmissions in one step."""
    rec = tracekit.Recorder(None, gc=False, handle_signals=False, os_evidence=False)
    ids = [f"req-{i}" for i in range(NUM_REQUESTS)]
    with rec:
        for r in ids:
            rec.request(r, prompt_tokens=100, max_new_tokens=100)
        with rec.step():
            for r in ids:
                rec.admit(r)
            evict, readmit = rec.evict, rec.readmit
            gc.disable()
            t0 = time.thread_time()
            for i in range(calls):
                victim = ids[i % NUM_REQUESTS]
                if arm == "plain":
                    evict(victim, mode="recompute")
                elif arm == "cause":
                    evict(victim, mode="recompute", reason="kv_full", by=[ids[(i + 1) % 64]],
                          num_computed_tokens_lost=120, num_free_blocks=0,
                          num_used_blocks=512)  # fmt: skip
                else:
                    evict(victim, mode="recompute", reason="kv_full",
                          by=[ids[(i + k) % 64] for k in (1, 2, 3, 4)],
                          num_computed_tokens_lost=120, num_free_blocks=0,
                          num_used_blocks=512)  # fmt: skip
                readmit(victim)
            t = time.thread_time() - t0
            gc.enable()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument(
        "--plain-only", action="store_true",
        help="only the plain arm (to run on a checkout from before causes existed)",
    )  # fmt: skip
    a = ap.parse_args()
    arms = ("plain",) if a.plain_only else ("plain", "cause", "cause x4")
    us: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(a.rounds):
        for arm in arms:
            us[arm].append(one_arm(arm, a.calls) / a.calls * 1e6)
    base = statistics.median(us["plain"])
    print(f"per eviction (+ its readmission), us, median [min-max] of {a.rounds} rounds")
    for arm in arms:
        v = us[arm]
        extra = (
            "" if arm == "plain" else f"   cause's extra cost: {statistics.median(v) - base:.2f} us"
        )
        print(f"  {arm:9s} {statistics.median(v):6.2f} [{min(v):.2f}-{max(v):.2f}]{extra}")


if __name__ == "__main__":
    main()
