"""The verdict: what a comparison says, in words, with the caveats its data carries.

Pure: a `Comparison` in, a `Verdict` out; renderers only lay the sentences out. Every
number in a sentence is a figure of the comparison (medians across the runs of a group).

- The first group (the baseline, in the comparison's order) gets a diagnosis: the causes
  that hold the most tail time, with the counts the fixes act on.
- Every later group gets what changed from the group before it: the median p99.9 before
  and after, and the cause it took out of the tail: of the causes whose tail share fell
  by at least MIN_NAMED_SHARE, the one that fell by the largest fraction of its own share
  (a fix's signature is its cause going to zero, while the shares of the causes it left
  alone move only because the tail shrank around them). A change whose [min-max]
  ranges across runs overlap is marked as such: the runs do not separate the two groups.
  A change that does not cut median p99.9 with ranges apart also names the cause that
  holds the most of the later group's tail time (when it holds MIN_NAMED_SHARE, even if it
  is the cause that fell): what hides the fix's effect on the tail. A change that raised
  TTFT p50 says so, in a comparison of any length: a fix that cuts the tail can make
  requests wait to start.
- The last group is set against the first: median p99.9 (how many times lower or
  higher) and TTFT p50, since a fix that cuts the tail can make requests wait to start.

Caveats: runs of one group that disagree (p99.9 max / min >= DISAGREE_RATIO), a group of
one run, a cause the baseline lacks (no preemption, no eager step: fixes aimed at them have
nothing to act on), runs that missed what their engine said they need (`config.expect`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tracekit.analysis.compare import Comparison, GroupSummary, Spread
from tracekit.analysis.fix_first import FixFirst, fix_first, fix_first_sentence
from tracekit.analysis.whatif import (
    LadderCheck,
    WhatIf,
    ladder_checks,
)
from tracekit.labels import NON_CAUSES

#: Runs of a group "disagree" when their largest p99.9 is at least this many times their
#: smallest: a 2x spread is larger than any rung-to-rung change but the biggest ones.
DISAGREE_RATIO = 2.0
#: A cause is named in a diagnosis when it holds at least this share of tail time.
MIN_NAMED_SHARE = 0.05

_NAMES = {"preempt": "preemption", "tok": "tokenizer", "graph": "graph misses (eager steps)"}


@dataclass(frozen=True)
class Verdict:
    by: str
    findings: tuple[str, ...]  # one sentence per group, in the comparison's order
    caveats: tuple[str, ...]


def _ms(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def _cause_name(label: str) -> str:
    return _NAMES.get(label, label)


def _causes_by_share(share: Mapping[str, float]) -> list[tuple[str, float]]:
    items = [(lb, v) for lb, v in share.items() if lb not in NON_CAUSES and v > 0]
    return sorted(items, key=lambda t: (-t[1], t[0]))


def _count(g: GroupSummary, name: str) -> float:
    s = g.counts.get(name)
    return s.median if s is not None and s.num_runs else math.nan


def _overlap(a: Spread, b: Spread) -> bool:
    return a.num_runs > 0 and b.num_runs > 0 and a.lo <= b.hi and b.lo <= a.hi


def diagnosis(g: GroupSummary) -> str:
    """`baseline: preemption owns 46% of tail time, prefill 26% (117 preemptions, 580
    eager steps); median p99.9 986 ms.` A group with preemptions and a recompute tax has
    it beside them: `(117 preemptions, recompute tax 3.1%, 580 eager steps)`."""
    named = [(lb, v) for lb, v in _causes_by_share(g.tail_share) if v >= MIN_NAMED_SHARE]
    if named:
        first, rest = named[0], named[1:3]
        words = f"{_cause_name(first[0])} owns {first[1]:.0%} of tail time"
        words += "".join(f", {_cause_name(lb)} {v:.0%}" for lb, v in rest)
    else:
        fwd = g.tail_share.get("forward", 0.0)
        words = f"no cause holds {MIN_NAMED_SHARE:.0%} of tail time (forward {fwd:.0%})"
    counts = [
        f"{_count(g, n):.0f} {label}"
        for n, label in (("preemptions", "preemptions"), ("eager_steps", "eager steps"))
        if math.isfinite(_count(g, n))
    ]
    tax = _count(g, "recompute_tax")
    if math.isfinite(tax) and _count(g, "preemptions") > 0:  # beside its preemptions
        counts.insert(1, f"recompute tax {tax:.1%}")
    c = f" ({', '.join(counts)}{', medians' if g.num_runs > 1 else ''})" if counts else ""
    return f"{g.key}: {words}{c}; median p99.9 {_ms(g.figures['itl_p999'].median)} ms."


def _ttft(a: GroupSummary, b: GroupSummary) -> str:
    ta, tb = a.figures["ttft_p50"].median, b.figures["ttft_p50"].median
    if not (math.isfinite(ta) and math.isfinite(tb)):
        return ""
    if _ms(ta) == _ms(tb):
        return f"; TTFT p50 unchanged at {_ms(tb)} ms"
    return f"; TTFT p50 {'rose' if tb > ta else 'fell'} {_ms(ta)} -> {_ms(tb)} ms"


def change(prev: GroupSummary, g: GroupSummary, *, with_ttft: bool = False) -> str:
    """What moved from `prev` to `g`: p99.9, and the cause whose tail share fell by the
    largest fraction (see the module docstring); TTFT p50 too with `with_ttft`."""
    falls = []
    for lb, before in prev.tail_share.items():
        fall = before - g.tail_share.get(lb, 0.0)
        if lb not in NON_CAUSES and fall >= MIN_NAMED_SHARE:
            falls.append((fall / before, fall, lb))
    _, drop, lb = max(falls, default=(0.0, 0.0, ""))
    a, b = prev.figures["itl_p999"], g.figures["itl_p999"]
    if _ms(a.median) == _ms(b.median):  # equal as printed: no direction to name
        words = f"left median p99.9 at {_ms(b.median)} ms"
    else:
        verb = "cut" if b.median < a.median else "raised"
        words = f"{verb} median p99.9 from {_ms(a.median)} to {_ms(b.median)} ms"
    is_overlap = _overlap(a, b) and (a.num_runs > 1 or b.num_runs > 1)
    if is_overlap:
        words += " (the runs' ranges overlap)"
    if drop >= MIN_NAMED_SHARE:
        words += (
            f"; {_cause_name(lb)} {prev.tail_share.get(lb, 0.0):.0%} -> "
            f"{g.tail_share.get(lb, 0.0):.0%} of tail time"
        )
    if is_overlap or not b.median < a.median:  # not a clear cut: what holds the tail
        held = [(c, v) for c, v in _causes_by_share(g.tail_share) if v >= MIN_NAMED_SHARE]
        if held:
            words += f"; {_cause_name(held[0][0])} holds {held[0][1]:.0%} of tail time"
    ta, tb = prev.figures["ttft_p50"].median, g.figures["ttft_p50"].median
    is_ttft_rise = math.isfinite(ta) and math.isfinite(tb) and _ms(ta) != _ms(tb) and tb > ta
    return f"{g.key}: {words}{_ttft(prev, g) if with_ttft or is_ttft_rise else ''}."


def end_to_end(first: GroupSummary, last: GroupSummary) -> str:
    a, b = first.figures["itl_p999"].median, last.figures["itl_p999"].median
    if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b):
        times = f"{a / b:.1f}x lower" if b <= a else f"{b / a:.1f}x higher"
    else:
        times = "not comparable"
    return (
        f"{last.key} against {first.key}: median p99.9 {_ms(a)} -> {_ms(b)} ms ({times})"
        f"{_ttft(first, last)}."
    )


def caveats(cmp: Comparison) -> list[str]:
    out: list[str] = []
    for g in cmp.groups:
        s = g.figures["itl_p999"]
        if s.num_runs == 1:
            out.append(f"{g.key}: one run, so no spread to judge the figures by.")
        elif s.num_runs > 1 and s.lo > 0 and s.hi / s.lo >= DISAGREE_RATIO:
            out.append(
                f"{g.key}: runs disagree: p99.9 {_ms(s.lo)}-{_ms(s.hi)} ms across "
                f"{s.num_runs} runs ({s.hi / s.lo:.1f}x)."
            )
    if cmp.groups:
        g0 = cmp.groups[0]
        for name, what, fix in (
            ("preemptions", "no preemption", "preemption"),
            ("eager_steps", "no eager step", "graph misses"),
        ):
            if _count(g0, name) == 0:
                out.append(
                    f"{g0.key}: {what} in the median run: a fix aimed at {fix} has nothing to "
                    "act on here."
                )
    for g in cmp.groups:
        out.extend(f"regime not reached: {m}." for m in g.regime_misses)
    return out


def verdict(cmp: Comparison) -> Verdict:
    """The comparison in words: see the module docstring."""
    groups = cmp.groups
    findings: list[str] = []
    if groups:
        findings.append(diagnosis(groups[0]))
        pairs = list(zip(groups, groups[1:], strict=False))
        findings += [change(a, b, with_ttft=len(groups) == 2) for a, b in pairs]
        if len(groups) > 2:
            findings.append(end_to_end(groups[0], groups[-1]))
    return Verdict(by=cmp.by, findings=tuple(findings), caveats=tuple(caveats(cmp)))


def ladder_of(cmp: Comparison, whatifs: Mapping[str, WhatIf]) -> list[LadderCheck]:
    """The what-if checked against the ladder (docs/whatif.md, "Checked against a
    ladder"): each group's runs' what-ifs, groups in the comparison's order."""
    return ladder_checks([(g.key, [whatifs[p] for p in g.paths]) for g in cmp.groups])


def with_fix_first(
    v: Verdict, cmp: Comparison, whatifs: Mapping[str, WhatIf], checks: Sequence[LadderCheck]
) -> tuple[Verdict, list[FixFirst]]:
    """The verdict opening with what to fix first in the first group (docs/whatif.md, "The
    verdict"), and the ranked fixes it is taken from."""
    if not cmp.groups:
        return v, []
    g = cmp.groups[0]
    fixes = fix_first([whatifs[p] for p in g.paths], checks)
    group = g.key if len(cmp.groups) > 1 else None
    return replace(v, findings=(fix_first_sentence(fixes, group), *v.findings)), fixes
