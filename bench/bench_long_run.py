"""Runs of any length, capture side: an hour of a busy server through the public Recorder,
this tree against the previous main, in the same run.

    python bench/bench_long_run.py [--baseline /work/base] [--minutes 10 60] [--rounds 5]

The server is `bench/busy_server.py` (batch 256, ~19 ms steps, chunked prefill, Poisson
arrivals, an eviction now and then) on a fake clock, deterministically, paced at
`--speedup` simulated seconds per wall second (default 200: an hour in 18 s; unpaced, an
engine simulated far faster than the writer encodes would keep rows in flight that no
real server has). Each (checkout, length) records in a fresh process, so its peak memory
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

With ``--server``: a server's run instead (`vllm serve` as recorded, docs/adapters.md): an
engine core and an API server (`busy_server.serve(..., frontend=)`, a chunk row per
emitted token there, as many rows as the core), recorded to one directory per length;
then, each in a fresh process, the peak resident set (``/usr/bin/time -f %M``) and wall
seconds of ``tracekit merge DIR -o RUN.npz`` (the whole merge, up to ``--whole-max``
minutes), ``tracekit merge DIR -o RUN.npz --parts`` (chunk by chunk) and ``tracekit
analyze DIR`` (a long server run: merged to a temporary folder, read in slices).

    python bench/bench_long_run.py --server [--minutes 10 60] [--whole-max 10]

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
counts = serve(rec, clock, minutes, on_minute=lambda m: rss.append(status("VmRSS:")),
               speedup=float(sys.argv[5]) if sys.argv[5] != "none" else None)
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


SERVER_CHILD = r"""
import json, os, sys
root, minutes, out_dir, speedup = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, root)
sys.path.insert(0, os.path.join(root, "bench"))
import tracekit
from busy_server import FakeClock, serve

def ident(role, pid):
    return {"process": {"role": role, "pid": pid, "host": "h", "name": role, "boot_id": "b",
                        "clock": "clock_gettime(CLOCK_MONOTONIC)"}}

clock = FakeClock()
recs = [tracekit.Recorder(os.path.join(out_dir, f"{role}-{pid}.npz"), clock=clock,
                          seconds_per_tick=1e-9, gc=False, handle_signals=False,
                          config=ident(role, pid))
        for role, pid in (("engine_core", 1), ("api_server", 2))]
for r in recs:
    r.start()
counts = serve(recs[0], clock, minutes, frontend=recs[1],
               speedup=None if speedup == "none" else float(speedup))
for r in recs[::-1]:
    r.stop()
print(json.dumps(counts))
"""


def record_server(minutes: float, speedup: float | None, out_dir: str) -> dict:
    """A server's run of `minutes` (engine core and API server) recorded into `out_dir`."""
    r = subprocess.run(
        [sys.executable, "-c", SERVER_CHILD, ROOT, str(minutes), out_dir,
         "none" if speedup is None else str(speedup)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"the server recording failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def peak_rss(args: list[str]) -> tuple[float, float]:
    """(peak resident set MB, wall seconds) of `tracekit ARGS` in a fresh process."""
    r = subprocess.run(
        ["/usr/bin/time", "-f", "%M %e", sys.executable, "-m", "tracekit", *args],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
    )  # fmt: skip
    if r.returncode != 0:
        raise SystemExit(f"tracekit {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    kb, secs = r.stderr.strip().splitlines()[-1].split()
    return int(kb) / 1024, float(secs)


def server_main(minutes: list[float], whole_max: float, speedup: float | None) -> None:
    print(f"this tree: {ROOT}\n")
    print(f"{'minutes':>7} {'tokens':>11} {'command':<30} {'peak RSS MB':>11} {'wall s':>8}")
    for m in minutes:
        with tempfile.TemporaryDirectory(prefix="tracekit-server-bench-") as d:
            run = os.path.join(d, "serve")
            os.mkdir(run)
            counts = record_server(m, speedup, run)
            core = os.path.join(run, "engine_core-1.npz.parts", "index")
            with open(core) as fh:
                sizes = [int(line.split()[4]) for line in fh]
            print(f"{m:7.0f} {counts['tokens']:11,d} (engine core: {len(sizes)} parts, the "
                  f"largest {max(sizes):,d} emissions)")  # fmt: skip
            cmds = [
                ("merge -o RUN.npz --parts", ["merge", run, "-o", f"{d}/p.npz", "--parts"]),
                ("analyze DIR", ["analyze", run, "--format", "jsonl", "-o", f"{d}/a.jsonl"]),
            ]
            if m <= whole_max:
                cmds.insert(0, ("merge -o RUN.npz (whole)", ["merge", run, "-o", f"{d}/w.npz"]))
            for name, args in cmds:
                mb, secs = peak_rss(args)
                print(f"{m:7.0f} {counts['tokens']:11,d} {name:<30} {mb:11.0f} {secs:8.1f}",
                      flush=True)  # fmt: skip


def record_in_child(checkout: str, minutes: float, speedup: float | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="tracekit-long-") as d:
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                checkout,
                str(minutes),
                d,
                ROOT,
                "none" if speedup is None else str(speedup),
            ],
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
    ap.add_argument(
        "--speedup",
        type=float,
        default=200.0,
        help="simulated seconds per wall second at most (default 200: an hour in "
        "18 s; a real server gives the writer a second per second of rows)",
    )
    ap.add_argument(
        "--server",
        action="store_true",
        help="a server's run (engine core and API server): merge and analyze",
    )
    ap.add_argument(
        "--whole-max",
        type=float,
        default=10.0,
        help="--server: the longest run merged whole too (minutes; default 10)",
    )
    args = ap.parse_args()
    if args.server:  # two recorders share the writer's time: paced slower by default
        speedup = args.speedup if args.speedup != 200.0 else 50.0
        return server_main(args.minutes, args.whole_max, speedup)
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
            r = record_in_child(checkout, m, args.speedup)
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
