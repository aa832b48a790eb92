"""What a run is on disk, and the one way to open it (`open_run`).

A run takes one of these forms, and every command and API call that takes "a run" opens it
here:

- a raw log ``.npz`` (`tracekit.log.rawlog`'s layout, any version, or the published
  layout `tracekit.log.published`), including a run merged by ``tracekit merge``;
- a parts folder ``X.npz.parts/`` that a killed recorder left behind (read in place, as
  ``tracekit recover`` would merge it, and never removed);
- a process directory of a multi-process server (``ROLE-PID.npz`` or their parts, one per
  process), merged on the fly as ``tracekit merge`` merges it (`merge_run`).

A server's run is merged by the log stage (`tracekit.log.merge`) and then has the
tensor-parallel rule applied (`tracekit.attribution.tp`): the rule is a cause rule, so it
lives with the others, and the run opened here is the run ``tracekit merge`` writes.
"""

from __future__ import annotations

import os
from typing import Any

from tracekit.analysis.stream import DEFAULT_SLICE_EMISSIONS
from tracekit.attribution.tp import charge_tp_waits
from tracekit.errors import LogError, UsageError
from tracekit.log.archive import read_npz
from tracekit.log.merge import merge_server
from tracekit.log.merge_stream import server_emissions
from tracekit.log.parts import PARTS_SUFFIX, POINTER_MEMBER, merge_parts, pointed_parts
from tracekit.log.processes import is_process_dir, process_logs
from tracekit.log.rawlog import RawLog
from tracekit.log.reader import load
from tracekit.log.validate import validate_log

#: environment variable: the emissions a slice reads (`tracekit.analysis.workers`)
SLICE_ENV = "TRACEKIT_SLICE_EMISSIONS"


def is_parts_dir(path: str) -> bool:
    """True for the parts folder of one recorder (its ``meta.json`` and flushed parts)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "meta.json"))


def parts_dir_of(path: str | os.PathLike[str]) -> str | None:
    """The parts folder of the one-process run at `path` (the folder itself, the pointer
    file a clean stop writes, or ``OUT`` never written beside ``OUT.parts/``), or None for
    any other form (a one-file log, a process directory, nothing)."""
    path = os.fspath(path)
    if is_parts_dir(path):
        return path
    if not os.path.exists(path):
        return path + PARTS_SUFFIX if is_parts_dir(path + PARTS_SUFFIX) else None
    if not os.path.isfile(path):
        return None
    try:
        arrays, _ = read_npz(path, lambda names: [n for n in names if n == POINTER_MEMBER])
        return pointed_parts(path, arrays) if POINTER_MEMBER in arrays else None
    except (LogError, OSError, ValueError):
        return None  # the readers say what is wrong with it


def is_run_dir(path: str) -> bool:
    """True for a directory `open_run` opens as one run: a process directory of a
    multi-process server, or one recorder's parts folder."""
    return is_process_dir(path) or is_parts_dir(path)


def open_run(
    path: str | os.PathLike[str],
    *,
    max_inflate_mb: float | None = None,
    max_label_chars: int | None = None,
) -> RawLog:
    """The run at `path`, in any of its forms (see the module docstring), validated.
    Raises `LogError` naming the file and the field. `max_inflate_mb` and
    `max_label_chars`: `tracekit.log.reader.load`'s bounds on reading (a parts folder is
    read with `max_inflate_mb` only, as the merge reads a killed process's parts)."""
    path = os.fspath(path)
    limits: dict[str, Any] = {}
    if max_inflate_mb is not None:
        limits["max_inflate_mb"] = max_inflate_mb
    if max_label_chars is not None:
        limits["max_label_chars"] = max_label_chars
    if is_process_dir(path):
        refuse_long_server_run(path)
        return merge_run(path, **limits)
    if is_parts_dir(path):
        return validate_log(merge_parts(path, max_inflate_mb=max_inflate_mb))
    return load(path, **limits)


def refuse_long_server_run(directory: str) -> None:
    """A server's process directory whose engine core recorded more emissions than one
    slice holds is not read whole (every process's rows at once: gigabytes on a busy
    server): a `UsageError` naming what reads it in bounded memory. `analyze DIR` merges it
    into a temporary parts folder itself (`tracekit.analysis.stream_server`)."""
    n, budget = server_emissions(directory), _slice_budget()
    if n > budget:
        raise UsageError(
            f"{directory}: a server run of {n} engine emissions, more than one slice "
            f"({budget}, ${SLICE_ENV}): not read whole; merge it first (tracekit merge "
            f"{directory} -o RUN.npz --parts) and give RUN.npz, which is read in slices"
        )


def _slice_budget() -> int:
    """The emissions one slice holds, as `tracekit.analysis.workers.slice_budget` reads
    them (a value it refuses is the default here: that command says what is wrong)."""
    raw = os.environ.get(SLICE_ENV, "").strip()
    try:
        return max(1, int(raw)) if raw else DEFAULT_SLICE_EMISSIONS
    except ValueError:
        return DEFAULT_SLICE_EMISSIONS


def merge_run(directory: str, *, engine: int | None = None, **limits: Any) -> RawLog:
    """The run recorded in a process directory: its processes' logs merged onto the engine
    core's clock and requests (`tracekit.log.merge`), a tensor-parallel step's wait charged
    to its slowest rank (`tracekit.attribution.tp`), validated. `engine`: the data parallel
    rank whose run to build; `limits`: `load`'s bounds on reading each process log."""
    procs = process_logs(directory, **limits)
    return charge_tp_waits(merge_server(procs, path=directory, engine=engine))


def save_merged(
    directory: str, out: str, *, force: bool = False, engine: int | None = None, **limits: Any
) -> RawLog:
    """Merge `directory` into `out` (`merge_run`). An existing `out` is refused unless
    `force` (it may be one of the directory's own logs, or a part of one); nothing is
    written unless the merged log is valid. `engine`: the data parallel rank whose run to
    merge."""
    if os.path.lexists(out) and not force:
        raise LogError(
            out, "output", "already exists (it may be one of the logs being merged); write "
            "elsewhere with -o NEW.npz, or pass --force to replace it",
        )  # fmt: skip
    if inside_parts(directory, out):
        raise LogError(
            out, "output", f"is inside a parts folder of {directory}: the next read of that "
            "folder would take it for a part; write it elsewhere",
        )  # fmt: skip
    log = merge_run(directory, engine=engine, **limits)
    log.save(out)
    return log.with_path(out)


def save_one_file(path: str, out: str, *, force: bool = False, **limits: Any) -> RawLog:
    """The run at `path`, in any form (`open_run`), written as one `.npz` (the form to
    share: one file, no folder; `tracekit.log.rawlog`). An existing `out` is refused unless
    `force`; a parts folder is never modified or removed."""
    if os.path.lexists(out) and not force:
        raise LogError(
            out, "output", "already exists; write elsewhere with -o NEW.npz, or pass --force "
            "to replace it",
        )  # fmt: skip
    parent = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if any(x.endswith(PARTS_SUFFIX) for x in parent.split(os.sep)):
        raise LogError(
            out, "output", "is inside a parts folder: the next read of that folder would "
            "take it for a part; write it elsewhere",
        )  # fmt: skip
    log = open_run(path, **limits)
    log.save(out)
    return log.with_path(out)


def inside_parts(directory: str, out: str) -> bool:
    """`out` would land inside one of `directory`'s parts folders."""
    d = os.path.realpath(directory)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if not parent.startswith(d + os.sep):
        return False
    return any(x.endswith(PARTS_SUFFIX) for x in os.path.relpath(parent, d).split(os.sep))
