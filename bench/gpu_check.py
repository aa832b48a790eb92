"""The GPU check: the torch demo engine on CUDA, recorded with NVTX and CUDA events.

    python bench/gpu_check.py [--seconds 60] [--rate 12] [--out DIR]

About a minute on a CUDA machine (the `gpu` extra with a CUDA build of torch; docs/gpu.md):

1. Two recorded runs of the demo engine, synchronous and with async scheduling, each about
   a quarter of the budget, with NVTX ranges and a `CudaEventTimer`. Per run it prints the
   host vs device forward (decode) time per step (quantiles over steps), the share of steps
   where the host timer understates device time (host decode window shorter than the
   device's), the partition's reconciliation error, the device clock's drift and the
   calibration bracket, and what the partition charges to forward, residual and the rest.
2. The recording overhead: the same fixed workload (every request at t=0, outputs capped;
   both arms do identical work, checked by token count) served with the recorder off and
   on (NVTX + CUDA events), interleaved in ABBA order; prints tokens/s per pair and the
   median ratio on/off.
3. Per event: a device segment's enter+exit with CUDA events vs a plain segment.

On a machine without CUDA it says so and exits 0. `--cpu` runs the same plumbing on torch's
CPU backend (no device windows: their figures read n/a), to check the script itself.
Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy is imported

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)


def _cuda_or_exit(use_cpu: bool) -> str:
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed (pip install 'tracekit[gpu]'); nothing to check")
        sys.exit(0)
    if use_cpu:
        return "cpu"
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to check (--cpu for a dry run)")
        sys.exit(0)
    return "cuda"


def _quantiles(x, qs=(10, 50, 90, 99)) -> str:
    import numpy as np

    if len(x) == 0:
        return "n/a"
    return "  ".join(f"p{q} {np.percentile(x, q):7.3f}" for q in qs)


def _decode_per_step(log) -> tuple[Any, Any]:
    """(host ms, device ms) of each step's decode windows, steps that have both."""
    import numpy as np

    sg = log.segments
    if "decode" not in log.labels:
        return np.zeros(0), np.zeros(0)
    dec = (sg.label == log.labels.index("decode")) & (sg.step >= 0)
    n = len(log.steps)
    ms = (sg.t_end_s - sg.t_start_s) * 1e3
    host = np.bincount(sg.step[dec & (sg.is_device == 0)], ms[dec & (sg.is_device == 0)], n)
    dev = np.bincount(sg.step[dec & (sg.is_device == 1)], ms[dec & (sg.is_device == 1)], n)
    both = (host > 0) & (dev > 0)
    return host[both], dev[both]


def recorded_run(device: str, *, is_async: bool, seconds: float, rate: float, out: str | None):
    import torch

    import tracekit
    from demo_engine.config import WorkloadConfig, rung_config
    from demo_engine.engine import Engine
    from demo_engine.tokenizer import train_tokenizer
    from demo_engine.torch_runner import TorchModelRunner
    from demo_engine.workload import make_trace
    from tracekit.capture.device import CudaEventTimer

    cfg = rung_config("+compact history").replace(is_async_scheduling=is_async)
    wl = WorkloadConfig(rate_req_s=rate)
    tok = train_tokenizer(cfg.vocab_size, wl)
    runner = TorchModelRunner(cfg, tok.get_vocab_size(), device=device)
    timer = CudaEventTimer() if device == "cuda" else None
    nvtx_ok = _has_nvtx()
    name = "async" if is_async else "sync"
    path = None if out is None else os.path.join(out, f"gpu-check-{name}.npz")
    config = {"rung": f"gpu-check {name}", "seed": 1, "rate": rate, "engine": cfg.to_dict()}
    config["torch"] = torch.__version__
    if device == "cuda":
        config["gpu"] = torch.cuda.get_device_name()
    rec = tracekit.Recorder(path, config=config, nvtx=nvtx_ok, device_timer=timer)
    with rec:
        eng = Engine(cfg, rec, tok, runner=runner)
        try:
            eng.startup()
            stats = eng.serve(make_trace(1, seconds, wl), seconds)
        finally:
            eng.close()
    return rec.log(), stats


def report_run(name: str, log, stats) -> None:
    import numpy as np

    from tracekit.attribution.itl import partition

    p = partition(log)
    host, dev = _decode_per_step(log)
    print(
        f"\n[{name}] {stats.num_steps} steps, {stats.num_tokens} tokens, "
        f"{stats.tok_per_s:.0f} tok/s"
    )
    print(f"  host decode window per step, ms:   {_quantiles(host)}")
    print(f"  device decode window per step, ms: {_quantiles(dev)}")
    if len(dev):
        under = host < dev
        print(
            f"  host timer understates device time in {100 * under.mean():.1f}% of "
            f"{len(dev)} steps (median device - host {np.median(dev - host):+.3f} ms)"
        )
    else:
        print("  host timer understates device time: n/a (no device windows)")
    print(
        f"  reconciliation: max |gap - sum(parts)| = {p.reconcile_max_err_ms:.2e} ms "
        f"over {len(p)} gaps"
    )
    cal = log.meta.get("device_calibration")
    if cal:
        print(
            f"  device clock drift {log.meta.get('device_clock_drift_ppm', float('nan')):+.1f} "
            "ppm, "
            f"calibration +/-{cal.get('start_uncertainty_ms', float('nan')) * 1e3:.1f} us (start), "
            f"max placement error {cal.get('max_placement_err_ms', float('nan')) * 1e3:.1f} us; "
            f"windows {cal.get('num_windows')} ({cal.get('num_resolved_lazily')} lazily, "
            f"{cal.get('num_resolved_at_stop')} at stop)"
            + (f"; ERROR {cal['error']}" if "error" in cal else "")
        )
    total = p.gap_ms.sum()
    if total > 0:
        shares = {lb: p.column(lb).sum() / total for lb in p.labels}
        top = sorted(shares.items(), key=lambda kv: -kv[1])[:6]
        print("  all gaps by label: " + ", ".join(f"{lb} {100 * s:.1f}%" for lb, s in top))


