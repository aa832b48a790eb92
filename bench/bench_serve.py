"""Tokens/s of `vllm serve` with and without tracekit's plugin, interleaved.

    python bench/bench_serve.py                    # tiny random Llama, 8 rounds per side
    python bench/bench_serve.py --rounds 12 --requests 32 --max-tokens 64

Two servers of the same model run side by side for the whole benchmark, started the same
way; one has ``TRACEKIT_VLLM_DIR`` set (the plugin records its three processes), the other
not (the plugin loads and stays inert). Rounds alternate between them in ABBA order (a
slow drift of the machine hits both alike); a round streams ``--requests`` completions of
``--max-tokens`` tokens at once to one server with an httpx client and times from the
first request to the last chunk. Printed: tokens/s per round, then per ABBA pair the ratio
with / without, and their median with the spread (min..max) over pairs: the plugin's cost
is ``1 - ratio``. On a machine shared with other work the spread is the honest figure.
Needs the `adapters` extra and the editable install (docs/adapters.md).

    python bench/bench_serve.py --frontend-only    # no server: the API server's cost per
                                                   # streamed chunk, plain vs recorded

Per process, CPU seconds per generated token (printed after the rates): each
round reads the CPU time of every process of the server (the API server and its
descendants: engine core, worker; the sum over each process's threads of
``/proc/PID/task/TID/schedstat``, in nanoseconds) before and after, and divides
each role's CPU by the round's tokens. Per ABBA pair the ratio with / without per role,
and their median with the spread: CPU time is what the plugin adds to each process,
less sensitive than throughput to the other work on the machine. Caveat, read in vLLM:
the engine core and the workers poll their shared-memory queues for a while before they
block, so their CPU time grows with the wall time they wait, not only with their work; the
API server blocks in its event loop, so its figure is the cleanest.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(x) for x in fh.read().split()]
        except OSError:
            continue
    return out


def _role(pid: int) -> str:
    """engine_core, worker or api_server (the launcher); other for vLLM's helpers."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            comm = fh.read().strip()
    except OSError:
        return "other"
    if "EngineCor" in comm:
        return "engine_core"
    if "Worker" in comm:
        return "worker"
    if "APIServer" in comm or "ApiServer" in comm:
        return "api_server"
    return "other"


def _cpu_s(pid: int, stat_fields: list[str], tick: int) -> float:
    """CPU seconds so far of process `pid`: the sum over its threads of the time on a CPU
    from ``/proc/PID/task/TID/schedstat`` (nanoseconds), else ``utime + stime`` from its
    stat (clock ticks: 10 ms steps, coarse against a round's tenth of a second)."""
    total, seen = 0, False
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as fh:
                    total += int(fh.read().split()[0])
                    seen = True
            except (OSError, ValueError, IndexError):
                continue  # a thread that exited meanwhile
    except OSError:
        pass
    if seen:
        return total / 1e9
    return (int(stat_fields[11]) + int(stat_fields[12])) / tick


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of `root` (the API server) and its descendants, summed by role
    (`_cpu_s`)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            todo += _children(pid)
        except OSError:
            continue  # exited meanwhile
        role = "api_server" if pid == root else _role(pid)
        out[role] = out.get(role, 0.0) + _cpu_s(pid, fields, tick)
    return out


def _abba(rounds: int) -> list[bool]:
    """with-plugin flags in ABBA order: F T T F F T T F ..."""
    return [(i % 4) in (1, 2) for i in range(rounds * 2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a HF causal-LM folder (default: build the tiny Llama)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--frontend-only", action="store_true",
                    help="no server: the API server's cost per streamed chunk")  # fmt: skip
    args = ap.parse_args()
    if args.frontend_only:
        frontend_chunk_cost()
        return 0

    from engine_adapters import serve_harness as sh

    work = tempfile.mkdtemp(prefix="bench-serve-")
    model = args.model
    if model is None:
        from engine_adapters.tiny_model import build_tiny_llama

        model = build_tiny_llama(os.path.join(work, "model"))
    print(f"starting two servers (logs in {work}); a minute or more each on a CPU")
    servers = {
        False: sh.start_server(model, record_dir=None, log_path=os.path.join(work, "off.log")),
        True: sh.start_server(
            model, record_dir=os.path.join(work, "rec"), log_path=os.path.join(work, "on.log"),
            flush_s=0.5,
        ),
    }  # fmt: skip
    rates: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[dict[str, float]]] = {False: [], True: []}  # s per token, by role
    try:
        for flag in (False, True):  # warm-up round each (first-request costs)
            bodies = [sh.completion_body(model, f"warm {i}", 8) for i in range(2)]
            sh.stream_load(servers[flag], bodies)
        for i, flag in enumerate(_abba(args.rounds)):
            bodies = [
                sh.completion_body(
                    model, f"round {i} request {k}: the quick brown fox", args.max_tokens
                )  # fmt: skip
                for k in range(args.requests)
            ]
            c0 = cpu_by_role(servers[flag].proc.pid)
            t0 = time.perf_counter()
            streams = sh.stream_load(servers[flag], bodies)
            dt = time.perf_counter() - t0
            c1 = cpu_by_role(servers[flag].proc.pid)
            assert all(s.status == 200 for s in streams)
            tok = args.requests * args.max_tokens
            rates[flag].append(tok / dt)
            cpu[flag].append({r: (c1[r] - c0.get(r, 0.0)) / tok for r in c1 if r != "other"})
            print(f"round {i:2d} {'with   ' if flag else 'without'} {tok / dt:8.1f} tok/s")
    finally:
        for s in servers.values():
            s.stop(signal.SIGTERM)
    # pairs in ABBA order: round k of each side ran next to each other
    ratios = [w / o for w, o in zip(rates[True], rates[False], strict=True)]
    med = statistics.median(ratios)
    print(f"\nwithout: median {statistics.median(rates[False]):.1f} tok/s, "
          f"with: median {statistics.median(rates[True]):.1f} tok/s")  # fmt: skip
    print(f"with / without per pair: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(
        f"ratio median {med:.3f} (spread {min(ratios):.3f}..{max(ratios):.3f} over "
        f"{len(ratios)} pairs); plugin cost {100 * (1 - med):+.1f}% (goal: within 2%); "
        f"ratio of the sides' medians "
        f"{statistics.median(rates[True]) / statistics.median(rates[False]):.3f}"
    )
    print("\nCPU per generated token, by process (with / without per ABBA pair):")
    for role in ("api_server", "engine_core", "worker"):
        pairs = [(w.get(role), o.get(role)) for w, o in zip(cpu[True], cpu[False], strict=True)]
        r = [a / b for a, b in pairs if a and b]
        if not r:
            print(f"  {role:<12} not measured (no CPU time seen)")
            continue
        off_us = statistics.median(b for _, b in pairs if b) * 1e6
        on_us = statistics.median(a for a, _ in pairs if a) * 1e6
        print(f"  {role:<12} without {off_us:8.1f} us/token, with {on_us:8.1f} us/token; "
              f"ratio median {statistics.median(r):.3f} (spread {min(r):.3f}..{max(r):.3f}, "
              f"{len(r)} pairs; goal: within 2%)")  # fmt: skip
    return 0


