"""Analysis speed on one core, and fleet throughput (--jobs 1, --jobs 2, --ray).

    python bench/bench_fleet.py                 # ~3-5 min on a busy 2-core machine
    python bench/bench_fleet.py --runs 100 --gaps-per-run 112000

1. One run in the published layout (~112 k gaps, like the published runs): end to end
   `analyze(load(path))` (load + validate + partition + analyse) against the published
   analysis (bench/published_method.py, its per-gap Python loop) in the same process,
   interleaved A/B pairs; the stages; the allocator's share; a cProfile of where the time
   goes. Figures of both are compared (they must agree). The same against the previous
   main (a checkout of it, `--base`, /work/base by default: bench/base_main.py imports
   it into this process beside the working tree's package), interleaved rounds, median
   and spread; its figures are compared too.
2. Fleet: gaps/s per core of `tracekit analyze` over many runs with --jobs 1, --jobs 2 and
   --ray (a local Ray started by the command, so its start-up cost is in the figure).
3. Per-run costs for docs/fleet.md's sizing table: peak memory of one run's analysis
   and export, dataset bytes per run.

Prints ratios against baselines measured in the same run; absolute times are as measured
on this machine at this moment (a shared machine: read the ratios). Asserts nothing.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one core: before numpy is imported
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import cProfile
import io
import pstats
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from base_main import DEFAULT_CHECKOUT, BaseMain  # noqa: E402
from published_method import published_analysis  # noqa: E402
from synthetic import synthetic_log  # noqa: E402

from tracekit.allocator import (  # noqa: E402
    MMAP_THRESHOLD_BYTES,
    TRIM_THRESHOLD_BYTES,
    keep_freed_memory,
    set_malloc_thresholds,
)
from tracekit.analysis.figures import analyze  # noqa: E402
from tracekit.attribution.itl import partition  # noqa: E402
from tracekit.log.published import save_published  # noqa: E402
from tracekit.log.reader import load  # noqa: E402
from tracekit.log.validate import validate_log  # noqa: E402

BATCH = 32


def to_published(log, path: str, *, compressed: bool) -> str:
    return save_published(log, path, compressed=compressed, first_id=1000)


def best(fn, n: int) -> tuple[float, float]:
    """(wall s, CPU s of this process), each the best of `n` calls. On a shared machine
    CPU time is the one-core figure: wall time also counts waiting for a core."""
    walls, cpus = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - c)
        walls.append(time.perf_counter() - t)
    return min(walls), min(cpus)


def spread(xs: list[float], digits: int = 1) -> str:
    return f"{np.median(xs):.{digits}f}x [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def one_run(d: str, steps: int, base_checkout: str | None) -> None:
    log = synthetic_log(num_steps=steps, batch=BATCH, seed=4)
    files = {
        "published, np.savez (stored)": to_published(log, f"{d}/pub.npz", compressed=False),
        "published, np.savez_compressed": to_published(log, f"{d}/pubz.npz", compressed=True),
        "tracekit v1": log.save(f"{d}/v1.npz"),
    }
    n = analyze(load(files["tracekit v1"])).gaps
    print(f"== 1. one run, {n:,} gaps, {len(log.steps):,} steps, {len(log.requests)} requests")
    keep_freed_memory()

    # the published analysis agrees with tracekit on this file (it is the same method)
    pub = files["published, np.savez_compressed"]
    ref = published_analysis(pub)
    a = analyze(load(pub))
    same = all(ref[k] == getattr(a, k) for k in ("itl_p50", "itl_p90", "itl_p99", "itl_p999",
                                                 "itl_max", "gaps"))  # fmt: skip
    worst = max(abs(ref["tail_share"][k] - a.tail_share[k]) for k in ref["tail_share"])
    counts = ref["tail_count"] == {k: v for k, v in a.tail_count.items()}
    print(f"published analysis vs tracekit on the same file: percentiles equal {same}, "
          f"tail counts equal {counts}, tail shares differ by at most {worst:.1e}")  # fmt: skip

    # interleaved A/B pairs: published (once per pair: seconds) vs tracekit (best of 5)
    r_wall, r_cpu, t_pub = [], [], []
    for _ in range(3):
        tp = best(lambda: published_analysis(pub), 1)
        tt = best(lambda: analyze(load(pub)), 5)
        r_wall.append(tp[0] / tt[0])
        r_cpu.append(tp[1] / tt[1])
        t_pub.append(tp[1])
    print(f"published analysis: {n / np.median(t_pub) / 1e3:,.0f} k gaps/s of CPU time "
          f"(median of 3, {np.median(t_pub):.2f} s)")  # fmt: skip
    print("tracekit end to end (load + validate + partition + analyse), one core, best of 7:")
    for name, path in files.items():
        w, c = best(lambda p=path: analyze(load(p)), 7)
        print(f"  {name:<32} {n / c / 1e6:5.2f} M gaps/s of CPU time ({c * 1e3:5.1f} ms), "
              f"{n / w / 1e6:5.2f} M gaps/s of wall time ({w * 1e3:5.1f} ms)")  # fmt: skip
    print("  speed-up over the published analysis (compressed file, 3 interleaved pairs): "
          f"{spread(r_cpu)} in CPU time, {spread(r_wall)} in wall time")  # fmt: skip

    if base_checkout:
        against_previous_main(pub, n, base_checkout)

    # stages, on the compressed published file
    raw = load(pub, validate=False)
    lg = validate_log(raw)
    p = partition(lg)
    stages = {
        "read (zip, inflate, published -> tables)": best(lambda: load(pub, validate=False), 7),
        "validate": best(lambda: validate_log(raw), 7),
        "partition": best(lambda: partition(lg), 7),
        "analyse (figures from the partition)": best(lambda: analyze(lg, p), 7),
    }
    total = sum(c for _, c in stages.values())
    print("stages (CPU time, best of 7 each, compressed published file):")
    for k, (_, c) in stages.items():
        print(f"  {k:<42} {c * 1e3:5.1f} ms  {100 * c / total:4.0f}%")

    # the allocator: glibc defaults vs keep_freed_memory, interleaved
    rs = []
    for _ in range(3):
        set_malloc_thresholds(128 * 1024, 128 * 1024)  # glibc's initial (static) thresholds
        t_def = best(lambda: analyze(load(pub)), 5)[1]
        set_malloc_thresholds(MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)  # keep_freed_memory
        t_keep = best(lambda: analyze(load(pub)), 5)[1]
        rs.append(t_def / t_keep)
    print(f"keeping freed memory (tracekit.allocator) vs glibc's default thresholds: "
          f"{spread(rs)} less CPU time (page faults of fresh mmaps)")  # fmt: skip

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(10):
        analyze(load(pub))
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print("cProfile of 10 x analyze(load(compressed published file)), by own time:")
    body = s.getvalue().strip().splitlines()
    start = next(i for i, line in enumerate(body) if "ncalls" in line)
    print("\n".join("  " + line for line in body[start - 2 :]))


def against_previous_main(pub: str, n: int, checkout: str) -> None:
    """tracekit's analyze(load(pub)) against the previous main's, in this process."""
    base = BaseMain(checkout)
    ours, theirs = analyze(load(pub)).to_dict(), base.analyze_path(pub).to_dict()
    common = sorted(set(ours) & set(theirs))
    differ = [k for k in common if ours[k] != theirs[k]]
    r_cpu, t_base, t_new = [], [], []
    for _ in range(7):  # interleaved rounds, best of 5 each
        tb = best(lambda: base.analyze_path(pub), 5)[1]
        tn = best(lambda: analyze(load(pub)), 5)[1]
        r_cpu.append(tb / tn)
        t_base.append(tb)
        t_new.append(tn)
    print(f"against the previous main ({checkout}), analyze(load(compressed published file)), "
          f"{n:,} gaps, 7 interleaved rounds (best of 5 each, CPU time):")  # fmt: skip
    print(f"  previous main {np.median(t_base) * 1e3:5.1f} ms, this tree "
          f"{np.median(t_new) * 1e3:5.1f} ms (medians): {spread(r_cpu, 2)} faster "
          f"(median [min-max] of the rounds' ratios)")  # fmt: skip
    print(f"  figures: {len(common)} fields in common, "
          f"{'all equal' if not differ else 'DIFFER: ' + ', '.join(differ)}")  # fmt: skip


def _peak_rss_mb(code: str) -> float:  # peak RSS of a fresh interpreter running `code`
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def fleet(d: str, runs: int, steps: int) -> None:
    print(f"\n== 2. fleet: {runs} runs in the published layout (compressed)")
    paths = []
    for i in range(runs):
        log = synthetic_log(num_steps=steps, batch=BATCH, seed=100 + i)
        paths.append(to_published(log, f"{d}/run{i:03d}.npz", compressed=True))
    n = analyze(load(paths[0])).gaps
    total = n * runs
    print(f"{total:,} gaps ({n:,} a run)")
    modes = {"--jobs 1": (["--jobs", "1"], 1), "--jobs 2": (["--jobs", "2"], 2),
             "--ray (local, starts Ray)": (["--ray"], os.cpu_count() or 1)}  # fmt: skip
    wall: dict[str, list[float]] = {k: [] for k in modes}
    cpu: dict[str, list[float]] = {k: [] for k in modes}
    outs: dict[str, bytes] = {}
    for _ in range(2):  # interleaved
        for name, (flag, _cores) in modes.items():
            cmd = [sys.executable, "-m", "tracekit", "analyze", "--format", "jsonl", *flag]
            c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            r = subprocess.run(cmd + paths, capture_output=True, check=True)
            wall[name].append(time.perf_counter() - t)
            c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
            outs[name] = r.stdout
    cmd = [sys.executable, "-m", "tracekit", "analyze", "--format", "jsonl", "--ray", paths[0]]
    t = time.perf_counter()
    subprocess.run(cmd, capture_output=True, check=True)
    ray_fixed = time.perf_counter() - t
    base = min(wall["--jobs 1"])
    print("  (wall: best of 2, whole command incl. interpreter start; CPU: the command's "
          "processes, Ray's workers not counted)")  # fmt: skip
    for name, (_, cores) in modes.items():
        w, c = min(wall[name]), min(cpu[name])
        per_cpu = "-" if "ray" in name else f"{total / c / 1e6:5.2f}"  # tasks: Ray's processes
        print(f"  {name:<26} {w:6.2f} s wall  {total / w / 1e6:5.2f} M gaps/s  "
              f"{total / w / cores / 1e6:5.2f} M gaps/s per core ({cores} cores)  "
              f"x{base / w:.2f} vs --jobs 1 | {per_cpu} M gaps per CPU-s")  # fmt: skip
    same = len({outs[k] for k in outs}) == 1
    print(f"  the three outputs are byte for byte equal: {same}")
    w = min(wall["--ray (local, starts Ray)"]) - ray_fixed
    rest = f"--ray without it: {total / w / 1e6:.2f} M gaps/s" if w > 0 else "it dominates"
    print(f"  Ray's fixed cost (start a local Ray, one run, shut down): {ray_fixed:.1f} s; {rest}")

    print("\n== 3. per-run costs (sizing, docs/fleet.md)")
    code = ("import pickle, resource, tracemalloc, tracekit; "
            "from tracekit.allocator import keep_freed_memory; keep_freed_memory(); "
            "from tracekit.analysis.figures import analyze; rss0 = resource.getrusage("
            "resource.RUSAGE_SELF).ru_maxrss; tracemalloc.start(); "
            f"a = analyze(tracekit.load({paths[0]!r})); "
            "peak = tracemalloc.get_traced_memory()[1]; tracemalloc.stop(); "
            "print(rss0 / 1024, peak / 2**20, len(pickle.dumps(a)) / 1024)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    rss0, peak, result_kb = (float(x) for x in out)
    print(f"  analyse one {n:,}-gap run: peak of arrays and objects {peak:.0f} MB "
          f"({peak * 2**20 / n:.0f} B a gap) over an interpreter of {rss0:.0f} MB RSS; "
          f"the result (RunAnalysis, pickled) {result_kb:.0f} kB")  # fmt: skip
    ds = f"{d}/dataset"
    m = len(paths[:10])
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tracekit", "export", *paths[:m], "-o", ds],
                   capture_output=True, check=True)  # fmt: skip
    t_exp = (time.perf_counter() - t) / m
    size = {k: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(f"{ds}/{k}")
                   for f in fs) / m for k in ("gaps", "runs")}  # fmt: skip
    raw = sum(os.path.getsize(p) for p in paths[:m]) / m
    print(f"  export: {t_exp:.2f} s a run (incl. interpreter start / {m}); dataset "
          f"{size['gaps'] / 1e6:.2f} MB gaps + {size['runs'] / 1e3:.0f} kB runs a run "
          f"({size['gaps'] / n:.1f} B a gap); raw log {raw / 1e6:.2f} MB")  # fmt: skip
    code = ("import resource, time; from tracekit.analysis.fleet import rollup; "
            f"rollup({ds!r}, 'rung'); c = time.process_time(); rollup({ds!r}, 'rung'); "
            "c = time.process_time() - c; "
            "print(c, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")  # fmt: skip
    c, rss = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()  # fmt: skip
    rate = m * n / float(c) / 1e6
    print(f"  fleet rollup of {m} runs ({m * n:,} gaps, exact, 2nd call): {float(c):.2f} s CPU "
          f"({rate:.1f} M gaps per CPU-s), peak RSS {float(rss):.0f} MB")  # fmt: skip
    code = code.replace("print(c, ", "print(")
    code = code.replace("'rung')", "'rung', memory_budget_bytes=0)")
    code = code.replace("rollup(", "r = rollup(").replace(
        "print(", "print(r.groups[0].pooled['itl_p999'][1], "
    )
    err, rss = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout.split()  # fmt: skip
    print(f"  the same from the sketch (100k points): peak RSS {float(rss):.0f} MB, "
          f"p99.9 rank error {int(err):,} of {m * n:,} gaps")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--gaps-per-run", type=int, default=112_000)
    ap.add_argument("--skip-fleet", action="store_true")
    ap.add_argument("--base", default=DEFAULT_CHECKOUT,
                    help="checkout of the previous main to time against ('' to skip)")  # fmt: skip
    args = ap.parse_args()
    steps = args.gaps_per_run // BATCH + 1
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
          f"(a shared machine: absolute times are taken under that load)")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        one_run(d, steps, args.base or None)
        if not args.skip_fleet:
            fleet(d, args.runs, steps)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
