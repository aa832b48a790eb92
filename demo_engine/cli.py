"""`demo`: run the demonstrator engine, one rung or the whole fix ladder.

    python -m demo_engine.cli run --rung baseline --seed 1 --duration 30 --load 0.8 --out raw/
    python -m demo_engine.cli ladder --seeds 1,2,3 --duration 30 --load 0.8 --out raw/

(`tracekit demo ...` once the lead registers this group.) Each run writes
`OUT/<rung-slug>__s<seed>.npz`. `--rate` fixes the arrival rate; `--load F` measures this
machine's capacity at startup and uses F times it, so the ladder lands near capacity on
any machine. `ladder` measures once and gives every run the same rate, and runs each in
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
from .config import RUNG_NAMES, EngineConfig, WorkloadConfig, find_rung, rung_config, rung_slug

DEFAULT_LOAD = 0.8


def _progress_printer(label: str, *, quiet: bool) -> Any:
    if quiet:
        return None
    is_tty = sys.stderr.isatty()
    state = {"last": 0.0}

    def show(p: Any) -> None:
        if not is_tty and p.elapsed_s - state["last"] < 5.0:
            return
        state["last"] = p.elapsed_s
        line = (
            f"[{label}] {p.elapsed_s:5.1f}/{p.duration_s:.0f} s  tokens {p.num_tokens}  "
            f"arrived {p.num_arrived}  running {p.num_running}  waiting {p.num_waiting}  "
            f"preempted {p.num_preempted_now} (total {p.num_preemptions})"
        )
        click.echo(("\r" + line + "\033[K") if is_tty else line, err=True, nl=not is_tty)

    return show


def calibrate(load: float, *, quiet: bool = False) -> tuple[float, dict[str, float]]:
    """The arrival rate for `load` times this machine's measured capacity."""
    from .engine import measure_capacity
    from .tokenizer import train_tokenizer

    cfg, wl = EngineConfig(), WorkloadConfig()
    tok = train_tokenizer(cfg.vocab_size, wl)
    cap = measure_capacity(cfg, tok, wl)
    rate = load * cap.req_s
    if not quiet:
        click.echo(
            f"capacity: decode {cap.decode_tok_s:.0f} tok/s (batch {cap.decode_batch}: "
            f"{cap.decode_step_ms:.1f} ms/step), prefill {cap.prefill_tok_s:.0f} tok/s; "
            f"~{cap.req_s:.2f} req/s -> load {load} = {rate:.2f} req/s",
            err=True,
        )
    return rate, cap.to_dict()


