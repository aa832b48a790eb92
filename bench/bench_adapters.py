"""Engine throughput with and without a tracekit adapter, interleaved in one run.

    python bench/bench_adapters.py                       # both engines, 6 rounds each
    python bench/bench_adapters.py --engine vllm --rounds 10 --requests 32

Each engine is built once (tiny random Llama, CPU, one torch thread) and serves the same
batch of requests in every round; rounds alternate without / with the adapter (ABBA order,
so a slow drift of the machine hits both sides alike). "With" means a running
`tracekit.Recorder` writing to a temporary file plus the adapter installed; "without"
means neither. The timed window is the serving only: from the first request to the last
token (transformers: a started manager, `add_request` ... `get_result`; vLLM:
`LLM.generate`). Printed: tokens/s per round; per side the median and the best round
(the one least disturbed by other processes), their ratios, and the adapter's cost per
engine step from the best rounds. Needs the `adapters` extra (docs/adapters.md).

    python bench/bench_adapters.py --step-cost --engine vllm --batches 1,8,32,256 --pairs 6

`--step-cost`: the adapter's own CPU cost per engine-core step, per batch size. For each
batch size B, B requests of `--max-new-tokens` tokens are served in one `LLM.generate`
(every request in the running batch at once: `max_num_seqs` is the largest B), in
interleaved pairs of rounds (recorder and adapter off, then on, the order alternating
pair by pair). Measured per round: the CPU time of the thread that runs the engine core
(`time.thread_time`: the engine's own loop, what a GPU would wait on; unaffected by other
processes taking the CPU away) and of the whole process (`time.process_time`: adds the
recorder's writer thread), divided by the engine-core steps of the round (the steps
recorded in the "on" round of the pair: the same requests take the same steps). Printed:
per batch size, the difference on - off per step in us, median of the pairs [min-max],
and as a share of the "off" step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _abba(rounds: int) -> list[bool]:
    """with-adapter flags in ABBA order: F T T F F T T F ..."""
    return [(i % 4) in (1, 2) for i in range(rounds * 2)]


class TransformersBench:
    name = "transformers-cb"

    def __init__(self, model_dir: str, args: argparse.Namespace) -> None:
        import torch
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            ContinuousBatchingConfig,
            GenerationConfig,
        )

        from engine_adapters.tiny_model import tiny_prompts

        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        self.inputs = [tok(p).input_ids for p in tiny_prompts(args.requests, seed=0)]
        self.max_new = args.max_new_tokens
        gen = GenerationConfig(max_new_tokens=self.max_new, do_sample=False, eos_token_id=-1)
        cb = ContinuousBatchingConfig(
            page_size=16, num_blocks=256, use_async_batching=False, use_cuda_graph=False
        )
        self.manager = model.init_continuous_batching(gen, cb)
        self.manager.start()

    def serve(self, rec) -> tuple[int, float]:
        from engine_adapters.transformers_cb import instrument_transformers

        m = self.manager
        adapter = instrument_transformers(rec, m) if rec is not None else None
        try:
            t0 = time.perf_counter()
            for ids in self.inputs:
                m.add_request(ids, max_new_tokens=self.max_new)
            tokens = done = 0
            while done < len(self.inputs):
                r = m.get_result(timeout=60)
                if r is None:
                    raise RuntimeError("the engine stopped answering")
                if r.is_finished():
                    done += 1
                    tokens += len(r.generated_tokens)
            return tokens, time.perf_counter() - t0
        finally:
            if adapter is not None:
                adapter.uninstall()

    def close(self) -> None:
        self.manager.stop(block=True)


class VllmBench:
    name = "vllm"

    def __init__(self, model_dir: str, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        from engine_adapters.tiny_model import tiny_prompts

        self.llm = LLM(
            model=model_dir,
            dtype="float32",
            enforce_eager=True,
            distributed_executor_backend="uni",
            max_model_len=256,
            disable_log_stats=False,
            seed=0,
        )
        self.prompts = tiny_prompts(args.requests, seed=0)
        self.params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True, temperature=0)

    def serve(self, rec) -> tuple[int, float]:
        from engine_adapters.vllm_v1 import instrument_vllm

        adapter = instrument_vllm(rec, self.llm) if rec is not None else None
        try:
            t0 = time.perf_counter()
            outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
            wall = time.perf_counter() - t0
        finally:
            if adapter is not None:
                adapter.uninstall()
        return sum(len(o.outputs[0].token_ids) for o in outs), wall

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def run(bench, rounds: int, tmp: str) -> dict:
    import tracekit

    bench.serve(None)  # warm-up round, not counted
    rates: dict[bool, list[float]] = {False: [], True: []}
    steps: list[int] = []
    walls: dict[bool, list[float]] = {False: [], True: []}
    for i, with_adapter in enumerate(_abba(rounds)):
        rec = None
        if with_adapter:
            rec = tracekit.Recorder(os.path.join(tmp, f"{bench.name}-{i}.npz")).start()
        try:
            tokens, wall = bench.serve(rec)
        finally:
            if rec is not None:
                log = rec.stop()
                steps.append(len(log.steps))
        rates[with_adapter].append(tokens / wall)
        walls[with_adapter].append(wall)
        tag = "with   " if with_adapter else "without"
        print(f"  {bench.name:16s} round {i + 1:2d} {tag} {tokens / wall:8.1f} tok/s", flush=True)
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    num_steps = statistics.median(steps)
    # min wall: the round least disturbed by other processes (a shared machine is noisy)
    best_cost_s = min(walls[True]) - min(walls[False])
    return {"engine": bench.name, "off": off, "on": on, "steps": num_steps,
            "best_off": max(rates[False]), "best_on": max(rates[True]),
            "per_step_us": best_cost_s / num_steps * 1e6}  # fmt: skip


class OwnTime:
    """Times the adapter's own code: every method the adapter wraps gets a timer inside the
    adapter's wrapper (around the original) and one outside it; the adapter's own time in a
    call is outer - inner (its bookkeeping and the recorder calls it makes). A wrapped
    method that runs inside another one (`schedule` inside the engine-core step) is timed
    by its own pair, so nothing is counted twice. Each call also counts the inner timer's
    own overhead: measured here on a no-op (`bias_ns`) and taken off every call.
    `untimed`: wrapped methods left without timers (the vLLM adapter's `allocate_slots`
    wrapper, one call per scheduled request, is bypassed while nothing waits only when it
    is the outermost wrapper: timers over it would keep it on; its cost while requests
    wait, about 0.2 us a call, is then in the engine's own time, not here).

    Summed per engine-core step (from the end of one `step_name` call to the end of the
    next): `per_step_ns`. Wall time: its median over the steps leaves out the rare step
    whose adapter code was preempted by another process (a shared machine)."""

    def __init__(self, step_name: str, untimed: tuple[str, ...] = ()) -> None:
        self.own_ns = 0
        self.per_step_ns: list[int] = []
        self._step_name = step_name
        self._untimed = untimed
        self.bias_ns = self._bias_ns()
        self._targets: list[tuple[Any, str, Any]] = []  # (object, name, its own attribute)
        self._outer: list[tuple[Any, str, Any]] = []

    def before(self, adapter_cls: Any, rec: Any, engine: Any) -> None:
        """Put the inner timers on what the adapter will wrap (found by a trial install)."""
        probe = adapter_cls(rec, engine).install()
        targets = [
            (obj, name) for obj, name, _own, _w in probe._patches._undo if name not in self._untimed
        ]
        probe.uninstall()
        for obj, name in targets:
            own = vars(obj).get(name, _MISSING)
            self._targets.append((obj, name, own))
            setattr(obj, name, self._timed(getattr(obj, name), -1))

    def after(self) -> None:
        """Put the outer timers on the adapter's wrappers (after its install)."""
        for obj, name, _own in self._targets:
            wrapper = vars(obj)[name]
            self._outer.append((obj, name, wrapper))
            setattr(obj, name, self._timed(wrapper, +1, name == self._step_name))

    def remove_outer(self) -> None:
        for obj, name, wrapper in self._outer:
            setattr(obj, name, wrapper)
        self._outer.clear()

    def remove_inner(self) -> None:
        for obj, name, own in self._targets:
            if own is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        self._targets.clear()

    def _bias_ns(self, n: int = 20_000) -> float:
        """What the timers count in a call when the wrapper does nothing (median of 5)."""
        import statistics

        def noop() -> None:
            return None

        runs = []
        for _ in range(5):
            f = self._timed(self._timed(noop, -1), +1)
            self.own_ns = 0
            for _ in range(n):
                f()
            runs.append(self.own_ns / n)
        self.own_ns = 0
        return statistics.median(runs)

    def _timed(self, fn: Any, sign: int, ends_step: bool = False) -> Any:
        pc = time.perf_counter_ns
        bias = getattr(self, "bias_ns", 0.0) if sign > 0 else 0.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                self.own_ns += sign * (pc() - t0) - bias
                if ends_step:
                    self.per_step_ns.append(self.own_ns)
                    self.own_ns = 0

        return timed


_MISSING = object()


def step_cost_vllm(model_dir: str, args: argparse.Namespace, tmp: str) -> None:
    """The vLLM adapter's CPU cost per engine-core step, per batch size (`--step-cost`)."""
    import statistics

    from vllm import LLM, SamplingParams

    import tracekit
    from engine_adapters.tiny_model import tiny_prompts
    from engine_adapters.vllm_v1 import VllmV1Adapter

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=256,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, 64 * max(batches)),  # every prompt in one step
        disable_log_stats=False,
        seed=0,
    )
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True, temperature=0)
    try:

        def serve(prompts: list[str], arm: str, i: int) -> tuple[float, float, int, float]:
            """(engine thread CPU s, process CPU s, steps, adapter's own s) of one round."""
            rec = adapter = own = None
            if arm != "off":
                rec = tracekit.Recorder(os.path.join(tmp, f"vllm-step-{arm}-{i}.npz")).start()
                if arm == "own":
                    own = OwnTime("step_fn", untimed=("allocate_slots",))
                    own.before(VllmV1Adapter, rec, llm)
                adapter = VllmV1Adapter(rec, llm).install()
                if own is not None:
                    own.after()
            try:
                c0, p0 = time.thread_time(), time.process_time()
                llm.generate(prompts, params, use_tqdm=False)
                c1, p1 = time.thread_time(), time.process_time()
            finally:
                if own is not None:
                    own.remove_outer()
                if adapter is not None:
                    adapter.uninstall()
                if own is not None:
                    own.remove_inner()
                steps = len(rec.stop().steps) if rec is not None else 0
            # the steps that ran (EngineCore.step returns at once without requests: no step)
            ran = [x for x in own.per_step_ns if x > 0] if own is not None else [0]
            return c1 - c0, p1 - p0, steps, statistics.median(ran) * 1e-9

        print(
            f"vLLM in process, {args.max_new_tokens} new tokens a request, {args.pairs} pairs "
            "of rounds a batch size; per engine-core step, median [min-max] over the pairs:"
        )
        print("  own: the adapter's own time, median over the steps of a round (timers around")
        print("       each wrapped method, outer - inner; wall time, preempted steps left out)")
        print("  thread / process: CPU time on - off (engine thread / whole process)")
        print(f"{'batch':>5s} {'steps':>5s} {'off us':>7s} {'own us':>22s} {'share':>6s}"
              f" {'thread us':>24s} {'process us':>24s}")  # fmt: skip
        for b in batches:
            prompts = tiny_prompts(b, seed=b)
            serve(prompts, "off", 0)  # warm-up, not counted
            thread, proc, off_us, steps, own_us = [], [], [], [], []
            for k in range(args.pairs):
                r = {}
                for arm in ("off", "on", "own") if k % 2 == 0 else ("own", "on", "off"):
                    r[arm] = serve(prompts, arm, k)
                n = r["on"][2]
                steps.append(n)
                off_us.append(r["off"][0] / n * 1e6)
                thread.append((r["on"][0] - r["off"][0]) / n * 1e6)
                proc.append((r["on"][1] - r["off"][1]) / n * 1e6)
                own_us.append(r["own"][3] * 1e6)

            def spread(xs: list[float]) -> str:
                return f"{statistics.median(xs):7.1f} [{min(xs):.1f} - {max(xs):.1f}]"

            share = statistics.median(own_us) / statistics.median(off_us) * 100
            print(f"{b:5d} {statistics.median(steps):5.0f} {statistics.median(off_us):7.0f}"
                  f" {spread(own_us):>22s} {share:5.2f}% {spread(thread):>24s}"
                  f" {spread(proc):>24s}", flush=True)  # fmt: skip
    finally:
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["transformers", "vllm", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per side (with / without)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model", help="a HF causal-LM folder (default: build the tiny Llama)")
    ap.add_argument(
        "--step-cost",
        action="store_true",
        help="the adapter's CPU cost per engine-core step, per batch size (vLLM)",
    )
    ap.add_argument("--batches", default="1,8,32,256", help="with --step-cost: batch sizes")
    ap.add_argument("--pairs", type=int, default=6, help="with --step-cost: pairs of rounds")
    args = ap.parse_args()

    import torch

    from engine_adapters.tiny_model import build_tiny_llama

    torch.set_num_threads(1)
    model_dir = args.model or build_tiny_llama(os.path.expanduser("~/.cache/tracekit/tiny-llama"))
    if args.step_cost:
        if args.engine == "transformers":
            ap.error("--step-cost measures the vLLM adapter (--engine vllm)")
        with tempfile.TemporaryDirectory(prefix="tracekit-bench-") as tmp:
            step_cost_vllm(model_dir, args, tmp)
        return
    kinds = {"transformers": [TransformersBench], "vllm": [VllmBench]}
    classes = kinds.get(args.engine, [TransformersBench, VllmBench])
    results = []
    with tempfile.TemporaryDirectory(prefix="tracekit-bench-") as tmp:
        for cls in classes:
            bench = cls(model_dir, args)
            try:
                results.append(run(bench, args.rounds, tmp))
            finally:
                bench.close()
    print()
    print(f"{args.requests} requests x {args.max_new_tokens} tokens, {args.rounds} rounds a side")
    print("tok/s: median over rounds, and best round (least disturbed); cost/step from the")
    print("best rounds: (with - without wall) / steps")
    print(f"{'engine':16s} {'without':>8s} {'with':>8s} {'ratio':>6s} {'best w/o':>9s}"
          f" {'best w/':>8s} {'ratio':>6s} {'steps':>6s} {'cost/step':>10s}")  # fmt: skip
    for r in results:
        print(
            f"{r['engine']:16s} {r['off']:8.1f} {r['on']:8.1f} {r['on'] / r['off']:6.3f}"
            f" {r['best_off']:9.1f} {r['best_on']:8.1f} {r['best_on'] / r['best_off']:6.3f}"
            f" {r['steps']:6.0f} {r['per_step_us']:8.0f}us"
        )


if __name__ == "__main__":
    main()
