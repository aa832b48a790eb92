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
    from .analysis import analyze
    from .rawlog import load

    return analyze(load(path))


def _map_with_progress(fn: Callable[[str], Any], paths: Sequence[str], jobs: int, what: str):
    """Apply `fn` to each path (in `jobs` processes), in order, with a progress bar on stderr."""
    show = len(paths) > 1 and sys.stderr.isatty()
    out: list[Any] = []
    with (
        open(os.devnull, "w") as devnull,
        click.progressbar(
            length=len(paths), label=what, file=sys.stderr if show else devnull
        ) as bar,
    ):
        if jobs <= 1 or len(paths) <= 1:
            for p in paths:
                out.append(fn(p))
                bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for r in pool.map(fn, paths):
                    out.append(r)
                    bar.update(1)
    return out


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
def analyze(runs: tuple[str, ...], fmt: str, output: str | None, jobs: int) -> None:
    """Per-run breakdown of every inter-token gap by cause.

    For each RUN (a raw .npz log): requests, tokens, gaps, tokens/s; ITL p50/p90/p99/p99.9/max
    and TTFT p50/p99 (ms); the share of tail time (gaps >= the run's p99) and of all gap time
    by label (preempt, gc, tok, prefill, graph, forward, residual, and any label the engine
    added); tail gaps by primary cause; the reconciliation error (max |gap - sum of parts|);
    GC counts and generation-2 pauses; the ITL histogram by primary cause.
    """
    from .render import text

    paths = _expand(runs)
    results = _map_with_progress(_analyze_one, paths, jobs, "analysing")
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
    "--format", "fmt", type=click.Choice(["table", "jsonl", "csv", "parquet"]), default=None,
    help="table: the longest gaps, readable (the default on a terminal); jsonl (the default "
    "otherwise), csv: every selected gap; parquet: -o FILE.",
)  # fmt: skip
@click.option("--min-ms", type=float, default=None, help="Only gaps at least this long (ms).")
@click.option("--request", "request_id", default=None, help="Only this request's gaps (its id).")
@click.option("--top", type=click.IntRange(min=0), default=20, show_default=True,
              help="table: show this many of the longest gaps (0: all).")  # fmt: skip
@click.option("-o", "--output", type=click.Path(), help="Write here instead of stdout.")
def gaps(
    run: str, fmt: str | None, min_ms: float | None, request_id: str | None, top: int,
    output: str | None,
):  # fmt: skip
    """One record per gap of RUN: request, t0, t1 (seconds, as in the log), gap_ms,
    parts and context (ms by label; parts sum to gap_ms) and the primary cause."""
    from .gaps import gap_records
    from .partition import partition
    from .rawlog import load

    if fmt is None:
        fmt = "table" if output is None and sys.stdout.isatty() else "jsonl"
    log = load(run)
    _warn(log.path, log.warnings)
    part = partition(log)
    records = gap_records(log, part, min_ms=min_ms, request_id=request_id)
    if not records:
        longest = f"{float(part.gap_ms.max()):.1f} ms" if len(part) else "none: no gaps"
        what = f" of request {request_id!r}" if request_id is not None else ""
        above = f" at least {min_ms:g} ms long" if min_ms is not None else ""
        click.echo(
            f"tracekit: {run}: no gap{what}{above} (the run's longest gap: {longest})", err=True
        )
    if fmt == "parquet":
        _write_parquet(records, output, "parquet files")
        return
    if fmt == "table":
        from .render import text

        body = text.gaps_table(records, top) + "\n" if records else ""
    elif fmt == "jsonl":
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
              help="Sort groups by this config key, e.g. rung_index (the demo ladder's "
              "order); default: the order of the runs. Unknown keys are an error that "
              "lists the keys there are.")  # fmt: skip