def overhead(device: str, *, pairs: int, requests: int, max_new: int) -> None:
    from bench_overhead import fixed_workload

    import tracekit
    from demo_engine.config import WorkloadConfig, rung_config
    from demo_engine.engine import Engine
    from demo_engine.tokenizer import train_tokenizer
    from demo_engine.torch_runner import TorchModelRunner
    from tracekit.capture.device import CudaEventTimer

    cfg = rung_config("+compact history")
    tok = train_tokenizer(cfg.vocab_size, WorkloadConfig())
    trace = fixed_workload(1, requests, max_new)
    nvtx_ok = _has_nvtx()

    def serve(enabled: bool, trace) -> tuple[float, int]:
        runner = TorchModelRunner(cfg, tok.get_vocab_size(), device=device)
        timer = CudaEventTimer() if (enabled and device == "cuda") else None
        rec = tracekit.Recorder(None, enabled=enabled, nvtx=nvtx_ok, device_timer=timer)
        with rec:
            eng = Engine(cfg, rec, tok, runner=runner)
            t0 = time.perf_counter()
            stats = eng.serve(trace, 3600.0, is_drain=True)
            wall = time.perf_counter() - t0
            eng.close()
        return wall, stats.num_tokens

    serve(True, trace[:4])  # warm up kernels and caches
    ratios = []
    print(
        f"\n[overhead] {len(trace)} requests at t=0, outputs <= {max_new}; recorder off vs on "
        f"(NVTX {'on' if nvtx_ok else 'not installed'}, "
        f"CUDA events {'on' if device == 'cuda' else 'n/a'}), ABBA"
    )
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {en: serve(en, trace) for en in order}
        (w_off, n_off), (w_on, n_on) = got[False], got[True]
        if n_off != n_on:
            sys.exit(f"pair {i}: the arms did different work ({n_off} vs {n_on} tokens)")
        ratios.append(w_off / w_on)
        print(
            f"  pair {i + 1}: off {n_off / w_off:7.0f} tok/s  on {n_on / w_on:7.0f} tok/s  "
            f"on/off {w_off / w_on:.3f}"
        )
    med = statistics.median(ratios)
    print(
        f"  tokens/s ratio on/off: median {med:.4f} [{min(ratios):.4f}-{max(ratios):.4f}] "
        f"-> overhead {100 * (1 - med):+.2f}%"
    )


def per_event(device: str, n: int = 20_000) -> None:
    import tracekit
    from tracekit.capture.device import CudaEventTimer

    timer = CudaEventTimer() if device == "cuda" else None
    rec = tracekit.Recorder(None, gc=False, handle_signals=False, device_timer=timer)
    with rec:
        plain, dev = rec.segment("schedule"), rec.segment("decode", device=True)

        def timed(seg) -> float:
            t0 = time.perf_counter_ns()
            for i in range(n):
                if i % 32 == 0:
                    with rec.step():  # step ends resolve finished windows, as in an engine
                        pass
                with seg:
                    pass
            return (time.perf_counter_ns() - t0) / n

        a = min(timed(plain) for _ in range(3))
        b = min(timed(dev) for _ in range(3))
    kind = "CUDA events" if timer else "no device timer"
    print(
        f"\n[per event] segment enter+exit: plain {a / 1e3:.2f} us, "
        f"device ({kind}) {b / 1e3:.2f} us"
    )


def _has_nvtx() -> bool:
    import importlib.util

    return importlib.util.find_spec("nvtx") is not None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="total budget, about")
    ap.add_argument("--rate", type=float, default=12.0, help="arrival rate of the recorded runs")
    ap.add_argument("--out", default=None, help="keep the two recorded logs here")
    ap.add_argument("--cpu", action="store_true", help="dry run on torch's CPU backend")
    args = ap.parse_args()
    device = _cuda_or_exit(args.cpu)
    import torch

    torch.set_num_threads(1)
    what = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    print(f"gpu_check: torch {torch.__version__} on {what}; nvtx {'yes' if _has_nvtx() else 'no'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    run_s = args.seconds / 4
    for is_async in (False, True):
        log, stats = recorded_run(
            device, is_async=is_async, seconds=run_s, rate=args.rate, out=args.out
        )
        report_run("async scheduling" if is_async else "synchronous", log, stats)
    overhead(device, pairs=4, requests=32, max_new=64)
    per_event(device)


if __name__ == "__main__":
    main()
