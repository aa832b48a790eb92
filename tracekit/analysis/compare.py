"""Cross-run comparison: group runs (by rung, seed or any config key) and summarise each
group as the median and [min-max] across its runs.

Runs are the unit of evidence, never pooled gaps: one GC pause stalls every request of a
batch at once, so a run's ~100k gaps are far from independent. Every figure here is first
computed per run (`tracekit.analysis.figures.analyze`), then summarised across the runs of a group.

Pure: `RunAnalysis` objects in, a `Comparison` out. Rendering lives in `tracekit.render`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracekit.analysis.figures import RunAnalysis
from tracekit.errors import TracekitError
from tracekit.labels import STANDARD_LABELS

#: The per-run figures a comparison summarises: (RunAnalysis attribute, unit).
FIGURES: tuple[tuple[str, str], ...] = (
    ("itl_p50", "ms"),
    ("itl_p99", "ms"),
    ("itl_p999", "ms"),
    ("itl_max", "ms"),
    ("ttft_p50", "ms"),
    ("tok_per_s", "tok/s"),
)

#: Per-run counts a group also summarises: what the fixes of a ladder act on (and the
#: recompute tax, a share: recomputed / computed tokens, docs/partition.md "Who evicted whom").
COUNTS: tuple[str, ...] = ("preemptions", "eager_steps", "recompute_tax")

#: What a run without the grouping key is grouped under.
MISSING = "(none)"


@dataclass(frozen=True)
class Spread:
    """A figure across the runs of a group: median and [min, max], over its finite values.

    `num_runs` counts the runs that had a finite value (a run without gaps has no p99)."""

    median: float
    lo: float
    hi: float
    num_runs: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        a = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
        if not len(a):
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(float(np.median(a)), float(a.min()), float(a.max()), int(len(a)))

    def to_dict(self) -> dict[str, float | int | None]:
        def f(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "median": f(self.median),
            "min": f(self.lo),
            "max": f(self.hi),
            "runs": self.num_runs,
        }


@dataclass(frozen=True, slots=True)
class GroupTtft:
    """A group's TTFT figures across its runs (`ttft_summary`): p90 and p99 as spreads,
    then medians across runs of the per-run shares and counts (`RunAnalysis.ttft`)."""

    p90_ms: Spread
    p99_ms: Spread
    phase_share: dict[str, float]  # per phase: median share of TTFT time
    tail_phase_share: dict[str, float]  # the same over tail requests (>= each run's p90)
    tail_share: dict[str, float]  # per label: median share of tail TTFT time
    tail_count: dict[str, float]  # per primary cause: median count of tail requests
    num_unsplit: int  # requests without an admission row, summed over the runs

    def to_record(self) -> dict[str, Any]:
        """The group's ``ttft`` object in `Comparison.to_records`."""
        return {
            "p90_ms": self.p90_ms.to_dict(),
            "p99_ms": self.p99_ms.to_dict(),
            "phase_share": self.phase_share,
            "tail_phase_share": self.tail_phase_share,
            "tail_share": self.tail_share,
            "tail_count": self.tail_count,
            "unsplit": self.num_unsplit,
        }


@dataclass(frozen=True)
class GroupSummary:
    """One group of runs (one rung, one seed, one value of a config key)."""

    key: str  # the group's value of the grouping key, as text
    paths: tuple[str, ...]  # the runs, in input order
    figures: Mapping[str, Spread]  # FIGURES name -> spread across runs
    tail_share: Mapping[str, float]  # per label: median across runs of the run's tail share
    tail_count: Mapping[str, float]  # per primary cause ("clean" too): median across runs
    counts: Mapping[str, Spread] = field(default_factory=dict)  # COUNTS name -> spread
    regime_misses: tuple[str, ...] = ()  # per run, what it lacked of its config's `expect`
    ttft: GroupTtft | None = None  # None: no run of the group has TTFT figures

    @property
    def num_runs(self) -> int:
        return len(self.paths)


