"""What to fix first: the removals of a group's runs ranked by predicted gain, each with
how far the same model was off on a ladder for causes of its family (docs/whatif.md, "The
verdict"). Pure: `WhatIf`s and `LadderCheck`s in, `FixFirst`s and a sentence out."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tracekit.analysis.compare import Spread
from tracekit.analysis.whatif import FIGURE_NAMES, SECOND, LadderCheck, WhatIf, family_of

# -- what to fix first -----------------------------------------------------------------------


@dataclass(frozen=True)
class FixFirst:
    """One removal's predicted gain across the runs of a group, and how far the same model
    was off on a ladder for causes of the same family."""

    name: str
    kind: str
    model: str
    figure: str
    measured: Spread  # the figure as recorded, across runs
    predicted: Spread  # the figure with the removal, across runs
    gain_frac: Spread  # per run: (measured - predicted) / measured
    ladder_error_frac: Spread | None  # the model's ladder errors (see `ladder_basis`)
    family: str | None
    #: what the ladder errors are of: rungs that fix this very cause (its name), else rungs
    #: that fix a cause of its family ("<family> causes"); "" without any
    ladder_basis: str = ""
    #: of every figure the same ladder checks predicted for that basis, the one whose median
    #: error was largest in size, and its errors; None without ladder checks
    worst_figure: str | None = None
    worst_error_frac: Spread | None = None


def fix_first(
    runs: Sequence[WhatIf],
    checks: Sequence[LadderCheck] = (),
    *,
    model: str = SECOND,
    figure: str = "itl_p999_ms",
    kind: str = "cause",
) -> list[FixFirst]:
    """The removals of `kind` ranked by median predicted gain in `figure` across `runs`
    (largest first), each with the ladder's error for its family by the same model."""
    names: list[str] = []
    for w in runs:
        for p in w.predictions:
            if p.removal.kind == kind and p.model == model and p.removal.name not in names:
                names.append(p.removal.name)
    out = []
    for name in names:
        meas, pred, gain = [], [], []
        for w in runs:
            got = w.get(name, model)
            m = w.measured[figure]
            if got is None or not math.isfinite(m):
                continue
            meas.append(m)
            pred.append(got.figures[figure])
            gain.append((m - got.figures[figure]) / m if m else 0.0)
        if not gain:
            continue
        fam = family_of(name)
        errs, basis = _ladder_errors(checks, model, figure, name, fam)
        worst: tuple[float, str, Spread] | None = None
        for fig in FIGURE_NAMES:
            e, b = _ladder_errors(checks, model, fig, name, fam)
            finite = [x for x in e if math.isfinite(x)]
            if finite and b == basis:
                sp = Spread.of(finite)
                if worst is None or abs(sp.median) > worst[0]:
                    worst = (abs(sp.median), fig, sp)
        out.append(
            FixFirst(
                name=name,
                kind=kind,
                model=model,
                figure=figure,
                measured=Spread.of(meas),
                predicted=Spread.of(pred),
                gain_frac=Spread.of(gain),
                ladder_error_frac=Spread.of(errs) if errs else None,
                family=fam,
                ladder_basis=basis if errs else "",
                worst_figure=worst[1] if worst else None,
                worst_error_frac=worst[2] if worst else None,
            )
        )
    return sorted(out, key=lambda f: (-f.gain_frac.median, f.name))


def _ladder_errors(
    checks: Sequence[LadderCheck], model: str, figure: str, name: str, fam: str | None
) -> tuple[list[float], str]:
    """The ladder's errors of `model` on `figure` for rungs that fix `name`, else for rungs
    that fix a cause of its family; and what they are of (`FixFirst.ladder_basis`)."""
    mine = [c for c in checks if c.model == model and c.figure == figure]
    errs = [c.error_frac for c in mine if c.fixes == name]
    if errs or fam is None:
        return errs, name
    return [c.error_frac for c in mine if family_of(c.fixes) == fam], f"{fam} causes"


#: the figures' names in a sentence
FIGURE_WORDS = {
    "itl_p50_ms": "ITL p50", "itl_p99_ms": "ITL p99", "itl_p999_ms": "ITL p99.9",
    "itl_max_ms": "ITL max", "ttft_p50_ms": "TTFT p50", "ttft_p90_ms": "TTFT p90",
    "ttft_p99_ms": "TTFT p99",
}  # fmt: skip


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%" if math.isfinite(x) else "-"


def _ms(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def fix_first_sentence(ranked_fixes: Sequence[FixFirst], group: str | None = None) -> str:
    """The verdict's opening: what to fix first and what it buys, with its uncertainty."""
    if not ranked_fixes or ranked_fixes[0].gain_frac.median <= 0:
        return "What to fix first: no removable cause lowers p99.9 in these runs (what-if)."
    f = ranked_fixes[0]
    where = f" in {group}" if group else ""
    n = f.gain_frac.num_runs
    spread = (
        f", {_pct(-f.gain_frac.hi)} to {_pct(-f.gain_frac.lo)} across {n} runs" if n > 1 else ""
    )
    s = (
        f"What to fix first{where}: {f.name}. Without it p99.9 would be "
        f"{_ms(f.predicted.median)} ms instead of {_ms(f.measured.median)} "
        f"({_pct(-f.gain_frac.median)}{spread}; {f.model}-order model)."
    )
    if f.ladder_error_frac is not None:
        e = f.ladder_error_frac
        rng = f", {_pct(e.lo)} to {_pct(e.hi)}" if e.num_runs > 1 else ""
        s += (
            f" On this ladder that model's p99.9 predictions for {f.ladder_basis} were off by "
            f"{_pct(e.median)} ({e.num_runs} rung{'s' if e.num_runs != 1 else ''}{rng})."
        )
        w = f.worst_error_frac
        if f.worst_figure is not None and w is not None and f.worst_figure != f.figure:
            s += (
                f" Its worst figure there: {FIGURE_WORDS.get(f.worst_figure, f.worst_figure)}, "
                f"off by {_pct(w.median)}."
            )
    else:
        s += " No rung in these runs fixes it or a cause of its family: the error is unchecked."
    if f.family == "os":
        s += (
            " The OS, not the engine, holds this tail: the engine's threads waited for a CPU "
            "or were off it; pin them to cores of their own, isolate those cores, or run "
            "fewer processes per core."
        )
    if len(ranked_fixes) > 1 and ranked_fixes[1].gain_frac.median > 0:
        g = ranked_fixes[1]
        s += f" Next: {g.name} ({_pct(-g.gain_frac.median)})."
    return s
