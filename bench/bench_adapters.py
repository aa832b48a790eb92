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
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["transformers", "vllm", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per side (with / without)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model", help="a HF causal-LM folder (default: build the tiny Llama)")
    args = ap.parse_args()

    import torch

    from engine_adapters.tiny_model import build_tiny_llama

    torch.set_num_threads(1)
    model_dir = args.model or build_tiny_llama(os.path.expanduser("~/.cache/tracekit/tiny-llama"))
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
