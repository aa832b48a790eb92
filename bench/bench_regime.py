"""The demo ladder's regime on a slowed engine and on a contended machine.

The story the ladder tells needs a regime: a KV pool under pressure (preemptions) and
batches above the largest captured size (eager steps) at baseline, so that preemption and
prefill own the baseline tail and the admission watermark has something to cut. Arrivals
are paced in engine steps, which should make that regime independent of the machine's
speed. This script checks it under three conditions, each running `baseline` and
`+admit watermark` for every seed (short runs, fresh interpreters):

    plain        the machine as it is
    slow x4      every model call stretched 4x (`--compute-slowdown 4`: a slower machine)
    contended    the same runs while busy processes (one per core) compete for the CPUs

and prints, per condition, the checks with their figures:

- every baseline run has preemptions > 0 and eager steps > 0;
- the baseline tail share of preempt + prefill is >= FLOOR in every run. FLOOR = 0.5:
  "preemption and prefill own the baseline tail" means they hold the majority of tail
  time, more than every other cause (gc, tok, graph, forward, residual) together;
- the watermark's median p99.9 across seeds is >= 3x lower than the baseline's.

The contended condition also runs every seed and rung a second time, under the same busy
processes, with the recorder on wall time (`--timer wall`), and reports (never as a check)
what the CPU clock leaves out there: each run's wall p50 against its CPU-clock p50, the
baseline tail share of preempt + prefill and of forward + residual (where the OS's time
slices to other processes land on wall time), and the watermark's p99.9 cut on wall time.

Exit code 1 if a check fails. Milliseconds are never compared across conditions (a busy
machine is slower); only within a condition, baseline against watermark.

    python bench/bench_regime.py [--seeds 1,2] [--steps 600] [--out /tmp/regime]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FLOOR = 0.5  # baseline tail share of preempt + prefill (see the module docstring)
MIN_P999_RATIO = 3.0  # baseline median p99.9 / watermark median p99.9
RUNGS = ("baseline", "+admit watermark")
CONDITIONS = ("plain", "slow x4", "contended")

_BUSY = "import time\nt = time.time() + {s}\nwhile time.time() < t:\n    pass\n"


def run(rung: str, seed: int, steps: int, out: str, slowdown: float, timer: str = "cpu") -> str:
    cmd = [sys.executable, "-m", "demo_engine.cli", "run", "--rung", rung, "--seed", str(seed)]
    cmd += ["--steps", str(steps), "--compute-slowdown", str(slowdown), "--out", out, "--quiet"]
    cmd += ["--timer", timer]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{rung} s{seed} failed:\n{proc.stderr[-2000:]}")
    print("   ", proc.stdout.strip().replace("\n", "\n    "), flush=True)
    return proc.stdout.split(":")[0]


def condition(name: str, seeds: list[int], steps: int, out: str, timer: str = "cpu") -> dict:
    import numpy as np

    import tracekit
    from tracekit.analysis.figures import analyze

    busy: list[subprocess.Popen] = []
    if name == "contended":  # one busy process per core, for longer than the runs take
        busy = [
            subprocess.Popen([sys.executable, "-c", _BUSY.format(s=3600)])
            for _ in range(os.cpu_count() or 1)
        ]
    slowdown = 4.0 if name == "slow x4" else 1.0
    t0 = time.monotonic()
    wall_runs: dict[str, list] = {}
    try:
        runs = {
            r: [analyze(tracekit.load(run(r, s, steps, out, slowdown, timer))) for s in seeds]
            for r in RUNGS
        }
        if busy and timer == "cpu":  # the same runs, the same busy processes, on wall time
            print("    (the same runs with --timer wall)", flush=True)
            wall_runs = {
                r: [
                    analyze(tracekit.load(run(r, s, steps, out + "-wall", slowdown, "wall")))
                    for s in seeds
                ]
                for r in RUNGS
            }
    finally:
        for p in busy:
            p.kill()
            p.wait()
    base, wm = runs["baseline"], runs["+admit watermark"]
    share = [a.tail_share.get("preempt", 0.0) + a.tail_share.get("prefill", 0.0) for a in base]
    p999_base = float(np.median([a.itl_p999 for a in base]))
    p999_wm = float(np.median([a.itl_p999 for a in wm]))
    ratio = p999_base / p999_wm if p999_wm > 0 else float("inf")
    checks = {
        "baseline preemptions > 0 in every run": (
            all(a.preemptions > 0 for a in base),
            [a.preemptions for a in base],
        ),
        "baseline eager steps > 0 in every run": (
            all(a.eager_steps > 0 for a in base),
            [a.eager_steps for a in base],
        ),
        f"baseline tail share preempt+prefill >= {FLOOR:.0%}": (
            min(share) >= FLOOR,
            [round(x, 3) for x in share],
        ),
        f"watermark median p99.9 >= {MIN_P999_RATIO:g}x lower": (
            ratio >= MIN_P999_RATIO,
            f"{p999_base:.0f} -> {p999_wm:.0f} ms ({ratio:.1f}x)",
        ),
    }
    return {
        "condition": name,
        "wall_s": round(time.monotonic() - t0, 1),
        "load_avg_1min": os.getloadavg()[0],
        "checks": {k: {"ok": ok, "figures": fig} for k, (ok, fig) in checks.items()},
        "reported": _wall_figures(runs, wall_runs) if wall_runs else _os_figures(runs),
    }


def _os_figures(runs: dict[str, list]) -> dict[str, object]:
    """With the recorder on wall time: how much of each run the OS took (figures)."""

    def shares(label: str) -> list[float]:
        return [round(a.tail_share.get(label, 0.0), 3) for r in RUNGS for a in runs[r]]

    return {
        "baseline tail share os_runqueue (baseline seeds, then watermark seeds)": shares(
            "os_runqueue"
        ),
        "tail share os_blocked": shares("os_blocked"),
    }


def _wall_figures(cpu: dict[str, list], wall: dict[str, list]) -> dict[str, object]:
    """What the wall clock shows of the same contended runs (figures, not checks)."""
    import numpy as np

    def shares(runs: list, *labels: str) -> list[float]:
        return [round(sum(a.tail_share.get(lb, 0.0) for lb in labels), 3) for a in runs]

    base, wm = wall["baseline"], wall["+admit watermark"]
    p999_base = float(np.median([a.itl_p999 for a in base]))
    p999_wm = float(np.median([a.itl_p999 for a in wm]))
    ratio = p999_base / p999_wm if p999_wm > 0 else float("inf")
    p50_ratio = [
        round(w.itl_p50 / c.itl_p50, 2)
        for r in RUNGS
        for w, c in zip(wall[r], cpu[r], strict=True)
        if c.itl_p50 > 0
    ]
    return {
        "wall p50 / cpu p50, every run (baseline seeds, then watermark seeds)": p50_ratio,
        "wall: baseline tail share preempt+prefill": shares(base, "preempt", "prefill"),
        "wall: baseline tail share forward+residual": shares(base, "forward", "residual"),
        "cpu:  baseline tail share forward+residual": shares(
            cpu["baseline"], "forward", "residual"
        ),
        "wall: median p99.9 baseline -> watermark": (
            f"{p999_base:.0f} -> {p999_wm:.0f} ms ({ratio:.1f}x)"
        ),
        "wall: watermark p99.9 per run": [round(a.itl_p999, 1) for a in wm],
        "wall: watermark tail share forward+residual": shares(wm, "forward", "residual"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--out", default=None, help="keep the logs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--timer",
        choices=("cpu", "wall"),
        default="cpu",
        help="the checked runs' clock (wall: contention is os_runqueue in the partition)",
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.conditions.split(","):
            out = os.path.join(args.out or tmp, name.replace(" ", "-"))
            print(f"[{name}] {len(seeds)} seeds x {RUNGS}, {args.steps} steps", flush=True)
            res = condition(name, seeds, args.steps, out, args.timer)
            results.append(res)
            for k, c in res["checks"].items():
                ok &= c["ok"]
                print(f"  {'ok  ' if c['ok'] else 'FAIL'} {k}: {c['figures']}", flush=True)
            for k, fig in res["reported"].items():  # reported, never a check
                print(f"  info {k}: {fig}", flush=True)
            print(f"  ({res['wall_s']} s, load average {res['load_avg_1min']:.1f})", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
