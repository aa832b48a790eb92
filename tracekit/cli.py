"""The `tracekit` command line. A thin edge: load, call the pure stages, render, print.

Every error about the user's input is one line on stderr and exit code 2, never a
traceback (set TRACEKIT_DEBUG=1 to see one anyway).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import click

from .errors import TracekitError

EXIT_BAD_INPUT = 2


class _Group(click.Group):
    """Turns tracekit's errors (and any crash on a user's file) into one line, exit 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except TracekitError as e:
            _fail(str(e))
        except KeyboardInterrupt:
            click.echo("tracekit: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(0)
        except Exception as e:  # an unexpected crash is a bug; still no traceback by default
            if os.environ.get("TRACEKIT_DEBUG"):
                raise
            _fail(f"internal error: {type(e).__name__}: {e} (TRACEKIT_DEBUG=1 shows the traceback)")


def _fail(msg: str) -> None:
    click.echo(f"tracekit: error: {msg}", err=True)
    sys.exit(EXIT_BAD_INPUT)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tracekit")
def main() -> None:
    """Why was that token late? Partition every inter-token gap of a recorded run by cause.

    \b
    Typical use:
      tracekit analyze raw/*.npz                 per-run percentiles and tail share by cause
      tracekit gaps raw/run.npz --min-ms 100     drill into single gaps
      tracekit check raw/*.npz                   validate logs without analysing them
    """


# -- shared helpers ------------------------------------------------------------------------


def _warn(path: str, warnings: Sequence[str]) -> None:
    for w in warnings:
        click.echo(f"tracekit: warning: {path}: {w}", err=True)


def _analyze_one(path: str) -> Any:
    from .allocator import keep_freed_memory
    from .analysis import analyze
    from .rawlog import load

    keep_freed_memory()  # once per process: ~40% of a run's analysis was page faults
    return analyze(load(path))


def _map_with_progress(
    fn: Callable[[str], Any], paths: Sequence[str], jobs: int, what: str, ray: str | None = None
):
    """Apply `fn` to each path (in `jobs` processes, or as Ray tasks on the cluster at `ray`:
    "" for a local Ray), in order, with a progress bar on stderr."""
    show = len(paths) > 1 and sys.stderr.isatty()
    out: list[Any] = []
    with (
        open(os.devnull, "w") as devnull,
        click.progressbar(
            length=len(paths), label=what, file=sys.stderr if show else devnull
        ) as bar,
    ):
        if ray is not None:
            from .cluster import ray_map

            out = ray_map(fn, [(p,) for p in paths], ray, on_result=lambda: bar.update(1))
        elif jobs <= 1 or len(paths) <= 1:
            for p in paths:
                out.append(fn(p))
                bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for r in pool.map(fn, paths):
                    out.append(r)
                    bar.update(1)
    return out


def _ray_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
        help="Run the per-run work as Ray tasks: on the cluster at ADDRESS (auto, "
        "ray://head:10001, head:6379), or on a local Ray started for this call when ADDRESS is "
        "omitted. Same output as without it. Needs `pip install 'tracekit[ray]'`; see "
        "docs/fleet.md.",
    )(fn)  # fmt: skip


def _ray_runs(
    ray_address: str | None, runs: tuple[str, ...], jobs: int
) -> tuple[str | None, tuple[str, ...]]:
    """(address, runs): `--ray raw/a.npz raw/b.npz` means a local Ray and two runs (the
    option's optional value swallowed the first run)."""
    if ray_address is None:
        return None, runs
    if jobs > 1:
        _fail("--ray and --jobs both given: --ray runs every run as its own task (drop --jobs)")
    if ray_address and (ray_address.endswith(".npz") or os.path.exists(ray_address)):
        return "", (ray_address, *runs)
    return ray_address, runs


def _expand(paths: Sequence[str]) -> list[str]:
    if not paths:
        _fail("no run given (pass one or more raw logs, e.g. raw/*.npz)")
    return list(paths)


