"""What do device segments cost on the host? `FakeDeviceTimer` on the wall clock, no GPU.

    python bench/bench_device.py [--pairs 6] [--requests 24]

The fake's primitives are a few attribute reads, cheaper than `cudaEventRecord` and
`cudaEventQuery` (a few microseconds each on a real GPU; bench/gpu_check.py measures
those), so these figures are tracekit's own bookkeeping: the event pair, the pending queue,
lazy resolution at step end, the chained mapping onto the host clock.

1. Per event: enter+exit of a plain segment, of a device segment, and a step end that
   resolves one window, net of an empty loop.
2. End to end: the numpy demo engine (its model segments are `device=True`) serving one
   fixed workload with a recorder without and with a fake device timer, ABBA order; the
   tokens/s ratio.

Benchmarks live outside the tests: nothing here asserts on wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = "1"  # before numpy is imported

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from bench_overhead import fixed_workload  # noqa: E402

import tracekit  # noqa: E402
from demo_engine.config import WorkloadConfig, rung_config  # noqa: E402
from demo_engine.engine import Engine  # noqa: E402
from demo_engine.tokenizer import train_tokenizer  # noqa: E402
from tracekit.capture.device import FakeDeviceTimer  # noqa: E402


class WallClock:
    """`time.perf_counter_ns` with the `t` attribute the fake device reads (and, at
    synchronize, waits for)."""

    def __call__(self) -> int:
        return time.perf_counter_ns()

    @property
    def t(self) -> int:
        return time.perf_counter_ns()

    @t.setter
    def t(self, tick: int) -> None:
        while time.perf_counter_ns() < tick:
            pass


def fake_timer(clock: WallClock) -> FakeDeviceTimer:
    return FakeDeviceTimer(clock, lag_ms=0.005, exec_ms=0.02, resolve_delay_ms=0.0)


def per_event(n: int = 100_000) -> dict[str, float]:
    clock = WallClock()
    rec = tracekit.Recorder(
        None, gc=False, handle_signals=False, clock=clock, device_timer=fake_timer(clock)
    )
    res: dict[str, float] = {}
    with rec:
        plain, dev = rec.segment("schedule"), rec.segment("decode", device=True)

        def timed(fn) -> float:
            t0 = time.perf_counter_ns()
            fn()
            return (time.perf_counter_ns() - t0) / n

        def empty() -> None:
            for _ in range(n):
                pass

        def seg(s) -> None:
            for _ in range(n):
                with s:
                    pass

        def steps(with_device: bool) -> None:
            for _ in range(n):
                with rec.step():
                    if with_device:
                        with dev:
                            pass

        base = min(timed(empty) for _ in range(3))
        res["plain segment enter+exit"] = min(timed(lambda: seg(plain)) for _ in range(3)) - base
        empty_step = min(timed(lambda: steps(False)) for _ in range(3)) - base
        dev_step = min(timed(lambda: steps(True)) for _ in range(3)) - base
        # enter+exit, the event pair, and its resolution at the step's end
        res["device segment, resolved at step end"] = dev_step - empty_step
        res["empty step"] = empty_step
    return res


def serve(cfg, tok, trace, *, device: bool) -> tuple[float, int]:
    clock = WallClock()
    timer = fake_timer(clock) if device else None
    rec = tracekit.Recorder(None, gc=True, clock=clock, device_timer=timer)
    with rec:
        eng = Engine(cfg, rec, tok)
        t0 = time.perf_counter()
        stats = eng.serve(trace, 3600.0, is_drain=True)
        wall = time.perf_counter() - t0
        eng.close()
    if device:
        cal = rec.log().meta["device_calibration"]
        assert cal["num_windows"] == int((rec.log().segments.is_device == 1).sum())
    return wall, stats.num_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    print("per event (enabled, in-memory, wall clock, net of an empty loop):")
    for name, ns in per_event().items():
        print(f"  {name:32s} {ns / 1000:6.3f} us")
    cfg = rung_config("+compact history")
    tok = train_tokenizer(cfg.vocab_size, WorkloadConfig())
    trace = fixed_workload(1, args.requests, args.max_new_tokens)
    serve(cfg, tok, trace[:4], device=True)  # warm up
    ratios = []
    print(f"end to end: {len(trace)} requests at t=0, outputs <= {args.max_new_tokens}, ABBA")
    for i in range(args.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        got = {d: serve(cfg, tok, trace, device=d) for d in order}
        (w0, n0), (w1, n1) = got[False], got[True]
        if n0 != n1:
            sys.exit(f"pair {i}: the arms did different work ({n0} vs {n1} tokens)")
        ratios.append(w0 / w1)
        print(
            f"  pair {i + 1}: host only {n0 / w0:6.0f} tok/s  + device timer {n1 / w1:6.0f} tok/s"
        )
    med = statistics.median(ratios)
    print(
        f"tokens/s ratio with/without the fake device timer: median {med:.4f} "
        f"[{min(ratios):.4f}-{max(ratios):.4f}] -> overhead {100 * (1 - med):+.2f}%"
    )


if __name__ == "__main__":
    main()
