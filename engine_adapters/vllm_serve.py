"""Record every process of `vllm serve` (a vLLM general plugin; no code change to serve).

    pip install -e '.[adapters]'                 # declares the entry point below
    TRACEKIT_VLLM_DIR=runs/serve1 python -m vllm.entrypoints.openai.api_server --model M ...
    ...                                          # stream requests, stop the server
    tracekit merge runs/serve1 -o runs/serve1.npz

vLLM loads every entry point of the group ``vllm.general_plugins`` in each of its
processes (the API server while it parses its arguments, the engine core at the top of
``EngineCore.__init__``, each worker in ``WorkerWrapperBase.init_worker``). tracekit's
entry point, `register`, does nothing unless the environment variable ``TRACEKIT_VLLM_DIR``
names an output directory. Then it installs class-level wrappers that start a
`tracekit.Recorder` in the process where they first fire, writing
``DIR/ROLE-PID.npz`` (crash-safe parts in ``DIR/ROLE-PID.npz.parts/`` meanwhile):

- **engine core** (``EngineCoreProc.run_busy_loop``): what the in-process adapter
  (`engine_adapters.vllm_v1`) records, on the engine core: steps, ``schedule``, the forward
  window as the engine core waits for it (``execute_model`` to ``sample_tokens``: the RPC
  to the worker and its forward pass, split into ``prefill`` / ``decode`` by token mix),
  ``sample``, ``update``, preemptions as evictions, emissions at the core boundary
  (requests named by vLLM's internal id), and two paired stamps for the merge: counter
  ``serve.added`` (value: request index) when a request reaches the scheduler and
  ``serve.out`` (value: ``EngineCoreOutputs.timestamp``) when a step's outputs are built.
- **worker** (``WorkerProc.worker_busy_loop``): the model runner's windows, outside any
  step: ``prepare`` (``execute_model`` up to the forward), ``forward`` (``_model_forward``
  to the end of ``execute_model``), ``sample`` (``sample_tokens``) and, with speculative
  decoding, ``draft`` (``propose_draft_token_ids``, the proposer); with tensor
  parallelism, ``collective`` (each call of the TP group's device communicator, entered to
  left: `COLLECTIVES`, the thread's OS counters sampled at both ends). Its ranks
  (``rank``, ``tp_rank``, ``dp_rank``, ``output_rank``) are in its
  ``config["process"]``; the merge charges a step's wait on its slowest rank to that
  rank's own causes (docs/adapters.md).
- **API server** (``AsyncLLM``, the completion and chat streams), started at its first
  HTTP request: arrival at the HTTP request's first byte (`RECEIPT_KEY` in the ASGI scope),
  counter ``serve.handler`` (value: request index) when its handler ran (requests
  named ``CLIENT_ID<US>ENGINE_ID``, see `FRONT_SEP`; CLIENT_ID is vLLM's external id,
  ``cmpl-...-PROMPT`` or ``chatcmpl-...``, with ``#INDEX`` for the siblings of
  ``n > 1``), ``tokenize`` (``BaseRenderer.tokenize_prompts_async``: a window that awaits
  vLLM's tokenizer thread, so not event-loop time), ``input``
  (``InputProcessor.process_inputs``), counter ``serve.sent`` (value:
  request index) when the request leaves for the engine core, counter ``serve.recv``
  (value: the outputs' ``EngineCoreOutputs.timestamp``) when a step's outputs arrive,
  ``output`` (``OutputProcessor.process_outputs``: output processing and
  detokenisation), and per SSE chunk written: ``sse_write`` (from the chunk being ready to
  uvicorn's transport write returning) and one emission at the client boundary, at that
  write, with the chunk's tokens.

Each process flushes at least every ``TRACEKIT_VLLM_FLUSH_S`` seconds (default 0.5, at
most `MAX_FLUSH_S`), also while idle (a background thread), so what was recorded reaches
disk within that interval; with ``TRACEKIT_VLLM_RETAIN_S`` set, each keeps only about its
last that many seconds of parts (`Recorder(retain_s=)`). The API server stops its
recorder at exit (SIGTERM / SIGINT of the server end in a normal exit there). With vLLM's
default ``--shutdown-timeout 0`` the
engine core and workers are SIGKILLed right after their SIGTERM, so no exit hook runs
there: their parts stay on disk and ``tracekit merge`` recovers them (without removing
them). To lose less there, the engine core and workers flush on SIGTERM
(`Recorder.flush_soon`), and the process that stops the engine cores sends that SIGTERM
itself and waits, at most ``TRACEKIT_VLLM_KILL_FLUSH_S`` seconds (default 2), for each
recording engine core's flush to reach disk before vLLM's SIGKILL (`flush_before_kill`);
what the core does after its SIGTERM is still lost, and the merged run says so
(docs/adapters.md, "Stopping"). The OpenAI
``/v1/completions`` and ``/v1/chat/completions`` streams are recorded at the client
boundary; a server started with tracekit refuses nothing.

With ``TRACEKIT_VLLM_METRICS_PORT`` each engine core also feeds its recorder to a live sink
(`tracekit.live.LiveMetrics`): per-cause metrics on port + its data-parallel rank, slow-gap
spans parented on the ``traceparent`` vLLM carries (`live_options`, docs/live.md). With
``TRACEKIT_VLLM_API_METRICS_PORT`` each API server feeds its own recorder to
`tracekit.live.client_ttft.ClientTtftLive`: the client-boundary TTFT on port + its index
(`api_live_sinks`).
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

# the names the merge reads back: request names' separator, paired-stamp counters, roles
from tracekit.log.serve_contract import (
    ADDED,
    CORE,
    FRONT_SEP,
    FRONTEND,
    HANDLER,
    OUT,
    RECV,
    ROLES,
    SENT,
    WORKER,
)

from ._common import Patches, add_forward
from .vllm_v1 import VllmV1Adapter

ENV_DIR = "TRACEKIT_VLLM_DIR"
ENV_FLUSH_S = "TRACEKIT_VLLM_FLUSH_S"
DEFAULT_FLUSH_S = 0.5
#: The longest flush interval under serve: what a SIGKILL without a SIGTERM first can lose.
MAX_FLUSH_S = 1.0
ENV_RETAIN_S = "TRACEKIT_VLLM_RETAIN_S"
ENV_KILL_FLUSH_S = "TRACEKIT_VLLM_KILL_FLUSH_S"
DEFAULT_KILL_FLUSH_S = 2.0

_lock = threading.Lock()
#: vLLM's logger tree: what the plugin says lands in the server's log.
_log = logging.getLogger("vllm.tracekit")
_registered = [False]
_class_patches = Patches()
_rec: dict[str, Any] = {}  # role -> the process's Recorder
_INDEX = re.compile(r'"index":\s*(\d+)')
#: Set by the SSE generator of a request to its list of write ticks and the API server
#: recorder's clock; the server's ``send`` appends the tick each body write returned at
#: (the same task runs both).
_writes: contextvars.ContextVar[tuple[list[int], Callable[[], int]] | None] = (
    contextvars.ContextVar("tracekit_sse_writes", default=None)
)


def register() -> None:
    """vLLM's plugin entry point: installs the hooks when ``TRACEKIT_VLLM_DIR`` is set."""
    out = os.environ.get(ENV_DIR)
    if not out:
        return
    with _lock:
        if _registered[0]:
            return
        check_output_dir(out)
        flush_interval_s()  # a bad value fails here, at startup, with what to do
        retain_s()
        live_options()  # a bad TRACEKIT_VLLM_* live option stops the server at startup
        api_metrics_port()
        _registered[0] = True
    _install_core_hooks()
    _install_worker_hooks()
    _install_frontend_hooks()
    _install_shutdown_grace()
    _install_flush_before_kill()


