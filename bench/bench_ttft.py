"""TTFT partition speed, and what recording its events adds to a step.

    python bench/bench_ttft.py [--steps 20000] [--pairs 15] [--waiting 16]

1. Partition throughput: `ttft_partition` on a synthetic run (bench/synthetic.py's steps,
   with arrivals, admissions, prefill chunks and wait reasons added), in requests/s, best
   of 5; and its ratio to the reference implementation on a slice of the same run.
2. Recording cost per step: an in-memory recorder records a typical step (two segments,
   32 emissions, step attributes) with and without the TTFT calls a scheduler makes in it
   (one admission, two prefill rows, one wait call naming `--waiting` requests).
   Interleaved ABBA pairs in this process; prints the median ratio with [min-max] over
   the pairs, and the added time per step.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from synthetic import synthetic_log  # noqa: E402

import tracekit  # noqa: E402
from tracekit.attribution.reference import ttft_partition_reference
from tracekit.attribution.ttft import ttft_partition  # noqa: E402
from tracekit.log.rawlog import Admissions, Evictions, PrefillChunks, Requests, Waits  # noqa: E402
from tracekit.log.validate import validate_log  # noqa: E402


def ttft_log(num_steps: int, seed: int = 0):
    """synthetic_log plus TTFT events: each request arrives 0-20 steps before its first
    emission, is admitted two steps before it (or at arrival), prefills in the two steps
    before it, and waits with a reason in each step between arrival and admission."""
    log = synthetic_log(num_steps, seed=seed)
    rng = np.random.default_rng(seed)
    em, st = log.emissions, log.steps
    n = len(log.requests)
    first_step = np.full(n, -1)
    o = np.lexsort((em.t_s, em.request))
    head = np.ones(len(o), bool)
    head[1:] = em.request[o][1:] != em.request[o][:-1]
    first_step[em.request[o][head]] = em.step[o][head]
    first_t = np.full(n, np.nan)
    first_t[em.request[o][head]] = em.t_s[o][head]
    has = first_step >= 3
    r = np.flatnonzero(has)
    fs = first_step[r]
    arr_step = np.maximum(fs - rng.integers(2, 20, len(r)), 0)
    adm_step = fs - 2
    arrival = np.full(n, np.nan)
    arrival[r] = st.t_start_s[arr_step] - 1e-4
    adm_t = st.t_start_s[adm_step]
    pre_steps = np.concatenate([adm_step, adm_step + 1])
    pre_req = np.concatenate([r, r])
    w_len = np.maximum(adm_step - arr_step, 0)
    w_req = np.repeat(r, w_len)
    w_step = np.repeat(arr_step, w_len) + (
        np.arange(w_len.sum()) - np.repeat(np.cumsum(w_len) - w_len, w_len)
    )
    adm_of = np.full(n, np.inf)
    adm_of[r] = adm_t
    ev = log.evictions
    keep = ev.t_evict_s >= adm_of[ev.request]  # an eviction needs an admission before it
    return replace(
        log,
        requests=Requests(
            arrival_s=arrival,
            prompt_tokens=log.requests.prompt_tokens,
            max_new_tokens=log.requests.max_new_tokens,
            first_token_s=np.where(has, first_t, np.nan),
        ),
        evictions=Evictions(**{k: v[keep] for k, v in ev.columns().items()}),
        admissions=Admissions(request=r, t_s=adm_t),
        prefill_chunks=PrefillChunks.from_columns(
            step=pre_steps, request=pre_req, num_tokens=rng.integers(16, 128, len(pre_req))
        ),
        waits=Waits.from_columns(step=w_step, request=w_req, reason=rng.integers(0, 3, len(w_req))),
    )


def best_of(fn, n: int = 5) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def partition_speed(num_steps: int) -> None:
    log = validate_log(ttft_log(num_steps))
    p = ttft_partition(log)
    s = best_of(lambda: ttft_partition(log))
    print(
        f"ttft_partition: {len(p)} requests, {len(log.steps)} steps, {len(log.waits)} wait "
        f"rows: {s * 1e3:.1f} ms, {len(p) / s:,.0f} requests/s "
        f"(reconcile max err {p.reconcile_max_err_ms:.1e} ms)"
    )
    small = validate_log(ttft_log(max(num_steps // 20, 400)))
    fast = best_of(lambda: ttft_partition(small), 3)
    ref = best_of(lambda: ttft_partition_reference(small), 1)
    n_small = len(ttft_partition(small))
    print(
        f"  vs reference on {n_small} requests ({len(small.steps)} steps): vectorised "
        f"{n_small / fast:,.0f} req/s, reference {n_small / ref:,.0f} req/s, "
        f"ratio {ref / fast:,.0f}x"
    )


def recording_cost(pairs: int, steps_per_arm: int, num_waiting: int) -> None:
    rec = tracekit.Recorder(None, flush_interval_s=3600.0)
    batch = [f"r{i}" for i in range(32)]
    waiting = [f"w{i}" for i in range(num_waiting)]
    with rec:
        for rid in batch + waiting:
            rec.request(rid)
        seg_p, seg_d = rec.segment("prefill"), rec.segment("decode")
        k = [0]

        def step(with_ttft: bool) -> None:
            with rec.step():
                if with_ttft:
                    k[0] += 1
                    rec.admit(f"new{k[0]}")  # one admission per step
                    rec.prefill(batch[0], 64)
                    rec.prefill(batch[1], 32)
                    rec.wait(waiting, "kv_blocks")
                with seg_p:
                    pass
                with seg_d:
                    pass
                rec.emit(batch)
                rec.step_info(num_decode=32, num_prefill_tokens=96, graph_size=32)

        def arm(with_ttft: bool) -> float:
            t0 = time.perf_counter()
            for _ in range(steps_per_arm):
                step(with_ttft)
            return (time.perf_counter() - t0) / steps_per_arm

        arm(False), arm(True)  # warm up
        ratios, base_us, added_us = [], [], []
        for i in range(pairs):  # ABBA: drift on a shared machine hits both arms alike
            order = (False, True) if i % 2 == 0 else (True, False)
            t = {w: arm(w) for w in order}
            ratios.append(t[True] / t[False])
            base_us.append(t[False] * 1e6)
            added_us.append((t[True] - t[False]) * 1e6)
    med = statistics.median(ratios)
    print(
        f"recording cost per step, with / without the TTFT calls (1 admit, 2 prefill rows, "
        f"1 wait call naming {num_waiting} requests), {pairs} ABBA pairs x {steps_per_arm} "
        f"steps: ratio {med:.3f} [{min(ratios):.3f}-{max(ratios):.3f}]; baseline step "
        f"{statistics.median(base_us):.1f} us, added {statistics.median(added_us):.1f} us "
        f"(median)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20_000, help="steps of the synthetic run")
    ap.add_argument("--pairs", type=int, default=15, help="ABBA pairs for the recording cost")
    ap.add_argument("--steps-per-arm", type=int, default=2_000)
    ap.add_argument("--waiting", type=int, default=16, help="requests named per wait call")
    a = ap.parse_args()
    partition_speed(a.steps)
    recording_cost(a.pairs, a.steps_per_arm, a.waiting)


if __name__ == "__main__":
    main()
