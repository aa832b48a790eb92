"""The `tracekit` command line. A thin edge: load, call the pure stages, render, print.

Every error is one line on stderr, never a traceback (set TRACEKIT_DEBUG=1 to see one
anyway): exit code 2 for bad input or a bad option, 3 for a bug in tracekit. A command
imports the stages it runs inside itself (`# deferred`), so `tracekit --help` loads none.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import click

from tracekit.cli_listing import gaps_in_slices, ttft_in_slices
from tracekit.cli_output import emit, open_in_browser, write_records
from tracekit.cli_window import no_window_options, say_window, say_windows, view, window_options
from tracekit.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    LogError,
    TracekitError,
    UsageError,
    one_line,
)

#: Modules only some commands need -> the extra that installs them.
OPTIONAL_MODULES = {"torch": "gpu", "nvtx": "gpu", "tokenizers": "demo"}


class _Group(click.Group):
    """Turns tracekit's errors (and any crash) into one line: exit 2 for bad input, 3 for
    a bug in tracekit (an internal error, which asks to be reported)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except TracekitError as e:
            if e.exit_code == EXIT_INTERNAL:
                _internal(str(e))
            _fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            click.echo("tracekit: interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            sys.exit(0)
        except ModuleNotFoundError as e:
            extra = OPTIONAL_MODULES.get((e.name or "").split(".")[0])
            if extra is None or os.environ.get("TRACEKIT_DEBUG"):
                _raise_or_report(e)
            _fail(f"this command needs {e.name}: pip install 'tracekit[{extra}]'")
        except Exception as e:  # an unexpected crash is a bug; still no traceback by default
            _raise_or_report(e)


def _raise_or_report(e: Exception) -> NoReturn:
    if os.environ.get("TRACEKIT_DEBUG"):
        raise e
    _internal(f"{type(e).__name__}: {e}")


def _internal(msg: str) -> NoReturn:
    _fail(
        f"internal error: {msg} (a bug in tracekit, not in your input: please report it "
        "with the output of TRACEKIT_DEBUG=1)",
        EXIT_INTERNAL,
    )


def _fail(msg: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    click.echo(f"tracekit: error: {one_line(msg)}", err=True)
    sys.exit(code)


class _OutputFile(click.Path):
    """An -o FILE: refused at parse time, in one line (exit 2), when it names a folder or
    lies in a folder that does not exist, before any run is read."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = os.fspath(value)
        if os.path.isdir(path):
            _fail(f"-o {path}: is a directory (give a file name)")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            _fail(f"-o {path}: the folder {folder} does not exist (create it first)")
        return super().convert(value, param, ctx)


#: the type of every -o that names one file to write
OUTPUT_FILE = _OutputFile()


class _DemoGroup(click.Group):
    """`tracekit demo`: the bundled demo engine's commands (`demo_engine.cli`), imported
    when used, so that `tracekit analyze` never pays for them. An import that fails is
    reported, never hidden: a missing optional package names its extra, anything else is
    an internal error."""

    def _demo(self) -> click.Group:
        return importlib.import_module("demo_engine.cli").demo

    def list_commands(self, ctx: click.Context) -> list[str]:
        return self._demo().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._demo().get_command(ctx, cmd_name)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tracekit")
def main() -> None:
    """Why was that token late? Partition every inter-token gap of a recorded run by cause.

    \b
    Typical use:
      tracekit analyze raw/*.npz                 per-run percentiles and tail share by cause
      tracekit gaps raw/run.npz --min-ms 100     drill into single gaps
      tracekit check raw/*.npz                   validate logs without analysing them

    \b
    Exit codes:
      0  done
      2  bad input or a bad option: one line on stderr names the file, field and problem
      3  internal error: a bug in tracekit, not in the input (please report it; set
         TRACEKIT_DEBUG=1 for the traceback)
    """


main.add_command(
    _DemoGroup(
        "demo",
        help="Run the bundled demo engine: one rung (`demo run`) or the fix ladder "
        "(`demo ladder`). `tracekit demo COMMAND --help` for each.",
        short_help="Run the demo engine (one rung or the fix ladder).",
    )
)


# -- shared helpers ------------------------------------------------------------------------


def _warn(path: str, warnings: Sequence[str]) -> None:
    for w in warnings:
        click.echo(f"tracekit: warning: {one_line(f'{path}: {w}')}", err=True)


_LIMITS_KEY = "tracekit.read_limits"


def _store_limit(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is not None:
        ctx.meta.setdefault(_LIMITS_KEY, {})[param.name] = value


def _read_limits(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that raise the bounds on reading a log (see docs/input-validation.md)."""
    fn = click.option(
        "--max-label-chars", type=click.IntRange(min=1), default=None, metavar="N",
        expose_value=False, callback=_store_limit,
        help="Keep labels, causes and request ids up to N characters whole (default 1000, "
        "or $TRACEKIT_MAX_LABEL_CHARS); longer ones are shortened with a warning.",
    )(fn)  # fmt: skip
    fn = click.option(
        "--max-inflate-mb", type=click.FloatRange(min=0, min_open=True), default=None,
        metavar="MB", expose_value=False, callback=_store_limit,
        help="Refuse a log whose arrays would inflate beyond MB in memory (default: 64x "
        "the file, at least 256 MB, at most 8 GB; or $TRACEKIT_MAX_INFLATE_MB).",
    )(fn)  # fmt: skip
    return fn


def _limits() -> dict[str, Any]:
    """The --max-* options given to the running command, as `load`'s keyword arguments."""
    given = click.get_current_context().meta.get(_LIMITS_KEY, {})
    return {k: v for k, v in given.items() if k.startswith("max_")}


def _map_with_progress(
    fn: Callable[..., Any],
    paths: Sequence[str],
    jobs: int,
    what: str,
    ray: str | None = None,
    sliced: bool = False,
):
    """Apply `fn` to each path (in `jobs` processes, or as Ray tasks on the cluster at `ray`:
    "" for a local Ray), in order, with a progress bar on stderr. One run read in slices
    (`sliced`): its slices go to the processes or tasks (`fn`'s `mapper`), not the run."""
    if sliced and len(paths) == 1 and (jobs > 1 or ray is not None):
        from tracekit.analysis.workers import slice_mapper  # deferred: loaded per command

        fn, jobs, ray = functools.partial(fn, mapper=slice_mapper(jobs, ray)), 1, None
    show = len(paths) > 1 and sys.stderr.isatty()
    out: list[Any] = []
    with (
        open(os.devnull, "w") as devnull,
        click.progressbar(
            length=len(paths), label=what, file=sys.stderr if show else devnull
        ) as bar,
    ):
        if ray is not None:
            from tracekit.analysis.cluster import ray_map  # optional extra: ray only with --ray

            out = ray_map(fn, [(p,) for p in paths], ray, on_result=lambda: bar.update(1))
        elif jobs <= 1 or len(paths) <= 1:
            from tracekit.analysis.progress import progress_on  # deferred: loaded per command

            one = len(paths) == 1 and sys.stderr.isatty()  # a long run says how far it is
            with progress_on(sys.stderr if one else None):
                for p in paths:
                    out.append(fn(p))
                    bar.update(1)
        else:
            from concurrent.futures import ProcessPoolExecutor  # deferred: only with -j

            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for r in pool.map(fn, paths):
                    out.append(r)
                    bar.update(1)
    return out


def _ray_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
        help="Run the per-run work (one long run read in slices: its slices) as Ray tasks: on "
        "the cluster at ADDRESS (auto, "
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


def _say_sliced(paths: Sequence[str]) -> bool:
    """On stderr, each run read in slices (a long one-process run, no window:
    docs/reports.md, "Reading a long run in slices"); whether any is."""
    from tracekit.analysis import workers  # deferred: loaded per command

    sliced = [p for p in paths if view().is_whole_run and workers.reads_in_slices(p)]
    for p in sliced:
        click.echo(f"tracekit: {one_line(p)}: read in slices (bounded memory)", err=True)
    return bool(sliced)


# -- analyze -------------------------------------------------------------------------------


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@click.option(
    "--format", "fmt", type=click.Choice(["table", "jsonl", "parquet"]), default="table",
    show_default=True, help="table: readable; jsonl: one JSON object per run; parquet: -o FILE.",
)  # fmt: skip
@click.option("-o", "--output", type=OUTPUT_FILE, help="Write here instead of stdout.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes (one long run read in slices: its "
              "slices).")  # fmt: skip
@click.option("--by", "by", default=None, metavar="DURATION",
              help="One row per time bucket (500ms, 30s, 1m, 1h, 1d), not per run.")  # fmt: skip
@window_options
@_ray_option
@_read_limits
def analyze(
    runs: tuple[str, ...], fmt: str, output: str | None, jobs: int, ray_address: str | None,
    by: str | None,
) -> None:  # fmt: skip
    """Per-run breakdown of every inter-token gap by cause.

    For each RUN (a raw .npz log): requests, tokens, gaps, tokens/s; ITL p50/p90/p99/p99.9/max
    and TTFT p50/p99 (ms); the share of tail time (gaps >= the run's p99) and of all gap time
    by label (preempt, gc, tok, prefill, graph, forward, residual, and any label the engine
    added); tail gaps by primary cause; the reconciliation error (max |gap - sum of parts|);
    GC counts and generation-2 pauses; the ITL histogram by primary cause. --window and
    --around: the per-gap figures of part of the run; --by: the tail over time.
    """
    from tracekit.analysis import workers  # deferred: loaded per command
    from tracekit.analysis.window import parse_duration  # deferred: loaded per command
    from tracekit.render import text  # deferred: loaded per command

    width_s = None if by is None else parse_duration(by)  # refused before anything is read
    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    sliced = _say_sliced(paths)
    if width_s is not None:
        by_s = functools.partial(workers.over_time_path, width_s=width_s, view=view(), **_limits())
        runs_rows = _map_with_progress(by_s, paths, jobs, "analysing", ray_address, sliced)
        rows = [b.to_record() for bs in runs_rows for b in bs]
        return write_records(rows, fmt, output, lambda: text.over_time(rows) + "\n")
    from tracekit.analysis.stream_server import analyze_server_path  # deferred: as above

    one = functools.partial(analyze_server_path, view=view(), **_limits())
    results = _map_with_progress(one, paths, jobs, "analysing", ray_address, sliced)
    for a in results:
        _warn(a.path, a.warnings)
    table = lambda: text.analyze_report(results) + "\n\n" + text.ttft_runs(results) + "\n"  # noqa: E731
    write_records([a.to_dict() for a in results], fmt, output, table)


# -- gaps ----------------------------------------------------------------------------------


@main.command()
@click.argument("run", type=click.Path())
@click.option(
    "--format", "fmt", type=click.Choice(["table", "jsonl", "csv", "parquet"]), default=None,
    help="table: the longest gaps, readable (the default on a terminal); jsonl (the default "
    "otherwise), csv: every selected gap; parquet: -o FILE.",
)  # fmt: skip
@click.option("--min-ms", type=float, default=None, help="Only gaps at least this long (ms).")
@click.option("--request", "request_id", default=None,
              help="Only this request's gaps: its id in the run, or the id its client saw "
              "(every choice and every request that reused it).")  # fmt: skip
@click.option("--boundary", type=click.Choice(["engine", "client"]), default="engine",
              show_default=True,
              help="engine: gaps between the engine's emissions of a request; client: gaps "
              "between the chunks a server streamed (a merged server run only).")  # fmt: skip
@click.option("--top", type=click.IntRange(min=0), default=20, show_default=True,
              help="table: show this many of the longest gaps (0: all).")  # fmt: skip
@click.option("-o", "--output", type=OUTPUT_FILE, help="Write here instead of stdout.")
@window_options
@_read_limits
def gaps(
    run: str, fmt: str | None, min_ms: float | None, request_id: str | None, boundary: str,
    top: int, output: str | None,
):  # fmt: skip
    """One record per gap of RUN: request, t0_s, t1_s (seconds from engine start), gap_ms,
    parts and context (ms by label; parts sum to gap_ms) and the primary cause. With
    --boundary client, the gaps between a server's streamed chunks (engine labels, then
    the API server's), with each chunk's tokens and the engine/frontend split."""
    # deferred: loaded per command
    from tracekit.analysis import workers
    from tracekit.analysis.gaps import client_gap_records, gap_records
    from tracekit.analysis.window import select_gaps

    if fmt is None:
        fmt = "table" if output is None and sys.stdout.isatty() else "jsonl"
    if boundary == "engine" and _say_sliced([run]) and gaps_in_slices(
            run, fmt, min_ms, request_id, top, output, _warn, **_limits()):  # fmt: skip
        return
    if boundary == "client":
        workers.refuse_whole_client(run, view())  # read whole: bounded by the one-file limit
    log, part, _, win = workers.opened(run, view(), **_limits())  # a long run: in slices
    _warn(log.path, log.warnings)
    win = say_window(run, win)
    if boundary == "client":
        if not len(log.client_emissions):
            raise LogError(
                log.path, "client_emissions", "empty: --boundary client needs a merged server "
                "run (tracekit merge DIR, see docs/adapters.md)"
            )  # fmt: skip
        from tracekit.attribution.client import client_partition

        cpart = client_partition(log)
        gap_ms = cpart.gap_ms
        records = client_gap_records(log, cpart, min_ms=min_ms, request_id=request_id, window=win)
    else:
        gap_ms = part.gap_ms
        records = gap_records(log, select_gaps(part, win), min_ms=min_ms, request_id=request_id)
    if not records:
        longest = f"{float(gap_ms.max()):.1f} ms" if len(gap_ms) else "none: no gaps"
        what = f" of request {request_id!r}" if request_id is not None else ""
        what += " in the window" if win is not None else ""
        above = f" at least {min_ms:g} ms long" if min_ms is not None else ""
        click.echo(
            f"tracekit: {run}: no gap{what}{above} (the run's longest gap: {longest})", err=True
        )
    from tracekit.render import text  # deferred: loaded per command

    write_records(
        records, fmt, output, lambda: text.gaps_table(records, top) + "\n" if records else ""
    )


# -- ttft ----------------------------------------------------------------------------------


@main.command()
@click.argument("run", type=click.Path())
@click.option(
    "--format", "fmt", type=click.Choice(["table", "jsonl", "csv", "parquet"]), default="table",
    show_default=True,
    help="table: the run's TTFT figures and its slowest requests; jsonl/csv/parquet: one "
    "record per request.",
)  # fmt: skip
@click.option("--min-ms", type=float, default=None, help="Only requests with TTFT >= this (ms).")
@click.option("--request", "request_id", default=None, help="Only this request (its id).")
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True,
              help="table: list this many of the slowest requests.")  # fmt: skip
@click.option("--boundary", type=click.Choice(["engine", "client"]), default="engine",
              show_default=True,
              help="engine: arrival to the engine core's first token; client: arrival to the "
              "write of the first streamed chunk (a merged server run only).")  # fmt: skip
@click.option("-o", "--output", type=OUTPUT_FILE, help="Write here instead of stdout.")
@window_options
@_read_limits
def ttft(
    run: str, fmt: str, min_ms: float | None, request_id: str | None, top: int, boundary: str,
    output: str | None,
) -> None:  # fmt: skip
    """Where each request's time to first token went (docs/ttft.md).

    Every request's window [arrival, first token] of RUN is split exclusively into phases
    (queued: arrival to admission; prefilling: admission to first token; evicted) and into
    parts by cause: preempt, gc, wait_<reason> (the scheduler said why it did not admit the
    request: kv_blocks, max_num_seqs, token_budget, preempted_first, other, tokenizing), tok,
    prefill_own / prefill_other (a step's prefill time split by the request's token share),
    decode_other and graph (others' decoding), residual. Parts and phases each sum to the
    TTFT (checked; a mismatch is an error). A log without admission events (schema v1, the
    published layout) is unsplit: the output says so. With --boundary client, the window
    ends at the write of the request's first streamed chunk: the engine boundary's parts to
    the first token, then the API server's (docs/ttft.md, "The client boundary").
    """
    from tracekit.analysis import workers  # deferred: loaded per command
    from tracekit.analysis.ttft_records import ttft_records
    from tracekit.analysis.window import select_ttfts
    from tracekit.attribution.ttft import ttft_figures
    from tracekit.render import text

    if boundary == "engine" and _say_sliced([run]) and ttft_in_slices(
            run, fmt, min_ms, request_id, top, output, _warn, **_limits()):  # fmt: skip
        return
    if boundary == "client":
        workers.refuse_whole_client(run, view())  # read whole: bounded by the one-file limit
    log, _, whole, win = workers.opened(run, view(), **_limits())  # a long run: in slices
    _warn(log.path, log.warnings)
    win = say_window(run, win)
    _warn(log.path, [f"TTFT: {n}" for n in whole.notes])
    p = select_ttfts(whole, win)
    if boundary == "client":
        records, table_of = _client_ttft(run, log, whole, min_ms, request_id, top, win)
    else:
        records = ttft_records(log, p, min_ms=min_ms, request_id=request_id)
        table_of = lambda: text.ttft_requests(run, ttft_figures(p), records, top)  # noqa: E731
    write_records(records, fmt, output, lambda: table_of() + "\n")


def _client_ttft(run, log, engine, min_ms, request_id, top, win):
    """`tracekit ttft --boundary client`: (the client-boundary TTFT records, the table)."""
    # attribution and rendering are imported per command (startup time of the CLI)
    from tracekit.attribution import client_ttft as ct
    from tracekit.render import text

    if not len(log.client_emissions):
        raise LogError(log.path, "client_emissions", "empty: --boundary client needs a merged "
                       "server run (tracekit merge DIR, see docs/adapters.md)")  # fmt: skip
    cp = ct.client_ttft_partition(log, engine=engine)
    if win is not None:  # the requests whose first chunk is written in the window
        cp = cp.take(win.contains(cp.write_s))
    _warn(log.path, [f"TTFT at the client boundary: {n}" for n in cp.notes])
    records = ct.client_ttft_records(log, cp, min_ms=min_ms, request_id=request_id)
    return records, lambda: text.client_ttft_requests(run, ct.client_ttft_figures(cp), records,
                                                      top)  # fmt: skip


# -- check and recover ---------------------------------------------------------------------


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@no_window_options("validates whole logs and reads no gaps: give the window to the command "
                   "that reads them (analyze, gaps, ttft, ...)")  # fmt: skip
@_read_limits
def check(runs: tuple[str, ...]) -> None:
    """Validate raw logs without analysing them: one line per file, exit 2 if any is bad."""
    from tracekit.analysis.stream_check import check_run  # deferred: loaded per command

    bad = 0
    for path in _expand(runs):
        try:  # a long one-process run part by part, in bounded memory (the same verdict)
            log = check_run(path, **_limits())
        except TracekitError as e:
            click.echo(f"BAD   {one_line(str(e))}")
            bad += 1
            continue
        note = f" ({len(log.warnings)} warning(s))" if log.warnings else ""
        click.echo(
            f"ok    {one_line(path)}: {log.num_steps} steps, {log.num_emissions} emissions{note}"
        )
        _warn(path, log.warnings)
    if bad:
        sys.exit(EXIT_BAD_INPUT)


@main.command()
@click.argument("parts_dir", type=click.Path())
@click.option("-o", "--output", type=OUTPUT_FILE, help="Default: the run's own .npz name.")
@click.option("--keep-parts/--remove-parts", default=True, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing output log (refused by default).")
@no_window_options("writes a whole log from its parts and reads no gaps")
@_read_limits
def recover(parts_dir: str, output: str | None, keep_parts: bool, force: bool) -> None:
    """Give an interrupted run's parts folder (RUN.npz.parts/) the RUN.npz a clean stop
    writes. Everything flushed before the interruption is kept. A run of at most one slice
    becomes one RUN.npz file; a longer one, recovered beside its folder with its parts
    kept, is checked part by part and RUN.npz becomes the small file that points at its
    parts (bounded memory, nothing copied). An existing RUN.npz (or -o file) is never
    replaced without --force; the parts are validated first."""
    from tracekit.analysis.recover import recover_run  # deferred: loaded per command

    if not os.path.isdir(parts_dir):
        _fail(f"{parts_dir}: not a parts folder (expected RUN.npz.parts/ left by a recorder)")
    out, log = recover_run(parts_dir, output, remove_parts=not keep_parts, force=force,
                           **_limits())  # fmt: skip
    click.echo(f"recovered {one_line(out)}: {log.num_steps} steps, {log.num_emissions} emissions")


@main.command()
@click.argument("directory", type=click.Path())
@click.option("-o", "--output", type=OUTPUT_FILE, required=True, help="The merged RUN.npz.")
@click.option("--force", is_flag=True, help="Replace an existing output log (refused by default).")
@click.option("--engine", type=click.IntRange(min=0), default=None, metavar="RANK",
              help="Data parallel: the rank of the engine core whose run to merge.")  # fmt: skip
@click.option("--parts", "as_parts", is_flag=True, help="Write RUN.npz.parts/ and the pointer "
              "RUN.npz (a recorder's form), merged chunk by chunk in bounded memory.")  # fmt: skip
@no_window_options("joins whole logs into one run and reads no gaps")
@_read_limits
def merge(directory: str, output: str, force: bool, engine: int | None, as_parts: bool) -> None:
    """Join the per-process logs of one server run (DIRECTORY/ROLE-PID.npz, or the parts of
    a killed process, read in place and never removed) into one RUN.npz: the engine core's
    clock and steps, the API server's client-boundary emissions and windows, the workers'
    windows, requests named as the client knows them. Prints each process's clock offset
    against the engine core and its uncertainty. `analyze`, `report` and `trace` also
    accept DIRECTORY itself. A data-parallel server has one engine core per rank: merge
    each rank's run with --engine RANK (its steps, workers and requests).

    With --parts, a server's run of any length is merged chunk by chunk, in memory bounded
    by its requests and steps, into RUN.npz.parts/ (one part per engine core part) and the
    pointer RUN.npz: every command reads RUN.npz as it reads a recorder's run.

    Given one run instead (a recorder's RUN.npz and its RUN.npz.parts/ folder, the folder
    alone, any log), writes it as one self-contained .npz: the form to share."""
    from tracekit.analysis.recover import refuse_one_file  # deferred: loaded per command
    from tracekit.analysis.run import is_run_dir, save_merged, save_one_file  # deferred
    from tracekit.analysis.unrecorded import unrecorded_report
    from tracekit.log.processes import is_process_dir

    if not as_parts:
        refuse_one_file(directory, "merge -o FILE.npz")
    if not is_process_dir(directory):
        if engine is not None or as_parts:
            _fail(f"{directory}: --engine and --parts take a server's process directory (a "
                  "recorder's parts folder is already a run's parts)")  # fmt: skip
        one = save_one_file(directory, output, force=force, **_limits())
        _warn(directory, one.warnings)
        form = "parts folder" if is_run_dir(directory) else "log"
        click.echo(f"wrote {output}: one file from the {form} {one_line(directory)}, "
                   f"{len(one.steps)} steps, {len(one.emissions)} emissions")  # fmt: skip
        return
    from tracekit.render.text import process_line  # deferred: loaded per command

    if as_parts:
        from tracekit.analysis.server_parts import merge_parts_lines  # deferred: as above

        warnings, lines = merge_parts_lines(directory, output, force, engine, _limits(),
                                            process_line)  # fmt: skip
        _warn(directory, warnings)
        click.echo("\n".join(lines))
        return
    log = save_merged(directory, output, force=force, engine=engine, **_limits())
    _warn(directory, log.warnings)

    for p in log.meta["processes"]:
        click.echo(process_line(p))
    click.echo(
        f"wrote {output}: {len(log.steps)} steps, {len(log.emissions)} engine emissions, "
        f"{len(log.client_emissions)} client chunks, {len(log.request_ids)} requests"
    )
    for u in unrecorded_report(log):  # partial or missing evidence, said, never assumed idle
        click.echo(f"unrecorded: {u['line']}")


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
@click.option("-o", "--output", type=OUTPUT_FILE, help="Write here instead of stdout.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes (one long run read in slices: its "
              "slices).")  # fmt: skip
@window_options
@_ray_option
@_read_limits
def compare(
    runs: tuple[str, ...], by: str, fmt: str, order_by: str | None, output: str | None, jobs: int,
    ray_address: str | None,
) -> None:  # fmt: skip
    """Compare groups of runs: per group (in the order groups first appear), the median and
    [min-max] across its runs of ITL p50, p99, p99.9 and max, TTFT p50 and tokens/s, and the
    median tail-time share by label; then the verdict in words (what owns the first group's
    tail, what each group changed) and its caveats (runs that disagree, a cause the first
    group lacks, runs that missed the regime their engine asked for). Runs are the unit of
    evidence: gaps are never pooled across runs.

    The verdict opens with what to fix first (`tracekit whatif`: the first group's cause
    whose removal lowers p99.9 most). Where runs name the cause their rung fixes (config
    `fixes`, as the demo ladder writes it), each rung's measured p99, p99.9 and TTFT p50 are
    set against the prediction from the rung before it, by both what-if models, with each
    model's error and where it misses the measured runs' [min-max]. --window / --around:
    each run's own window (--around: centred on each run's own gap; docs/reports.md)."""
    from tracekit.analysis import workers  # deferred: loaded per command
    from tracekit.analysis.compare import compare as do_compare
    from tracekit.analysis.verdict import ladder_of, verdict, with_fix_first

    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    one = functools.partial(workers.analyze_whatif_path, view=view(), **_limits())
    pairs = _map_with_progress(one, paths, jobs, "analysing", ray_address, _say_sliced(paths))
    results = [a for a, _ in pairs]
    whatifs = {a.path: w for a, w in pairs}  # the what-if of each run (docs/whatif.md)
    say_windows(paths, [a.window for a in results])  # each run's own
    for a in results:
        _warn(a.path, a.warnings)
    cmp = do_compare(results, by=by, order_by=order_by)
    checks = ladder_of(cmp, whatifs)
    if fmt == "jsonl":
        records = cmp.to_records()
        for rec in records:  # each rung's fix, predicted from the rung before it
            rec["whatif_check"] = [c.to_dict() for c in checks if c.to_key == rec["group"]]
            if any(a.window for a in results):  # each run's window, in the group's order
                rec["windows"] = [a.window for p in rec["paths"] for a in results if a.path == p]
        body = "".join(json.dumps(r) + "\n" for r in records)
    else:
        from tracekit.render import text  # deferred: loaded per command
        from tracekit.render.whatif import compare_text

        v, _ = with_fix_first(verdict(cmp), cmp, whatifs, checks)
        body = compare_text(cmp, v, checks, md=fmt == "markdown")
        body = "".join(f"{text.run_name(a)}: {text.window_text(a.window)}\n" for a in results
                       if a.window) + body  # fmt: skip
    emit(body, output)


@main.command()
@click.argument("run", type=click.Path())
@click.option("-o", "--output", type=OUTPUT_FILE, required=True,
              help="trace.json, or trace.json.gz to gzip it.")  # fmt: skip
@click.option("--requests", "request_ids", default=None,
              help="Only these requests' tracks: comma-separated ids.")  # fmt: skip
@window_options
@_read_limits
def trace(run: str, output: str, request_ids: str | None) -> None:
    """Write RUN as a Chrome trace for Perfetto (ui.perfetto.dev -> Open trace file): the
    engine loop (steps with their segments nested), gc, counters (batch size, free KV
    blocks), and one track per request with every gap named by its primary cause and its
    partition in args.parts; for a merged server run (or its directory) also one process
    track per process (API server, workers) with their windows, the chunks written to
    clients and the arrival of each step's outputs. Use --requests / --window / --around to
    cut large runs: a window keeps the events overlapping it and the gaps ending in it."""

    from tracekit.analysis import workers  # deferred: loaded per command
    from tracekit.analysis.window import trace_span_s
    from tracekit.render import perfetto

    t_start = time.perf_counter()
    ids = [r.strip() for r in request_ids.split(",") if r.strip()] if request_ids else None
    workers.refuse_whole_trace(run, view())  # a long run: a window of it
    log, part, tpart, win = workers.opened(run, view(), **_limits())  # a long run: in slices
    _warn(log.path, log.warnings)
    win = say_window(run, win)
    events = perfetto.chrome_trace_events(
        log, part, requests=ids, window_s=trace_span_s(part, win) if win else None, ttft=tpart,
        own_s=(win.t0_s, win.t1_s) if win else None,
    )  # fmt: skip
    if log.meta.get("processes"):  # a merged server run: one track per process
        from tracekit.render.client import process_events

        shift = perfetto.engine_start_us(events)
        extra = process_events(log, trace_span_s(part, win) if win else None)
        for e in extra:
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift, 3)
        events += extra
    size = perfetto.write_trace(events, output, meta={"source": os.path.basename(run)})
    click.echo(
        f"wrote {one_line(output)}: {len(events)} events, {size / 1e6:.1f} MB in "
        f"{time.perf_counter() - t_start:.1f} s (open it at ui.perfetto.dev)",
        err=True,
    )


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@click.option("-o", "--output", type=OUTPUT_FILE, default="report.html", show_default=True)
@click.option("--by", default="rung", show_default=True, help="Group runs by this config key.")
@click.option("--order-by", default=None, metavar="KEY",
              help="Sort groups and runs (every table and chart) by this config key, e.g. "
              "rung_index (the demo ladder's order); default: the order of the runs.")  # fmt: skip
@click.option("--worst", "n_worst", type=click.IntRange(min=0), default=10, show_default=True,
              help="List this many of the worst stalls of each run.")  # fmt: skip
@click.option("--title", default="tracekit report", show_default=True)
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes (one long run read in slices: its "
              "slices).")  # fmt: skip
@window_options
@_ray_option
@_read_limits
@click.option(
    "--open", "open_", is_flag=True,
    help="Open the report in a browser (or print its file:// URL if none is here).",
)  # fmt: skip
def report(
    runs: tuple[str, ...], output: str, by: str, order_by: str | None, n_worst: int, title: str,
    jobs: int, ray_address: str | None, open_: bool,
):  # fmt: skip
    """Write one self-contained HTML report of RUNS (opens offline, no network): the
    verdict in words with its caveats, summary per run and per group, ITL over time per
    run, the ITL histogram by primary cause, tail-time share and tail-gap counts by cause,
    the ladder (p99 and p99.9 per group), forward share of clean vs tail gaps, TTFT, and
    the worst stalls (gaps grouped by the event that caused them) with their partition and
    steps. --window / --around: the page of each run's window, which says which figures
    stay per run."""

    from tracekit.analysis import workers  # deferred: loaded per command
    from tracekit.analysis.compare import compare as do_compare
    from tracekit.analysis.compare import order_runs
    from tracekit.analysis.verdict import ladder_of, verdict, with_fix_first
    from tracekit.render.html import ReportRun, render_report
    from tracekit.render.whatif import whatif_html

    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    sliced = _say_sliced(paths)
    one = functools.partial(workers.report_path, n_worst=n_worst, view=view(), **_limits())
    pairs = _map_with_progress(one, paths, jobs, "analysing", ray_address, sliced)
    results = [ReportRun(**r) for r, _ in pairs]
    whatifs = {r.analysis.path: w for r, (_, w) in zip(results, pairs, strict=True)}
    say_windows(paths, [r.analysis.window for r in results])  # each run's own
    for r in results:
        _warn(r.analysis.path, r.analysis.warnings)
    cmp = do_compare([r.analysis for r in results], by=by, order_by=order_by)
    order = order_runs([r.analysis for r in results], order_by)
    results = sorted(results, key=lambda r: order.index(r.analysis))
    checks = ladder_of(cmp, whatifs)
    v, fixes = with_fix_first(verdict(cmp), cmp, whatifs, checks)
    first = cmp.groups[0] if cmp.groups else None
    section = (
        whatif_html(fixes, first.key, [whatifs[p] for p in first.paths], checks) if first else ""
    )
    page = render_report(results, cmp, v, title=title, whatif_section=section)
    with open(output, "w", encoding="utf-8") as fh:
        fh.write(page)
    click.echo(
        f"wrote {one_line(output)} ({len(page) / 1e6:.1f} MB, {len(results)} runs)", err=True
    )
    if open_:
        open_in_browser(output)


# -- whatif (docs/whatif.md) ---------------------------------------------------------------


@main.command()
@click.argument("runs", nargs=-1, type=click.Path())
@click.option(
    "--format", "fmt", type=click.Choice(["table", "markdown", "jsonl"]), default="table",
    show_default=True,
    help="table: terminal; markdown: a PR or doc; jsonl: one object per run, removal and model.",
)  # fmt: skip
@click.option(
    "--model", type=click.Choice(["both", "first", "second"]), default="both",
    show_default=True, help="Which model's rows to print (jsonl always has both).",
)  # fmt: skip
@click.option("--remove", "names", multiple=True, metavar="CAUSE",
              help="Only this cause or family (repeatable); default: all of them.")  # fmt: skip
@click.option("-o", "--output", type=OUTPUT_FILE, help="Write here instead of stdout.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Analyse runs in this many processes (one long run read in slices: its "
              "slices).")  # fmt: skip
@window_options
@_read_limits
def whatif(
    runs: tuple[str, ...], fmt: str, model: str, names: tuple[str, ...], output: str | None,
    jobs: int,
) -> None:  # fmt: skip
    """What to fix first: each RUN's ITL p50/p99/p99.9/max and TTFT p50/p90/p99 with one
    cause's time removed, for every cause of the run and every cause family (host overhead,
    scheduling, memory pressure, OS), against the run as measured.

    Two models (docs/whatif.md), each row names its own. First order: every gap and TTFT
    loses the time its partition gave the cause; nothing else moves. Second order: the
    recorded steps replayed in order with the same batches, without the cause's time: an
    instant goes only where everything running then goes (a stall hidden under a longer one
    stays), a preempted request emits at every step it missed and its readmission prefill
    goes. Rows are sorted by the second-order p99.9 gain; the assumptions follow the table.
    Time no instrument covered (residual) is never removed. --window / --around: the
    prediction for the gaps and TTFTs of the window (docs/whatif.md, "A window").

    Families: host (gc, tok, graph and engine host labels such as sample, detokenize),
    scheduling (prefill, schedule; in TTFT others' prefill and waits for a batch slot or
    token budget), memory (preempt; in TTFT waits for KV blocks or behind preempted
    requests), os (labels an engine's cause map maps to os).

    \b
    Examples:
      tracekit whatif raw/baseline__s1.npz
      tracekit whatif raw/*.npz --remove preempt --remove host --format jsonl
    """
    from tracekit.analysis import workers  # deferred: loaded per command
    from tracekit.render.whatif import whatif_table  # deferred: loaded per command

    paths = _expand(runs)
    one = functools.partial(
        workers.whatif_path, names=list(names) or None, view=view(), **_limits()
    )
    results = _map_with_progress(one, paths, jobs, "analysing", sliced=_say_sliced(paths))
    say_windows(paths, [w.window for w in results])  # each run's own
    for w in results:
        _warn(w.path, w.warnings)
    if fmt == "jsonl":
        body = "".join(json.dumps(r) + "\n" for w in results for r in w.to_records())
    else:
        models = ("first", "second") if model == "both" else (model,)
        body = whatif_table(results, models, md=fmt == "markdown")
    emit(body, output)


# -- export and fleet (Parquet datasets, fleet rollups) ------------------------------------


def _ray_mapper(ray_address: str | None, jobs: int = 1):
    """A `mapper(fn, arg_tuples)` running each call as a Ray task, in a process pool, or here."""
    if ray_address is not None:
        from tracekit.analysis.cluster import ray_map  # optional extra: ray only with --ray

        return lambda fn, args: ray_map(fn, args, ray_address)
    if jobs > 1:

        def pool_map(fn, args):
            from concurrent.futures import ProcessPoolExecutor  # deferred: only with -j

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
@window_options
@_ray_option
@_read_limits
def export_cmd(
    runs: tuple[str, ...], output: str, partition_by: str, jobs: int, ray_address: str | None
) -> None:
    """Write RUNS as a Parquet dataset any tool reads without tracekit (pandas, pyarrow,
    DuckDB, Ray Data, Spark): DATASET/gaps/ has one row per gap (run, request, t0_s, t1_s,
    gap_ms, steps, primary cause, part_LABEL_ms for every label, summing to gap_ms);
    DATASET/runs/ one row per run with every per-run figure of `tracekit analyze`.
    --window / --around: each run's window's gaps and its `analyze --window` figures.

    \b
      pandas:  pd.read_parquet("DATASET/gaps")
      DuckDB:  SELECT * FROM read_parquet('DATASET/gaps/**/*.parquet', hive_partitioning=true)
    """
    from tracekit.analysis.export import export  # deferred: loaded per command

    ray_address, runs = _ray_runs(ray_address, runs, jobs)
    paths = _expand(runs)
    _say_sliced(paths)
    keys = [k.strip() for k in partition_by.split(",") if k.strip()]
    meta = export(paths, output, keys, mapper=_ray_mapper(ray_address, jobs), limits=_limits(),
                  view=view())  # fmt: skip
    used, absent = meta["partition_by"], meta["partition_by_absent"]
    if absent:
        click.echo(
            f"tracekit: warning: --partition-by {one_line(', '.join(absent))}: no run has this "
            "config key; the dataset is not partitioned by it",
            err=True,
        )
    part = f", partitioned by {one_line(', '.join(used))}" if used else ""
    click.echo(
        f"wrote {one_line(output)}: {len(meta['runs'])} runs, {meta['gaps']:,} gaps{part}",
        err=True,
    )


@main.command("fleet")
@click.argument("source", nargs=-1, type=click.Path())
@click.option("--by", required=True, metavar="KEY", help="Group runs by this config key "
              "(or a hive key / run figure of the dataset).")  # fmt: skip
@click.option(
    "--format", "fmt", type=click.Choice(["table", "jsonl"]), default="table",
    show_default=True, help="table: terminal; jsonl: one object per group, every figure.",
)  # fmt: skip
@click.option("--memory-mb", type=click.FloatRange(min=0), default=1024, show_default=True,
              help="Pooled percentiles are exact while the gaps held (8 bytes each) fit in "
              "this; larger groups use a quantile sketch and print its rank error.")  # fmt: skip
@click.option("--sketch-points", type=click.IntRange(min=16), default=100_000, show_default=True,
              help="Size of a merged quantile sketch: its rank error is about "
              "gaps/points.")  # fmt: skip
@click.option("-o", "--output", type=OUTPUT_FILE, help="Write here instead of stdout.")
@window_options
@_ray_option
@_read_limits
def fleet_cmd(
    source: tuple[str, ...], by: str, fmt: str, memory_mb: float, sketch_points: int,
    output: str | None, ray_address: str | None,
) -> None:  # fmt: skip
    """Roll up a fleet: SOURCE is a dataset folder from `tracekit export`, or raw logs.

    Per group of runs (one value of --by): the median [min-max] across runs of every per-run
    figure (exact), and pooled over all the group's gaps the ITL p50/p90/p99/p99.9/max, the
    pooled tail (gaps >= the pooled p99) with each label's share of its time and its gaps
    by primary cause. Pooled percentiles are exact when they fit --memory-mb, else from a
    mergeable quantile sketch whose rank error is printed with each value. --window /
    --around (raw logs only): the rollup of each run's window.
    """
    from tracekit.analysis.fleet import rollup, rollup_logs  # deferred: loaded per command
    from tracekit.analysis.run import is_run_dir
    from tracekit.render.fleet import fleet_table

    ray_address, source = _ray_runs(ray_address, source, 1)
    paths = _expand(source)
    win = view()
    mapper = _ray_mapper(ray_address)
    if ray_address is not None:  # results combined as they arrive, not all held at once
        from tracekit.analysis.cluster import ray_imap

        mapper = lambda fn, args: ray_imap(fn, args, ray_address)  # noqa: E731
    opts = {"memory_budget_bytes": int(memory_mb * (1 << 20)), "sketch_points": sketch_points}
    if len(paths) == 1 and os.path.isdir(paths[0]) and not is_run_dir(paths[0]):  # a dataset
        if not win.is_whole_run:
            raise UsageError(f"{paths[0]}: a dataset holds the rows `tracekit export` wrote: "
                             "give the window to export (export --window), or run fleet on "
                             "the raw logs")  # fmt: skip
        r = rollup(paths[0], by, mapper=mapper, **opts)
    else:
        _say_sliced(paths)
        r = rollup_logs(paths, by, export_mapper=mapper, mapper=mapper, limits=_limits(),
                        view=win, **opts)  # fmt: skip
    said = {} if win.is_whole_run else {"window": win.to_dict()}
    if fmt == "jsonl":
        body = "".join(json.dumps({**rec, **said}) + "\n" for rec in r.to_records())
    else:
        body = ("" if win.is_whole_run else win.describe() + "\n") + fleet_table(r) + "\n"
    emit(body, output)
