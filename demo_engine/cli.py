"""`demo`: run the demonstrator engine, one rung or the whole fix ladder.

    tracekit demo run --rung baseline --seed 1 --steps 700 --out raw/
    tracekit demo ladder --seeds 1,2,3 --steps 700 --out raw/

Each run writes `OUT/<rung-slug>__s<seed>.npz`. Arrivals are paced in engine steps
(`--load F`: F times the requests per step the engine retires with its batch full, in
the bursts of `demo_engine.workload.STEP_WORKLOAD`), so
the scheduler sees the same pressure on a slow, fast or busy machine; only the
milliseconds differ. Times are wall time (`--timer wall`, the default): what a client
would see, with the time the OS gave other processes recorded as `os_runqueue` (the
recorder reads the loop thread's run-queue wait at every step boundary on Linux;
docs/partition.md, "OS evidence"). `--timer cpu` records this process's CPU time
instead, so that time lands in no gap (and no OS evidence is recorded). `--rate R
--duration S` paces arrivals in seconds instead (R req/s for S s, on the wall clock),
which makes the pressure depend on this machine's speed. `ladder` runs each run in
a fresh interpreter (no GC state or heap carried from one run to the next).

numpy is imported only inside the commands, after BLAS is limited to one thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import click
import numpy as np

from ._blas import limit_blas_threads, set_thread_env
from .config import (
    RUNG_FIXES,
    RUNG_NAMES,
    EngineConfig,
    WorkloadConfig,
    find_rung,
    rung_config,
    rung_slug,
)

#: Mean arrivals per step relative to the batch capacity (48 / 102 mean output tokens =
#: 0.47 requests per step), in the bursts of `demo_engine.workload.STEP_WORKLOAD`: the
#: reference post's main regime, below capacity on average, a burst overloading the engine
#: for a while (the KV pool runs dry: preemptions, batches past the largest captured size)
#: and the queue draining before the next. 1.8 is the overload sidebar: the queue grows
#: through the run (reports/demo-engine-ladder.md).
DEFAULT_LOAD = 0.5
DEFAULT_STEPS = 700
#: What the ladder's story needs from its baseline run: a KV pool under pressure
#: (preemptions) and batches above the largest captured size (eager steps). Written into
#: the run's config, where `tracekit compare` and `report` check it too.
BASELINE_EXPECT = {"preemptions": 1, "eager_steps": 1}


def _progress_printer(label: str, *, quiet: bool) -> Any:
    if quiet:
        return None
    is_tty = sys.stderr.isatty()
    state = {"last": 0.0}

    def show(p: Any) -> None:
        if not is_tty and p.elapsed_s - state["last"] < 5.0:
            return
        state["last"] = p.elapsed_s
        where = (
            f"step {p.num_steps}/{p.span:.0f}"
            if p.clock == "steps"
            else f"{p.elapsed_s:5.1f}/{p.span:.0f} s"
        )
        line = (
            f"[{label}] {where}  tokens {p.num_tokens}  "
            f"arrived {p.num_arrived}  running {p.num_running}  waiting {p.num_waiting}  "
            f"preempted {p.num_preempted_now} (total {p.num_preemptions})"
        )
        click.echo(("\r" + line + "\033[K") if is_tty else line, err=True, nl=not is_tty)

    return show


def run_one(
    rung: str,
    seed: int,
    out_dir: str,
    *,
    steps: int = DEFAULT_STEPS,
    load: float = DEFAULT_LOAD,
    rate: float | None = None,
    duration_s: float | None = None,
    compute_slowdown: float = 1.0,
    timer: str | None = None,
    preemption_mode: str = "swap",
    quiet: bool = False,
    enabled: bool = True,
    backend: str = "numpy",
    device: str = "cpu",
    is_async_scheduling: bool = False,
    nvtx: bool = False,
    metrics_port: int | None = None,
    live: Any = None,
    flush_interval_s: float = 1.0,
) -> tuple[str, Any]:
    """Run one rung with one seed; returns (log path, engine RunStats).

    Arrivals are paced in engine steps (`load` times the step capacity, for `steps`
    steps) unless `rate` is given: then `rate` req/s for `duration_s` seconds.
    `compute_slowdown` stretches every model call (a slower machine, for checks).
    `timer`: what the recorder's clock counts: "wall" (the default, and the only choice
    with `rate` or on a GPU, whose device windows are mapped onto wall time; time the OS
    took from the engine's thread is `os_runqueue`/`os_blocked`) or "cpu" (this process's
    CPU time, with step pacing on the CPU: time the OS gave others lands in no gap).
    `backend="torch"` runs the same model in torch on `device` (cpu or cuda); on cuda the
    recorder times device work with CUDA events. `is_async_scheduling` (torch only)
    schedules step N+1 while the device runs step N. `metrics_port`: serve live per-cause
    metrics (`tracekit.live`) on this port from before the run until the process exits
    (the run's final values stay scrapeable); `live`: a `tracekit.live.LiveMetrics` sink
    of the caller's to attach instead (see `live_sink`). `flush_interval_s`: the
    recorder's flush interval, in seconds of its clock (each flush is a part of the log)."""
    limit_blas_threads(1)
    from tracekit import Recorder

    from .engine import Engine
    from .model import SlowedRunner
    from .tokenizer import train_tokenizer
    from .workload import make_trace, step_workload

    rung = find_rung(rung)
    cfg = rung_config(rung).replace(
        preemption_mode=preemption_mode, is_async_scheduling=is_async_scheduling
    )
    if rate is None:  # the step clock: the same pressure on any machine
        wl = step_workload(load, cfg.max_num_seqs)
        span: float = steps
        hint = "raise --load or --steps"
    else:
        wl = WorkloadConfig(clock="seconds", rate_req_s=rate)
        span = 30.0 if duration_s is None else duration_s
        hint = (
            "a rate in req/s puts a different pressure on every machine: drop --rate "
            "(arrivals paced in engine steps) or raise it"
        )
    if timer is None:
        timer = "wall"
    if timer not in ("cpu", "wall") or (timer == "cpu" and (rate is not None or device != "cpu")):
        raise ValueError("timer must be 'wall', or 'cpu' with step pacing on the CPU")
    tokenizer = train_tokenizer(cfg.vocab_size, wl)
    trace = make_trace(seed, span, wl)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{rung_slug(rung)}__s{seed}.npz")
    config = {
        "rung": rung,
        "rung_index": RUNG_NAMES.index(rung),  # ladder order, for compare --order-by
        "fixes": RUNG_FIXES[rung],  # the cause this rung removes (docs/whatif.md)
        "seed": seed,
        "clock": wl.clock,
        "steps": steps if rate is None else None,
        "duration": span if rate is not None else None,
        "rate": wl.rate,  # per step or per second, by clock
        "load": load if rate is None else None,
        "compute_slowdown": compute_slowdown,
        "timer": timer,
        "engine": cfg.to_dict(),
        "workload": wl.to_dict(),
        "trace": {
            "num_requests": len(trace),
            "num_docs": sum(t.is_doc for t in trace),
            "num_prompt_chars": sum(len(t.text) for t in trace),
        },
        "env": {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
        "backend": backend,
        "device": device,
    }
    if rung == RUNG_NAMES[0]:
        config["expect"] = dict(BASELINE_EXPECT)
        config["expect_hint"] = hint
    runner, device_timer = _make_runner(backend, device, cfg, tokenizer.get_vocab_size())
    if compute_slowdown != 1.0:
        if is_async_scheduling:
            raise ValueError("--compute-slowdown works on synchronous steps only")
        from .model import NumpyModelRunner

        runner = SlowedRunner(
            runner or NumpyModelRunner(cfg, tokenizer.get_vocab_size()), compute_slowdown
        )
    # wall time: what a client sees; the recorder's OS evidence names the time the OS gave
    # other processes (os_runqueue). The CPU clock leaves that time out of every gap.
    clock = time.process_time_ns if timer == "cpu" else time.perf_counter_ns
    rec = Recorder(
        path if enabled else None,
        config=config,
        enabled=enabled,
        device_timer=device_timer,
        nvtx=nvtx,
        clock=clock,
        flush_interval_s=flush_interval_s,
    )
    if live is not None:
        rec.add_sink(live)
    elif metrics_port is not None:
        _serve_live_metrics(rec, metrics_port, quiet=quiet)
    engine = Engine(cfg, rec, tokenizer, runner=runner)
    with rec:
        try:
            engine.startup()
            stats = engine.serve(
                trace,
                span,
                clock=wl.clock,
                progress=_progress_printer(f"{rung} s{seed}", quiet=quiet),
            )
        finally:
            engine.close()
        # the arrival trace as the published logs kept it (id, arrival s, prompt chars,
        # max new tokens), for the requests that arrived, at the time they did (on the
        # recorder's clock)
        t0 = rec.t0_tick
        rows = [
            [t.index, (engine.arrival_ticks[t.index] - t0) / 1e9, len(t.text), t.max_new_tokens]
            for t in trace
            if t.index in engine.arrival_ticks
        ]
        rec.attach("trace", np.array(rows, dtype=np.float64).reshape(-1, 4))
    if not quiet and sys.stderr.isatty():
        click.echo("", err=True)
    return path, stats


def _serve_live_metrics(rec: Any, port: int, *, quiet: bool) -> Any:
    """A `tracekit.live.LiveMetrics` sink on `rec`, serving /metrics on `port`."""
    from tracekit.live import attach

    return attach(rec, live_sink(port))


def live_sink(
    port: int,
    *,
    bind: str = "127.0.0.1",
    slo_ms: float | None = None,
    otlp_endpoint: str | None = None,
    hold_s: float = 2.0,
    const_labels: dict[str, str] | None = None,
) -> Any:
    """A `tracekit.live.LiveMetrics` sink serving /metrics on `bind`:`port` (0: any free
    port); the chosen address is always printed (stderr), --quiet or not."""
    try:
        from tracekit.live import LiveMetrics

        live = LiveMetrics(
            addr=bind,
            slo_ms=slo_ms,
            otlp_endpoint=otlp_endpoint,
            hold_s=hold_s,
            const_labels=const_labels,
        )
        live.serve(port)
    except ImportError as e:
        raise click.UsageError(f"live metrics: {e}") from None
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except OSError as e:
        raise click.UsageError(
            f"--metrics-port {port} --bind {bind}: cannot listen there ({e.strerror}); "
            "pick a free port or another address"
        ) from None
    host = f"[{bind}]" if ":" in bind else bind
    click.echo(f"metrics: http://{host}:{live.port}/metrics", err=True)
    return live


def regime_misses(rung: str, stats: Any) -> list[str]:
    """What the run lacked of what the ladder's story needs from it (baseline only)."""
    if rung != RUNG_NAMES[0]:
        return []
    got = {"preemptions": stats.num_preemptions, "eager_steps": stats.num_eager_steps}
    return [
        f"{got[k]} {k.replace('_', ' ')} (needs >= {v})"
        for k, v in BASELINE_EXPECT.items()
        if got[k] < v
    ]


def _make_runner(backend: str, device: str, cfg: EngineConfig, vocab_size: int) -> tuple[Any, Any]:
    """(model runner, device timer): None, None for numpy (the engine's default)."""
    if backend == "numpy":
        if device != "cpu" or cfg.is_async_scheduling:
            raise ValueError("--device cuda and --async-scheduling need --backend torch")
        return None, None
    import torch

    from .torch_runner import TorchModelRunner

    torch.set_num_threads(1)  # one core, as the numpy engine
    timer = None
    if device == "cuda":
        from tracekit.capture.device import CudaEventTimer

        timer = CudaEventTimer()
    return TorchModelRunner(cfg, vocab_size, device=device), timer


def _summary(path: str, rung: str, stats: Any) -> str:
    line = (
        f"{path}: {stats.num_steps} steps, {stats.num_tokens} tokens in {stats.wall_s:.1f} s "
        f"({stats.tok_per_s:.0f} tok/s), {stats.num_arrived} arrived, "
        f"{stats.num_finished} finished, {stats.num_preemptions} preemptions, "
        f"{stats.num_eager_steps} eager steps, max decode batch {stats.num_max_decode_batch}"
    )
    misses = regime_misses(rung, stats)
    if misses:
        line += (
            f"\n  regime NOT reached: {'; '.join(misses)}: the fixes aimed at preemption and "
            "graph misses will have nothing to act on"
        )
    return line


def _check_pacing(
    rate: float | None, load: float | None, duration: float | None, steps: int | None
) -> None:
    if rate is not None and (load is not None or steps is not None):
        raise click.UsageError(
            "--rate (req/s, with --duration) paces arrivals in seconds; --load and --steps "
            "pace them in engine steps: give one or the other"
        )
    if duration is not None and rate is None:
        raise click.UsageError(
            "--duration goes with --rate (arrivals in req/s); without --rate arrivals are "
            "paced in engine steps: give the run's length with --steps"
        )
    if load is not None and not load > 0:
        raise click.BadParameter(f"must be > 0, got {load}", param_hint="--load")
    if steps is not None and steps < 1:
        raise click.BadParameter(f"must be >= 1, got {steps}", param_hint="--steps")


@click.group("demo")
def demo() -> None:
    """The CPU demonstrator engine: every stall cause real, recorded with tracekit."""


def _pacing_opts(fn: Any) -> Any:
    opts = [
        click.option(
            "--steps",
            type=int,
            default=None,
            help=f"Engine steps per run (default {DEFAULT_STEPS}); arrivals are paced in "
            "steps, so the pressure is the same on any machine.",
        ),
        click.option(
            "--load",
            type=float,
            default=None,
            help="Arrivals per step as a fraction of what the engine retires with its batch "
            f"full (max_num_seqs / mean output tokens); default {DEFAULT_LOAD}.",
        ),
        click.option(
            "--rate",
            type=float,
            default=None,
            help="Pace arrivals in seconds instead: this many req/s (the pressure then "
            "depends on this machine's speed).",
        ),
        click.option(
            "--duration",
            type=float,
            default=None,
            help="With --rate: seconds of serving (default 30).",
        ),
        click.option(
            "--timer",
            type=click.Choice(["cpu", "wall"]),
            default=None,
            help="What the recorded times count: wall (the default: what a client sees; on "
            "Linux the time the OS gives other processes is os_runqueue) or cpu (this "
            "process's CPU time, with step pacing on the CPU: that time lands in no gap).",
        ),
        click.option(
            "--compute-slowdown",
            type=click.FloatRange(min=1.0),
            default=1.0,
            show_default=True,
            help="Stretch every model call this many times (a slower machine, to check "
            "that the regime holds).",
        ),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


_mode_opt = click.option(
    "--preemption-mode", type=click.Choice(["swap", "recompute"]), default="swap", show_default=True
)


@demo.command("run")
@click.option(
    "--rung",
    default="baseline",
    show_default=True,
    help="One of: " + ", ".join(RUNG_NAMES) + " (or its slug).",
)
@click.option("--seed", type=int, default=1, show_default=True)
@_pacing_opts
@click.option("--out", "out_dir", default="raw", show_default=True, help="Directory for the log.")
@_mode_opt
@click.option("--quiet", is_flag=True, help="No progress line.")
@click.option(
    "--backend",
    type=click.Choice(["numpy", "torch"]),
    default="numpy",
    show_default=True,
    help="The model runner (torch needs the gpu extra).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where torch runs; cuda times device work with CUDA events.",
)
@click.option(
    "--async-scheduling",
    is_flag=True,
    help="Schedule step N+1 while the device runs step N (torch only).",
)
@click.option("--nvtx", is_flag=True, help="NVTX ranges per step and segment (gpu extra).")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve live per-cause ITL/TTFT Prometheus metrics on BIND:PORT/metrics while "
    "the run goes (0: any free port, printed; needs the live extra). See docs/live.md.",
)
@click.option(
    "--bind",
    default="127.0.0.1",
    show_default=True,
    help="With --metrics-port: the address the metrics server listens on.",
)
@click.option(
    "--slo-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="With --metrics-port: every gap >= this (ms) becomes an OpenTelemetry "
    "span (and an exemplar on its histogram bucket).",
)
@click.option(
    "--otlp-endpoint",
    default=None,
    help="With --slo-ms: send the spans to this OTLP/HTTP collector "
    "(e.g. http://127.0.0.1:4318/v1/traces).",
)
@click.option(
    "--hold",
    "hold_s",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="With --metrics-port: seconds a gap waits after a flush before it is "
    "settled (a window open longer arrives late).",
)
@click.option(
    "--lead-s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="With --metrics-port: serve the metrics (every series at 0) this long before the "
    "run starts, so that a scraper's first sample is 0 and increase() over the run is exact.",
)
@click.option(
    "--linger-s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="With --metrics-port: keep serving the final values (tracekit_live_final "
    "1) this long after the run (at least two scrape intervals to be sure one "
    "scrape sees them).",
)
@click.option(
    "--flush-interval",
    "flush_interval_s",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Seconds (of the run's clock: see --timer) between the recorder's flushes: each "
    "is a part of the log's parts folder, at most what a crash loses.",
)
def run_cmd(
    rung: str,
    seed: int,
    steps: int | None,
    load: float | None,
    rate: float | None,
    duration: float | None,
    timer: str | None,
    compute_slowdown: float,
    out_dir: str,
    preemption_mode: str,
    quiet: bool,
    backend: str,
    device: str,
    async_scheduling: bool,
    nvtx: bool,
    metrics_port: int | None,
    bind: str,
    slo_ms: float | None,
    otlp_endpoint: str | None,
    hold_s: float,
    lead_s: float,
    linger_s: float,
    flush_interval_s: float,
) -> None:
    """Run one rung of the fix ladder with one seed; writes OUT/<rung>__s<seed>.npz."""
    _check_pacing(rate, load, duration, steps)
    if metrics_port is None and (slo_ms is not None or otlp_endpoint or linger_s or lead_s):
        raise click.UsageError(
            "--slo-ms, --otlp-endpoint, --lead-s and --linger-s go with --metrics-port"
        )
    if otlp_endpoint and slo_ms is None:
        raise click.UsageError("--otlp-endpoint sends the spans of gaps >= --slo-ms: give both")
    try:
        rung = find_rung(rung)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rung") from None
    if backend == "numpy" and (device != "cpu" or async_scheduling):
        raise click.UsageError("--device cuda and --async-scheduling need --backend torch")
    if async_scheduling and compute_slowdown != 1.0:
        raise click.UsageError("--compute-slowdown works on synchronous steps only")
    if timer == "cpu" and (rate is not None or device != "cpu"):
        raise click.UsageError(
            "--timer cpu needs arrivals paced in steps (no --rate) on the CPU: a rate in "
            "req/s and CUDA device windows are both wall time"
        )
    if backend == "torch":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise click.UsageError("--backend torch needs torch: pip install 'tracekit[gpu]'")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise click.UsageError("--device cuda: torch sees no CUDA device here")
    live = None
    if metrics_port is not None:
        labels = {
            "run": f"{rung_slug(rung)}__s{seed}",
            "engine": "tracekit-demo",
            "model": f"demo-{backend}",
            "process": str(os.getpid()),
        }
        live = live_sink(
            metrics_port, bind=bind, slo_ms=slo_ms, otlp_endpoint=otlp_endpoint,
            hold_s=hold_s, const_labels=labels,
        )  # fmt: skip
        time.sleep(lead_s)
    path, stats = run_one(
        rung,
        seed,
        out_dir,
        steps=DEFAULT_STEPS if steps is None else steps,
        load=DEFAULT_LOAD if load is None else load,
        rate=rate,
        duration_s=duration,
        compute_slowdown=compute_slowdown,
        timer=timer,
        preemption_mode=preemption_mode,
        quiet=quiet,
        backend=backend,
        device=device,
        is_async_scheduling=async_scheduling,
        nvtx=nvtx,
        live=live,
        flush_interval_s=flush_interval_s,
    )
    click.echo(_summary(path, rung, stats))
    if live is not None and linger_s > 0:
        sys.stdout.flush()
        state = "final" if live.is_final else "last settled (the close timed out)"
        click.echo(
            f"metrics: {state} values at http://{bind}:{live.port}/metrics for {linger_s:g} s",
            err=True,
        )
        time.sleep(linger_s)


@demo.command("ladder")
@click.option("--seeds", default="1,2,3", show_default=True, help="Comma-separated seeds.")
@_pacing_opts
@click.option("--out", "out_dir", default="raw", show_default=True)
@click.option(
    "--rungs",
    default=",".join(RUNG_NAMES),
    show_default=True,
    help="Comma-separated rung names or slugs.",
)
@_mode_opt
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Each run serves live Prometheus metrics on this port while it goes (runs are "
    "sequential; each is its own series, label run). See docs/live.md.",
)
@click.option(
    "--bind",
    default="127.0.0.1",
    show_default=True,
    help="With --metrics-port: the address each run's metrics server listens on.",
)
@click.option(
    "--lead-s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="With --metrics-port: each run serves its series at 0 this long first.",
)
@click.option(
    "--linger-s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="With --metrics-port: each run keeps its final values scrapeable this long.",
)
def ladder_cmd(
    seeds: str,
    steps: int | None,
    load: float | None,
    rate: float | None,
    duration: float | None,
    timer: str | None,
    compute_slowdown: float,
    out_dir: str,
    rungs: str,
    preemption_mode: str,
    metrics_port: int | None,
    bind: str,
    lead_s: float,
    linger_s: float,
) -> None:
    """Every rung x every seed, each in a fresh interpreter, all with one workload."""
    _check_pacing(rate, load, duration, steps)
    if timer == "cpu" and rate is not None:
        raise click.UsageError(
            "--timer cpu needs arrivals paced in steps (no --rate): a rate in wall time on a "
            "clock that counts CPU time would mix the two clocks"
        )
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
        rung_list = [find_rung(r.strip()) for r in rungs.split(",") if r.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    limit_blas_threads(1)
    if rate is None:
        pacing = ["--steps", str(DEFAULT_STEPS if steps is None else steps)]
        pacing += ["--load", repr(DEFAULT_LOAD if load is None else load)]
    else:
        pacing = ["--rate", repr(rate)] + (
            [] if duration is None else ["--duration", repr(duration)]
        )
    if timer is not None:  # every rung's run records on the clock the ladder was given
        pacing += ["--timer", timer]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ladder.json"), "w") as fh:
        json.dump(
            {
                "seeds": seed_list,
                "rungs": rung_list,
                "pacing": pacing,
                "compute_slowdown": compute_slowdown,
                "preemption_mode": preemption_mode,
                "argv": sys.argv,
            },
            fh,
            indent=1,
        )
    env = dict(os.environ)
    set_thread_env(1)
    env.update({k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    # every rung once per seed, the rung order rotated from seed to seed, so a slow patch of
    # a shared machine does not always land on the same rungs
    runs = []
    for k, s in enumerate(seed_list):
        shift = (k * len(rung_list)) // max(1, len(seed_list))
        runs += [(s, r) for r in rung_list[shift:] + rung_list[:shift]]
    t_start = time.monotonic()
    failures = 0
    for i, (seed, rung) in enumerate(runs, 1):
        cmd = [
            sys.executable,
            "-m",
            "demo_engine.cli",
            "run",
            *("--rung", rung, "--seed", str(seed), *pacing),
            *("--compute-slowdown", repr(compute_slowdown), "--out", out_dir),
            *("--preemption-mode", preemption_mode, "--quiet"),
        ]
        if metrics_port is not None:
            cmd += ["--metrics-port", str(metrics_port), "--bind", bind]
            cmd += ["--lead-s", repr(lead_s), "--linger-s", repr(linger_s)]
        click.echo(f"[{i}/{len(runs)}] {rung} s{seed} ...", err=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        elapsed = time.monotonic() - t_start
        eta = elapsed / i * (len(runs) - i)
        if proc.returncode != 0:
            failures += 1
            click.echo(f"  FAILED (exit {proc.returncode}):\n{proc.stderr[-2000:]}", err=True)
        else:
            click.echo(
                f"  {proc.stdout.strip()}  [{elapsed:.0f} s elapsed, ~{eta:.0f} s left]", err=True
            )
    if failures:
        raise click.ClickException(f"{failures} of {len(runs)} runs failed")


def main() -> None:
    demo(prog_name="python -m demo_engine.cli")


if __name__ == "__main__":
    main()
