"""The per-run work of the commands, one function a run, given its path: what the CLI maps
over runs here, in a process pool (`--jobs`) or as Ray tasks (`--ray`,
`tracekit.analysis.cluster`). Each opens the run the one way (`open_run`), partitions it
once and returns what the command renders; each is a module-level function, so a pool or
Ray pickles it by name."""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tracekit.allocator import keep_freed_memory
from tracekit.analysis.figures import RunAnalysis, analyze
from tracekit.analysis.gaps import itl_series, worst_stalls
from tracekit.analysis.progress import reporter
from tracekit.analysis.run import open_run, parts_dir_of
from tracekit.analysis.stream import DEFAULT_SLICE_EMISSIONS, NotSliceable
from tracekit.analysis.stream_client import analyze_sliced_client
from tracekit.analysis.stream_index import index_pass_spread
from tracekit.analysis.window import Window, WindowOptions, select_gaps
from tracekit.attribution.itl import Partition, partition
from tracekit.attribution.timeline import PreparedRun
from tracekit.attribution.ttft import TtftPartition, ttft_partition
from tracekit.errors import UsageError
from tracekit.log.parts import read_index
from tracekit.log.rawlog import RawLog

if TYPE_CHECKING:  # types of signatures only: their modules load where they are used
    from tracekit.analysis.overtime import Bucket
    from tracekit.analysis.stream_window import WindowRead
    from tracekit.analysis.whatif import WhatIf


def analyze_path(
    path: str, view: WindowOptions | None = None, mapper: Any = None, **limits: Any
) -> RunAnalysis:
    """`analyze`'s work on one run: every figure of design.md (of the window `view` asks
    for, if any: docs/reports.md, "Windows")."""
    keep_freed_memory()  # once per process: ~40% of a run's analysis was page faults
    if view is None or view.is_whole_run:
        sliced = _analyze_in_slices(path, mapper, **limits)
        return sliced if sliced is not None else analyze(open_run(path, **limits))
    from tracekit.analysis.stream_window import analyze_window  # deferred: windows only

    wr = _window_in_slices(path, view, **limits)
    if wr is not None:
        return analyze_window(wr)
    log, part, tpart = partitions(path, **limits)
    return analyze(log, part, tpart, window=view.resolve(log, part))


#: environment variable: the emissions a slice reads (`DEFAULT_SLICE_EMISSIONS`)
SLICE_ENV = "TRACEKIT_SLICE_EMISSIONS"


def slice_budget() -> int:
    """Emissions a slice reads: `SLICE_ENV`, else the default."""
    return env_count(SLICE_ENV, DEFAULT_SLICE_EMISSIONS)


#: environment variable: the most emissions `trace` writes a whole run's trace of
TRACE_ENV = "TRACEKIT_TRACE_EMISSIONS"
#: ~1.7 KB of memory an emission while the trace is built: ~3.4 GB, a ~100 MB trace file
DEFAULT_TRACE_EMISSIONS = 2_000_000


def refuse_whole_trace(path: str, view: WindowOptions) -> None:
    """`trace` of a whole one-process run of more than `TRACE_ENV` emissions is refused,
    with the windows that cut it: its trace would take gigabytes to build and more than the
    Perfetto UI opens (docs/reports.md, "Reading a long run in slices")."""
    n, limit = _whole_run_over(path, view, TRACE_ENV, DEFAULT_TRACE_EMISSIONS)
    if n > limit:
        raise UsageError(
            f"{path}: {n:,} emissions, more than a whole-run trace holds ({TRACE_ENV}="
            f"{limit:,}: building it would take ~{n * 1.7e3 / 1e9:.0f} GB, and the Perfetto "
            "UI opens a few hundred MB): trace a window of it (--around worst, --around "
            f"p99.9, --window FROM..TO; `tracekit analyze {path} --by 1m` shows when the "
            f"tail was), or set {TRACE_ENV} to {n} or more to write it whole"
        )


def _whole_run_over(path: str, view: WindowOptions, env: str, default: int) -> tuple[int, int]:
    """(emissions, the limit `env` sets) of the whole of a run kept in parts; (0, 0) for a
    window of it or a one-file log (read whole, as always)."""
    parts_dir = parts_dir_of(path)
    if not view.is_whole_run or parts_dir is None:
        return 0, 0
    return emissions_of(parts_dir), env_count(env, default)


#: Emissions above which a run is not held whole in memory: not written as one file
#: (`tracekit.analysis.recover`), not listed at the client boundary (`refuse_whole_client`).
ONE_FILE_ENV = "TRACEKIT_ONE_FILE_EMISSIONS"
DEFAULT_ONE_FILE_EMISSIONS = 10_000_000