def _write_parquet(records: list[dict[str, Any]], output: str | None, what: str) -> None:
    if not output:
        _fail(f"--format parquet needs -o/--output FILE ({what} are binary)")
    import pandas as pd

    pd.json_normalize(records, sep=".").to_parquet(output, index=False)
    click.echo(f"wrote {output}", err=True)


# -- analyze -------------------------------------------------------------------------------


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@click.option(
    "--format", "fmt", type=click.Choice(["table", "jsonl", "parquet"]), default="table",
    show_default=True, help="table: readable; jsonl: one JSON object per run; parquet: -o FILE.",
)  # fmt: skip
@click.option("-o", "--output", type=click.Path(), help="Write here instead of stdout.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes.")  # fmt: skip
@_ray_option
def analyze(
    runs: tuple[str, ...], fmt: str, output: str | None, jobs: int, ray_address: str | None
) -> None:
    """Per-run breakdown of every inter-token gap by cause.

    For each RUN (a raw .npz log): requests, tokens, gaps, tokens/s; ITL p50/p90/p99/p99.9/max
    and TTFT p50/p99 (ms); the share of tail time (gaps >= the run's p99) and of all gap time
    by label (preempt, gc, tok, prefill, graph, forward, residual, and any label the engine
    added); tail gaps by primary cause; the reconciliation error (max |gap - sum of parts|);
    GC counts and generation-2 pauses; the ITL histogram by primary cause.
    """
    from .render import text

    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    results = _map_with_progress(_analyze_one, paths, jobs, "analysing", ray_address)
    for a in results:
        _warn(a.path, a.warnings)
    if fmt == "parquet":
        _write_parquet([a.to_dict() for a in results], output, "tables")
        return
    if fmt == "jsonl":
        body = "".join(json.dumps(a.to_dict(), sort_keys=False) + "\n" for a in results)
    else:
        body = text.analyze_report(results) + "\n"
    _emit(body, output)


def _emit(body: str, output: str | None) -> None:
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(body)
        click.echo(f"wrote {output}", err=True)
    else:
        click.echo(body, nl=False)


# -- gaps ----------------------------------------------------------------------------------


@main.command()
@click.argument("run", type=click.Path())
@click.option(
    "--format", "fmt", type=click.Choice(["jsonl", "csv", "parquet"]), default="jsonl",
    show_default=True,
)  # fmt: skip
@click.option("--min-ms", type=float, default=None, help="Only gaps at least this long (ms).")
@click.option("--request", "request_id", default=None, help="Only this request's gaps (its id).")
@click.option("-o", "--output", type=click.Path(), help="Write here instead of stdout.")
def gaps(run: str, fmt: str, min_ms: float | None, request_id: str | None, output: str | None):
    """One record per gap of RUN: request, t0, t1 (seconds, as in the log), gap_ms,
    parts and context (ms by label; parts sum to gap_ms) and the primary cause."""
    from .gaps import gap_records
    from .rawlog import load

    log = load(run)
    _warn(log.path, log.warnings)
    records = gap_records(log, min_ms=min_ms, request_id=request_id)
    if fmt == "parquet":
        _write_parquet(records, output, "parquet files")
        return
    if fmt == "jsonl":
        body = "".join(json.dumps(r) + "\n" for r in records)
    else:
        import io

        import pandas as pd

        buf = io.StringIO()
        pd.json_normalize(records, sep=".").to_csv(buf, index=False)
        body = buf.getvalue()
    _emit(body, output)


# -- check and recover ---------------------------------------------------------------------


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
def check(runs: tuple[str, ...]) -> None:
    """Validate raw logs without analysing them: one line per file, exit 2 if any is bad."""
    from .rawlog import load

    bad = 0
    for path in _expand(runs):
        try:
            log = load(path)
        except TracekitError as e:
            click.echo(f"BAD   {e}")
            bad += 1
            continue
        note = f" ({len(log.warnings)} warning(s))" if log.warnings else ""
        click.echo(f"ok    {path}: {len(log.steps)} steps, {len(log.emissions)} emissions{note}")
        _warn(path, log.warnings)
    if bad:
        sys.exit(EXIT_BAD_INPUT)


