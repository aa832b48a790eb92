"""The published method's analysis, re-implemented as its article describes it: a Python
loop over every gap of every request, each gap partitioned by walking the segments of the
steps it spans, the GC pauses and the request's evictions (design.md's rules 1-5, which are
exactly its rules). The baseline bench/bench_fleet.py measures tracekit against, in the
same process. It reads the published `.npz` layout only.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict

import numpy as np

CODES = ("tok", "swap", "prefill", "decode")
CAUSE = {"tok": "tok", "swap": "preempt", "prefill": "prefill", "decode": "decode"}
LABELS = ("preempt", "gc", "tok", "prefill", "graph", "forward", "residual")
CAUSES = ("preempt", "gc", "tok", "prefill", "graph")


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def published_analysis(path: str) -> dict:
    z = np.load(path, allow_pickle=False)
    steps, segs, gcs = z["steps"], z["segs"], z["gcs"]
    em, ev = z["emissions"], z["evictions"]
    config = json.loads(str(z["config"])) if "config" in z.files else {}

    gc_list = sorted((float(a), float(b)) for a, b, _ in gcs)
    gc_starts = [a for a, _ in gc_list]

    def gc_in(a: float, b: float) -> float:
        """GC time inside [a, b] (pauses do not overlap in the published engine)."""
        total = 0.0
        i = max(0, bisect.bisect_right(gc_starts, a) - 1)
        while i < len(gc_list) and gc_list[i][0] < b:
            total += _overlap(a, b, *gc_list[i])
            i += 1
        return total

    seg_by_step: dict[int, list] = defaultdict(list)
    for s, code, a, b in segs:
        seg_by_step[int(s)].append((CODES[int(code)], float(a), float(b)))

    # the graph baseline: GC-free decode ms against padded size over captured steps
    net = np.zeros(len(steps))
    for s, lst in seg_by_step.items():
        for lb, a, b in lst:
            if lb == "decode":
                net[s] += ((b - a) - gc_in(a, b)) * 1e3
    graph = steps[:, 4]
    cap = (graph > 0) & (net > 0)
    slope, icpt = np.polyfit(graph[cap], net[cap], 1)
    frac = np.zeros(len(steps))
    for s in np.flatnonzero((graph == 0) & (net > 0)):
        pred = slope * steps[s, 2] + icpt
        frac[s] = min(1.0, max(0.0, net[s] - pred) / net[s])

    evicted: dict[int, list] = defaultdict(list)
    for r, a, b in ev:
        evicted[int(r)].append((float(a), float(b) if b == b else float("inf")))

    by_req: dict[int, list] = defaultdict(list)
    for r, t, s in em:
        by_req[int(r)].append((float(t), int(s)))

    gaps: list[float] = []
    parts: list[list[float]] = []
    for r in sorted(by_req):
        es = sorted(by_req[r])
        for (t0, s0), (t1, s1) in zip(es[:-1], es[1:], strict=True):
            p = dict.fromkeys(LABELS, 0.0)
            windows = [(max(a, t0), min(b, t1)) for a, b in evicted.get(r, ()) if
                       min(b, t1) > max(a, t0)]  # fmt: skip
            live, cur = [], t0
            for a, b in sorted(windows):
                if a > cur:
                    live.append((cur, a))
                cur = max(cur, b)
            if cur < t1:
                live.append((cur, t1))
            for a, b in windows:
                p["preempt"] += (b - a) * 1e3
            for la, lb_ in live:
                covered = 0.0
                g = gc_in(la, lb_)
                p["gc"] += g * 1e3
                covered += g
                for s in range(s0, s1 + 1):
                    for lab, a, b in seg_by_step.get(s, ()):
                        a, b = max(a, la), min(b, lb_)
                        if b <= a:
                            continue
                        ms = ((b - a) - gc_in(a, b)) * 1e3
                        covered += ms / 1e3
                        cause = CAUSE[lab]
                        if cause == "decode":
                            p["graph"] += ms * frac[s]
                            p["forward"] += ms * (1 - frac[s])
                        else:
                            p[cause] += ms
                p["residual"] += ((lb_ - la) - covered) * 1e3
            gaps.append((t1 - t0) * 1e3)
            parts.append([p[lb] for lb in LABELS])

    gap = np.array(gaps)
    pm = np.array(parts).reshape(-1, len(LABELS))
    p99 = float(np.percentile(gap, 99))
    tail = gap >= p99
    cause_cols = [LABELS.index(c) for c in CAUSES]
    best = pm[:, cause_cols].argmax(axis=1)
    val = pm[np.arange(len(pm)), np.array(cause_cols)[best]]
    primary = np.where((val >= 1.0) & (val >= 0.25 * gap), best, -1)
    return {
        "rung": config.get("rung"),
        "gaps": len(gap),
        "itl_p50": float(np.percentile(gap, 50)),
        "itl_p90": float(np.percentile(gap, 90)),
        "itl_p99": p99,
        "itl_p999": float(np.percentile(gap, 99.9)),
        "itl_max": float(gap.max()),
        "tail_share": dict(
            zip(LABELS, (pm[tail].sum(axis=0) / gap[tail].sum()).tolist(), strict=True)
        ),  # fmt: skip
        "tail_count": {name: int((primary[tail] == i).sum()) for i, name in enumerate(CAUSES)}
        | {"clean": int((primary[tail] == -1).sum())},
        "reconcile_max_err_ms": float(np.abs(pm.sum(axis=1) - gap).max()),
    }