def refuse_whole_client(path: str, view: WindowOptions) -> None:
    """`gaps`/`ttft --boundary client` of a whole run read it whole (its client boundary is
    read in slices by `analyze` only): of a run of more than `ONE_FILE_ENV` emissions,
    refused in one line naming what reads it in bounded memory."""
    n, limit = _whole_run_over(path, view, ONE_FILE_ENV, DEFAULT_ONE_FILE_EMISSIONS)
    if n > limit:
        raise UsageError(
            f"{path}: {n:,} emissions, more than a run read whole holds ({ONE_FILE_ENV}="
            f"{limit:,}): --boundary client lists a whole run read whole; list a window of "
            f"it (--window FROM..TO, --around worst: read from the parts it needs), take its "
            f"client figures from `tracekit analyze {path}` (read in slices), or set "
            f"{ONE_FILE_ENV} to {n} or more"
        )


def env_count(name: str, default: int) -> int:
    """A whole number >= 1 from the environment variable `name`, else `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise UsageError(f"{name}={raw!r}: expected a whole number of emissions >= 1")
    return n


def reads_in_slices(path: str) -> bool:
    """Whether `analyze` reads the run at `path` in slices: one process's parts, more
    emissions than one slice holds (by its index)."""
    parts_dir = parts_dir_of(path)
    return parts_dir is not None and emissions_of(parts_dir) > slice_budget()


def sliced_parts(path: str) -> tuple[str, str] | None:
    """(its parts folder, its path as the whole-run reader names it) for a run read in
    slices (`reads_in_slices`); None for one read whole."""
    parts_dir = parts_dir_of(path)
    if parts_dir is None or not reads_in_slices(path):
        return None
    return parts_dir, _shown_path(path, parts_dir)


def _analyze_in_slices(path: str, mapper: Any = None, **limits: Any) -> RunAnalysis | None:
    """A one-process run longer than one slice, analysed slice by slice in bounded memory
    (`tracekit.analysis.stream`, a merged server run's client boundary
    `tracekit.analysis.stream_client`: the same figures); None where it is read whole."""
    parts_dir = parts_dir_of(path)
    if parts_dir is None or not reads_in_slices(path):
        return None
    spread = None if mapper is None else functools.partial(index_pass_spread, mapper=mapper)
    try:
        shown = _shown_path(path, parts_dir)
        return analyze_sliced_client(parts_dir, path=shown, max_emissions=slice_budget(),
                              mapper=mapper, indexer=spread, progress=reporter(shown),
                              max_inflate_mb=limits.get("max_inflate_mb"))  # fmt: skip
    except NotSliceable:  # damaged or written before parts said their first step
        return None


#: slice tasks submitted to a Ray cluster and not yet taken back: the tasks are made as
#: they are sent (a what-if's carry their cut of `R`: minutes of it each on a busy server)
RAY_SLICES_AHEAD = 64


def slice_mapper(jobs: int, ray_address: str | None) -> Callable[..., Iterator[Any]]:
    """How one run's slices run: in `jobs` processes, or as Ray tasks on the cluster at
    `ray_address` ("" for a local Ray); results in slice order either way. The tasks (any
    iterable) are taken as they are sent: twice `jobs` at a time in the pool,
    `RAY_SLICES_AHEAD` on Ray, never all of them at once."""

    def each(fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        if ray_address is not None:
            from tracekit.analysis.cluster import ray_imap  # optional extra: only with --ray

            yield from ray_imap(fn, ((x,) for x in items), ray_address, RAY_SLICES_AHEAD)
        else:
            # deferred: only with -j
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # workers forked from a fresh server, not from this process: forked from here
            # (a day's index, ~1 GB by the later passes) each kept the heap it had when
            # forked, ~250 MB of it dead, for as long as the pass ran
            ctx = multiprocessing.get_context("forkserver")
            with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=keep_freed_memory) as pool:
                running: collections.deque[Any] = collections.deque()
                for x in items:
                    running.append(pool.submit(fn, x))
                    if len(running) >= 2 * jobs:
                        yield running.popleft().result()
                while running:
                    yield running.popleft().result()

    return each


def sliced_window(path: str, view: WindowOptions, **limits: Any) -> WindowRead | None:
    """The window `view` asks for of a run read in slices (`read_window`: the parts it
    needs); None where the run is read whole or `view` is the whole run."""
    return None if view.is_whole_run else _window_in_slices(path, view, **limits)


def _window_in_slices(
    path: str, view: WindowOptions, run_percentiles: bool = False, **limits: Any
) -> WindowRead | None:
    """A window of a one-process run longer than one slice, read from the parts it needs
    (`tracekit.analysis.stream_window`; `run_percentiles`: with the whole run's exact ITL
    percentiles); None where the run is read whole."""
    from tracekit.analysis.stream_window import read_window  # deferred: windows only

    parts_dir = parts_dir_of(path)
    if parts_dir is None or not reads_in_slices(path):
        return None
    try:
        return read_window(parts_dir, view, path=_shown_path(path, parts_dir),
                           max_inflate_mb=limits.get("max_inflate_mb"),
                           run_percentiles=run_percentiles)  # fmt: skip
    except NotSliceable:
        return None


def opened(
    path: str, view: WindowOptions, **limits: Any
) -> tuple[RawLog, Partition, TtftPartition, Window | None]:
    """A run's log, its two partitions and the window `view` picks in it. A window of a
    long one-process run is read in slices: the log is the window's (its gaps and TTFTs
    the whole run's), never the whole run (docs/reports.md, "Reading a long run in
    slices")."""
    wr = None if view.is_whole_run else _window_in_slices(path, view, **limits)
    if wr is not None:
        return wr.log, wr.part, wr.tpart, wr.window
    log, part, tpart = partitions(path, **limits)
    return log, part, tpart, view.resolve(log, part)


