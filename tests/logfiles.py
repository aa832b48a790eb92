"""A recorder's run on disk, for tests that read or rewrite its files.

A recorder writes its run as a parts folder (``OUT.parts/``) and, at a clean stop, ``OUT``:
a small pointer file naming the folder (docs/design.md, "The run's log on disk"). Tests that
craft a malformed log, or compare two runs array by array, work on the one-file form
(`tracekit.log.rawlog`), which ``tracekit merge RUN -o FILE.npz`` writes for any run.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import tracekit
from tracekit.log.parts import part_paths, read_part


def one_file(path: str | os.PathLike[str]) -> Path:
    """Rewrite the run at `path` (a pointer, a parts folder's run) as one `.npz` in place of
    its pointer; returns `path`. A one-file log is left as it is."""
    p = Path(path)
    with np.load(p, allow_pickle=False) as z:
        if "schema" in z.files:
            return p
    log = tracekit.load(p)
    log.save(p)
    return p


def one_file_arrays(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every array of the run at `path` in the one-file form."""
    p = one_file(path)
    with np.load(p, allow_pickle=False) as z:
        return {k: z[k].copy() for k in z.files}


def part_files(parts_dir: str | os.PathLike[str]) -> list[Path]:
    """A parts folder's parts in flush order (either format)."""
    return [Path(x) for x in part_paths(str(parts_dir))]


def part_arrays(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """One part's arrays (what the recorder flushed)."""
    return dict(read_part(str(path)))