@click.option("-o", "--output", type=click.Path(), help="Write here instead of stdout.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes.")  # fmt: skip
def compare(
    runs: tuple[str, ...], by: str, fmt: str, order_by: str | None, output: str | None, jobs: int
) -> None:
    """Compare groups of runs: per group (in the order groups first appear), the median and
    [min-max] across its runs of ITL p50, p99, p99.9 and max, TTFT p50 and tokens/s, and the
    median tail-time share by label; then the verdict in words (what owns the first group's
    tail, what each group changed) and its caveats (runs that disagree, a cause the first
    group lacks, runs that missed the regime their engine asked for). Runs are the unit of
    evidence: gaps are never pooled across runs."""
    from .compare import compare as do_compare
    from .render import text
    from .verdict import verdict

    paths = _expand(runs)
    results = _map_with_progress(_analyze_one, paths, jobs, "analysing")
    for a in results:
        _warn(a.path, a.warnings)
    cmp = do_compare(results, by=by, order_by=order_by)
    if fmt == "jsonl":
        body = "".join(json.dumps(r) + "\n" for r in cmp.to_records())
    else:
        v = verdict(cmp)
        is_md = fmt == "markdown"
        lines = ["", "**VERDICT**" if is_md else "VERDICT", *(f"- {f}" for f in v.findings)]
        if v.caveats:
            lines += ["", "**CAVEATS**" if is_md else "CAVEATS", *(f"- {c}" for c in v.caveats)]
        tables = text.comparison_markdown(cmp) if is_md else text.comparison(cmp)
        body = tables + "\n" + "\n".join(lines) + "\n"
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
    if win is not None:
        lo, hi = _run_span_s(log)
        if not (win[0] <= hi and win[1] >= lo):
            _fail(
                f"{run}: --window {window}: outside the run, which spans {lo:.3f}-{hi:.3f} s "
                "from engine start"
            )
    events = perfetto.chrome_trace_events(log, partition(log), requests=ids, window_s=win)
    size = perfetto.write_trace(events, output, meta={"source": os.path.basename(run)})
    click.echo(
        f"wrote {output}: {len(events)} events, {size / 1e6:.1f} MB in "
        f"{time.perf_counter() - t_start:.1f} s (open it at ui.perfetto.dev)",
        err=True,
    )


def _run_span_s(log: Any) -> tuple[float, float]:
    """First and last moment the run recorded (steps, emissions), seconds from start."""
    import numpy as np

    ts = [log.steps.t_start_s, log.steps.t_end_s, log.emissions.t_s]
    t = np.concatenate([np.asarray(a, dtype=float) for a in ts])
    t = t[np.isfinite(t)]
    return (float(t.min()), float(t.max())) if len(t) else (0.0, 0.0)


def _report_one(path: str, n_worst: int) -> Any:
    from .analysis import analyze
    from .gaps import itl_series, worst_stalls
    from .partition import partition
    from .rawlog import load
    from .render.html import ReportRun

    log = load(path)
    part = partition(log)
    return ReportRun(
        analysis=analyze(log, part),
        worst_stalls=worst_stalls(log, part, n_worst),
        series=itl_series(log, part),
    )


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@click.option("-o", "--output", type=click.Path(), default="report.html", show_default=True)
@click.option("--by", default="rung", show_default=True, help="Group runs by this config key.")
@click.option("--order-by", default=None, metavar="KEY",
              help="Sort groups and runs (every table and chart) by this config key, e.g. "
              "rung_index (the demo ladder's order); default: the order of the runs.")  # fmt: skip
@click.option("--worst", "n_worst", type=click.IntRange(min=0), default=10, show_default=True,
              help="List this many of the worst stalls of each run.")  # fmt: skip
@click.option("--title", default="tracekit report", show_default=True)
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes.")  # fmt: skip
@click.option(
    "--open", "open_", is_flag=True,
    help="Open the report in a browser (or print its file:// URL if none is here).",
)  # fmt: skip
def report(
    runs: tuple[str, ...], output: str, by: str, order_by: str | None, n_worst: int, title: str,
    jobs: int, open_: bool,
):  # fmt: skip
    """Write one self-contained HTML report of RUNS (opens offline, no network): the
    verdict in words with its caveats, summary per run and per group, ITL over time per
    run, the ITL histogram by primary cause, tail-time share and tail-gap counts by cause,
    the ladder (p99 and p99.9 per group), forward share of clean vs tail gaps, TTFT, and
    the worst stalls (gaps grouped by the event that caused them) with their partition and
    steps."""
    import functools

    from .compare import compare as do_compare
    from .compare import order_runs
    from .render.html import render_report
    from .verdict import verdict

    paths = _expand(runs)
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(out_dir):
        _fail(f"-o {output}: the directory {out_dir} does not exist (create it first)")
    one = functools.partial(_report_one, n_worst=n_worst)
    results = _map_with_progress(one, paths, jobs, "analysing")
    for r in results:
        _warn(r.analysis.path, r.analysis.warnings)
    cmp = do_compare([r.analysis for r in results], by=by, order_by=order_by)
    order = order_runs([r.analysis for r in results], order_by)
    results = sorted(results, key=lambda r: order.index(r.analysis))
    page = render_report(results, cmp, verdict(cmp), title=title)
    with open(output, "w", encoding="utf-8") as fh:
        fh.write(page)
    click.echo(f"wrote {output} ({len(page) / 1e6:.1f} MB, {len(results)} runs)", err=True)
    if open_:
        _open_in_browser(output)


def _open_in_browser(path: str) -> None:
    import pathlib
    import webbrowser

    url = pathlib.Path(os.path.abspath(path)).as_uri()
    try:
        ok = webbrowser.open(url)
    except webbrowser.Error:
        ok = False
    if ok:
        click.echo(f"opened {url}", err=True)
    else:
        click.echo(f"no browser available here; open {url}", err=True)