def installed_hooks() -> int:
    """How many class-level wrappers the plugin installed in this process (0: inert)."""
    return len(_class_patches)


# -- per-process recorder ---------------------------------------------------------------


def check_output_dir(out: str) -> None:
    """Fail at startup, with what to do, rather than on the first request."""
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".tracekit-probe-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        raise RuntimeError(
            f"{ENV_DIR}={out!r}: cannot write per-process logs there ({e.strerror or e}); "
            f"set {ENV_DIR} to a writable directory, or unset it to serve without recording"
        ) from None
    try:
        flush_s = float(os.environ.get(ENV_FLUSH_S, DEFAULT_FLUSH_S))
    except ValueError:
        flush_s = -1.0
    if not flush_s > 0:
        raise RuntimeError(
            f"{ENV_FLUSH_S}={os.environ.get(ENV_FLUSH_S)!r}: expected a positive number of "
            "seconds (how long recorded rows may stay in memory), e.g. 0.5"
        )


def _seconds(name: str, default: float, lo: float, hi: float) -> float:
    """A number of seconds from the environment, checked: a value that is not a number in
    [lo, hi] fails with the variable's name and what it needs."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not lo <= v <= hi:  # NaN fails too
        raise RuntimeError(f"{name}={raw[:40]!r}: expected seconds in [{lo}, {hi}]")
    return v


def flush_interval_s() -> float:
    """``TRACEKIT_VLLM_FLUSH_S``: each process's flush interval, bounded by `MAX_FLUSH_S`
    (what a SIGKILL that no SIGTERM announced can lose)."""
    return _seconds(ENV_FLUSH_S, DEFAULT_FLUSH_S, 0.01, MAX_FLUSH_S)


def retain_s() -> float | None:
    """``TRACEKIT_VLLM_RETAIN_S``: each process keeps only about its last this many seconds
    of parts on disk (`Recorder(retain_s=)`: a server that runs for days keeps a bounded
    folder); unset: every part."""
    if not os.environ.get(ENV_RETAIN_S):
        return None
    return _seconds(ENV_RETAIN_S, 0.0, 1.0, 10.0 * 365 * 86400)


def flush_on_sigterm(rec: Any) -> None:
    """Chain a SIGTERM handler in front of the process's own (vLLM's): ask the recorder to
    flush (`Recorder.flush_soon`: at once between steps, else at the open step's end), so
    the rows so far reach disk before a SIGKILL can land; then vLLM's handler runs. Where
    the process had no handler of its own (the default: SIGTERM ends it), the process
    still ends: with SystemExit(143) (128 + SIGTERM), so the code that stops the recorder
    on the way out runs and the log is whole; an ignored SIGTERM stays ignored."""
    prev = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        try:
            rec.flush_soon()
        finally:
            if callable(prev):
                prev(signum, frame)
            elif prev != signal.SIG_IGN:  # SIG_DFL, or a handler not set from Python
                raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def process_identity(role: str) -> dict[str, Any]:
    """Who recorded a log: role, pid, host, process name, and what the merge needs to
    decide whether two processes share a clock (boot id, the clock behind perf_counter)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot_id = fh.read().strip()
    except OSError:
        boot_id = ""
    import multiprocessing

    return {
        "role": role,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "name": multiprocessing.current_process().name,
        "boot_id": boot_id,
        "clock": time.get_clock_info("perf_counter").implementation,
    }


def recorder_for(role: str, sinks: tuple[Any, ...] = (), **identity: Any) -> Any:
    """This process's recorder (started on first use), writing ``DIR/ROLE-PID.npz``;
    `identity`: more of who recorded it (``dp_rank``, ``tp_rank``, ``rank``), kept in its
    ``config["process"]`` for the merge; `sinks`: more sinks of its flushed rows (the
    engine core's live metrics), used only by the call that starts it."""
    rec = _rec.get(role)
    if rec is not None:
        return rec
    with _lock:
        rec = _rec.get(role)
        if rec is None:
            import tracekit

            out_dir = os.environ[ENV_DIR]
            os.makedirs(out_dir, exist_ok=True)
            try:
                import vllm

                version = str(getattr(vllm, "__version__", "?"))
            except ImportError:  # pragma: no cover - the plugin runs inside vLLM
                version = "?"
            flush_s = flush_interval_s()
            rec = tracekit.Recorder(
                os.path.join(out_dir, f"{role}-{os.getpid()}.npz"),
                config={
                    "engine": "vllm",
                    "vllm": version,
                    "process": {**process_identity(role), **identity},
                },
                flush_interval_s=flush_s,
                handle_signals=False,  # vLLM's own handlers decide how each process ends
                sinks=sinks,
                retain_s=retain_s(),
            )
            rec.start()
            _rec[role] = rec  # the recorder's own idle flush bounds what a SIGKILL loses
    return rec


# -- engine core ------------------------------------------------------------------------


class ServeCoreAdapter(VllmV1Adapter):
    """The in-process adapter, on the engine core of a multiprocess server: the model runs
    in worker processes behind the multiproc executor, so the forward window is what the
    engine core waits for (``execute_model`` to ``sample_tokens``)."""

    def __init__(self, rec: Any, core: Any) -> None:
        super().__init__(rec, core)
        self._exec_t0: int | None = None

    def install(self) -> ServeCoreAdapter:
        if self._installed:
            return self
        core = self.engine
        if getattr(core, "batch_queue", None) is not None:
            raise ValueError(
                "tracekit records the synchronous engine step only: this engine core uses a "
                "batch queue (async scheduling or pipeline parallelism)"
            )
        cfg = core.vllm_config
        mode = getattr(getattr(cfg, "compilation_config", None), "cudagraph_mode", None)
        self._eager = bool(getattr(cfg.model_config, "enforce_eager", False)) or (
            getattr(mode, "name", None) == "NONE"
        )
        p, executor, sched = self._patches, core.model_executor, core.scheduler
        try:
            p.wrap(core, "step_fn", self._wrap_step(sched))
            p.wrap(sched, "add_request", self._wrap_add_request)
            p.wrap(sched, "schedule", self._wrap_schedule(sched))
            p.wrap(sched, "_preempt_request", self._wrap_preempt)
            p.wrap(sched, "update_from_output", self._wrap_update)
            p.wrap(executor, "execute_model", self._wrap_execute)
            p.wrap(executor, "sample_tokens", self._wrap_sample)
            if getattr(cfg, "speculative_config", None) is not None:
                # after each step: fetch the proposer's draft tokens from the worker
                p.wrap(core, "post_step", self._wrap_timed("draft_ids", in_step_only=False))
        except BaseException:
            p.restore()
            raise
        self._installed = True
        return self

    def _close_forward(self, t1: int) -> None:
        t0, self._exec_t0 = self._exec_t0, None
        if t0 is not None:
            label = "verify" if self._spec else "decode"
            add_forward(self.rec, t0, t1, self._num_prefill_tokens, self._num_decode, label)

    def _wrap_execute(self, execute: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        def execute_instrumented(*args: Any, **kwargs: Any) -> Any:
            if self._in_step:
                self._exec_t0 = rec.now()
            return execute(*args, **kwargs)

        return execute_instrumented

    def _wrap_sample(self, sample: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        def sample_instrumented(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:
                return sample(*args, **kwargs)
            t0 = rec.now()
            self._close_forward(t0)
            try:
                return sample(*args, **kwargs)
            finally:
                rec.add_segment("sample", t0, rec.now())

        return sample_instrumented

    def _request_key(self, request_id: str) -> str:
        return request_id  # the engine's id: the merge names it as the client knows it

    def _on_added(self, index: int) -> None:
        self.rec.counter(ADDED, float(index))  # a paired stamp for the merge's clock check

    def _wrap_update(self, update: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec
        inner = super()._wrap_update(update)

        def update_instrumented(scheduler_output: Any, model_runner_output: Any) -> Any:
            if self._exec_t0 is not None:  # no separate sample_tokens call this step
                self._close_forward(rec.now())
            out = inner(scheduler_output, model_runner_output)
            for eco in out.values() if isinstance(out, dict) else ():
                if getattr(eco, "outputs", None):
                    rec.counter(OUT, float(eco.timestamp))
            return out

        return update_instrumented


def _install_core_hooks() -> None:
    from vllm.v1.engine.core import EngineCoreProc

    def make(run_busy_loop: Callable[..., Any]) -> Callable[..., Any]:
        def run_busy_loop_recorded(self: Any) -> Any:
            dp_rank = int(getattr(self, "engine_index", 0))
            live = live_sink_for_core(self, dp_rank)
            par = getattr(getattr(self, "vllm_config", None), "parallel_config", None)
            tp = getattr(par, "tensor_parallel_size", None)
            rec = recorder_for(
                CORE,
                () if live is None else (live,),
                dp_rank=dp_rank,
                **({"tp_size": tp} if isinstance(tp, int) else {}),  # the ranks to expect
            )
            adapter = ServeCoreAdapter(rec, self).install()
            flush_on_sigterm(rec)  # vLLM's handler is in place: chain in front of it
            parents = Patches()
            if live is not None:
                _propagate_trace_context(live, self.scheduler, parents)
            try:
                return run_busy_loop(self)
            finally:  # a clean shutdown (--shutdown-timeout > 0); a SIGKILL leaves parts
                parents.restore()
                adapter.uninstall()
                rec.stop()
                if live is not None:
                    linger_then_shutdown(live)

        return run_busy_loop_recorded

    _class_patches.wrap(EngineCoreProc, "run_busy_loop", make)


# -- live metrics (engine core) ---------------------------------------------------------

#: The live options of the plugin (docs/live.md, "vllm serve"): with a metrics port, each
#: engine core serves its own live per-cause metrics.
ENV_METRICS_PORT = "TRACEKIT_VLLM_METRICS_PORT"
ENV_METRICS_ADDR = "TRACEKIT_VLLM_METRICS_ADDR"
ENV_SLO_MS = "TRACEKIT_VLLM_SLO_MS"
ENV_OTLP_ENDPOINT = "TRACEKIT_VLLM_OTLP_ENDPOINT"
ENV_HOLD_S = "TRACEKIT_VLLM_HOLD_S"
ENV_LINGER_S = "TRACEKIT_VLLM_LINGER_S"
ENV_RUN = "TRACEKIT_VLLM_RUN"
#: Each API server's client-boundary TTFT (docs/live.md): API server K serves on port + K.
ENV_API_METRICS_PORT = "TRACEKIT_VLLM_API_METRICS_PORT"


@dataclass(frozen=True, slots=True)
class LiveOptions:
    """The plugin's live options, read from the environment (`live_options`).

    port: the first engine core's metrics port (data-parallel rank R serves on port + R;
    0: each takes any free port). addr: the address the servers bind. slo_ms: gaps at
    least this long become spans (None: none). otlp_endpoint: where the spans go (OTLP/HTTP;
    None: the engine core's global tracer provider). hold_s: how long a gap waits after a
    flush to settle. linger_s: how long the final values stay served after the engine core
    stopped. run: the ``run`` label (default: the output directory's name).
    """

    port: int
    addr: str
    slo_ms: float | None
    otlp_endpoint: str | None
    hold_s: float
    linger_s: float
    run: str


def live_options() -> LiveOptions | None:
    """The live options from ``TRACEKIT_VLLM_*`` (None: no metrics port, live mode off);
    RuntimeError naming the variable and what it expects."""
    env = os.environ

    def number(name: str, default: float | None, ok: Callable[[float], bool], want: str):
        raw = env.get(name)
        if raw is None or raw == "":
            return default
        try:
            v = float(raw)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and ok(v)):
            raise RuntimeError(f"{name}={raw!r}: expected {want}")
        return v

    raw_port = env.get(ENV_METRICS_PORT)
    live_only = [n for n in (ENV_SLO_MS, ENV_OTLP_ENDPOINT, ENV_HOLD_S, ENV_LINGER_S,
                             ENV_METRICS_ADDR) if env.get(n)]  # fmt: skip
    if api_metrics_port() is not None and ENV_METRICS_ADDR in live_only:
        live_only.remove(ENV_METRICS_ADDR)  # the API servers bind it too
    if not raw_port:
        if live_only:
            raise RuntimeError(
                f"{', '.join(live_only)} set without {ENV_METRICS_PORT}: live options go "
                f"with a metrics port (e.g. {ENV_METRICS_PORT}=9400, or 0 for any free one)"
            )
        return None
    port = _port(ENV_METRICS_PORT, raw_port)
    slo_ms = number(ENV_SLO_MS, None, lambda v: v > 0, "a number of milliseconds > 0")
    otlp = env.get(ENV_OTLP_ENDPOINT) or None
    if otlp is not None:
        if slo_ms is None:
            raise RuntimeError(
                f"{ENV_OTLP_ENDPOINT} sends the spans of gaps >= {ENV_SLO_MS}: set both"
            )
        if not re.match(r"https?://[^/\s]+", otlp):
            raise RuntimeError(
                f"{ENV_OTLP_ENDPOINT}={otlp!r}: expected an OTLP/HTTP URL, e.g. "
                "http://127.0.0.1:4318/v1/traces"
            )
    return LiveOptions(
        port=port,
        addr=env.get(ENV_METRICS_ADDR) or "127.0.0.1",
        slo_ms=slo_ms,
        otlp_endpoint=otlp,
        hold_s=float(number(ENV_HOLD_S, 2.0, lambda v: v >= 0, "seconds >= 0")),
        linger_s=float(number(ENV_LINGER_S, 0.0, lambda v: v >= 0, "seconds >= 0")),
        run=run_label(),
    )


def _port(name: str, raw: str) -> int:
    if not re.fullmatch(r"\d{1,5}", raw.strip()) or int(raw) > 65535:
        raise RuntimeError(
            f"{name}={raw!r}: expected a port number 0-65535 (0: any free port, printed at startup)"
        )
    return int(raw)


def run_label() -> str:
    """The ``run`` label of every live series: ``TRACEKIT_VLLM_RUN``, else the recording
    directory's name."""
    out_dir = os.environ.get(ENV_DIR, "")
    return os.environ.get(ENV_RUN) or os.path.basename(os.path.normpath(out_dir))


def api_metrics_port() -> int | None:
    """``TRACEKIT_VLLM_API_METRICS_PORT``: the first API server's port for its
    client-boundary TTFT (None: not served); RuntimeError if it is not a port number."""
    raw = os.environ.get(ENV_API_METRICS_PORT)
    return None if not raw else _port(ENV_API_METRICS_PORT, raw)


def live_sink_for_core(core: Any, dp_rank: int) -> Any:
    """The engine core's live sink (`tracekit.live.LiveMetrics`), serving its metrics
    (None: live mode off). It runs where the steps, admissions and emissions are recorded:
    each engine core partitions its own engine-boundary gaps and TTFTs, on port + its
    data-parallel rank, with constant labels ``run``, ``engine`` (vllm), ``model`` (the
    served model name), ``process`` (``engine_core-PID``) and ``dp_rank``. The chosen
    address is always printed on stderr."""
    opts = live_options()
    if opts is None:
        return None
    from tracekit.live import LiveMetrics

    mc = getattr(getattr(core, "vllm_config", None), "model_config", None)
    model = getattr(mc, "served_model_name", None) or getattr(mc, "model", None) or ""
    if isinstance(model, (list, tuple)):
        model = model[0] if model else ""
    live = LiveMetrics(
        addr=opts.addr,
        slo_ms=opts.slo_ms,
        otlp_endpoint=opts.otlp_endpoint,
        hold_s=opts.hold_s,
        const_labels={
            "run": opts.run,
            "engine": "vllm",
            "model": str(model),
            "process": f"engine_core-{os.getpid()}",
            "dp_rank": str(dp_rank),
        },
    )
    port = opts.port + dp_rank if opts.port else 0
    try:
        live.serve(port)
    except OSError as e:
        live.shutdown()
        raise RuntimeError(
            f"{ENV_METRICS_PORT}: engine core (data-parallel rank {dp_rank}) cannot listen "
            f"on {opts.addr}:{port} ({e.strerror or e}); pick a free port (rank R takes "
            "port + R) or another address"
        ) from None
    host = f"[{opts.addr}]" if ":" in opts.addr else opts.addr
    print(
        f"tracekit: engine core (dp_rank {dp_rank}, pid {os.getpid()}) live metrics at "
        f"http://{host}:{live.port}/metrics",
        file=sys.stderr,
        flush=True,
    )
    return live


# -- live client-boundary TTFT (API server) -----------------------------------------------

#: The served model's name, as the API server's engine client knows it (the ``model`` label).
_served_model: list[str] = []
_api_sink: list[Any] = []  # this API server's `ClientTtftLive`, once made (at most one)


def api_server_index() -> int:
    """This API server's index: vLLM names API server K's process ``ApiServer_K`` with
    ``--api-server-count`` > 1; a single API server runs in the launching process (0)."""
    import multiprocessing

    m = re.fullmatch(r"ApiServer_(\d+)", multiprocessing.current_process().name)
    return int(m.group(1)) if m else 0


def api_live_sinks() -> tuple[Any, ...]:
    """This API server's live sinks: its `tracekit.live.client_ttft.ClientTtftLive` serving
    ``tracekit_ttft_client_seconds`` on ``TRACEKIT_VLLM_API_METRICS_PORT`` + its index, made
    and served at the first call (the engine client's start, so its series are at 0 before
    the first request); () when the port is not set. The address is printed on stderr."""
    port = api_metrics_port()
    if port is None:
        return ()
    with _lock:
        if not _api_sink:
            _api_sink.append(_start_api_sink(port))
    return (_api_sink[0],)


def _start_api_sink(port: int) -> Any:
    # the live extra is imported only where live mode is asked for
    from tracekit.live.client_ttft import ClientTtftLive

    k = api_server_index()
    addr = os.environ.get(ENV_METRICS_ADDR) or "127.0.0.1"
    sink = ClientTtftLive(
        addr=addr,
        const_labels={"run": run_label(), "engine": "vllm",
                      "model": _served_model[0] if _served_model else "",
                      "process": f"api_server-{os.getpid()}", "api_server": str(k)},
    )  # fmt: skip
    want = port + k if port else 0
    try:
        sink.serve(want)
    except OSError as e:
        raise RuntimeError(
            f"{ENV_API_METRICS_PORT}: API server {k} cannot listen on {addr}:{want} "
            f"({e.strerror or e}); pick a free port (API server K takes port + K) or another "
            "address"
        ) from None
    host = f"[{addr}]" if ":" in addr else addr
    print(f"tracekit: API server {k} (pid {os.getpid()}) client-boundary TTFT at "
          f"http://{host}:{sink.port}/metrics", file=sys.stderr, flush=True)  # fmt: skip
    return sink


def frontend_recorder() -> Any:
    """The API server's recorder (started at its first request), with its live sink."""
    rec = _rec.get(FRONTEND)
    return rec if rec is not None else recorder_for(FRONTEND, sinks=api_live_sinks())


def _propagate_trace_context(live: Any, scheduler: Any, p: Patches) -> None:
    """Hand each request's W3C ``traceparent`` to the live sink as it reaches the
    scheduler, so its slow-gap spans join that trace. vLLM carries the client's trace
    headers to the engine core (``EngineCoreRequest.trace_headers`` ->
    ``Request.trace_headers``) only when the server traces (``--otlp-traces-endpoint``);
    otherwise each request has a trace of its own. A malformed header is ignored (the
    request gets a trace of its own) and said once."""
    warned = [False]

    def make(add_request: Callable[..., Any]) -> Callable[..., Any]:
        def add_request_traced(request: Any, *args: Any, **kwargs: Any) -> Any:
            headers = getattr(request, "trace_headers", None)
            tp = headers.get("traceparent") if isinstance(headers, Mapping) else None
            if tp is not None:
                try:
                    live.trace_parent(request.request_id, tp)
                except ValueError as e:
                    if not warned[0]:
                        warned[0] = True
                        print(f"tracekit: {e}; that request's spans get a trace of their own",
                              file=sys.stderr, flush=True)  # fmt: skip
            return add_request(request, *args, **kwargs)

        return add_request_traced

    p.wrap(scheduler, "add_request", make)


def linger_then_shutdown(live: Any) -> None:
    """After the engine core's recorder stopped (its sink closed: every gap settled,
    ``tracekit_live_final 1``): keep serving for ``TRACEKIT_VLLM_LINGER_S`` seconds, then
    send the spans still batched and stop the metrics server. vLLM waits for the engine
    core up to ``--shutdown-timeout`` before it kills it: give it more than the linger."""
    opts = live_options()
    linger_s = 0.0 if opts is None else opts.linger_s
    try:
        if linger_s > 0:
            print(
                f"tracekit: engine core final live metrics at port {live.port} for {linger_s:g} s",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(linger_s)
    finally:
        live.shutdown()


# -- worker -----------------------------------------------------------------------------


def _install_worker_hooks() -> None:
    from vllm.v1.executor.multiproc_executor import WorkerProc

    def make(busy_loop: Callable[..., Any]) -> Callable[..., Any]:
        def worker_busy_loop_recorded(self: Any) -> Any:
            ranks = worker_ranks(self)
            rec = recorder_for(WORKER, **ranks)
            runner = getattr(getattr(self.worker, "worker", None), "model_runner", None)
            patches = Patches()
            if runner is not None:
                _instrument_runner(rec, runner, patches, injector(ranks.get("tp_rank")))
            _instrument_collectives(rec, patches)
            flush_on_sigterm(rec)
            try:
                return busy_loop(self)
            finally:
                patches.restore()
                rec.stop()

        return worker_busy_loop_recorded

    _class_patches.wrap(WorkerProc, "worker_busy_loop", make)


def worker_ranks(proc: Any) -> dict[str, int]:
    """A worker process's ranks: global (``rank``), tensor parallel (``tp_rank``) and data
    parallel (``dp_rank``), where vLLM knows them."""
    out: dict[str, int] = {}
    if isinstance(getattr(proc, "rank", None), int):
        out["rank"] = int(proc.rank)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        out["tp_rank"] = int(get_tensor_model_parallel_rank())
    except Exception:  # groups not initialised in this vLLM layout: rank unknown
        pass
    cfg = getattr(getattr(proc.worker, "worker", None), "vllm_config", None)
    par = getattr(cfg, "parallel_config", None)
    # an independent (non-MoE) DP engine keeps its rank as data_parallel_index only
    dp = getattr(par, "data_parallel_index", None)
    if not isinstance(dp, int):
        dp = getattr(par, "data_parallel_rank", None)
    if isinstance(dp, int):
        out["dp_rank"] = dp
    # the rank whose outputs the engine core waits for (vLLM's multiproc executor: the
    # first tensor-parallel rank of the last pipeline stage); the others may still run a
    # step after the engine core's wait for it returned
    sizes = [getattr(par, x, None) for x in
             ("world_size", "tensor_parallel_size", "prefill_context_parallel_size")]  # fmt: skip
    if all(isinstance(x, int) for x in sizes[:2]):
        pcp = sizes[2] if isinstance(sizes[2], int) else 1
        out["output_rank"] = int(sizes[0] - sizes[1] * pcp)
    return out


#: Collective calls of the tensor-parallel group recorded on each worker, as ``collective``
#: windows (entered, left): ranks enter each one in the same order, so the n-th window of
#: every rank is one collective (the merge reads the skew between ranks from them).
COLLECTIVES = ("all_reduce", "all_gather", "gather", "broadcast", "reduce_scatter")


def _instrument_collectives(rec: Any, p: Patches) -> None:
    """Wrap the tensor-parallel group's device communicator (one instance per worker)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except Exception:  # groups not initialised in this vLLM layout: no collectives
        return
    comm = getattr(group, "device_communicator", None)
    if comm is None or getattr(group, "world_size", 1) < 2:
        return

    # a segment, not a window added afterwards: the worker's thread samples its OS counters
    # at each collective's entry and exit (an OS interval of its own), the evidence of a
    # rank held by the OS between its entry stamp and the call (docs/adapters.md)
    seg = rec.segment("collective")

    def make(fn: Callable[..., Any]) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            with seg:
                return fn(*args, **kwargs)

        return collective

    for name in COLLECTIVES:
        if callable(getattr(comm, name, None)):
            p.wrap(comm, name, make)


#: Test-only: ``rank=R,every=N,ms=M[,kinds=sleep+gc]`` makes the worker of tensor-parallel
#: rank R stall at the start of every N-th forward pass: a sleep of M ms, or a full
#: garbage collection over a heap of M * 2000 objects (alternating when both kinds are
#: named), recorded as an ``injected`` window (the GC's own pause is recorded as any GC).
ENV_TEST_INJECT = "TRACEKIT_VLLM_TEST_INJECT"


def injector(tp_rank: int | None) -> Callable[[Any], None] | None:
    """The stall `ENV_TEST_INJECT` asks of this rank (called with the recorder before each
    forward pass), or None."""
    spec = os.environ.get(ENV_TEST_INJECT)
    if not spec or tp_rank is None:
        return None
    try:
        kv = dict(item.split("=", 1) for item in spec.split(","))
        rank, every, ms = int(kv["rank"]), int(kv["every"]), float(kv["ms"])
        kinds = kv.get("kinds", "sleep").split("+")
    except (KeyError, ValueError) as e:
        raise RuntimeError(
            f"{ENV_TEST_INJECT}={spec!r}: expected rank=R,every=N,ms=M[,kinds=sleep+gc] ({e})"
        ) from None
    if rank != tp_rank or every < 1:
        return None
    count = [0]

    def inject(rec: Any) -> None:
        count[0] += 1
        if count[0] % every:
            return
        kind = kinds[(count[0] // every - 1) % len(kinds)]
        t0 = rec.now()
        if kind == "gc":
            import gc

            junk = [[i] for i in range(int(ms * 2_000))]  # a heap for the collection to walk
            gc.collect()
            del junk
        else:
            time.sleep(ms / 1e3)
        rec.add_segment("injected", t0, rec.now())

    return inject


def _instrument_runner(
    rec: Any, runner: Any, p: Patches, inject: Callable[[Any], None] | None = None
) -> None:
    fwd_t0: list[int | None] = [None]

    def wrap_execute(execute: Callable[..., Any]) -> Callable[..., Any]:
        def execute_model(*args: Any, **kwargs: Any) -> Any:
            fwd_t0[0] = None
            t0 = rec.now()
            try:
                return execute(*args, **kwargs)
            finally:
                t1 = rec.now()
                tf = fwd_t0[0] if fwd_t0[0] is not None else t0
                if tf > t0:
                    rec.add_segment("prepare", t0, tf)
                rec.add_segment("forward", tf, t1)

        return execute_model

    def wrap_model_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
        def model_forward(*args: Any, **kwargs: Any) -> Any:
            if fwd_t0[0] is None:
                fwd_t0[0] = rec.now()
                if inject is not None:
                    inject(rec)
            return forward(*args, **kwargs)

        return model_forward

    def wrap_sample(sample: Callable[..., Any]) -> Callable[..., Any]:
        seg = rec.segment("sample")

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            with seg:
                return sample(*args, **kwargs)

        return sample_tokens

    def wrap_draft(propose: Callable[..., Any]) -> Callable[..., Any]:
        seg = rec.segment("draft")

        def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
            with seg:
                return propose(*args, **kwargs)

        return propose_draft_token_ids

    p.wrap(runner, "execute_model", wrap_execute)
    if hasattr(runner, "_model_forward"):
        p.wrap(runner, "_model_forward", wrap_model_forward)
    if hasattr(runner, "sample_tokens"):
        p.wrap(runner, "sample_tokens", wrap_sample)
    if hasattr(runner, "propose_draft_token_ids"):
        p.wrap(runner, "propose_draft_token_ids", wrap_draft)


# -- API server -------------------------------------------------------------------------


class _Frontend:
    """The API server's bookkeeping between hooks (all on its event loop thread)."""

    def __init__(self) -> None:
        self.key: dict[str, str] = {}  # client name -> recorder request name (the latest)
        self.index: dict[str, int] = {}  # engine (internal) id -> recorder request index


_front = _Frontend()


class _Http:
    """One HTTP request: when its first byte was read, when its handler started, and the
    recorder names of the engine requests it made (client name -> ``CLIENT<US>ENGINE``),
    so two requests with one ``X-Request-Id`` keep their own chunks."""

    __slots__ = ("receipt", "handler", "keys")

    def __init__(self, receipt: int, handler: int) -> None:
        self.receipt, self.handler = receipt, handler
        self.keys: dict[str, str] = {}


#: One slot per HTTP request, set where uvicorn starts the request's ASGI task: vLLM runs
#: the handler in a task of its own (cancellation on disconnect) and the response stream in
#: another, both copying the request task's context, so the handler fills the slot and the
#: stream reads the same one.
_http: contextvars.ContextVar[list[_Http | None] | None] = contextvars.ContextVar(
    "tracekit_http_request", default=None
)


def _current_http() -> _Http | None:
    slot = _http.get()
    return slot[0] if slot else None


#: The ASGI scope key holding the tick of the HTTP request's first byte.
RECEIPT_KEY = "tracekit.receipt_tick"


def _key_of(name: str) -> str | None:
    http = _current_http()
    key = http.keys.get(name) if http is not None else None
    return key if key is not None else _front.key.get(name)


def finish_http(http: _Http) -> None:
    """An HTTP request's response is over: the engine requests it made leave the API
    server's recorder (`Recorder.finish`) and this module's bookkeeping, so a server's
    memory stays flat over any number of requests (docs/adapters.md). Their chunks are all
    recorded: the stream wrote its last one before the ASGI task ended."""
    rec = frontend_recorder()
    for name, key in http.keys.items():
        if _front.key.get(name) == key:
            del _front.key[name]
        rec.finish(key)
    http.keys.clear()


def client_name(external_id: str, parent: Any, index: int) -> str:
    """A request's name at the client boundary: vLLM's external id, ``#INDEX`` for the
    siblings of parallel sampling (as the in-process adapter names them)."""
    return external_id if parent is None else f"{external_id}#{index}"


ENV_API_GRACE_S = "TRACEKIT_VLLM_API_SHUTDOWN_S"
DEFAULT_API_GRACE_S = 5.0


def _install_shutdown_grace() -> None:
    """With several API servers, the launching process stops them with SIGTERM and, under
    vLLM's default ``--shutdown-timeout 0``, SIGKILLs them at once: no exit hook runs and
    their logs stay parts. While recording, the launcher gives them up to
    ``TRACEKIT_VLLM_API_SHUTDOWN_S`` seconds (default 5) to exit on their SIGTERM (uvicorn
    stops serving, the recorder writes its log); one that is still alive is killed as
    before."""
    try:
        from vllm.v1.utils import APIServerProcessManager
    except ImportError:  # another vLLM layout: API servers stop as vLLM decides
        return
    try:
        grace = float(os.environ.get(ENV_API_GRACE_S, DEFAULT_API_GRACE_S))
    except ValueError:
        grace = DEFAULT_API_GRACE_S

    def make(shutdown: Callable[..., Any]) -> Callable[..., Any]:
        def shutdown_with_grace(self: Any, timeout: float | None = None) -> Any:
            return shutdown(self, timeout=max(timeout or 0.0, grace))

        return shutdown_with_grace

    _class_patches.wrap(APIServerProcessManager, "shutdown", make)


def _install_flush_before_kill() -> None:
    """Where vLLM stops the engine cores (`CoreEngineProcManager.shutdown`, in the API
    server or the launcher) with ``--shutdown-timeout 0``, it SIGTERMs and SIGKILLs at
    once: no SIGTERM handler runs in between. While recording, `flush_before_kill` runs
    first; vLLM's shutdown then goes on as before."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager
    except ImportError:  # another vLLM layout: engine cores stop as vLLM decides
        return
    wait_s = _seconds(ENV_KILL_FLUSH_S, DEFAULT_KILL_FLUSH_S, 0.0, 10.0)

    def make(shutdown: Callable[..., Any]) -> Callable[..., Any]:
        def shutdown_after_flush(self: Any, timeout: float | None = None) -> Any:
            if timeout == 0 and wait_s > 0:
                flush_before_kill(list(getattr(self, "processes", ())), wait_s)
            return shutdown(self, timeout)

        return shutdown_after_flush

    _class_patches.wrap(CoreEngineProcManager, "shutdown", make)


def flush_before_kill(procs: list[Any], wait_s: float) -> int:
    """SIGTERM each live engine core that is recording (its parts folder exists: its
    handler flushes, `flush_on_sigterm`) and wait until each has a part on disk taken after
    the signal (its ``flush_tick``, on the one ``perf_counter`` clock of the host, is past
    it: an older flush the writer was still behind on does not count) or has exited, at
    most `wait_s` seconds in all. Returns how many did in time."""
    from tracekit.log.parts import FINAL_NAME, part_paths, read_part

    def flushed_since(d: str, t_tick: int) -> bool:
        try:
            if os.path.exists(os.path.join(d, FINAL_NAME)):  # it stopped its recorder
                return True
            last = part_paths(d)[-1:]
            if not last:
                return False
            return (read_part(last[0]).scalar("flush_tick") or 0) >= t_tick
        except FileNotFoundError:  # gone: its folder was moved or removed
            return True
        except Exception:  # a part being renamed into place, or unreadable: look again
            return False

    out = os.environ.get(ENV_DIR, "")
    watch = []
    for p in procs:
        d = os.path.join(out, f"engine_core-{p.pid}.npz.parts")
        if p.pid and p.is_alive() and os.path.isdir(d):
            watch.append((p, d))
    t_term = time.perf_counter_ns()  # the recorders' clock (docs/adapters.md, the merge)
    for p, _ in watch:
        p.terminate()
    t0 = time.monotonic()
    left = watch
    while left and time.monotonic() < t0 + wait_s:
        time.sleep(0.002)
        left = [(p, d) for p, d in left if p.is_alive() and not flushed_since(d, t_term)]
    _log.info(
        "tracekit: %d of %d recording engine core(s) flushed on SIGTERM in %.1f ms, before "
        "the kill (at most %s s)", len(watch) - len(left), len(watch),
        (time.monotonic() - t0) * 1e3, wait_s,
    )  # fmt: skip
    return len(watch) - len(left)


def _install_frontend_hooks() -> None:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.engine.output_processor import OutputProcessor

    p = _class_patches

    def wrap_create(create: Callable[..., Any]) -> Callable[..., Any]:
        async def create_handler(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            now = frontend_recorder().now()
            raw = args[0] if args else kwargs.get("raw_request")
            scope = getattr(raw, "scope", None)
            receipt = scope.get(RECEIPT_KEY) if isinstance(scope, dict) else None
            slot = _http.get()
            if slot is None:  # no ASGI task of ours above (called directly)
                slot = [None]
                _http.set(slot)
            slot[0] = _Http(now if receipt is None else int(receipt), now)
            return await create(self, request, *args, **kwargs)

        return create_handler

    def wrap_add(add: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(self: Any, request: Any, prompt: Any, parent_req: Any = None,
                        request_index: int = 0, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
            out = add(self, request, prompt, parent_req, request_index, *args, **kwargs)
            rec = frontend_recorder()
            external = getattr(request, "external_req_id", None) or request.request_id
            name = client_name(external, parent_req, request_index)
            key = f"{name}{FRONT_SEP}{request.request_id}"
            params = getattr(request, "sampling_params", None)
            max_tokens = getattr(params, "max_tokens", None)
            prompt_ids = getattr(request, "prompt_token_ids", None)
            _front.key[name] = key
            http = _current_http()
            idx = rec.request(
                key,
                prompt_tokens=-1 if prompt_ids is None else len(prompt_ids),
                max_new_tokens=-1 if max_tokens is None else int(max_tokens),
                arrival_tick=rec.now() if http is None else http.receipt,
            )
            if http is not None:
                http.keys[name] = key
                rec.counter(HANDLER, float(idx), at_tick=http.handler)
            _front.index[request.request_id] = idx
            return out

        return add_request

    def wrap_send(send: Callable[..., Any]) -> Callable[..., Any]:
        async def add_request_async(self: Any, request: Any) -> Any:
            idx = _front.index.pop(request.request_id, None)
            if idx is not None:
                frontend_recorder().counter(SENT, float(idx))
            return await send(self, request)

        return add_request_async

    def wrap_get(get: Callable[..., Any]) -> Callable[..., Any]:
        async def get_output_async(self: Any) -> Any:
            outputs = await get(self)
            if outputs.outputs:
                frontend_recorder().counter(RECV, float(outputs.timestamp))
            return outputs

        return get_output_async

    def wrap_timed(label: str) -> Callable[..., Callable[..., Any]]:
        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                with frontend_recorder().segment(label):
                    return fn(*args, **kwargs)

            return timed

        return make

    p.wrap(OpenAIServingCompletion, "create_completion", wrap_create)
    p.wrap(OpenAIServingCompletion, "completion_stream_generator", _wrap_stream)
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    except ImportError:  # another vLLM layout: chat streams are then not recorded
        OpenAIServingChat = None  # noqa: N806
    if OpenAIServingChat is not None:
        p.wrap(OpenAIServingChat, "create_chat_completion", wrap_create)
        p.wrap(OpenAIServingChat, "chat_completion_stream_generator", _wrap_chat_stream)
    p.wrap(OutputProcessor, "add_request", wrap_add)
    p.wrap(OutputProcessor, "process_outputs", wrap_timed("output"))
    p.wrap(InputProcessor, "process_inputs", wrap_timed("input"))
    p.wrap(AsyncMPClient, "add_request_async", wrap_send)
    p.wrap(AsyncMPClient, "get_output_async", wrap_get)
    try:
        from vllm.renderers.base import BaseRenderer
    except ImportError:  # another vLLM layout: tokenisation is then not recorded
        BaseRenderer = None  # noqa: N806
    if BaseRenderer is not None and hasattr(BaseRenderer, "tokenize_prompts_async"):

        def wrap_tokenize(tokenize: Callable[..., Any]) -> Callable[..., Any]:
            async def tokenize_prompts_async(*args: Any, **kwargs: Any) -> Any:
                rec = frontend_recorder()
                t0 = rec.now()
                try:
                    return await tokenize(*args, **kwargs)
                finally:
                    rec.add_segment("tokenize", t0, rec.now())

            return tokenize_prompts_async

        p.wrap(BaseRenderer, "tokenize_prompts_async", wrap_tokenize)
    _install_write_hooks(p)
    _install_api_live_hook(p)


def _install_api_live_hook(p: Patches) -> None:
    """With ``TRACEKIT_VLLM_API_METRICS_PORT``, the API server's engine client, once made,
    names the served model and starts the client-boundary TTFT's sink (serving from then
    on; the recorder it follows starts at the first request)."""
    if api_metrics_port() is None:
        return
    from vllm.v1.engine.async_llm import AsyncLLM

    def make(init: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            mc = getattr(self, "model_config", None)
            name = getattr(mc, "served_model_name", None) or getattr(mc, "model", None)
            if isinstance(name, (list, tuple)):
                name = name[0] if name else None
            if name and not _served_model:
                _served_model.append(str(name))
            api_live_sinks()

        return __init__

    p.wrap(AsyncLLM, "__init__", make)


def _install_write_hooks(p: Patches) -> None:
    """Stamp each response body write where it happens: in uvicorn's ``send``, at the
    transport write (a chunk's generator is resumed only after ASGI middleware and other
    tasks ran, which can be milliseconds later)."""

    def wrap_send(send: Callable[..., Any]) -> Callable[..., Any]:
        async def send_stamped(self: Any, message: Any) -> Any:
            slot = _writes.get()
            if slot is None or message.get("type") != "http.response.body":
                return await send(self, message)
            flow = getattr(self, "flow", None)
            if flow is not None and getattr(flow, "write_paused", False):
                # the client is not reading: the write waits for it inside `send`
                out = await send(self, message)
                slot[0].append(slot[1]())
                return out
            # else `send` writes to the socket at once, without a suspension: stamped just
            # before, as after the write's system call the loop thread may wait for the GIL
            # (another thread took it meanwhile) while the client already reads the bytes
            slot[0].append(slot[1]())
            return await send(self, message)

        return send_stamped

    def wrap_run_asgi(run_asgi: Callable[..., Any]) -> Callable[..., Any]:
        async def run_asgi_slotted(self: Any, app: Any) -> Any:
            slot: list[_Http | None] = [None]
            _http.set(slot)  # this request's slot (the task runs in a fresh context)
            try:
                return await run_asgi(self, app)
            finally:  # the response is written (or the client left): its requests are done
                if slot[0] is not None and slot[0].keys:
                    finish_http(slot[0])

        return run_asgi_slotted

    for mod in ("uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl"):
        try:
            cycle = __import__(mod, fromlist=["RequestResponseCycle"]).RequestResponseCycle
        except ImportError:  # that HTTP implementation is not installed
            continue
        p.wrap(cycle, "send", wrap_send)
        p.wrap(cycle, "run_asgi", wrap_run_asgi)
    _install_receipt_hooks(p)


def _install_receipt_hooks(p: Patches) -> None:
    """Stamp each HTTP request's first byte into its ASGI scope (`RECEIPT_KEY`): httptools
    calls ``on_message_begin`` as it parses a message's first byte; with h11, the first
    ``data_received`` of a request (no response in progress) carries its first byte."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools not installed: uvicorn uses h11
        HttpToolsProtocol = None  # noqa: N806
    if HttpToolsProtocol is not None:

        def wrap_begin(begin: Callable[..., Any]) -> Callable[..., Any]:
            def on_message_begin(self: Any) -> Any:
                t = frontend_recorder().now()
                out = begin(self)
                scope = getattr(self, "scope", None)
                if isinstance(scope, dict):
                    scope[RECEIPT_KEY] = t
                return out

            return on_message_begin

        p.wrap(HttpToolsProtocol, "on_message_begin", wrap_begin)
    try:
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:  # pragma: no cover - uvicorn depends on h11
        return

    def wrap_received(received: Callable[..., Any]) -> Callable[..., Any]:
        def data_received(self: Any, data: Any) -> Any:
            t = frontend_recorder().now()
            cycle = getattr(self, "cycle", None)
            if cycle is None or getattr(cycle, "response_complete", True):
                self._tracekit_first_byte = t  # these bytes start a new request
            before = getattr(self, "scope", None)
            out = received(self, data)
            scope = getattr(self, "scope", None)
            if scope is not before and isinstance(scope, dict):
                scope[RECEIPT_KEY] = getattr(self, "_tracekit_first_byte", t)
            return out

        return data_received

    p.wrap(H11Protocol, "data_received", wrap_received)


class _Chunks:
    """One stream's chunk records at the client boundary, cheap per chunk: each choice's
    recorder handle resolved once (at its first chunk whose request is known), then one
    `Recorder.emit_chunk` per chunk (its write window and its tokens)."""

    __slots__ = ("rec", "handles")

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.handles: dict[int, int] = {}  # choice index -> the recorder's handle

    def record(self, i: int, name: str, k: int, t_ready: int, t_sent: int) -> None:
        """Choice `i` (request `name` at the client boundary) sent a chunk of `k` tokens:
        ready at `t_ready`, written at `t_sent`."""
        h = self.handles.get(i)
        if h is None:
            key = _key_of(name)
            if key is None:
                return
            h = self.handles[i] = self.rec.handle(key)
        self.rec.emit_chunk(h, t_ready, t_sent, k)


def _choice_of(chunk: str, names: dict[int, str]) -> int | None:
    """The choice an SSE chunk carries, None for one without a choice (usage, [DONE]). A
    chunk is made from outputs already seen, so while a stream has seen one choice every
    chunk with a choice is that one's (no search of the chunk's text)."""
    if '"choices":[{' not in chunk:
        return None
    if len(names) == 1:
        for i in names:
            return i
    m = _INDEX.search(chunk)
    return None if m is None else int(m.group(1))


def _wrap_stream(stream: Callable[..., Any]) -> Callable[..., Any]:
    """The ``/v1/completions`` SSE generator: each chunk it yields is written to the client
    before the generator is resumed, so ``[yield, resume]`` is the chunk's write."""

    async def completion_stream_generator(self: Any, request: Any, engine_inputs: Any,
                                          result_generator: Any, *args: Any,
                                          **kwargs: Any) -> Any:  # fmt: skip
        rec = frontend_recorder()
        n = 1 if getattr(request, "n", None) is None else int(request.n)
        pending: dict[int, deque[int]] = defaultdict(deque)  # tokens of each chunk to come
        names: dict[int, str] = {}  # choice -> its request's name at the client boundary
        seen: dict[int, int] = defaultdict(int)

        async def observed() -> AsyncIterator[Any]:
            # mirror of the generator's own rule: an output with no text and no tokens
            # before the choice's first token makes no chunk
            async for prompt_idx, res in result_generator:
                for output in res.outputs:
                    i = output.index + prompt_idx * n
                    k = len(output.token_ids)
                    if not output.text and not k and not seen[i]:
                        continue
                    seen[i] += k
                    if i not in names:
                        names[i] = res.request_id if n == 1 else f"{res.request_id}#{output.index}"
                    pending[i].append(k)
                yield prompt_idx, res

        gen = stream(self, request, engine_inputs, observed(), *args, **kwargs)
        chunks = _Chunks(rec)
        writes: list[int] = []
        _writes.set((writes, rec.now))
        now = rec.now
        try:
            async for chunk in gen:
                t_ready = now()
                writes.clear()
                yield chunk  # the server writes it before asking for the next one
                i = _choice_of(chunk, names)
                if i is None:
                    continue
                queue = pending.get(i)
                if not queue:
                    continue
                t_sent = writes[-1] if writes else now()
                chunks.record(i, names[i], queue.popleft(), t_ready, t_sent)
        finally:
            await gen.aclose()

    return completion_stream_generator


def _wrap_chat_stream(stream: Callable[..., Any]) -> Callable[..., Any]:
    """The ``/v1/chat/completions`` SSE generator. Its first chunk per choice carries only
    the role; every later chunk of a choice carries the tokens that choice's outputs
    brought since its previous chunk (a reasoning or tool parser may hold tokens back, and
    they arrive with a later chunk), so a chunk's tokens are counted, not mirrored."""

    async def chat_completion_stream_generator(self: Any, request: Any, result_generator: Any,
                                               *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        rec = frontend_recorder()
        n = 1 if getattr(request, "n", None) is None else int(request.n)
        seen: dict[int, int] = defaultdict(int)  # tokens of each choice's outputs so far
        sent: dict[int, int] = defaultdict(int)  # ... that chunks carried
        names: dict[int, str] = {}

        async def observed() -> AsyncIterator[Any]:
            async for res in result_generator:
                for output in res.outputs:
                    i = output.index
                    seen[i] += len(output.token_ids)
                    if i not in names:
                        names[i] = res.request_id if n == 1 else f"{res.request_id}#{i}"
                yield res

        gen = stream(self, request, observed(), *args, **kwargs)
        chunks = _Chunks(rec)
        writes: list[int] = []
        _writes.set((writes, rec.now))
        now = rec.now
        try:
            async for chunk in gen:
                t_ready = now()
                writes.clear()
                yield chunk  # the server writes it before asking for the next one
                i = _choice_of(chunk, names)
                if i is None or '"delta":{"role":' in chunk:
                    continue
                k = seen[i] - sent[i]
                name = names.get(i)
                if k <= 0 or name is None:
                    continue
                sent[i] = seen[i]
                t_sent = writes[-1] if writes else now()
                chunks.record(i, name, k, t_ready, t_sent)
        finally:
            await gen.aclose()

    return chat_completion_stream_generator


__all__ = [
    "ENV_DIR",
    "ENV_FLUSH_S",
    "FRONT_SEP",
    "ROLES",
    "ServeCoreAdapter",
    "check_output_dir",
    "client_name",
    "installed_hooks",
    "process_identity",
    "recorder_for",
    "register",
]
