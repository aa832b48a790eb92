"""Helpers shared by the engine-adapter tests (tests/adapters/test_adapters_*.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from engine_adapters._common import is_patched
from tracekit.log.rawlog import RawLog


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread (two made steps 6-40x slower on a 2-core machine), restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tokens_by_request(log: RawLog) -> dict[str, int]:
    """Emitted tokens per request name."""
    em = log.emissions
    counts = np.bincount(em.request, weights=em.num_tokens, minlength=len(log.request_ids))
    return {name: int(c) for name, c in zip(log.request_ids, counts, strict=True)}


def emission_times(log: RawLog, name: str) -> np.ndarray:
    """A request's emission times, engine clock seconds, in order."""
    i = log.request_ids.index(name)
    return np.sort(log.emissions.t_s[log.emissions.request == i])


def log_origin_s(log: RawLog) -> float:
    """The recorder's clock origin in seconds of `time.perf_counter` (its default clock)."""
    return log.meta["t0_tick"] * log.meta["seconds_per_tick"]


def analyze_jsonl(path: str) -> dict[str, Any]:
    """`tracekit analyze PATH --format jsonl`, through a subprocess, parsed."""
    out = subprocess.run(
        [sys.executable, "-c", "from tracekit.cli import main; main()", "analyze", path]
        + ["--format", "jsonl"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    return json.loads(lines[0])


def patches_left(*objs: Any) -> list[str]:
    """Attributes of `objs` (instances or classes) that are still tracekit wrappers."""
    left = []
    for obj in objs:
        if obj is None:
            continue
        for name, value in vars(obj).items():
            if is_patched(value):
                left.append(f"{type(obj).__name__}.{name}")
    return left


def gc_ms_between(log: RawLog, t0_s: np.ndarray, t1_s: np.ndarray) -> np.ndarray:
    """Milliseconds of recorded GC pauses inside each window ``[t0_s, t1_s]``: a pause
    between an emission and the engine's own stamp of it delays the stamp, not the token."""
    g = log.gc_pauses
    a = np.maximum(t0_s[:, None], g.t_start_s[None, :])
    b = np.minimum(t1_s[:, None], g.t_end_s[None, :])
    return np.clip(b - a, 0.0, None).sum(axis=1) * 1e3
