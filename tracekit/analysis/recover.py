"""`tracekit recover` and one-file writes of a run of any length (docs/capture.md, "Every
command reads `OUT.parts/` in place"; docs/design.md, "The run's log on disk").

An interrupted run's parts folder is already readable by every command; recovering it gives
it the name a clean stop would have (`OUT`) and says in the folder that it is recovered.

- A run of at most one slice (`tracekit.analysis.workers.reads_in_slices`) is merged into
  one `.npz` at `OUT`, as ever (`tracekit.log.parts.recover`).
- A longer run, recovered beside its folder with its parts kept (the default), is checked
  part by part (`tracekit.analysis.stream_check.check_run`: the verdict and the one-line
  error `load` gives, in bounded memory) and `OUT` becomes the small pointer file a clean
  stop writes: its parts stay the log, nothing is copied, and its coverage still ends at
  its last part (an interrupted run is read as one). Its cost is one read of the parts.
- A one-file copy (`recover -o ELSEWHERE`, `recover --remove-parts`, `merge RUN -o
  FILE.npz`, and `merge DIR -o FILE.npz` of a server's process directory) holds the run in
  memory; above `ONE_FILE_ENV` emissions it is refused in one line that says what to do
  instead (for a server: `merge --parts`, chunk by chunk).
"""

from __future__ import annotations

import os
from typing import Any

from tracekit.analysis.run import parts_dir_of
from tracekit.analysis.stream_check import Checked, check_run
from tracekit.analysis.workers import (
    DEFAULT_ONE_FILE_EMISSIONS,
    ONE_FILE_ENV,
    emissions_of,
    env_count,
    reads_in_slices,
)
from tracekit.errors import UsageError
from tracekit.log.merge_stream import server_emissions
from tracekit.log.parts import mark_recovered, recover, recover_target, write_pointer
from tracekit.log.processes import is_process_dir


def refuse_one_file(path: str, what: str) -> None:
    """A one-file copy of the run at `path` (one process's, or a server's process
    directory) is refused above `ONE_FILE_ENV` emissions (`what`: the command that would
    write it, for the message)."""
    if is_process_dir(path):
        n = server_emissions(path)
        instead = f"merge it chunk by chunk (tracekit merge {path} -o RUN.npz --parts)"
    else:
        parts_dir = parts_dir_of(path)
        if parts_dir is None:
            return
        n = emissions_of(parts_dir)
        instead = (
            "its parts folder is the log, read in place by every command (recover it "
            "beside its folder, keeping the parts; share the folder)"
        )
    limit = env_count(ONE_FILE_ENV, DEFAULT_ONE_FILE_EMISSIONS)
    if n > limit:
        raise UsageError(
            f"{path}: {n:,} emissions, more than one file holds ({ONE_FILE_ENV}={limit:,}: "
            f"{what} holds the whole run in memory, ~{n * 270 / 1e9:.0f} GB or more): "
            f"{instead}, or set {ONE_FILE_ENV} to {n} or more to write it"
        )


def recover_run(
    parts_dir: str,
    out: str | None = None,
    *,
    remove_parts: bool = False,
    force: bool = False,
    **limits: Any,
) -> tuple[str, Checked]:
    """Recover the interrupted run in `parts_dir` (see the module docstring); returns
    where it is and its check (steps, emissions, warnings). Refuses what
    `tracekit.log.parts.recover_target` refuses; a folder whose parts contradict the run
    is a one-line `LogError` with nothing written."""
    parts_dir = parts_dir.rstrip("/") or parts_dir
    target = recover_target(parts_dir, out, force=force)
    beside = os.path.dirname(os.path.abspath(target)) == os.path.dirname(os.path.abspath(parts_dir))
    if remove_parts or not beside or not reads_in_slices(parts_dir):
        refuse_one_file(parts_dir, "recover -o FILE" if not beside else "recover --remove-parts")
        done = recover(
            parts_dir, target, remove_parts=remove_parts, force=force,
            max_inflate_mb=limits.get("max_inflate_mb"),
        )  # fmt: skip
        return done, check_run(done, **limits)
    checked = check_run(parts_dir, **limits)  # part by part: raises before anything is written
    write_pointer(target, parts_dir)
    mark_recovered(parts_dir, target)
    return target, checked


__all__ = ["DEFAULT_ONE_FILE_EMISSIONS", "ONE_FILE_ENV", "recover_run", "refuse_one_file"]
