"""What `vllm serve` stopped while streams run loses from the engine core's log.

    python bench/bench_serve_stop.py                 # 3 stops of each setting, tiny model
    python bench/bench_serve_stop.py --repeats 5 --settings default,no-wait

Each stop: start `vllm serve` (the API server module, default multiprocess mode) of the
tiny local model with tracekit's plugin recording, stream ``--streams`` completions of
``--max-tokens`` tokens with a real httpx client, SIGTERM the API server ``--after``
seconds later while they run, merge the directory, and print:

- how the engine core ended (killed: recovered from parts, or a whole log);
- ``core_end - sigterm``: up to when its rows are complete, against when the API server
  got the SIGTERM (both on the run's clock): negative means rows before the signal were
  lost;
- ``after_ms``: from the end of the engine core's complete rows to the API server's last
  chunk, the window whose client gaps are ``unrecorded:engine_core``;
- tokens the API server streamed (its client-boundary record) that the engine core's log
  lacks, of all it streamed, and the client-gap time left unrecorded (in how many gaps).

Settings: ``default`` (vLLM's ``--shutdown-timeout 0``, the plugin's flush before the
kill), ``no-wait`` (``--shutdown-timeout 0`` with ``TRACEKIT_VLLM_KILL_FLUSH_S=0``: vLLM's
SIGTERM-then-SIGKILL with nothing in between, what the plugin lost before), ``drain5``
(``--shutdown-timeout 5``: the engine core drains its requests for up to 5 s). Needs the
`adapters` extra and the editable install (docs/adapters.md). The machine's other load
moves every figure: read the spread over repeats.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SETTINGS = {
    "default": ([], {}),
    "no-wait": ([], {"TRACEKIT_VLLM_KILL_FLUSH_S": "0"}),
    "drain5": (["--shutdown-timeout", "5"], {}),
}


def one_stop(model: str, base: str, setting: str, args: argparse.Namespace) -> dict:
    import numpy as np

    from engine_adapters import serve_harness as sh
    from tracekit.analysis.run import merge_run as merge_dir
    from tracekit.attribution.client import client_partition
    from tracekit.log.serve_contract import CORE

    extra, env = SETTINGS[setting]
    rec = tempfile.mkdtemp(prefix=f"rec-{setting}-", dir=base)
    server = sh.start_server(model, record_dir=rec, log_path=rec + ".log", extra_args=extra,
                             flush_s=args.flush_s, env_extra=env)  # fmt: skip
    bodies = [sh.completion_body(model, f"the quick brown fox {i} jumps", args.max_tokens)
              for i in range(args.streams)]  # fmt: skip
    streams, t_sig_ns, _ = sh.stop_while_streaming(server, bodies, args.after)
    log = merge_dir(rec)
    procs = log.meta["processes"]
    core = next(i for i, p in enumerate(procs) if p["role"] == CORE)
    row = log.coverage.process.tolist().index(core)
    core_end = float(log.coverage.t_end_s[row])
    t_sig = t_sig_ns * 1e-9 - log.meta["t0_tick"] * log.meta.get("seconds_per_tick", 1e-9)
    cp = client_partition(log)
    # tokens the API server streamed (its client-boundary record) that the core's log lacks
    sent, core_tok = collections.Counter(), collections.Counter()
    for r, n in zip(log.client_emissions.request.tolist(),
                    log.client_emissions.num_tokens.tolist(), strict=True):  # fmt: skip
        sent[r] += n
    for r, n in zip(log.emissions.request.tolist(), log.emissions.num_tokens.tolist(),
                    strict=True):  # fmt: skip
        core_tok[r] += n
    last = float(log.client_emissions.t_s.max()) if len(log.client_emissions) else core_end
    return {
        "setting": setting,
        "core": "killed" if procs[core]["recovered"] else "whole log",
        "core_end_minus_sigterm_ms": (core_end - t_sig) * 1e3,
        "after_ms": max(0.0, last - core_end) * 1e3,
        "lost_tokens": sum(max(0, sent[k] - core_tok[k]) for k in sent),
        "client_tokens": sum(sent.values()),
        "client_chunks": sum(len(s.t_ns) for s in streams),
        "unrecorded_ms": float(np.sum(cp.unrecorded_ms())),
        "unrecorded_gaps": int(np.sum(cp.unrecorded_ms() > 0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="default,no-wait,drain5")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=480)
    ap.add_argument("--after", type=float, default=1.5, help="seconds of streaming before SIGTERM")
    ap.add_argument("--flush-s", type=float, default=0.5, help="TRACEKIT_VLLM_FLUSH_S")
    args = ap.parse_args()
    settings = args.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"--settings: {s!r} is not one of {', '.join(SETTINGS)}")
    from engine_adapters.tiny_model import build_tiny_llama

    with tempfile.TemporaryDirectory() as base:
        model = build_tiny_llama(os.path.join(base, "model"))
        print(f"{'setting':<9}{'core':>10}{'end-sigterm ms':>16}{'after ms':>10}"
              f"{'lost tok':>10}{'unrec ms':>10}{'gaps':>6}")  # fmt: skip
        for _ in range(args.repeats):  # interleaved: the machine's drift hits each alike
            for s in settings:
                r = one_stop(model, base, s, args)
                lost = f"{r['lost_tokens']}/{r['client_tokens']}"
                print(f"{s:<9}{r['core']:>10}{r['core_end_minus_sigterm_ms']:>16.1f}"
                      f"{r['after_ms']:>10.1f}{lost:>10}{r['unrecorded_ms']:>10.1f}"
                      f"{r['unrecorded_gaps']:>6}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