def emissions_of(parts_dir: str) -> int:
    """The run's emissions as its index counts them (0 without an index: read whole)."""
    entries, _ = read_index(parts_dir)
    return sum(e.num_emissions for e in entries)


def _shown_path(path: str, parts_dir: str) -> str:
    """The run's path as the whole-run reader names it."""
    return parts_dir if os.path.isdir(path) or not os.path.exists(path) else path


def over_time_path(
    path: str,
    width_s: float,
    view: WindowOptions | None = None,
    mapper: Any = None,
    **limits: Any,
) -> list[Bucket]:
    """`analyze --by`'s work on one run: its buckets of `width_s` seconds (a long run's
    slices run by `mapper`, if given: `slice_mapper`)."""
    # deferred: only analyze --by reads these
    from tracekit.analysis.overtime import over_time
    from tracekit.analysis.stream_overtime import over_time_sliced, over_time_window

    keep_freed_memory()
    parts_dir = parts_dir_of(path)
    if parts_dir is not None and reads_in_slices(path):
        shown, inflate = _shown_path(path, parts_dir), limits.get("max_inflate_mb")
        try:  # a long run: in slices, in bounded memory (the same rows)
            if view is None or view.is_whole_run:
                return over_time_sliced(parts_dir, width_s, path=shown,
                                        max_emissions=slice_budget(),
                                        max_inflate_mb=inflate, mapper=mapper)  # fmt: skip
            return over_time_window(parts_dir, width_s, view, path=shown, max_inflate_mb=inflate)
        except NotSliceable:
            pass
    log = open_run(path, **limits)
    part = partition(log)
    return over_time(log, part, width_s, view.resolve(log, part) if view else None)


def partitions(path: str, **limits: Any) -> tuple[RawLog, Partition, TtftPartition]:
    """A run, its ITL partition and its TTFT partition, from one prepared timeline."""
    log = open_run(path, **limits)
    prep = PreparedRun(log)
    return log, partition(log, run=prep), ttft_partition(log, run=prep)


def whatif_path(
    path: str,
    names: Sequence[str] | None = None,
    view: WindowOptions | None = None,
    mapper: Any = None,
    **limits: Any,
) -> WhatIf:
    """`whatif`'s work on one run: every removal (or those named), by both models, for the
    window `view` asks for, if any. A long one-process run (no window) is read in slices."""
    from tracekit.analysis.whatif import whatif  # deferred: what-if commands only

    keep_freed_memory()
    if view is None or view.is_whole_run:
        sliced = _whatif_in_slices(path, names, mapper, **limits)
        if sliced is not None:
            return sliced
    elif (wr := _window_in_slices(path, view, **limits)) is not None:  # the window's parts
        return _window_whatif(wr, names)
    log, part, tpart = partitions(path, **limits)
    return whatif(log, part, tpart, names, window=_resolve(view, log, part))


def _whatif_in_slices(
    path: str, names: Sequence[str] | None, mapper: Any = None, **limits: Any
) -> WhatIf | None:
    """A one-process run longer than one slice: its what-if slice by slice, in bounded
    memory (`tracekit.analysis.stream_whatif`: the same result); None where it is read
    whole."""
    from tracekit.analysis.stream_whatif import whatif_sliced  # deferred: what-if only

    parts_dir = parts_dir_of(path)
    if parts_dir is None or not reads_in_slices(path):
        return None
    try:
        shown = _shown_path(path, parts_dir)
        return whatif_sliced(parts_dir, names, path=shown, max_emissions=slice_budget(),
                             mapper=mapper, progress=reporter(shown),
                             max_inflate_mb=limits.get("max_inflate_mb"))  # fmt: skip
    except NotSliceable:
        return None