@dataclass(frozen=True)
class Comparison:
    """Runs grouped by `by`, groups in the order they first appear in the input."""

    by: str
    labels: tuple[str, ...]  # tail-share columns: the standard labels, then any extra
    groups: tuple[GroupSummary, ...]

    def to_records(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per group (for `--format jsonl`)."""
        out = []
        for g in self.groups:
            rec: dict[str, Any] = {"by": self.by, "group": g.key, "runs": g.num_runs}
            for name, _unit in FIGURES:
                rec[name] = g.figures[name].to_dict()
            rec["tail_share_median"] = {lb: g.tail_share.get(lb, 0.0) for lb in self.labels}
            rec["tail_count_median"] = dict(g.tail_count)
            rec["ttft"] = g.ttft.to_record() if g.ttft is not None else {}
            for name in COUNTS:
                if name in g.counts:
                    rec[name] = g.counts[name].to_dict()
            rec["regime_misses"] = list(g.regime_misses)
            rec["paths"] = list(g.paths)
            out.append(rec)
        return out


def config_value(config: Mapping[str, Any], key: str) -> Any:
    """`config[key]`, where a dotted key walks nested objects (`engine.block_size`).
    A key that exists verbatim (dots and all) wins. Missing: None."""
    if key in config:
        return config[key]
    cur: Any = config
    for part in key.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


class ConfigKeyError(TracekitError):
    """A grouping or ordering key that no run's config has."""


def config_keys(runs: Sequence[RunAnalysis]) -> list[str]:
    """The keys runs can be grouped or ordered by: every top-level config key (and
    `rung`), with nested objects shown as `name.KEY`, sorted."""
    keys = {"rung"}
    for r in runs:
        for k, v in r.config.items():
            keys.add(f"{k}.KEY" if isinstance(v, Mapping) else str(k))
    return sorted(keys)


def check_key(runs: Sequence[RunAnalysis], key: str, option: str) -> None:
    """Raise `ConfigKeyError` (listing the keys there are) unless some run has `key`."""
    if not runs or key == "rung" or any(config_value(r.config, key) is not None for r in runs):
        return
    raise ConfigKeyError(
        f"{option} {key!r}: no run's config has this key; keys: {', '.join(config_keys(runs))} "
        "(a dotted key reaches a nested value, e.g. engine.block_size)"
    )


def regime_misses(run: RunAnalysis) -> list[str]:
    """What `run` lacked of what its engine said the run needs (`config["expect"]`: figure
    name -> minimum, e.g. {"preemptions": 1}), each with the config's `expect_hint`."""
    expect = run.config.get("expect")
    if not isinstance(expect, Mapping):
        return []
    hint = run.config.get("expect_hint")
    out = []
    for name, lo in expect.items():
        got = getattr(run, str(name), None)
        if isinstance(got, (int, float)) and isinstance(lo, (int, float)) and got < lo:
            out.append(
                f"{run.path}: {got:g} {str(name).replace('_', ' ')} (the run needs >= {lo:g})"
                + (f": {hint}" if isinstance(hint, str) and hint else "")
            )
    return out


def order_runs(runs: Sequence[RunAnalysis], key: str | None) -> list[RunAnalysis]:
    """`runs` sorted by config `key` (numbers, then text, then runs without it), stable;
    as given when `key` is None."""
    if key is None:
        return list(runs)
    return sorted(runs, key=lambda r: _order_value(r, key))


def group_key(run: RunAnalysis, by: str) -> str:
    """The text a run is grouped under: the config value (strings as they are, anything else
    as compact JSON), or MISSING."""
    v = config_value(run.config, by)
    if v is None and by == "rung":
        v = run.rung
    if v is None:
        return MISSING
    if isinstance(v, str):
        return v
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _order_value(run: RunAnalysis, key: str) -> tuple[int, float, str]:
    """Sort key of a group by config `key` of its first run: numbers, then text, then runs
    without the key (each kept in input order among equals: the sort is stable)."""
    v = config_value(run.config, key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return (0, float(v), "")
    if v is None:
        return (2, 0.0, "")
    return (1, 0.0, v if isinstance(v, str) else json.dumps(v, sort_keys=True))


def compare(
    runs: Sequence[RunAnalysis], by: str = "rung", *, order_by: str | None = None
) -> Comparison:
    """Group `runs` by `by` and summarise each group across its runs. Groups come in the
    order they first appear in `runs`, or sorted by the config key `order_by` (say a
    `rung_index` the engine records) when given. A key no run has is a `ConfigKeyError`."""
    check_key(runs, by, "--by")
    if order_by is not None:
        check_key(runs, order_by, "--order-by")
    groups: dict[str, list[RunAnalysis]] = {}
    for r in runs:
        groups.setdefault(group_key(r, by), []).append(r)
    if order_by is not None:
        ordered = sorted(groups.items(), key=lambda kv: _order_value(kv[1][0], order_by))
        groups = dict(ordered)
    labels = list(STANDARD_LABELS)
    for r in runs:
        labels += [lb for lb in r.labels if lb not in labels]
    out = []
    for key, members in groups.items():
        figures = {name: Spread.of([getattr(r, name) for r in members]) for name, _ in FIGURES}
        share = {
            lb: float(np.median([r.tail_share.get(lb, 0.0) for r in members])) for lb in labels
        }
        count_keys: list[str] = []
        for r in members:
            count_keys += [k for k in r.tail_count if k not in count_keys]
        count = {k: float(np.median([r.tail_count.get(k, 0) for r in members])) for k in count_keys}
        out.append(
            GroupSummary(
                key=key,
                paths=tuple(r.path for r in members),
                figures=figures,
                tail_share=share,
                tail_count=count,
                ttft=ttft_summary(members),
                counts={n: Spread.of([getattr(r, n) for r in members]) for n in COUNTS},
                regime_misses=tuple(m for r in members for m in regime_misses(r)),
            )
        )
    return Comparison(by=by, labels=tuple(labels), groups=tuple(out))


# -- TTFT ladder columns --------------------------------------------------------------------


def ttft_summary(members: Sequence[RunAnalysis]) -> GroupTtft | None:
    """A group's TTFT figures across its runs (each run's from `RunAnalysis.ttft`):
    `p90_ms`, `p99_ms` (Spread), and medians across runs of the phase shares, the tail
    share by label (requests >= each run's TTFT p90) and the tail counts by primary cause.
    None when no run has TTFT figures."""
    runs = [r.ttft for r in members if r.ttft]
    if not runs:
        return None

    def med(per_run: list[Mapping[str, float]]) -> dict[str, float]:
        names: list[str] = []
        for m in per_run:
            names += [k for k in m if k not in names]
        return {n: float(np.median([m.get(n, 0.0) for m in per_run])) for n in names}

    return GroupTtft(
        p90_ms=Spread.of([t.p90_ms for t in runs]),
        p99_ms=Spread.of([t.p99_ms for t in runs]),
        phase_share=med([t.phase_share for t in runs]),
        tail_phase_share=med([t.tail_phase_share for t in runs]),
        tail_share=med([t.tail_share for t in runs]),
        tail_count=med([t.tail_count for t in runs]),
        num_unsplit=int(sum(t.unsplit for t in runs)),
    )
