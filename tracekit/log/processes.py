"""The per-process logs of a multi-process server: finding them in a directory (whole
``ROLE-PID.npz`` logs, or the ``ROLE-PID.npz.parts/`` of a killed process, read in place),
checking who wrote each (``config["process"]``), and reading their counters and windows.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.log.archive import describe_non_regular
from tracekit.log.parts import PARTS_SUFFIX, merge_parts
from tracekit.log.rawlog import RawLog
from tracekit.log.reader import load
from tracekit.log.serve_contract import CORE, FRONTEND, WORKER


@dataclass(frozen=True)
class ProcessLog:
    path: str
    log: RawLog
    identity: dict[str, Any]
    recovered: bool

    @property
    def role(self) -> str:
        return str(self.identity.get("role", "?"))

    @property
    def t0_s(self) -> float:
        """The recorder's start on its own clock, seconds."""
        return int(self.log.meta.get("t0_tick", 0)) * float(
            self.log.meta.get("seconds_per_tick", 1e-9)
        )


def _entries(directory: str) -> tuple[list[str], list[str]]:
    """(whole logs, parts folders) of `directory`, by name (never a glob pattern built from
    its path, which may hold ``[`` or ``*``). A ``.npz`` that is not a regular file (a FIFO,
    a device) is refused before a byte is read; a ``.parts`` that is not a folder is
    skipped."""
    done, parts = [], []
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise LogError(directory, "directory", f"cannot be listed ({e.strerror})") from None
    for n in names:
        p = os.path.join(directory, n)
        if n.endswith(".npz"):
            try:
                mode = os.stat(p).st_mode
            except OSError as e:
                raise LogError(p, "file", f"cannot be read ({e.strerror})") from None
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise LogError(p, "file", f"is {describe_non_regular(mode)}, not a regular file")
            done.append(p)
        elif n.endswith(PARTS_SUFFIX) and os.path.isdir(p):
            parts.append(p)
    return done, parts


def process_entries(directory: str) -> list[tuple[str, str | None, bool]]:
    """The process logs of `directory`, by name: (path, its parts folder where it is one
    (None for a whole ``.npz``), recovered). A parts folder beside its ``.npz`` is left out
    (the process stopped cleanly: the ``.npz`` is its whole run)."""
    if not os.path.isdir(directory):
        raise LogError(directory, "directory", "does not exist or is not a directory")
    done, parts = _entries(directory)
    have = set(done)
    out: list[tuple[str, str | None, bool]] = [(p, None, False) for p in done]
    out += [(d, d, True) for d in parts if d[: -len(PARTS_SUFFIX)] not in have]
    if not out:
        raise LogError(
            directory, "directory", "holds no process logs (ROLE-PID.npz or ROLE-PID.npz.parts/)"
        )
    return out


def process_logs(directory: str, **limits: Any) -> list[ProcessLog]:
    """Every process log in `directory`: a whole ``.npz``, else its parts (read in place).
    `limits`: `load`'s bounds on reading (``max_inflate_mb``, ``max_label_chars``)."""
    out = []
    for path, parts_dir, recovered in process_entries(directory):
        if parts_dir is None:
            log = load(path, **limits)
        else:
            log = merge_parts(parts_dir, max_inflate_mb=limits.get("max_inflate_mb"))
        out.append(check_process_log(path, log, recovered))
    return out


def check_process_log(path: str, log: RawLog, recovered: bool) -> ProcessLog:
    """`log` read from `path` as one process's log: who wrote it checked (a `LogError`
    naming the field otherwise)."""
    ident = log.config.get("process")
    if not isinstance(ident, dict) or ident.get("role") not in (CORE, FRONTEND, WORKER):
        raise LogError(
            path,
            "config.process.role",
            f"missing or not one of {CORE}, {FRONTEND}, {WORKER}: not a per-process log "
            "(record the server with TRACEKIT_VLLM_DIR set, see docs/adapters.md)",
        )
    pid = ident.get("pid", 0)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 2**63:
        raise LogError(path, "config.process.pid", f"{str(pid)[:40]!r} is not a process id")
    for k in ("boot_id", "clock", "host", "name"):
        if not isinstance(ident.get(k, ""), str):
            raise LogError(path, f"config.process.{k}", "not a string")
    t0 = log.meta.get("t0_tick")
    if t0 is None:
        raise LogError(path, "meta.t0_tick", "missing: the merge needs each recorder's start tick")
    if isinstance(t0, bool) or not isinstance(t0, int) or not abs(t0) < 2**63:
        raise LogError(path, "meta.t0_tick", f"{str(t0)[:40]!r} is not an integer tick")
    spt = log.meta.get("seconds_per_tick", 1e-9)
    if (
        isinstance(spt, bool)
        or not isinstance(spt, (int, float))
        or not math.isfinite(spt)
        or not 0 < spt < 1e3
    ):
        raise LogError(
            path, "meta.seconds_per_tick", f"{str(spt)[:40]!r} is not a positive number of seconds"
        )
    return ProcessLog(path, log, dict(ident), recovered)


def is_process_dir(path: str) -> bool:
    """True for a directory of per-process logs (what `merge_dir` reads)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "meta.json")):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith((".npz", PARTS_SUFFIX)) for n in names)


def dp_rank(p: ProcessLog) -> int | None:
    """The data-parallel rank a process recorded (engine cores and workers), else None."""
    r = p.identity.get("dp_rank")
    return int(r) if isinstance(r, int) and not isinstance(r, bool) else None


def tp_rank(p: ProcessLog) -> int | None:
    r = p.identity.get("tp_rank")
    return int(r) if isinstance(r, int) and not isinstance(r, bool) else None


def waited_on(p: ProcessLog) -> bool:
    """Whether the engine core's forward window waits for this worker's outputs: the
    worker whose ``rank`` is the ``output_rank`` it recorded; in a log without it, tensor
    parallel rank 0 (vLLM's output rank with one pipeline stage) or a worker without a
    tensor-parallel rank (the engine core's only worker)."""
    out, rank = p.identity.get("output_rank"), p.identity.get("rank")
    if isinstance(out, int) and isinstance(rank, int):
        return rank == out
    r = tp_rank(p)
    return r is None or r == 0


def counter(log: RawLog, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(times, values) of one counter of a log (empty if it never fired)."""
    if name not in log.counter_names:
        return np.zeros(0), np.zeros(0)
    m = log.counters.name == log.counter_names.index(name)
    return log.counters.t_s[m], log.counters.value[m]


def windows(log: RawLog, labels: tuple[str, ...], steps_only: bool) -> np.ndarray:
    """Per step (engine core) the [first start, last end] of its `labels` windows, or for
    a worker each execute window (``prepare`` + ``forward``) in order: (n, 2)."""
    ids = [log.labels.index(x) for x in labels if x in log.labels]
    seg = log.segments
    m = np.isin(seg.label, ids)
    if steps_only:
        m &= seg.step >= 0
        st = seg.step[m]
        if not len(st):
            return np.zeros((0, 2))
        uniq, inv = np.unique(st, return_inverse=True)
        a = np.full(len(uniq), np.inf)
        b = np.full(len(uniq), -np.inf)
        np.minimum.at(a, inv, seg.t_start_s[m])
        np.maximum.at(b, inv, seg.t_end_s[m])
        return np.column_stack([a, b])
    return np.column_stack([seg.t_start_s[m], seg.t_end_s[m]])