@main.command()
@click.argument("parts_dir", type=click.Path())
@click.option("-o", "--output", type=click.Path(), help="Default: the run's own .npz name.")
@click.option("--keep-parts/--remove-parts", default=True, show_default=True)
def recover(parts_dir: str, output: str | None, keep_parts: bool) -> None:
    """Turn an interrupted run's parts folder (RUN.npz.parts/) into the one RUN.npz a clean
    stop writes. Everything flushed before the interruption is kept."""
    from .rawlog import load
    from .stream import recover as do_recover

    if not os.path.isdir(parts_dir):
        _fail(f"{parts_dir}: not a parts folder (expected RUN.npz.parts/ left by a recorder)")
    out = do_recover(parts_dir, output, remove_parts=not keep_parts)
    log = load(out)
    click.echo(f"recovered {out}: {len(log.steps)} steps, {len(log.emissions)} emissions")


def _register_optional() -> None:
    """Subcommands from the bundled demo engine (its own package)."""
    try:
        from demo_engine.cli import demo
    except ImportError:
        return
    main.add_command(demo)


_register_optional()


# -- compare, report, trace (issue 4: reports) ---------------------------------------------


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@click.option(
    "--by", default="rung", show_default=True,
    help="Group runs by this config key: rung, seed, or dotted (engine.block_size).",
)  # fmt: skip
@click.option(
    "--format", "fmt", type=click.Choice(["table", "markdown", "jsonl"]), default="table",
    show_default=True, help="table: terminal; markdown: a PR or doc; jsonl: one object per group.",
)  # fmt: skip
@click.option("--order-by", default=None, metavar="KEY",
              help="Sort groups by this config key (default: the order of the runs).")  # fmt: skip
@click.option("-o", "--output", type=click.Path(), help="Write here instead of stdout.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes.")  # fmt: skip
@_ray_option
def compare(
    runs: tuple[str, ...], by: str, fmt: str, order_by: str | None, output: str | None, jobs: int,
    ray_address: str | None,
) -> None:  # fmt: skip
    """Compare groups of runs: per group (in the order groups first appear), the median and
    [min-max] across its runs of ITL p50, p99, p99.9 and max, TTFT p50 and tokens/s, and the
    median tail-time share by label. Runs are the unit of evidence: gaps are never pooled
    across runs."""
    from .compare import compare as do_compare
    from .render import text

    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    results = _map_with_progress(_analyze_one, paths, jobs, "analysing", ray_address)
    for a in results:
        _warn(a.path, a.warnings)
    cmp = do_compare(results, by=by, order_by=order_by)
    if fmt == "jsonl":
        body = "".join(json.dumps(r) + "\n" for r in cmp.to_records())
    elif fmt == "markdown":
        body = text.comparison_markdown(cmp) + "\n"
    else:
        body = text.comparison(cmp) + "\n"
    _emit(body, output)


@main.command()
@click.argument("run", type=click.Path())
@click.option("-o", "--output", type=click.Path(), required=True,
              help="trace.json, or trace.json.gz to gzip it.")  # fmt: skip
@click.option("--requests", "request_ids", default=None,
              help="Only these requests' tracks: comma-separated ids.")  # fmt: skip
