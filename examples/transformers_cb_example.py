"""Record a transformers continuous-batching run with tracekit, then analyse it.

    python examples/transformers_cb_example.py                 # tiny random Llama, CPU
    python examples/transformers_cb_example.py --model DIR --out raw/cb.npz
    tracekit analyze raw/transformers_cb.npz                   # what the script runs too
    tracekit report raw/transformers_cb.npz -o cb.html

Requests arrive at a steady rate through the manager's streaming API
(`init_continuous_batching`, `start`, `add_request`, `get_result`), the way a server feeds
it. The default KV pool (8 pages of 16 tokens) is small on purpose: the engine offloads
requests and the report shows what that costs (`preempt`). Needs the `adapters` extra
(docs/adapters.md).
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads on 2 cores is slower
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a HF causal-LM folder (default: build the tiny Llama)")
    ap.add_argument("--out", default="raw/transformers_cb.npz", help="the raw log to write")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rate", type=float, default=40.0, help="arrivals per second (Poisson)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--num-blocks", type=int, default=8, help="KV pages: small forces offloads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None, help="also write an HTML report here")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        ContinuousBatchingConfig,
        GenerationConfig,
    )

    import tracekit
    from engine_adapters.tiny_model import build_tiny_llama, tiny_prompts
    from engine_adapters.transformers_cb import instrument_transformers

    torch.set_num_threads(1)
    path = args.model or build_tiny_llama(os.path.expanduser("~/.cache/tracekit/tiny-llama"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    prompts = [tok(p).input_ids for p in tiny_prompts(args.requests, seed=args.seed)]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(
        page_size=args.page_size,
        num_blocks=args.num_blocks,
        use_async_batching=False,  # the adapter records synchronous batching
        use_cuda_graph=False,
    )
    manager = model.init_continuous_batching(gen, cb)
    config = {"engine": "transformers-cb", "seed": args.seed, "rate": args.rate, **vars(args)}
    rec = tracekit.Recorder(args.out, config=config)
    rng = random.Random(args.seed)
    done = 0
    t_start = time.perf_counter()
    with rec, instrument_transformers(rec, manager):
        manager.start()
        try:
            for ids in prompts:
                manager.add_request(ids, max_new_tokens=args.max_new_tokens)
                time.sleep(rng.expovariate(args.rate))
            while done < len(prompts):
                result = manager.get_result(timeout=30)
                if result is None:
                    raise RuntimeError("the engine stopped answering")
                done += result.is_finished()
        finally:
            manager.stop(block=True)
    print(f"recorded {args.out}: {done} requests in {time.perf_counter() - t_start:.1f} s")
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