def frontend_chunk_cost(n: int = 20000, repeats: int = 5) -> None:
    """The API server's cost per streamed chunk, without a server: vLLM's completion
    stream generator shape (one output per RequestOutput, one SSE string per chunk) run
    plain and through the plugin's wrapper, interleaved; prints microseconds per chunk."""
    import asyncio
    import types

    import numpy as np

    os.environ.setdefault("TRACEKIT_VLLM_DIR", tempfile.mkdtemp(prefix="bench-serve-"))
    from engine_adapters import vllm_serve as vs

    chunk = 'data: {"id":"cmpl-a","object":"text_completion","choices":[{"index":0,"text":"x"}]}'

    async def results(k):
        for i in range(k):
            out = types.SimpleNamespace(index=0, token_ids=[i], text="x")
            yield 0, types.SimpleNamespace(request_id="cmpl-a-0", outputs=[out])

    async def stream(self, request, engine_inputs, result_generator, *a, **kw):
        async for _ in result_generator:
            yield chunk + "\n\n"

    async def drive(gen_fn) -> float:
        vs.recorder_for("api_server")  # started before the timed loop
        vs._front.key["cmpl-a-0"] = "cmpl-a-0" + vs.FRONT_SEP + "cmpl-a-0-x"
        t = time.perf_counter()
        async for _ in gen_fn(None, types.SimpleNamespace(n=1), None, results(n)):
            slot = vs._writes.get()
            if slot is not None:  # what the server's send hook does per write
                slot[0].append(slot[1]())
        return (time.perf_counter() - t) / n * 1e6

    async def run() -> None:
        wrapped = vs._wrap_stream(stream)
        costs = []
        for _ in range(repeats):
            plain, recorded = await drive(stream), await drive(wrapped)
            costs.append(recorded - plain)
            print(f"per chunk: plain {plain:.2f} us, recorded {recorded:.2f} us")
        print(
            f"plugin cost per chunk: median {statistics.median(costs):.2f} us "
            f"(spread {min(costs):.2f}..{max(costs):.2f})"
        )
        # of which the recorder call a chunk makes (`emit_chunk`: its sse_write window
        # and its emission), timed alone in this process, beside the two calls it replaces
        # (`add_segment` + `emit_handles`); the plugin's own share is the rest (the wrapper
        # generators, the chunk's choice, the write stamp)
        rec = vs.recorder_for("api_server")
        h = rec.handle(vs._front.key["cmpl-a-0"])
        hv = np.array([h], dtype=np.int64)
        one, two = [], []
        for _ in range(repeats):
            t0 = rec.now()
            t = time.perf_counter()
            for _ in range(n):
                rec.emit_chunk(h, t0, t0)
            one.append((time.perf_counter() - t) / n * 1e6)
            t = time.perf_counter()
            for _ in range(n):
                rec.add_segment("sse_write", t0, t0)
                rec.emit_handles(hv, at_tick=t0)
            two.append((time.perf_counter() - t) / n * 1e6)
        med = statistics.median(one)
        print(
            f"of which the recorder's emit_chunk: median {med:.2f} us "
            f"(spread {min(one):.2f}..{max(one):.2f}; add_segment + emit_handles, the same "
            f"rows: {statistics.median(two):.2f} us); the plugin's own: "
            f"{statistics.median(costs) - med:.2f} us"
        )
        rec.stop()

    asyncio.run(run())


if __name__ == "__main__":
    raise SystemExit(main())