@click.option(
    "--window", default=None, metavar="T0:T1",
    help="Only events overlapping [T0, T1], seconds from engine start ('10:' ok).",
)  # fmt: skip
def trace(run: str, output: str, request_ids: str | None, window: str | None) -> None:
    """Write RUN as a Chrome trace for Perfetto (ui.perfetto.dev -> Open trace file): the
    engine loop (steps with their segments nested), gc, counters (batch size, free KV
    blocks), and one track per request with every gap named by its primary cause and its
    partition in args.parts. Use --requests / --window to cut large runs."""
    import time

    from .partition import partition
    from .rawlog import load
    from .render import perfetto

    t_start = time.perf_counter()
    win = perfetto.parse_window(window) if window else None
    ids = [r.strip() for r in request_ids.split(",") if r.strip()] if request_ids else None
    log = load(run)
    _warn(log.path, log.warnings)
    events = perfetto.chrome_trace_events(log, partition(log), requests=ids, window_s=win)
    size = perfetto.write_trace(events, output, meta={"source": os.path.basename(run)})
    click.echo(
        f"wrote {output}: {len(events)} events, {size / 1e6:.1f} MB in "
        f"{time.perf_counter() - t_start:.1f} s (open it at ui.perfetto.dev)",
        err=True,
    )


def _report_one(path: str, n_worst: int) -> Any:
    from .allocator import keep_freed_memory
    from .analysis import analyze
    from .gaps import worst_gaps
    from .partition import partition
    from .rawlog import load
    from .render.html import ReportRun

    keep_freed_memory()
    log = load(path)
    part = partition(log)
    return ReportRun(analysis=analyze(log, part), worst_gaps=worst_gaps(log, part, n_worst))


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@click.option("-o", "--output", type=click.Path(), default="report.html", show_default=True)
@click.option("--by", default="rung", show_default=True, help="Group runs by this config key.")
@click.option("--order-by", default=None, metavar="KEY",
              help="Sort groups by this config key (default: the order of the runs).")  # fmt: skip
@click.option("--worst", "n_worst", type=click.IntRange(min=0), default=10, show_default=True,
              help="List this many of the longest gaps of each run.")  # fmt: skip
@click.option("--title", default="tracekit report", show_default=True)
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes.")  # fmt: skip
@_ray_option
def report(
    runs: tuple[str, ...], output: str, by: str, order_by: str | None, n_worst: int, title: str,
    jobs: int, ray_address: str | None,
):  # fmt: skip
    """Write one self-contained HTML report of RUNS (opens offline, no network): summary
    per run and per group, the ITL histogram by primary cause, tail-time share and
    tail-gap counts by cause, the ladder (p99 and p99.9 per group), forward share of clean
    vs tail gaps, TTFT, and the worst gaps with their partition and steps."""
    import functools

    from .compare import compare as do_compare
    from .render.html import render_report

    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    one = functools.partial(_report_one, n_worst=n_worst)
    results = _map_with_progress(one, paths, jobs, "analysing", ray_address)
    for r in results:
        _warn(r.analysis.path, r.analysis.warnings)
    cmp = do_compare([r.analysis for r in results], by=by, order_by=order_by)
    page = render_report(results, cmp, title=title)
    with open(output, "w", encoding="utf-8") as fh:
        fh.write(page)
    click.echo(f"wrote {output} ({len(page) / 1e6:.1f} MB, {len(results)} runs)", err=True)


# -- export and fleet (Parquet datasets, fleet rollups) ------------------------------------


def _ray_mapper(ray_address: str | None, jobs: int = 1):
    """A `mapper(fn, arg_tuples)` running each call as a Ray task, in a process pool, or here."""
    if ray_address is not None:
        from .cluster import ray_map

        return lambda fn, args: ray_map(fn, args, ray_address)
    if jobs > 1:

        def pool_map(fn, args):
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                return list(pool.map(fn, *zip(*args, strict=True))) if args else []

        return pool_map
    return None


@main.command("export")
@click.argument("runs", nargs=-1, type=click.Path())
@click.option("-o", "--output", type=click.Path(), required=True, metavar="DATASET/",
              help="A new folder for the dataset.")  # fmt: skip