def run_one(
    rung: str,
    seed: int,
    duration_s: float,
    out_dir: str,
    *,
    rate: float | None = None,
    load: float | None = None,
    preemption_mode: str = "swap",
    quiet: bool = False,
    enabled: bool = True,
    backend: str = "numpy",
    device: str = "cpu",
    is_async_scheduling: bool = False,
    nvtx: bool = False,
    metrics_port: int | None = None,
) -> tuple[str, Any]:
    """Run one rung with one seed; returns (log path, engine RunStats).

    `backend="torch"` runs the same model in torch on `device` (cpu or cuda); on cuda the
    recorder times device work with CUDA events. `is_async_scheduling` (torch only)
    schedules step N+1 while the device runs step N. `metrics_port`: serve live per-cause
    metrics (`tracekit.live`) on this port from before the run until the process exits
    (the run's final values stay scrapeable)."""
    limit_blas_threads(1)
    from tracekit import Recorder

    from .engine import Engine
    from .tokenizer import train_tokenizer
    from .workload import make_trace

    rung = find_rung(rung)
    cfg = rung_config(rung).replace(
        preemption_mode=preemption_mode, is_async_scheduling=is_async_scheduling
    )
    capacity: dict[str, float] | None = None
    if rate is None:
        load = DEFAULT_LOAD if load is None else load  # recorded as used, not as typed
        rate, capacity = calibrate(load, quiet=quiet)
    wl = WorkloadConfig(rate_req_s=rate)
    tokenizer = train_tokenizer(cfg.vocab_size, wl)
    trace = make_trace(seed, duration_s, wl)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{rung_slug(rung)}__s{seed}.npz")
    config = {
        "rung": rung,
        "rung_index": RUNG_NAMES.index(rung),  # ladder order, for compare --order-by
        "seed": seed,
        "duration": duration_s,
        "rate": rate,
        "load": load,
        "capacity": capacity,
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
    runner, timer = _make_runner(backend, device, cfg, tokenizer.get_vocab_size())
    rec = Recorder(
        path if enabled else None, config=config, enabled=enabled, device_timer=timer, nvtx=nvtx
    )
    if metrics_port is not None:
        _serve_live_metrics(rec, metrics_port, quiet=quiet)
    engine = Engine(cfg, rec, tokenizer, runner=runner)
    with rec:
        # the arrival trace, as the published logs kept it: id, arrival s, prompt chars, max new
        rows = [[t.index, t.arrival_s, len(t.text), t.max_new_tokens] for t in trace]
        rec.attach("trace", np.array(rows, dtype=np.float64).reshape(-1, 4))
        try:
            engine.startup()
            stats = engine.serve(
                trace, duration_s, progress=_progress_printer(f"{rung} s{seed}", quiet=quiet)
            )
        finally:
            engine.close()
    if not quiet and sys.stderr.isatty():
        click.echo("", err=True)
    return path, stats


def _serve_live_metrics(rec: Any, port: int, *, quiet: bool) -> Any:
    """A `tracekit.live.LiveMetrics` sink on `rec`, serving /metrics on `port`."""
    try:
        from tracekit.live import LiveMetrics, attach

        live = LiveMetrics()
        live.serve(port)
    except ImportError as e:
        raise click.UsageError(f"--metrics-port: {e}") from None
    except OSError as e:
        raise click.UsageError(
            f"--metrics-port {port}: cannot listen there ({e.strerror}); pick a free port"
        ) from None
    if not quiet:
        click.echo(f"metrics: http://127.0.0.1:{live.port}/metrics", err=True)
    return attach(rec, live)


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
        from tracekit.device import CudaEventTimer

        timer = CudaEventTimer()
    return TorchModelRunner(cfg, vocab_size, device=device), timer


def _summary(path: str, stats: Any) -> str:
    return (
        f"{path}: {stats.num_tokens} tokens in {stats.wall_s:.1f} s ({stats.tok_per_s:.0f} tok/s), "
        f"{stats.num_arrived} arrived, {stats.num_finished} finished, "
        f"{stats.num_preemptions} preemptions, {stats.num_eager_steps} eager steps, "
        f"max decode batch {stats.num_max_decode_batch}"
    )


@click.group("demo")
def demo() -> None:
    """The CPU demonstrator engine: every stall cause real, recorded with tracekit."""


_rate_opt = click.option("--rate", type=float, default=None, help="Arrival rate, req/s.")
_load_opt = click.option(
    "--load",
    type=float,
    default=None,
    help=f"Arrival rate as a fraction of this machine's capacity (default {DEFAULT_LOAD}).",
)
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
@click.option("--duration", type=float, default=30.0, show_default=True, help="Seconds of serving.")
@_rate_opt
@_load_opt
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
    help="Serve live per-cause ITL/TTFT Prometheus metrics on 127.0.0.1:PORT/metrics while "
    "the run goes (0: any free port; needs the live extra). See docs/live.md.",
)
def run_cmd(
    rung: str,
    seed: int,
    duration: float,
    rate: float | None,
    load: float | None,
    out_dir: str,
    preemption_mode: str,
    quiet: bool,
    backend: str,
    device: str,
    async_scheduling: bool,
    nvtx: bool,
    metrics_port: int | None,
) -> None:
    """Run one rung of the fix ladder with one seed; writes OUT/<rung>__s<seed>.npz."""
    if rate is not None and load is not None:
        raise click.UsageError("give --rate or --load, not both")
    try:
        find_rung(rung)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--rung") from None
    if backend == "numpy" and (device != "cpu" or async_scheduling):
        raise click.UsageError("--device cuda and --async-scheduling need --backend torch")
    if backend == "torch":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            raise click.UsageError("--backend torch needs torch: pip install 'tracekit[gpu]'")
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise click.UsageError("--device cuda: torch sees no CUDA device here")
    path, stats = run_one(
        rung,
        seed,
        duration,
        out_dir,
        rate=rate,
        load=load,
        preemption_mode=preemption_mode,
        quiet=quiet,
        backend=backend,
        device=device,
        is_async_scheduling=async_scheduling,
        nvtx=nvtx,
        metrics_port=metrics_port,
    )
    click.echo(_summary(path, stats))


@demo.command("ladder")
@click.option("--seeds", default="1,2,3", show_default=True, help="Comma-separated seeds.")
@click.option("--duration", type=float, default=30.0, show_default=True)
@_rate_opt
@_load_opt
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
    "sequential; the counters restart with each run). See docs/live.md.",
)
def ladder_cmd(
    seeds: str,
    duration: float,
    rate: float | None,
    load: float | None,
    out_dir: str,
    rungs: str,
    preemption_mode: str,
    metrics_port: int | None,
) -> None:
    """Every rung x every seed, each in a fresh interpreter, all at one arrival rate."""
    if rate is not None and load is not None:
        raise click.UsageError("give --rate or --load, not both")
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
        rung_list = [find_rung(r.strip()) for r in rungs.split(",") if r.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    limit_blas_threads(1)
    capacity = None
    if rate is None:
        load = DEFAULT_LOAD if load is None else load
        rate, capacity = calibrate(load)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "ladder.json"), "w") as fh:
        json.dump(
            {
                "seeds": seed_list,
                "rungs": rung_list,
                "duration": duration,
                "rate": rate,
                "load": load,
                "capacity": capacity,
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
            "--rung",
            rung,
            "--seed",
            str(seed),
            "--duration",
            str(duration),
            "--rate",
            repr(rate),
            "--out",
            out_dir,
            "--preemption-mode",
            preemption_mode,
            "--quiet",
        ]
        if metrics_port is not None:
            cmd += ["--metrics-port", str(metrics_port)]
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
