"""Runs of any length, reading side: the busy server's runs read back, this tree against the
previous main, in the same run.

    python bench/bench_long_read.py [--baseline /work/base] [--minutes 10 60]

Each length is recorded once (`bench/busy_server.py`: batch 256, ~19 ms steps, on a fake
clock, paced at 200 simulated seconds a wall second) into a temporary folder, then each
command runs in a fresh process (`/usr/bin/time`-style: its peak resident set is its own,
VmHWM) and is timed by the wall clock:

- ``analyze``: this tree reads a run over one slice in slices (`tracekit.analysis.stream`);
  the previous main reads it whole;
- ``trace --around worst --width 1``: this tree reads the window's parts only;
- ``analyze --window``: a 10 s window in the middle of the run;
- ``analyze --by 1m``: the tail over time, a row a simulated minute;
- ``analyze -j 2``: one run's slices in two processes (its index pass stays in one);
- ``whatif``, ``report``, ``export``, ``gaps --format jsonl``, ``check``: the whole run,
  in slices in this tree where it reads them so.

The previous main runs only where its peak memory fits ``--baseline-max-gb`` (default 8;
an hour needed > 13 GB), with that limit set as its address-space limit: beyond it, it is
printed as not run. Printed per command: wall seconds, peak RSS, gaps a second (analyze).
Benchmarks live outside the tests: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RECORD = r"""
import os, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, os.path.join(sys.argv[1], "bench"))
import tracekit
from busy_server import FakeClock, serve
clock = FakeClock()
rec = tracekit.Recorder(sys.argv[3], clock=clock, seconds_per_tick=1e-9, gc=False,
                        handle_signals=False)
with rec:
    serve(rec, clock, minutes=float(sys.argv[2]), speedup=200.0)
"""

RUN = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from tracekit.cli import main
t = time.perf_counter()
try:
    main(sys.argv[2:], standalone_mode=False)
    ok = True
except MemoryError:
    ok = False
wall = time.perf_counter() - t
with open("/proc/self/status") as fh:
    hwm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmHWM"))
print(json.dumps({"wall_s": wall, "rss": hwm, "ok": ok}), file=sys.stderr)
"""


def run_cmd(checkout: str, args: list[str], max_gb: float | None = None) -> dict:
    """One command in a fresh process; its wall time and peak resident set."""

    def limit() -> None:
        if max_gb is not None:
            cap = int(max_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "PYTHONPATH": checkout}
    r = subprocess.run([sys.executable, "-c", RUN, checkout, *args], capture_output=True,
                       text=True, env=env, preexec_fn=limit)  # fmt: skip
    last = [line for line in r.stderr.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not last:
        return {"ok": False, "why": (r.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(last[-1])


def show(name: str, side: str, res: dict, gaps: int | None = None) -> None:
    if not res.get("ok"):
        print(f"  {name:<34} {side:<14} not run: {res.get('why', 'out of memory')}")
        return
    rate = f"  {gaps / res['wall_s'] / 1e6:6.2f} M gaps/s" if gaps else ""
    print(f"  {name:<34} {side:<14} {res['wall_s']:7.1f} s  {res['rss'] / 2**20:7.0f} MB{rate}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=os.environ.get("TRACEKIT_BASE", "/work/base"),
                    help="a checkout of the previous main")  # fmt: skip
    ap.add_argument("--minutes", type=float, nargs="+", default=[10.0, 60.0])
    ap.add_argument("--baseline-max-gb", type=float, default=8.0)
    ap.add_argument("--skip", nargs="*", default=[], metavar="COMMAND",
                    help="of whatif, report, export, gaps, check: not run (gaps of an hour "
                    "takes ~12 minutes)")  # fmt: skip
    a = ap.parse_args()
    for minutes in a.minutes:
        with tempfile.TemporaryDirectory(prefix="tracekit-long-read-") as tmp:
            out = os.path.join(tmp, "run.npz")
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", RECORD, ROOT, str(minutes), out], check=True,
                           env={**os.environ, "PYTHONPATH": ROOT})  # fmt: skip
            size = sum(os.path.getsize(os.path.join(out + ".parts", f))
                       for f in os.listdir(out + ".parts"))  # fmt: skip
            print(f"{minutes:g} simulated minutes: recorded in {time.perf_counter() - t:.0f} s, "
                  f"{size / 1e6:.0f} MB on disk")  # fmt: skip
            jl = os.path.join(tmp, "a.jsonl")
            mine = run_cmd(ROOT, ["analyze", out, "--format", "jsonl", "-o", jl])
            gaps = json.loads(open(jl).read())["gaps"] if mine.get("ok") else None
            show("analyze", "this tree", mine, gaps)
            base = run_cmd(a.baseline, ["analyze", out, "--format", "jsonl", "-o", jl],
                           a.baseline_max_gb)  # fmt: skip
            show("analyze", "previous main", base, gaps)
            two = run_cmd(ROOT, ["analyze", out, "-j", "2", "--format", "jsonl", "-o", jl])
            show("analyze -j 2 (its slices)", "this tree", two, gaps)
            for name, args in (
                ("whatif", ["whatif", out, "-o", os.path.join(tmp, "w.txt")]),
                ("report", ["report", out, "-o", os.path.join(tmp, "r.html")]),
                ("export", ["export", out, "-o", os.path.join(tmp, "dataset")]),
                ("gaps --format jsonl", ["gaps", out, "--format", "jsonl", "-o", jl]),
                ("check", ["check", out]),
            ):
                if args[0] in a.skip:
                    continue
                show(name, "this tree", run_cmd(ROOT, args))
                shutil.rmtree(os.path.join(tmp, "dataset"), ignore_errors=True)
                show(name, "previous main", run_cmd(a.baseline, args, a.baseline_max_gb))
                shutil.rmtree(os.path.join(tmp, "dataset"), ignore_errors=True)
            mid = minutes * 30
            win = ["--window", f"{mid:g}..{mid + 10:g}", "--format", "jsonl", "-o", jl]
            show("analyze --window (10 s)", "this tree", run_cmd(ROOT, ["analyze", out, *win]))
            by = ["analyze", out, "--by", "1m", "--format", "jsonl", "-o", jl]
            show("analyze --by 1m", "this tree", run_cmd(ROOT, by))
            tr = ["trace", out, "--around", "worst", "--width", "1", "-o",
                  os.path.join(tmp, "t.json")]  # fmt: skip
            show("trace --around worst --width 1", "this tree", run_cmd(ROOT, tr))
            show("trace --around worst --width 1", "previous main",
                 run_cmd(a.baseline, tr, a.baseline_max_gb))  # fmt: skip


if __name__ == "__main__":
    main()