@click.option(
    "--partition-by", default="", metavar="KEY[,KEY...]",
    help="Hive-partition both tables by these run config keys (rung, seed, replica, date, "
    "or dotted engine.block_size): DATASET/gaps/rung=baseline/seed=1/RUN.parquet.",
)  # fmt: skip
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Export runs in this many processes.")  # fmt: skip
@_ray_option
def export_cmd(
    runs: tuple[str, ...], output: str, partition_by: str, jobs: int, ray_address: str | None
) -> None:
    """Write RUNS as a Parquet dataset any tool reads without tracekit (pandas, pyarrow,
    DuckDB, Ray Data, Spark): DATASET/gaps/ has one row per gap (run, request, t0_s, t1_s,
    gap_ms, steps, primary cause, part_LABEL_ms for every label, summing to gap_ms);
    DATASET/runs/ one row per run with every per-run figure of `tracekit analyze`.

    \b
      pandas:  pd.read_parquet("DATASET/gaps")
      DuckDB:  SELECT * FROM read_parquet('DATASET/gaps/**/*.parquet', hive_partitioning=true)
    """
    from .export import export

    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    keys = [k.strip() for k in partition_by.split(",") if k.strip()]
    meta = export(paths, output, keys, mapper=_ray_mapper(ray_address, jobs))
    part = f", partitioned by {', '.join(keys)}" if keys else ""
    click.echo(f"wrote {output}: {len(meta['runs'])} runs, {meta['gaps']:,} gaps{part}", err=True)


@main.command("fleet")
@click.argument("source", nargs=-1, type=click.Path())
@click.option(
    "--by",
    required=True,
    metavar="KEY",
    help="Group runs by this config key (or a hive key / run figure of the dataset).",
)
@click.option(
    "--format", "fmt", type=click.Choice(["table", "jsonl"]), default="table",
    show_default=True, help="table: terminal; jsonl: one object per group, every figure.",
)  # fmt: skip
@click.option(
    "--memory-mb",
    type=click.FloatRange(min=0),
    default=1024,
    show_default=True,
    help="Pooled percentiles are exact while the gaps held (8 bytes each) fit in "
    "this; larger groups use a quantile sketch and print its rank error.",
)
@click.option(
    "--sketch-points",
    type=click.IntRange(min=16),
    default=100_000,
    show_default=True,
    help="Size of a merged quantile sketch: its rank error is about gaps/points.",
)
@click.option("-o", "--output", type=click.Path(), help="Write here instead of stdout.")
@_ray_option
def fleet_cmd(
    source: tuple[str, ...], by: str, fmt: str, memory_mb: float, sketch_points: int,
    output: str | None, ray_address: str | None,
) -> None:  # fmt: skip
    """Roll up a fleet: SOURCE is a dataset folder from `tracekit export`, or raw logs.

    Per group of runs (one value of --by): the median [min-max] across runs of every per-run
    figure (exact), and pooled over all the group's gaps the ITL p50/p90/p99/p99.9/max, the
    pooled tail (gaps >= the pooled p99) with each label's share of its time and its gaps
    by primary cause. Pooled percentiles are exact when they fit --memory-mb, else from a
    mergeable quantile sketch whose rank error is printed with each value.
    """
    from .fleet import rollup, rollup_logs
    from .render.fleet import fleet_table

    ray_address, source = _ray_runs(ray_address, source, 1)
    paths = _expand(source)
    mapper = _ray_mapper(ray_address)
    if ray_address is not None:  # results combined as they arrive, not all held at once
        from .cluster import ray_imap

        mapper = lambda fn, args: ray_imap(fn, args, ray_address)  # noqa: E731
    opts = {"memory_budget_bytes": int(memory_mb * (1 << 20)), "sketch_points": sketch_points}
    if len(paths) == 1 and os.path.isdir(paths[0]):
        r = rollup(paths[0], by, mapper=mapper, **opts)
    else:
        r = rollup_logs(paths, by, export_mapper=mapper, mapper=mapper, **opts)
    if fmt == "jsonl":
        body = "".join(json.dumps(rec) + "\n" for rec in r.to_records())
    else:
        body = fleet_table(r) + "\n"
    _emit(body, output)
