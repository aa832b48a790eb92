"""What do capture's hooks cost, and how long does a row wait before it is on disk?

    python bench/bench_capture.py --baseline ../other-checkout [--rounds 6] [--seconds 3]

Compares this checkout's recorder with the one of another checkout (`--baseline`, a folder
holding a `tracekit/` package, loaded under another name in this same process), in
interleaved ABBA rounds so drift on a shared machine hits both arms alike. Without
`--baseline` only this checkout is measured.

1. Per event: the hot-path hooks on an enabled in-memory recorder, net of an empty loop:
   segment enter+exit, emit per token (32-row steps), an empty step, a counter sample.
   Printed per arm (median of the rounds) and as the median ratio this/baseline with the
   spread of the per-round ratios.
2. Flush latency under load: an engine loop records 2,000 emission rows per step (plus a
   step and a segment), with `--work-ms` of GIL-free work per step (a forward pass), to
   ``OUT.npz`` with `--flush-interval-s`. A watcher thread lists the parts folder every
   2 ms; for each new part, the time from its oldest row's recording (the row's own clock
   tick) to the part being seen on disk is that part's latency. Printed: the worst and
   median latency, and the most rows recorded but not yet on disk at any poll (what a
   `kill -9` at that moment would lose), in rows and in seconds of recording.
   `--slow-disk-ms N` makes every part write take N ms longer (numpy's `savez` sleeps
   first, in both arms alike): a disk slower than the flush interval, where a writer that
   queues one part per flush falls further behind with every flush.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from types import ModuleType
from typing import Any

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy is imported

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import tracekit  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import per_event_ns  # noqa: E402  (one timing loop for both benches)

ROWS_PER_STEP = 2000


def load_baseline(folder: str, tmp: str) -> ModuleType:
    """The `tracekit` package of another checkout, imported as `tracekit_baseline`."""
    src = os.path.join(folder, "tracekit")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        sys.exit(f"{folder}: no tracekit/ package there (pass the checkout's root folder)")
    shutil.copytree(src, os.path.join(tmp, "tracekit_baseline"))
    sys.path.insert(0, tmp)
    return importlib.import_module("tracekit_baseline")


def flush_latency(
    tk: ModuleType, out: str, seconds: float, flush_interval_s: float, work_ms: float
) -> dict[str, float]:
    """Record 2,000 emission rows per step for `seconds`; watch the parts folder."""
    parts = out + ".parts"
    ids = list(range(ROWS_PER_STEP))
    recorded = [0]  # emission rows recorded so far (read by the watcher)
    seen: set[str] = set()
    latencies_s: list[float] = []
    backlog = [0]
    done = threading.Event()

    def watch() -> None:
        on_disk = 0
        while not done.is_set():
            now_ns = time.perf_counter_ns()
            rec_rows = recorded[0]
            try:
                names = sorted(n for n in os.listdir(parts) if n.startswith("part-"))
            except FileNotFoundError:
                names = []
            for n in names:
                if n in seen or not n.endswith(".npz"):
                    continue
                try:
                    with np.load(os.path.join(parts, n), allow_pickle=False) as z:
                        em = z["emissions"].reshape(-1, 5)
                except (OSError, ValueError, KeyError):
                    continue  # not whole yet (a writer without atomic rename)
                seen.add(n)
                on_disk += len(em)
                if len(em):
                    latencies_s.append((now_ns - int(em[:, 1].min())) * 1e-9)
            backlog[0] = max(backlog[0], rec_rows - on_disk)
            time.sleep(0.002)

    rec = tk.Recorder(out, gc=False, handle_signals=False, flush_interval_s=flush_interval_s)
    watcher = threading.Thread(target=watch, daemon=True)
    with rec:
        for rid in ids:
            rec.request(rid)
        seg = rec.segment("decode")
        watcher.start()
        t_end = time.monotonic() + seconds
        steps = 0
        while time.monotonic() < t_end:
            with rec.step():
                with seg:
                    if work_ms:
                        time.sleep(work_ms / 1e3)  # a forward pass: the GIL is free
                rec.emit(ids)
            recorded[0] += ROWS_PER_STEP
            steps += 1
        # last look before stop() merges the parts away
        time.sleep(0.05)
        done.set()
        watcher.join()
    rate = recorded[0] / seconds
    lat = sorted(latencies_s) or [float("nan")]
    return {
        "steps": steps,
        "rows/s": rate,
        "parts": len(seen),
        "worst_s": lat[-1],
        "median_s": statistics.median(lat),
        "backlog_rows": backlog[0],
        "backlog_s": backlog[0] / rate if rate else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="root of another checkout to compare with")
    ap.add_argument("--rounds", type=int, default=6, help="ABBA-ordered rounds")
    ap.add_argument("--iters", type=int, default=100_000, help="events per hook per round")
    ap.add_argument("--seconds", type=float, default=3.0, help="load run length per arm")
    ap.add_argument("--flush-interval-s", type=float, default=0.25)
    ap.add_argument("--work-ms", type=float, default=2.0, help="GIL-free work per step")
    ap.add_argument("--latency-rounds", type=int, default=2)
    ap.add_argument("--slow-disk-ms", type=float, default=0.0, help="added to each part write")
    args = ap.parse_args()
    if args.slow_disk_ms:
        real_savez = np.savez

        def slow_savez(*a: Any, **kw: Any) -> None:
            time.sleep(args.slow_disk_ms / 1e3)
            real_savez(*a, **kw)

        np.savez = slow_savez  # type: ignore[assignment]

    with tempfile.TemporaryDirectory(prefix="tk-bench-capture-") as tmp:
        arms: dict[str, ModuleType] = {"this": tracekit}
        if args.baseline:
            arms["baseline"] = load_baseline(args.baseline, tmp)
        names = list(arms)
        print(f"per-event cost: {args.rounds} rounds x {args.iters} events per hook, ABBA")
        costs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for r in range(args.rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                costs[n].append(per_event_ns(args.iters, arms[n]))
        hooks = list(costs["this"][0]) if costs["this"] else []
        for h in hooks:
            line = "  ".join(
                f"{n} {statistics.median(c[h] for c in costs[n]) / 1e3:6.3f} us" for n in names
            )
            if "baseline" in arms:
                ratios = [
                    a[h] / b[h] for a, b in zip(costs["this"], costs["baseline"], strict=True)
                ]
                line += (
                    f"  this/baseline median {statistics.median(ratios):.3f} "
                    f"[{min(ratios):.3f}-{max(ratios):.3f}]"
                )
            print(f"  {h:28s} {line}")

        print(
            f"flush latency under load: {ROWS_PER_STEP} emission rows per step, "
            f"{args.work_ms} ms of work per step, flush interval {args.flush_interval_s} s, "
            f"{args.seconds} s per run, {args.latency_rounds} round(s), ABBA"
            + (f", {args.slow_disk_ms} ms added per part write" if args.slow_disk_ms else "")
        )
        for r in range(args.latency_rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                out = os.path.join(tmp, f"{n}-{r}.npz")
                res = flush_latency(arms[n], out, args.seconds, args.flush_interval_s, args.work_ms)
                print(
                    f"  {n:8s} round {r + 1}: {res['steps']} steps ({res['rows/s']:.0f} rows/s), "
                    f"{res['parts']} parts; row-to-disk latency worst {res['worst_s']:.3f} s, "
                    f"median {res['median_s']:.3f} s; most rows not on disk "
                    f"{res['backlog_rows']} (= {res['backlog_s']:.2f} s of recording)"
                )


if __name__ == "__main__":
    main()
