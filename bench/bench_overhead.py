"""What does recording cost? The same engine, seed and workload, recorder off vs on.

    python bench/bench_overhead.py [--rung baseline] [--pairs 15] [--requests 32]

1. End to end: the demo engine serves one fixed workload to completion (every request
   arrives at t=0, so the scheduler's decisions do not depend on the clock and both arms
   do identical work; the token counts are checked equal). Runs alternate disabled /
   enabled in ABBA order so drift on a shared machine hits both arms alike. Prints each
   pair's tokens/s and the median ratio enabled/disabled (goal: within 2%).
2. Per event: a microbenchmark of the hot-path hooks on an enabled in-memory recorder,
   net of an empty loop: segment enter+exit, emit per token (32-row steps), an empty step,
   a counter sample.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tracekit  # noqa: E402
from demo_engine.config import WorkloadConfig, find_rung, rung_config  # noqa: E402
from demo_engine.engine import Engine  # noqa: E402
from demo_engine.tokenizer import train_tokenizer  # noqa: E402
from demo_engine.workload import TraceRequest, make_trace  # noqa: E402


def fixed_workload(seed: int, num_requests: int, max_new_tokens: int) -> list[TraceRequest]:
    """The seed's first requests, all arriving at t=0, outputs capped (a fixed amount of work)."""
    tr = make_trace(seed, 600.0, WorkloadConfig(rate_req_s=10.0, doc_frac=0.0))[:num_requests]
    return [
        TraceRequest(i, 0.0, t.text, min(t.max_new_tokens, max_new_tokens), False)
        for i, t in enumerate(tr)
    ]


def serve_once(cfg, tokenizer, trace, *, enabled: bool, tmp: str) -> tuple[float, float, int, Any]:
    """(wall s, process CPU s, tokens, the log or None) of one drained run. CPU time (all
    threads of this process, the recorder's writer included) is less disturbed by other
    tenants of a shared machine than wall time."""
    out = os.path.join(tmp, "bench.npz") if enabled else None
    rec = tracekit.Recorder(out, config={"rung": "bench"}, enabled=enabled)
    with rec:
        eng = Engine(cfg, rec, tokenizer)
        try:
            eng.startup()
            t0, c0 = time.perf_counter(), time.process_time()
            stats = eng.serve(trace, 3600.0, is_drain=True)
            wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        finally:
            eng.close()
    return wall_s, cpu_s, stats.num_tokens, rec.log() if enabled else None


def per_event_ns(num_iters: int = 200_000, tk: Any = tracekit) -> dict[str, float]:
    """Net cost of each hot-path hook, ns per event, on an enabled in-memory recorder of
    the package `tk` (this checkout's tracekit, or another's: bench_capture.py). No flush
    falls inside the timed loops."""
    rec = tk.Recorder(None, gc=False, handle_signals=False, flush_interval_s=3600.0)
    ids = list(range(32))
    res: dict[str, float] = {}
    with rec:
        for rid in ids:
            rec.request(rid, prompt_tokens=100, max_new_tokens=100)
        seg = rec.segment("decode")

        def timed(fn, n: int) -> float:
            t0 = time.perf_counter_ns()
            fn(n)
            return (time.perf_counter_ns() - t0) / n

        def empty(n: int) -> None:
            for _ in range(n):
                pass

        def segment(n: int) -> None:
            for _ in range(n):
                with seg:
                    pass

        def step(n: int) -> None:
            for _ in range(n):
                with rec.step():
                    pass

        def emit32(n: int) -> None:
            for _ in range(n):
                rec.emit(ids)

        def counter(n: int) -> None:
            for _ in range(n):
                rec.counter("batch_size", 32)

        base = min(timed(empty, num_iters) for _ in range(3))
        res["segment enter+exit"] = min(timed(segment, num_iters) for _ in range(3)) - base
        res["step (empty)"] = min(timed(step, num_iters) for _ in range(3)) - base
        n_emit = num_iters // 8
        res["emit, per token (32/step)"] = (
            min(timed(emit32, n_emit) for _ in range(3)) - base
        ) / 32
        res["counter"] = min(timed(counter, num_iters) for _ in range(3)) - base
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rung", default="baseline")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=15, help="ABBA-ordered disabled/enabled pairs")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=100)
    args = ap.parse_args()

    rung = find_rung(args.rung)
    cfg = rung_config(rung)
    tokenizer = train_tokenizer(cfg.vocab_size, WorkloadConfig())
    trace = fixed_workload(args.seed, args.requests, args.max_new_tokens)
    print(
        f"end to end: rung {rung!r}, seed {args.seed}, {len(trace)} requests at t=0, "
        f"outputs capped at {args.max_new_tokens}; {args.pairs} pairs, ABBA order"
    )
    walls: dict[bool, list[float]] = {False: [], True: []}
    log = None
    wall_ratios: list[float] = []
    cpu_ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="tk-bench-") as tmp:
        serve_once(cfg, tokenizer, trace[:8], enabled=False, tmp=tmp)  # warm caches
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {
                enabled: serve_once(cfg, tokenizer, trace, enabled=enabled, tmp=tmp)
                for enabled in order
            }
            (w_off, c_off, n_off, _), (w_on, c_on, n_on, log) = got[False], got[True]
            walls[False].append(w_off)
            walls[True].append(w_on)
            if n_off != n_on:
                sys.exit(f"pair {i}: the arms did different work ({n_off} vs {n_on} tokens)")
            # tokens/s ratio on/off = time off / time on (same tokens)
            wall_ratios.append(w_off / w_on)
            cpu_ratios.append(c_off / c_on)
            print(
                f"  pair {i + 1:2d}: off {n_off / w_off:6.0f} tok/s  on {n_on / w_on:6.0f} tok/s  "
                f"on/off wall {w_off / w_on:.3f}  cpu {c_off / c_on:.3f}  ({n_on} tokens)"
            )
    for name, rs in (("wall", wall_ratios), ("CPU", cpu_ratios)):
        med = statistics.median(rs)
        print(
            f"tokens/s ratio enabled/disabled ({name} time): median {med:.4f} "
            f"[{min(rs):.4f}-{max(rs):.4f}] -> overhead {100 * (1 - med):+.2f}% "
            f"({'within' if abs(1 - med) <= 0.02 else 'NOT within'} the 2% goal)"
        )
    best = min(walls[False]) / min(walls[True])
    print(f"tokens/s ratio enabled/disabled, best run of each arm: {best:.4f}")
    print("per-event recording cost (enabled, in-memory, net of an empty loop):")
    cost = per_event_ns()
    for name, ns in cost.items():
        print(f"  {name:28s} {ns / 1000:6.3f} us")
    if log is not None:
        # the recording work one enabled run did, priced at the microbenchmark's costs
        n_steps, n_segs = len(log.steps), len(log.segments)
        n_emit, n_ctr = int(log.emissions.num_tokens.sum()), len(log.counters)
        spent_s = 1e-9 * (
            n_steps * cost["step (empty)"]
            + n_segs * cost["segment enter+exit"]
            + n_emit * cost["emit, per token (32/step)"]
            + n_ctr * cost["counter"]
        )
        print(
            f"accounted: one enabled run = {n_steps} steps, {n_segs} segments, {n_emit} tokens, "
            f"{n_ctr} counter samples -> {1e3 * spent_s:.1f} ms of hooks in "
            f"{min(walls[True]):.2f} s = {100 * spent_s / min(walls[True]):.2f}% of its wall time"
        )


if __name__ == "__main__":
    main()
