"""Partition throughput: vectorised vs reference, and `tracekit analyze --jobs` scaling.

    python bench/bench_partition.py            # >= 1 M gaps; prints ratios, asserts nothing

It also times the device rule: the same log with a device window under every decode
(the host waiting for it), against the log without, interleaved.

Ratios are against baselines measured in the same process, so they hold on any machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from synthetic import synthetic_log  # noqa: E402

from tracekit.attribution.itl import partition
from tracekit.attribution.reference import partition_reference  # noqa: E402


def best_of(fn, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def with_device_windows(log):
    """`log` with each decode segment's device execution: 0.1 ms after the launch, as long."""
    from dataclasses import replace

    import numpy as np

    sg = log.segments
    dec = np.flatnonzero(sg.label == 3)
    cat = {k: np.concatenate([v, v[dec]]) for k, v in sg.columns().items()}
    n = len(sg)
    cat["t_start_s"][n:] += 1e-4
    cat["t_end_s"][n:] += 1e-4
    cat["is_device"][n:] = 1
    return replace(log, segments=type(sg)(**cat))


def device_rule_cost(log) -> None:
    dev = with_device_windows(log)
    n_win = int((dev.segments.is_device == 1).sum())
    host, device = [], []
    for _ in range(3):  # interleaved A/B pairs
        host.append(best_of(lambda: partition(log), 1))
        device.append(best_of(lambda: partition(dev), 1))
    ratios = sorted(d / h for d, h in zip(device, host, strict=True))
    print(f"device rule: {n_win:,} device windows cost {ratios[1]:.2f}x the host-only "
          f"partition [{ratios[0]:.2f}-{ratios[-1]:.2f}] (3 interleaved pairs)")  # fmt: skip


def main() -> None:
    big = synthetic_log(num_steps=34_000, batch=32)
    device_rule_cost(big)
    p = partition(big)
    n_gaps = len(p)
    t_fast = best_of(lambda: partition(big))
    print(f"vectorised: {n_gaps:,} gaps in {t_fast:.3f} s = {n_gaps / t_fast / 1e6:.2f} M gaps/s "
          f"(one core; reconcile max err {p.reconcile_max_err_ms:.1e} ms)")  # fmt: skip

    small = synthetic_log(num_steps=120, batch=32, seed=1)
    n_small = len(partition(small))
    t_ref = best_of(lambda: partition_reference(small), 1)
    t_fast_small = best_of(lambda: partition(small))
    ref_rate = n_small / t_ref
    print(f"reference:  {n_small:,} gaps in {t_ref:.3f} s = {ref_rate:,.0f} gaps/s")
    print(f"speed-up: {n_gaps / t_fast / ref_rate:,.0f}x (vectorised on {n_gaps:,} gaps vs "
          f"reference on {n_small:,}); same small log: {t_ref / t_fast_small:,.0f}x")  # fmt: skip

    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i in range(6):
            paths.append(synthetic_log(num_steps=20_000, batch=32, seed=10 + i).save(
                os.path.join(d, f"run{i}.npz")))  # fmt: skip
        walls: dict[int, float] = {1: 1e9, 2: 1e9}
        for jobs in (1, 2, 1, 2):  # interleaved, best of two each
            cmd = [sys.executable, "-m", "tracekit", "analyze", "--format", "jsonl",
                   "--jobs", str(jobs), *paths]  # fmt: skip
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            walls[jobs] = min(walls[jobs], time.perf_counter() - t)
        n = len(partition(synthetic_log(20_000, 32, 10)))
        print(
            f"tracekit analyze, 6 runs x {n:,} gaps: --jobs 1 {walls[1]:.2f} s, "
            f"--jobs 2 {walls[2]:.2f} s ({walls[1] / walls[2]:.2f}x on {os.cpu_count()} cores)"
        )


if __name__ == "__main__":
    main()
