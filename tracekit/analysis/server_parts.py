"""A server's run merged into a parts folder with the tensor-parallel rule applied part by
part (`tracekit.log.merge_stream` merges; the rule is a cause rule, `tracekit.attribution.tp`,
so it is applied from here, as `tracekit.analysis.run.merge_run` applies it to a whole
merge).

`tp_rule` finds each step's wait on its slowest rank from the skeleton logs (a worker's
rows are all there) and carves it out of the engine core's forward windows of each part as
it is written: the labels it adds and its report come from one pass over the core's
forward windows (what `carve_tp_waits` reads), so every part carves with the labels the
whole merge gives them, and the report is the whole merge's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from tracekit.analysis.run import inside_parts
from tracekit.analysis.stream_check import check_run
from tracekit.attribution.tp import FORWARD_LABELS, carve_tp_waits, tp_waits
from tracekit.errors import LogError, UsageError
from tracekit.log.merge import MergePlan
from tracekit.log.merge_stream import MergedParts, PartRule, merge_to_parts
from tracekit.log.rawlog import RawLog, Segments


def _forward_starts(log: RawLog) -> tuple[np.ndarray, np.ndarray]:
    """The starts and ends of a log's forward windows of steps, sorted by start."""
    ids = [log.labels.index(x) for x in FORWARD_LABELS if x in log.labels]
    sg = log.segments
    m = np.isin(sg.label, ids) & (sg.step >= 0)
    o = np.argsort(sg.t_start_s[m], kind="stable")
    return sg.t_start_s[m][o], sg.t_end_s[m][o]


def tp_rule(plan: MergePlan) -> PartRule | None:
    """The tensor-parallel rule as a `PartRule` (None: no two ranks recorded collectives)."""
    waits = tp_waits(plan.core, plan.others, plan.fits)
    if not waits:
        return None
    labels = list(plan.labels.labels)
    pos = {x: i for i, x in enumerate(labels)}

    def label_id(name: str) -> int:
        if name not in pos:
            pos[name] = len(labels)
            labels.append(name)
        return pos[name]

    # the skeleton core log holds the forward windows in their order: what the carve reads
    core = replace(plan.core.log, labels=tuple(labels))
    _, report = carve_tp_waits(core, waits, label_id)
    g_starts, _ = _forward_starts(core)
    # a wait starting before every forward window is carved from none (as a whole merge)
    a = np.array([w[1] for w in waits])
    keep = np.searchsorted(g_starts, a, side="right") - 1 >= 0
    kept = [w for w, k in zip(waits, keep.tolist(), strict=True) if k]
    kept.sort(key=lambda w: w[1])
    starts = np.array([w[1] for w in kept])
    longest = max((w[2] - w[1] for w in kept), default=0.0)
    full = tuple(labels)

    def carve(seg: Segments) -> Segments:
        part = replace(plan.core.log, segments=seg, labels=full)
        s, e = _forward_starts(part)
        if not len(s) or not kept:
            return seg
        i0 = int(np.searchsorted(starts, s[0] - longest, side="left"))
        i1 = int(np.searchsorted(starts, e.max(), side="left"))
        # a wait begun in an earlier part's window carries on into this part's first ones
        mine = [(r, max(lo, float(s[0])), hi, c) for r, lo, hi, c in kept[i0:i1] if hi > s[0]]
        out, _ = carve_tp_waits(part, mine, pos.__getitem__)
        return out  # type: ignore[no-any-return]

    return PartRule(labels[len(plan.labels.labels) :], {"tensor_parallel": report}, carve)


def save_merged_parts(
    directory: str,
    out: str,
    *,
    force: bool = False,
    engine: int | None = None,
    max_inflate_mb: float | None = None,
) -> MergedParts:
    """Merge `directory` into the parts folder ``OUT.parts/`` and its pointer `out`, chunk
    by chunk in memory bounded by the run's requests and steps (`tracekit.log.merge_stream`),
    the tensor-parallel rule applied part by part (`tp_rule`), each cleanly stopped
    process's log checked part by part as `load` checks it (`check_run`), and the merged
    run too before it is moved into place (a run `tracekit check` would reject is never
    written; a long one is checked part by part: its engine rows). Reading it whole
    (`open_run(out)`) gives `merge_run(directory)`'s log. Refused as `save_merged` refuses
    (an existing output without `force`, a place inside a parts folder of `directory`)."""
    if inside_parts(directory, out):
        raise LogError(
            out, "output", f"is inside a parts folder of {directory}: the next read of that "
            "folder would take it for a part; write it elsewhere",
        )  # fmt: skip

    def check(path: str) -> tuple[str, ...]:
        return check_run(path, max_inflate_mb=max_inflate_mb).warnings

    def verify(parts_dir: str) -> None:  # what `tracekit check` would reject: not written
        check_run(parts_dir, max_inflate_mb=max_inflate_mb)

    return merge_to_parts(directory, out, engine=engine, force=force,
                          max_inflate_mb=max_inflate_mb, rule_of=tp_rule, check=check,
                          verify=verify)  # fmt: skip


def merge_parts_lines(
    directory: str,
    out: str,
    force: bool,
    engine: int | None,
    limits: dict[str, Any],
    process_line: Callable[[dict[str, Any]], str],
) -> tuple[list[str], list[str]]:
    """``tracekit merge DIR -o OUT --parts``: its warnings, and its lines (each process and
    its clock, what was written)."""
    from tracekit.log.processes import is_process_dir  # deferred: only this command uses it

    if not is_process_dir(directory):
        raise UsageError(
            f"{directory}: --parts merges a server's process directory; a one-process run "
            "already is parts (its RUN.npz reads them)"
        )
    mp = save_merged_parts(directory, out, force=force, engine=engine,
                           max_inflate_mb=limits.get("max_inflate_mb"))  # fmt: skip
    lines = [process_line(p) for p in mp.meta["processes"]]
    return mp.warnings, [*lines, (
        f"wrote {mp.parts_dir} ({mp.num_parts} parts) and its pointer {out}: {mp.num_steps} "
        f"steps, {mp.num_emissions} engine emissions, {mp.num_client_emissions} client "
        f"chunks, {mp.num_requests} requests"
    )]  # fmt: skip
