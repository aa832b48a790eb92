"""`analyze DIR` of a long server run (docs/reports.md, "Reading a long run in slices"): a
process directory whose engine core recorded more emissions than one slice holds is merged
chunk by chunk into a temporary parts folder (`tracekit.analysis.server_parts`, in
``$TMPDIR``, removed after) and that run is analysed in slices, as any recorder's run
(`tracekit.analysis.workers.analyze_path`), its client boundary too
(`tracekit.analysis.stream_client`). Its figures are those of the whole merged run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from typing import Any

from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.server_parts import save_merged_parts
from tracekit.analysis.window import WindowOptions
from tracekit.analysis.workers import analyze_path, slice_budget
from tracekit.log.merge_stream import server_emissions
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
        return analyze_path(path, view, mapper, **limits)
    tmp = tempfile.mkdtemp(prefix="tracekit-server-")
    try:
        out = os.path.join(tmp, "run.npz")
        save_merged_parts(path, out, max_inflate_mb=limits.get("max_inflate_mb"))
        a = analyze_path(out, view, mapper, **limits)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return replace(a, path=path)
