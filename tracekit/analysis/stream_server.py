"""`analyze DIR` of a long server run (docs/reports.md, "Reading a long run in slices"): a
process directory whose engine core recorded more emissions than one slice holds is merged
chunk by chunk into a temporary parts folder (`tracekit.analysis.server_parts`, in
``$TMPDIR``, removed after) and that run is analysed in slices, as any recorder's run
(`tracekit.analysis.workers.analyze_path`). Its figures are those of the whole merged run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from typing import Any

from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.run import parts_dir_of
from tracekit.analysis.server_parts import save_merged_parts
from tracekit.analysis.window import WindowOptions
from tracekit.analysis.workers import analyze_path, slice_budget
from tracekit.errors import LogError
from tracekit.log.merge_stream import server_emissions
from tracekit.log.parts import read_final
from tracekit.log.processes import is_process_dir


def is_long_server_run(path: str) -> bool:
    """A server's process directory whose engine core recorded more emissions than one
    slice holds (`slice_budget`)."""
    return is_process_dir(path) and server_emissions(path) > slice_budget()


def analyze_server_path(
    path: str, view: WindowOptions | None = None, mapper: Any = None, **limits: Any
) -> RunAnalysis:
    """`analyze_path`, a long server run's whole-run analysis read in slices from a
    temporary merged parts folder (see the module docstring)."""
    if (view is not None and not view.is_whole_run) or not is_long_server_run(path):
        a = analyze_path(path, view, mapper, **limits)
        if a.client is None and _is_merged_server_run(path):  # read in slices
            a = replace(a, warnings=[*a.warnings, CLIENT_NOT_SLICED])
        return a
    tmp = tempfile.mkdtemp(prefix="tracekit-server-")
    try:
        out = os.path.join(tmp, "run.npz")
        save_merged_parts(path, out, max_inflate_mb=limits.get("max_inflate_mb"))
        a = analyze_path(out, view, mapper, **limits)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.client is None:
        a = replace(a, warnings=[*a.warnings, CLIENT_NOT_SLICED])
    return replace(a, path=path)


def _is_merged_server_run(path: str) -> bool:
    """A server's run merged into a parts folder (`tracekit merge DIR -o RUN.npz --parts`)."""
    parts_dir = parts_dir_of(path)
    try:
        final = read_final(parts_dir) if parts_dir is not None else None
    except (LogError, OSError):
        return False
    return isinstance(final, dict) and "processes" in final


#: What `analyze` of a long server run says of the figures it leaves out
CLIENT_NOT_SLICED = (
    "client-boundary figures ('client') are not read in slices yet: left out; for them, "
    "read the server run whole (tracekit merge DIR -o RUN.npz; tracekit analyze RUN.npz: "
    "its memory grows with the run)"
)
