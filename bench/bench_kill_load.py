"""How much does a `kill -9` lose on a machine busy with CPU and disk work?

    python bench/bench_kill_load.py [--kills 8] [--interval-s 0.5] [--root ../other-checkout]

An engine process records to ``OUT.npz`` on the wall clock (steps of about 1 ms: 64
emissions and a millisecond of GIL-free work, a forward pass) with `--interval-s`, while
the bench keeps the machine busy: one process spinning per core, and one writing 16 MiB to
a file in the same folder and fsyncing it, in a loop (`--no-load`: neither). After a
random 3-5 s the engine is killed with SIGKILL; its parts are read back and compared with
what it had recorded (the engine writes its last step's end tick to a shared page after
each step). Per kill:

- lost: the recording time whose rows are not on disk (the last recorded step's end minus
  the last step on disk's end), in flush intervals;
- spacing: the widest distance between two consecutive parts' flush ticks, in intervals
  (a flush cut later than one interval after the previous one; from the first part on:
  the engine's start-up under load is not the recorder's);

printed as median [min-max] over the kills. `--slow-fsync-ms N`: every fsync of the engine
process after its start takes N ms longer (this machine's disk syncs in tens of ms even
under the load above; a loaded disk elsewhere took hundreds). `--root` runs the engine on
another checkout's `tracekit` (a folder holding `tracekit/`), to compare two versions.
Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENGINE = r"""
import mmap, os, struct, sys, time
import tracekit
out, prog, interval_s, slow_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
mm = mmap.mmap(os.open(prog, os.O_RDWR), 16)
rec = tracekit.Recorder(out, flush_interval_s=interval_s, gc=False, clock=time.monotonic_ns)
rec.start()
if slow_s:  # a slower disk than this one: every fsync from now on takes slow_s longer
    real_fsync = os.fsync
    os.fsync = lambda fd: (time.sleep(slow_s), real_fsync(fd))[1]
ids = [f"r{i}" for i in range(64)]
handles = [rec.request(r) for r in ids]
print("started", flush=True)
k = 0
while True:
    with rec.step():
        with rec.segment("decode"):
            time.sleep(0.001)  # a forward pass: the GIL is free
        rec.emit_handles(handles)
    k += 1
    mm[:16] = struct.pack("qq", k, time.monotonic_ns())  # steps recorded, last one's end
"""

SPIN = "while True: pass"

IO = r"""
import os, sys
path, block = sys.argv[1], os.urandom(1 << 20)
while True:
    with open(path, "wb") as fh:
        for _ in range(16):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
"""


def start_load(folder: str) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(os.cpu_count() or 1)]
    procs.append(subprocess.Popen([sys.executable, "-c", IO, os.path.join(folder, "io-load")]))
    return procs


def one_kill(
    root: str, folder: str, interval_s: float, slow_s: float, rng: random.Random
) -> tuple[float, float]:
    """(rows lost, widest part spacing), both in flush intervals."""
    out, prog = os.path.join(folder, "run.npz"), os.path.join(folder, "progress")
    with open(prog, "wb") as fh:
        fh.write(bytes(16))
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, out, prog, str(interval_s), str(slow_s)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=folder,  # `python -c` puts its folder ahead of PYTHONPATH: not this checkout
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "started\n"
        time.sleep(rng.uniform(3.0, 5.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    with open(prog, "rb") as fh:
        _, t_recorded = struct.unpack("qq", fh.read(16))
    parts = out + ".parts"
    flush_ticks, t_on_disk = [], None
    for name in sorted(n for n in os.listdir(parts) if n.startswith("part-")):
        with np.load(os.path.join(parts, name)) as z:
            flush_ticks.append(int(z["flush_tick"]))
            steps = z["steps"].reshape(-1, 7)
            if len(steps):
                t_on_disk = int(steps[-1, 1])
    with open(os.path.join(parts, "meta.json"), "rb") as fh:
        t0 = int(__import__("json").loads(fh.read())["t0_tick"])
    start = t0 if t_on_disk is None else t_on_disk
    interval_ns = interval_s * 1e9
    spacing = np.diff(flush_ticks).max(initial=0) / interval_ns  # after the first part
    shutil.rmtree(parts)
    return (t_recorded - start) / interval_ns, spacing


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument("--root", default=REPO, help="the checkout whose tracekit the engine runs")
    ap.add_argument("--no-load", action="store_true")
    ap.add_argument("--slow-fsync-ms", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    folder = tempfile.mkdtemp(prefix="bench-kill-", dir=os.environ.get("BENCH_TMP"))
    load = [] if args.no_load else start_load(folder)
    lost, spacing = [], []
    try:
        for i in range(args.kills):
            a, b = one_kill(
                os.path.abspath(args.root), folder, args.interval_s, args.slow_fsync_ms / 1e3, rng
            )
            lost.append(a)
            spacing.append(b)
            print(f"kill {i + 1}: lost {a:.2f} intervals, widest part spacing {b:.2f}", flush=True)
    finally:
        for p in load:
            p.kill()
            p.wait()
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"{args.root} ({'no load' if args.no_load else 'CPU + fsync load'}), "
        f"interval {args.interval_s} s, fsync +{args.slow_fsync_ms:g} ms, {args.kills} kills, "
        f"load avg {os.getloadavg()[0]:.1f}"
    )
    print(f"  rows lost, in intervals:        {summary(lost)}")
    print(f"  widest part spacing, intervals: {summary(spacing)}")


if __name__ == "__main__":
    main()
