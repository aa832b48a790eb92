"""What does live mode cost? The same engine, seed and workload, recording only vs
recording plus the live sink (`tracekit.live.LiveMetrics`, metrics served over HTTP).

    python bench/bench_live.py [--rung baseline] [--pairs 10] [--requests 32] [--scrape-hz 1]

The demo engine serves one fixed workload to completion (every request arrives at t=0, so
both arms do identical work; token counts are checked equal). Both arms record to a raw
log; the live arm also partitions every gap on its background thread and serves
``/metrics`` (scraped `--scrape-hz` times a second by a client thread in this process).
Runs alternate in ABBA order so drift on a shared machine hits both arms alike. Prints each
pair's tokens/s and the median ratio live/recording-only with its [min-max] spread, in
wall time (what the engine delivers) and in process CPU time (all threads: the live
worker's partitioning is in it). Goal: tokens/s within 1%. Also
printed: the live worker thread's CPU time as a share of the live run's wall time (it holds
the interpreter lock while it partitions, so that is what it can take from the engine).

`--long-run STEPS` instead feeds a live sink a long synthetic run on a fake clock (16
requests decoding 20 ms steps, one step in 7 eager, a new request as each finishes) and
prints the worker's CPU time per 10,000 steps as the run grows, and what it retains: its
per-flush cost must not grow with the run's length.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from urllib.request import urlopen

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_overhead import fixed_workload  # noqa: E402

import tracekit  # noqa: E402
from demo_engine.config import WorkloadConfig, find_rung, rung_config  # noqa: E402
from demo_engine.engine import Engine  # noqa: E402
from demo_engine.tokenizer import train_tokenizer  # noqa: E402


def serve_once(cfg, tokenizer, trace, *, live: bool, tmp: str, scrape_hz: float):
    """(wall s, process CPU s, tokens, the live sink's snapshot or None) of one drained run."""
    rec = tracekit.Recorder(os.path.join(tmp, "bench.npz"), config={"rung": "bench"})
    sink = None
    stop = threading.Event()
    scraper = None
    if live:
        from tracekit.live import LiveMetrics, attach

        sink = LiveMetrics()
        port = sink.serve(0)
        attach(rec, sink)
        if scrape_hz > 0:

            def scrape() -> None:
                while not stop.wait(1.0 / scrape_hz):
                    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                        r.read()

            scraper = threading.Thread(target=scrape, daemon=True)
            scraper.start()
    with rec:
        eng = Engine(cfg, rec, tokenizer)
        try:
            eng.startup()
            t0, c0 = time.perf_counter(), time.process_time()
            stats = eng.serve(trace, 3600.0, is_drain=True)
            wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
        finally:
            eng.close()
    # the stop above waited for the live worker to settle the last gaps (close): that
    # tail is outside the timed region on purpose (the engine had finished)
    stop.set()
    if scraper is not None:
        scraper.join()
    snap = None
    if sink is not None:
        snap = sink.snapshot()
        sink.shutdown()
    return wall_s, cpu_s, stats.num_tokens, snap


def long_run(num_steps: int) -> None:
    """The live worker's CPU per 10,000 steps along one long synthetic run."""
    from tracekit.live import LiveMetrics, attach

    class Clock:
        now = 0

        def __call__(self) -> int:
            return self.now

    clk = Clock()
    rec = tracekit.Recorder(
        None, clock=clk, seconds_per_tick=1e-3, flush_interval_s=1.0, gc=False,
        handle_signals=False,
    )  # fmt: skip
    live = attach(rec, LiveMetrics(hold_s=2.0))
    active = list(range(16))
    left = dict.fromkeys(active, 200)
    nxt = len(active)
    marks = []
    with rec:
        for r in active:
            rec.request(r, max_new_tokens=200, arrival_tick=0)
        for k in range(num_steps):  # 20 ms steps of engine clock
            clk.now = 20 * k
            with rec.step():
                clk.now = 20 * k + 2
                with rec.segment("decode"):
                    clk.now = 20 * k + 12
                rec.emit(active)
                rec.step_info(graph_size=0 if k % 7 == 0 else 16)
            for r in list(active):
                left[r] -= 1
                if left[r] == 0:
                    active.remove(r)
                    rec.request(nxt, max_new_tokens=200, arrival_tick=clk.now)
                    active.append(nxt)
                    left[nxt] = 200
                    nxt += 1
            if k % 10_000 == 0:
                while live.snapshot()["backlog"]:
                    time.sleep(0.01)
                marks.append((k, live.snapshot()["cpu_s"]))
    s = live.snapshot()
    print(f"long run: {num_steps} steps of 20 ms ({num_steps * 0.02:.0f} s of engine clock), "
          f"{s['gaps']} gaps, {nxt} requests")  # fmt: skip
    for (k0, c0), (k1, c1) in zip(marks, marks[1:], strict=False):
        print(f"  steps {k0:7d}-{k1:7d}: worker CPU {c1 - c0:.3f} s "
              f"({100 * (c1 - c0) / ((k1 - k0) * 0.02):.2f}% of their engine clock)")  # fmt: skip
    r = live.retained()
    print(f"  retained at the end: {r['segments']} segments, {r['steps']} steps, "
          f"{r['ttft_rows']} TTFT rows, {r['inflight']} requests in flight; "
          f"late rows {s['late_rows']}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rung", default="baseline")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=10, help="ABBA-ordered pairs")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--scrape-hz", type=float, default=1.0, help="0: no scraper")
    ap.add_argument("--long-run", type=int, default=0, metavar="STEPS",
                    help="instead: the worker's cost along one long synthetic run")  # fmt: skip
    args = ap.parse_args()
    if args.long_run:
        long_run(args.long_run)
        return

    rung = find_rung(args.rung)
    cfg = rung_config(rung)
    tokenizer = train_tokenizer(cfg.vocab_size, WorkloadConfig())
    trace = fixed_workload(args.seed, args.requests, args.max_new_tokens)
    print(
        f"live sink vs recording only: rung {rung!r}, seed {args.seed}, {len(trace)} requests "
        f"at t=0, outputs capped at {args.max_new_tokens}; {args.pairs} pairs, ABBA order; "
        f"scraped at {args.scrape_hz} Hz; {os.cpu_count()} CPUs seen (shared machine: the "
        "spread below is mostly other tenants)"
    )
    wall_r: list[float] = []
    cpu_r: list[float] = []
    live_cpu: list[float] = []  # the live worker thread's CPU time per live run
    live_wall: list[float] = []
    snap = None
    with tempfile.TemporaryDirectory(prefix="tk-bench-live-") as tmp:
        serve_once(cfg, tokenizer, trace[:8], live=True, tmp=tmp, scrape_hz=0)  # warm up
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {
                live: serve_once(
                    cfg, tokenizer, trace, live=live, tmp=tmp, scrape_hz=args.scrape_hz
                )
                for live in order
            }
            (w_off, c_off, n_off, _), (w_on, c_on, n_on, snap) = got[False], got[True]
            if n_off != n_on:
                sys.exit(f"pair {i}: the arms did different work ({n_off} vs {n_on} tokens)")
            live_cpu.append(snap["cpu_s"])
            live_wall.append(w_on)
            wall_r.append(w_off / w_on)  # tokens/s ratio live / recording only
            cpu_r.append(c_off / c_on)
            print(
                f"  pair {i + 1:2d}: recording {n_off / w_off:6.0f} tok/s  live {n_on / w_on:6.0f} "
                f"tok/s  ratio wall {w_off / w_on:.4f}  cpu {c_off / c_on:.4f}  ({n_on} tokens)"
            )
    for name, rs in (("wall", wall_r), ("CPU", cpu_r)):
        med = statistics.median(rs)
        if max(rs) - min(rs) > 0.02:
            verdict = "the spread is wider than the 1% goal: this run cannot tell"
        else:
            verdict = "within the 1% goal" if 1 - med <= 0.01 else "NOT within the 1% goal"
        print(
            f"tokens/s ratio live/recording-only ({name} time): median {med:.4f} "
            f"[{min(rs):.4f}-{max(rs):.4f}] -> overhead {100 * (1 - med):+.2f}% ({verdict})"
        )
    # The worker holds the interpreter lock while it partitions, so its CPU time is what
    # it can take from the engine thread: a bound on the live sink's cost that other
    # tenants of the machine disturb far less than wall time.
    share = [c / w for c, w in zip(live_cpu, live_wall, strict=True)]
    print(
        f"live worker CPU / live run wall time: median {100 * statistics.median(share):.2f}% "
        f"[{100 * min(share):.2f}-{100 * max(share):.2f}%] over {len(share)} runs"
    )
    if snap is not None:
        print(
            f"last live run: {snap['gaps']} gaps settled, late rows {snap['late_rows']}, "
            f"errors {snap['errors']}, backlog at the end {snap['backlog']}"
        )


if __name__ == "__main__":
    main()
