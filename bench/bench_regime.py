"""The demo ladder's regime, checked over every rung and seed, plainly and on a busy machine.

The ladder's story (reports/demo-engine-ladder.md) is the reference post's main regime:
arrivals below the engine's capacity on average, bursts that fill the KV pool for a while
(transient overload), the queue draining between them. Arrivals are paced in engine
steps, so the schedule, and so the regime, should not depend on the machine's speed or
load. The demo records wall time (`--timer wall`, its default): on a busy machine the time
the OS took from the engine's loop thread is `os_runqueue` (waiting for a CPU) or
`os_blocked` (off the CPU: here mostly the loop waiting for its off-loop tokenizer process,
which shares the busy cores), and that pile is the machine's, not the regime's. So the
checks are taken on the *engine's time* (`engine_view`): each gap and TTFT less what the
OS took from the engine's threads in it (its `os_runqueue` and `os_blocked` parts, and the
OS's share of the time it was evicted or held, which the partitions leave to `preempt` and
the wait reasons: the time the CPU clock would not have counted), shares over the engine's
causes, primary causes among them (the verdict too). The OS pile is printed beside them
(`info` lines), never hidden: the wall-time figures are in the logs, and `tracekit
analyze` shows them. (`--timer cpu` runs, which record no OS evidence, are checked on
their own times.) This script runs the whole ladder (every rung x every seed, fresh
interpreters) under each condition:

    plain        the machine as it is
    contended    the same runs while two busy processes compete for the CPUs
    slow x4      (on request) every model call stretched 4x (`--compute-slowdown 4`)

and prints, per condition, the checks with their figures:

- every run: >= 90% of the requests that arrived finished within the run;
- every baseline run: TTFT p50 < 1 s, preemptions > 0, graph < 5% of all gap time;
- baseline: the median (across seeds) forward share of a clean gap >= 90%;
- the watermark raises TTFT p50 against the rung before it in every seed (its cost: the
  waiting moves from the middle of answers to before they start), and cuts median p99.9
  >= 5x against baseline;
- from `+compact history` on, GC's tail share is 0 in every run;
- each rung after baseline lowers median p99.9 against the rung before it, or the
  verdict (`tracekit.verdict`) names the cause that holds the tail and hides it.

Exit code 1 if a check fails. Milliseconds are never compared across conditions (a busy
machine is slower); only within a condition. `--jobs 2` runs two runs at a time (each in
its own process); the default is one. `--timer cpu` runs the demo on its CPU clock.

    python bench/bench_regime.py [--seeds 1,2,3] [--steps 700] [--out /tmp/regime]
    python bench/bench_regime.py --recheck /tmp/regime    # the checks again on kept logs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from demo_engine.config import RUNG_NAMES  # noqa: E402

MIN_FINISHED = 0.90  # share of arrivals that finish within the run
MAX_BASE_TTFT_P50_MS = 1000.0
MAX_BASE_GRAPH_SHARE = 0.05  # of all gap time
MIN_BASE_FWD_CLEAN = 0.90  # median forward share of a clean gap
MIN_P999_RATIO = 5.0  # baseline median p99.9 / watermark median p99.9
CONDITIONS = ("plain", "contended", "slow x4")
NUM_BUSY = 2
RUNS_FILE = "runs.json"  # each run's summary, beside its logs (for --recheck)

_BUSY = "import time\nt = time.time() + {s}\nwhile time.time() < t:\n    pass\n"
_SUMMARY = re.compile(r"(\d+) arrived, (\d+) finished")


#: Runs a command and prints, last on stderr, the CPU seconds it and its children used.
_CPU_WRAP = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[1:])\n"
    "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
    "print(f'cpu_s {u.ru_utime + u.ru_stime:.3f}', file=sys.stderr)\n"
    "sys.exit(r.returncode)\n"
)


def run(rung: str, seed: int, steps: int, out: str, slowdown: float, timer: str) -> dict:
    """One run in a fresh interpreter: its log path, arrivals, finished requests, and the
    CPU seconds the run used (its tokenizer worker included)."""
    cmd = [sys.executable, "-m", "demo_engine.cli", "run", "--rung", rung, "--seed", str(seed)]
    cmd += ["--steps", str(steps), "--compute-slowdown", str(slowdown), "--out", out, "--quiet"]
    cmd += ["--timer", timer]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _CPU_WRAP, *cmd], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{rung} s{seed} failed:\n{proc.stderr[-2000:]}")
    print("   ", proc.stdout.strip().replace("\n", "\n    "), flush=True)
    m = _SUMMARY.search(proc.stdout)
    cpu = re.search(r"cpu_s ([0-9.]+)", proc.stderr)
    if m is None or cpu is None:
        raise SystemExit(f"{rung} s{seed}: no 'arrived, finished' in its summary line")
    return {
        "path": proc.stdout.split(":")[0],
        "arrived": int(m.group(1)),
        "finished": int(m.group(2)),
        "cpu_s": float(cpu.group(1)),
    }


def os_taken_ms(log, t_a, t_b):
    """Per window [t_a, t_b] (engine seconds): the ms the OS took from the engine's threads
    in it, at every instant whoever owns it (the partition's OS shares integrated over
    the window: `tracekit.attribution.timeline.os_shares`)."""
    import numpy as np

    from tracekit.attribution.timeline import PreparedRun

    prep = PreparedRun(log)
    tl = prep.timeline()
    run, blk = prep.os_shares(tl)
    w = run + blk

    def at(t):
        k = np.searchsorted(tl.bounds, t, side="right")
        return tl.weighted("os_taken", w, t, k)

    h0, l0 = at(np.asarray(t_a, dtype=np.float64))
    h1, l1 = at(np.asarray(t_b, dtype=np.float64))
    return ((h1 - h0) + (l1 - l0)) * 1e3


def engine_view(log):
    """(the run's analysis on the engine's time, the OS pile). The engine's time of a gap
    or a TTFT is its wall time less what the OS took from the engine's threads in it, at
    every instant (`os_taken_ms`: the time the CPU clock would not have counted): its
    `os_runqueue` and `os_blocked` parts, and the OS's share of its evicted time, taken
    from `preempt` (the partition leaves evicted time whole to `preempt`). The OS columns
    are dropped and primary causes taken again among the engine's causes
    (`tracekit.attribution.itl.primary_of`, the partition's rule). TTFT percentiles are of
    each request's engine time (its queue time included). The pile: each OS label's share
    of the run's wall gap time and of its wall tail (gaps at or above the wall p99). A log
    without OS evidence is analysed as it is."""
    from dataclasses import replace

    import numpy as np

    from tracekit.analysis.figures import analyze
    from tracekit.attribution import itl, ttft
    from tracekit.attribution.timeline import PreparedRun
    from tracekit.labels import OS_LABELS

    prep = PreparedRun(log)
    p = itl.partition(log, run=prep)
    tp = ttft.ttft_partition(log, run=prep)
    os_cols = [j for j, lb in enumerate(p.labels) if lb in OS_LABELS]
    if not os_cols:
        return analyze(log, p, tp), {}
    tail = p.gap_ms >= np.percentile(p.gap_ms, 99) if len(p) else np.zeros(0, bool)
    total, tail_total = max(p.gap_ms.sum(), 1e-12), max(p.gap_ms[tail].sum(), 1e-12)
    pile = {
        lb: (float(p.parts_ms[:, j].sum() / total), float(p.parts_ms[tail, j].sum() / tail_total))
        for j, lb in enumerate(p.labels)
        if lb in OS_LABELS
    }
    keep = [j for j in range(len(p.labels)) if j not in os_cols]
    labels = tuple(p.labels[j] for j in keep)
    taken = os_taken_ms(log, p.t0_s, p.t1_s)
    parts = p.parts_ms[:, keep].copy()
    # the OS's share of evicted time (the demo has no device windows: no other time
    # the partition leaves without OS shares)
    evicted_taken = np.maximum(taken - p.parts_ms[:, os_cols].sum(axis=1), 0.0)
    pre = labels.index("preempt")
    assert (evicted_taken <= parts[:, pre] + 1e-6).all(), "OS time outside live and evicted time"
    parts[:, pre] -= np.minimum(evicted_taken, parts[:, pre])
    gap = parts.sum(axis=1)
    primary, causes = itl.primary_of(parts, gap, labels)
    pe = replace(p, labels=labels, parts_ms=parts, context_ms=p.context_ms[:, keep],
                 gap_ms=gap, primary=primary, causes=causes)  # fmt: skip
    # TTFT: only its percentiles enter the checks: each request's engine time
    t_ms = tp.ttft_ms - os_taken_ms(log, tp.arrival_s, tp.first_token_s)
    a = analyze(log, pe, tp)
    pct = {k: float(np.percentile(t_ms, q)) if len(t_ms) else float("nan")
           for k, q in (("ttft_p50", 50), ("ttft_p99", 99))}  # fmt: skip
    return replace(a, **pct), pile


def condition(
    name: str, seeds: list[int], steps: int, out: str, jobs: int, timer: str, recheck: bool
) -> dict:
    import numpy as np

    import tracekit

    busy: list[subprocess.Popen] = []
    if name == "contended" and not recheck:  # busy processes, longer than the runs take
        busy = [
            subprocess.Popen([sys.executable, "-c", _BUSY.format(s=3600)]) for _ in range(NUM_BUSY)
        ]
    slowdown = 4.0 if name == "slow x4" else 1.0
    t0 = time.monotonic()
    todo = [(r, s) for s in seeds for r in RUNG_NAMES]
    if recheck:  # the kept logs of an earlier run of this script
        done = [_kept(out, r, s) for r, s in todo]
    else:
        try:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                done = list(
                    pool.map(lambda rs: run(rs[0], rs[1], steps, out, slowdown, timer), todo)
                )
        finally:
            for p in busy:
                p.kill()
                p.wait()
        with open(os.path.join(out, RUNS_FILE), "w") as fh:
            json.dump([{"rung": r, "seed": s, **d} for (r, s), d in zip(todo, done, strict=True)],
                      fh)  # fmt: skip
    runs: dict[str, list] = {r: [] for r in RUNG_NAMES}
    piles: dict[str, list] = {r: [] for r in RUNG_NAMES}
    finished: dict[tuple[str, int], float] = {}
    for (rung, seed), d in zip(todo, done, strict=True):
        a, pile = engine_view(tracekit.load(d["path"]))
        runs[rung].append(a)
        piles[rung].append(pile)
        finished[(rung, seed)] = d["finished"] / d["arrived"] if d["arrived"] else 0.0
    cpu = [d["cpu_s"] for (_, seed), d in zip(todo, done, strict=True) if seed in seeds[:2]]
    reported: dict[str, object] = {}
    if cpu and all(c is not None for c in cpu):
        # what the README's first command (seeds 1,2: two seeds x every rung) costs in CPU
        # time: about its wall time on two idle cores, where it runs one run at a time
        reported[f"CPU s of the runs of the first two seeds ({len(cpu)} runs)"] = round(sum(cpu), 1)
    for lb in ("os_runqueue", "os_blocked"):
        if any(lb in pl for r in RUNG_NAMES for pl in piles[r]):
            reported[f"{lb} share of wall gap time, all / tail, median per rung"] = ", ".join(
                f"{r} {np.median([pl.get(lb, (0, 0))[0] for pl in piles[r]]):.1%}"
                f" / {np.median([pl.get(lb, (0, 0))[1] for pl in piles[r]]):.1%}"
                for r in RUNG_NAMES
            )
    return {
        "condition": name,
        "wall_s": round(time.monotonic() - t0, 1),
        "load_avg_1min": os.getloadavg()[0],
        "checks": checks(runs, finished, seeds),
        "reported": reported,
    }


def _kept(out: str, rung: str, seed: int) -> dict:
    """An earlier run's summary (`runs.json`, written beside its logs), without its CPU s."""
    try:
        with open(os.path.join(out, RUNS_FILE)) as fh:
            kept = json.load(fh)
    except OSError as e:
        raise SystemExit(f"--recheck: {e} (run once with --out first)") from None
    for d in kept:
        if d["rung"] == rung and d["seed"] == seed:
            return {**d, "cpu_s": None}
    raise SystemExit(f"--recheck: {out}/{RUNS_FILE} has no {rung} s{seed}")


def checks(runs: dict[str, list], finished: dict, seeds: list[int]) -> dict[str, dict]:
    """Every check of the module docstring: {name: {"ok": bool, "figures": ...}}."""
    import numpy as np

    from tracekit.analysis.compare import compare
    from tracekit.analysis.verdict import verdict

    def med(rung: str, field: str) -> float:
        return float(np.median([getattr(a, field) for a in runs[rung]]))

    base, wm, before_wm = runs[RUNG_NAMES[0]], runs[RUNG_NAMES[-1]], runs[RUNG_NAMES[-2]]
    out: dict[str, tuple[bool, object]] = {}
    worst = min(finished.items(), key=lambda kv: kv[1])
    out[f"every run: >= {MIN_FINISHED:.0%} of arrivals finish"] = (
        worst[1] >= MIN_FINISHED,
        f"lowest {worst[1]:.1%} ({worst[0][0]} s{worst[0][1]})",
    )
    out[f"baseline TTFT p50 < {MAX_BASE_TTFT_P50_MS:.0f} ms"] = (
        all(a.ttft_p50 < MAX_BASE_TTFT_P50_MS for a in base),
        [round(a.ttft_p50, 1) for a in base],
    )
    out["baseline preemptions > 0"] = (
        all(a.preemptions > 0 for a in base),
        [a.preemptions for a in base],
    )
    graph = [a.all_share.get("graph", 0.0) for a in base]
    out[f"baseline graph < {MAX_BASE_GRAPH_SHARE:.0%} of all gap time"] = (
        max(graph) < MAX_BASE_GRAPH_SHARE,
        [f"{g:.1%}" for g in graph],
    )
    fwd = med(RUNG_NAMES[0], "fwd_share_clean_median")
    out[f"baseline median forward share of a clean gap >= {MIN_BASE_FWD_CLEAN:.0%}"] = (
        fwd >= MIN_BASE_FWD_CLEAN,
        f"{fwd:.1%} (runs {[f'{a.fwd_share_clean_median:.1%}' for a in base]})",
    )
    rises = [(b.ttft_p50, w.ttft_p50) for b, w in zip(before_wm, wm, strict=True)]
    out["watermark raises TTFT p50 against the rung before, every seed"] = (
        all(w > b for b, w in rises),
        ", ".join(f"s{s} {b:.0f} -> {w:.0f} ms" for s, (b, w) in zip(seeds, rises, strict=True)),
    )
    p_base, p_wm = med(RUNG_NAMES[0], "itl_p999"), med(RUNG_NAMES[-1], "itl_p999")
    ratio = p_base / p_wm if p_wm > 0 else float("inf")
    out[f"watermark cuts median p99.9 >= {MIN_P999_RATIO:g}x against baseline"] = (
        ratio >= MIN_P999_RATIO,
        f"{p_base:.0f} -> {p_wm:.0f} ms ({ratio:.1f}x)",
    )
    after = RUNG_NAMES[RUNG_NAMES.index("+compact history") :]
    gc_tail = [a.tail_share.get("gc", 0.0) for r in after for a in runs[r]]
    out["gc tail share 0 from +compact history on"] = (
        max(gc_tail) < 0.0005,  # 0.0% as printed
        f"largest {max(gc_tail):.2%}",
    )
    every = [a for r in RUNG_NAMES for a in runs[r]]
    findings = verdict(compare(every, "rung", order_by="rung_index")).findings
    moves, ok = [], True
    for i, rung in enumerate(RUNG_NAMES[1:], 1):
        a, b = med(RUNG_NAMES[i - 1], "itl_p999"), med(rung, "itl_p999")
        said = next(f for f in findings if f.startswith(f"{rung}:"))
        held = re.search(r"; ([a-z ()]+) holds \d+% of tail time", said)
        ok &= f"{rung}: cut median p99.9" in said or held is not None  # as the verdict says
        moves.append(f"{rung} {a:.0f} -> {b:.0f}" + (f" ({held.group(1)} holds)" if held else ""))
    out["each rung lowers median p99.9, or the verdict names what holds the tail"] = (ok, moves)
    return {k: {"ok": v, "figures": f} for k, (v, f) in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--conditions", default="plain,contended", help=", ".join(CONDITIONS))
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    ap.add_argument("--out", default=None, help="keep the logs here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--timer", choices=("wall", "cpu"), default="wall", help="the demo's clock (its default)"
    )
    ap.add_argument(
        "--recheck",
        default=None,
        metavar="DIR",
        help="check the logs an earlier run kept in DIR (its --out) instead of running",
    )
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [c.strip() for c in args.conditions.split(",") if c.strip()]
    bad = [c for c in names if c not in CONDITIONS]
    if bad or args.jobs < 1:
        ap.error(f"unknown condition {bad} (known: {', '.join(CONDITIONS)})" if bad else "--jobs")
    results, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            out = os.path.join(args.recheck or args.out or tmp, name.replace(" ", "-"))
            print(f"[{name}] {len(seeds)} seeds x {len(RUNG_NAMES)} rungs, {args.steps} steps")
            print("  checks on the engine's time: gaps and TTFTs less what the OS took in them")
            res = condition(
                name, seeds, args.steps, out, args.jobs, args.timer, args.recheck is not None
            )
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