def analyze_whatif_path(
    path: str, view: WindowOptions | None = None, mapper: Any = None, **limits: Any
) -> tuple[RunAnalysis, WhatIf]:
    """`compare`'s work on one run: its figures and its what-if, from one partition (of the
    run's own window `view` asks for, if any). A long one-process run (no window) is read
    in slices, its figures and its what-if each by its own slice reader."""
    # deferred: what-if commands only
    from tracekit.analysis.stream_window import analyze_window
    from tracekit.analysis.whatif import whatif

    keep_freed_memory()
    if view is None or view.is_whole_run:
        a = _analyze_in_slices(path, mapper, **limits)
        w = _whatif_in_slices(path, None, mapper, **limits) if a is not None else None
        if a is not None and w is not None:
            return a, w
    elif (wr := _window_in_slices(path, view, **limits)) is not None:  # the window's parts
        return analyze_window(wr), _window_whatif(wr)
    log, part, tpart = partitions(path, **limits)
    win = _resolve(view, log, part)
    return analyze(log, part, tpart, window=win), whatif(log, part, tpart, window=win)


def report_path(
    path: str,
    n_worst: int,
    view: WindowOptions | None = None,
    mapper: Any = None,
    **limits: Any,
) -> tuple[dict[str, Any], WhatIf]:
    """`report`'s work on one run, all from one partition: the page's view of it (the
    fields of `tracekit.render.html.ReportRun`: figures, worst stalls, ITL series, the
    tail over time) and its what-if, of the window `view` asks for, if any. The whole of a
    long one-process run is read in slices (`tracekit.analysis.stream_report`; by
    `mapper`, if given: `slice_mapper`)."""
    # deferred: report only
    from tracekit.analysis.overtime import report_buckets
    from tracekit.analysis.stream_report import report_whatif_sliced
    from tracekit.analysis.whatif import whatif

    keep_freed_memory()
    parts_dir = parts_dir_of(path)
    if (view is None or view.is_whole_run) and parts_dir is not None and reads_in_slices(path):
        try:  # a long run: in slices, in bounded memory (the same page), one index pass
            shown = _shown_path(path, parts_dir)
            return report_whatif_sliced(parts_dir, n_worst, path=shown,
                                        max_emissions=slice_budget(), progress=reporter(shown),
                                        max_inflate_mb=limits.get("max_inflate_mb"),
                                        mapper=mapper)  # fmt: skip
        except NotSliceable:
            pass
    elif view is not None and (wr := _window_in_slices(path, view, True, **limits)) is not None:
        return _window_page(wr, n_worst), _window_whatif(wr)
    log, part, tpart = partitions(path, **limits)
    win = _resolve(view, log, part)
    page = {
        "analysis": analyze(log, part, tpart, window=win),
        "worst_stalls": worst_stalls(log, select_gaps(part, win), n_worst),
        "series": itl_series(log, part, window=win),
        "buckets": report_buckets(log, part, win),
    }
    return page, whatif(log, part, tpart, window=win)


def _window_whatif(wr: WindowRead, names: Sequence[str] | None = None) -> WhatIf:
    """The what-if of a window read from the parts it needs: its gaps and TTFTs as in the
    whole run, the victim-policy line the whole run's (as the whole-run reader states it)."""
    # deferred: what-if commands only
    from tracekit.analysis.stream_whatif import run_victim_policy
    from tracekit.analysis.whatif import whatif

    w = whatif(wr.log, wr.part, wr.tpart, names, window=wr.window)
    return replace(w, victim_policy=run_victim_policy(wr.run, wr.index))


def _window_page(wr: WindowRead, n_worst: int) -> dict[str, Any]:
    """`report_path`'s page of a window read from the parts it needs: the window log holds
    every gap and TTFT ending in it, partitioned as in the whole run; the over-time view's
    run tail is counted against the whole run's p99 (docs/reports.md, "Windows")."""
    # deferred: report only
    from tracekit.analysis.overtime import report_buckets
    from tracekit.analysis.stream_window import analyze_window

    log, part, win = wr.log, wr.part, wr.window
    return {
        "analysis": analyze_window(wr),
        "worst_stalls": worst_stalls(log, select_gaps(part, win), n_worst),
        "series": itl_series(log, part, window=win),
        "buckets": report_buckets(log, part, win, run_p99=wr.index.gaps.percentiles()[2]),
    }


def _resolve(view: WindowOptions | None, log: RawLog, part: Partition) -> Window | None:
    return view.resolve(log, part) if view is not None else None
