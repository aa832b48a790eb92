"""Runs of any length, capture side: an hour of a busy server through the public Recorder,
this tree against the previous main, in the same run.

    python bench/bench_long_run.py [--baseline /work/base] [--minutes 10 60] [--rounds 5]

The server is `bench/busy_server.py` (batch 256, ~19 ms steps, chunked prefill, Poisson
arrivals, an eviction now and then) on a fake clock: an hour in about a minute of CPU,
deterministically. Each (checkout, length) records in a fresh process, so its peak memory
is its own. Printed per length, for each side:

- ``stop``: wall seconds `Recorder.stop()` takes (the last flush, closing the sinks; the
  previous main merged every part into one `.npz` there);
- ``rss rec``: the recording process's largest resident set sampled at each simulated
  minute while it records, and ``rss peak``: its high-water mark over the whole run, stop
  included (VmHWM);
- ``B/token``: bytes on disk (every file of the run) per emitted token.

Then the recording cost per engine step at batch 512 (10 segments, one `emit_handles` of
the batch, an in-memory recorder): thread CPU time, interleaved rounds of both checkouts
in one process (`bench/base_main.py`), median [min-max] and the ratio.

Benchmarks live outside the tests: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import json, os, sys, time
checkout, minutes, out_dir = sys.argv[1], float(sys.argv[2]), sys.argv[3]
sys.path.insert(0, checkout)
sys.path.insert(0, os.path.join(checkout, "bench"))
sys.path.insert(0, os.path.join(sys.argv[4], "bench"))
import tracekit
from busy_server import FakeClock, serve
assert os.path.realpath(tracekit.__file__).startswith(os.path.realpath(checkout)), tracekit.__file__

def status(key):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0

rss = []
clock = FakeClock()
out = os.path.join(out_dir, "run.npz")
rec = tracekit.Recorder(out, clock=clock, seconds_per_tick=1e-9, gc=False, handle_signals=False)
rec.start()
t = time.perf_counter()
counts = serve(rec, clock, minutes, on_minute=lambda m: rss.append(status("VmRSS:")))
t_record = time.perf_counter() - t
t = time.perf_counter()
rec.stop()
t_stop = time.perf_counter() - t
size = 0
for base, _, files in os.walk(out_dir):
    size += sum(os.path.getsize(os.path.join(base, f)) for f in files)
print(json.dumps({"stop_s": t_stop, "record_s": t_record, "rss_rec": max(rss or [0]),
                  "rss_peak": status("VmHWM:"), "bytes": size, **counts}))
"""


def record_in_child(checkout: str, minutes: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="tracekit-long-") as d:
        r = subprocess.run(
            [sys.executable, "-c", CHILD, checkout, str(minutes), d, ROOT],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": ""},
        )
        if r.returncode != 0:
            raise SystemExit(f"{checkout}: the recording failed:\n{r.stderr[-3000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])


def per_step_rounds(baseline: str, rounds: int) -> tuple[list[float], list[float]]:
    sys.path.insert(0, HERE)
    from base_main import BaseMain
    from bench_house import record_steps

    from tracekit.capture.recorder import Recorder

    base = BaseMain(baseline, modules=("tracekit.capture.recorder",))
    theirs = base.mods["tracekit.capture.recorder"].Recorder
    a: list[float] = []
    b: list[float] = []
    for i in range(rounds):  # ABBA: neither side always goes first
        pair = [
            lambda: a.append(record_steps(Recorder, 512, 2000)),
            lambda: b.append(base.call(record_steps, theirs, 512, 2000)),
        ]
        for f in pair if i % 2 == 0 else pair[::-1]:
            f()
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--baseline",
        default=os.environ.get("TRACEKIT_BASE", "/work/base"),
        help="a checkout of the previous main (default $TRACEKIT_BASE or /work/base)",
    )
    ap.add_argument(
        "--minutes",
        type=float,
        nargs="+",
        default=[10.0, 60.0],
        help="simulated lengths to record (default: 10 and 60)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the per-step timing")
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(args.baseline, "tracekit")):
        raise SystemExit(f"{args.baseline}: no tracekit checkout there (--baseline)")
    print(f"this tree: {ROOT}\nbaseline:  {args.baseline}\n")
    print(
        f"{'minutes':>7} {'side':<9} {'tokens':>11} {'record s':>9} {'stop s':>8} "
        f"{'rss rec MB':>10} {'rss peak MB':>11} {'B/token':>8}"
    )
    for m in args.minutes:
        for side, checkout in (("this", ROOT), ("baseline", args.baseline)):
            t = time.perf_counter()
            r = record_in_child(checkout, m)
            print(f"{m:7.0f} {side:<9} {r['tokens']:11,d} {r['record_s']:9.1f} "
                  f"{r['stop_s']:8.3f} {r['rss_rec'] / 1e6:10.0f} {r['rss_peak'] / 1e6:11.0f} "
                  f"{r['bytes'] / r['tokens']:8.2f}   ({time.perf_counter() - t:.0f} s)",
                  flush=True)  # fmt: skip
    a, b = per_step_rounds(args.baseline, args.rounds)
    ma, mb = statistics.median(a), statistics.median(b)
    print(
        f"\nrecording CPU per step, batch 512, 10 segments + emit_handles ({args.rounds} rounds):"
        f"\n  this {ma * 1e6:.1f} us [{min(a) * 1e6:.1f}-{max(a) * 1e6:.1f}]  baseline "
        f"{mb * 1e6:.1f} us [{min(b) * 1e6:.1f}-{max(b) * 1e6:.1f}]  ratio {ma / mb:.2f}"
    )


if __name__ == "__main__":
    main()
