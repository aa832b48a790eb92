"""`TtftFold` (a long run's TTFT figures folded a slice at a time, docs/reports.md "Reading
a long run in slices") against `ttft_figures` of the slices' rows gathered whole: random
slices with their own label sets, causes, unsplit requests and ties at the p90."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tracekit.analysis.stream import gathered_ttft_rows
from tracekit.analysis.stream_ttft import TtftFold
from tracekit.attribution.ttft import CLEAN, PHASES, TtftPartition, ttft_figures

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sliced import _differences  # noqa: E402

def _plain(figures):  # NaN (no TTFT) as None, so that it compares
    return json.loads(json.dumps(dataclasses.asdict(figures)).replace("NaN", "null"))


LABELS = ("queue", "prefill", "preempt", "prefill_other", "gc", "residual")


def _piece(rng: np.random.Generator, n: int) -> TtftPartition:
    """A slice's rows: its own labels (a subset, in the run's order), parts summing to each
    TTFT, a primary cause among them, some requests unsplit; TTFTs on a 1 ms grid so that
    equal values (ties at the p90) occur."""
    labels = tuple(lb for lb in LABELS if rng.random() < 0.7) or ("residual",)
    parts = rng.integers(0, 40, size=(n, len(labels))).astype(np.float64)
    ttft = parts.sum(axis=1)
    phases = np.zeros((n, len(PHASES)))
    phases[:, 0] = ttft * 0.25
    phases[:, 1] = ttft - phases[:, 0]
    causes = tuple(lb for lb in labels if lb != "residual")
    primary = rng.integers(-1, len(causes), size=n) if causes else np.full(n, CLEAN)
    admit = np.where(rng.random(n) < 0.2, np.nan, 1.0)
    notes = ("1 request(s) unsplit: no admission event",) if np.isnan(admit).any() else ()
    z = np.zeros(n)
    return TtftPartition(labels=labels, request=np.arange(n), arrival_s=z, admit_s=admit,
                         first_token_s=ttft / 1e3, ttft_ms=ttft, parts_ms=parts,
                         context_ms=parts * 0.5, phases_ms=phases, reprefill_own_ms=z,
                         reprefill_other_ms=z, primary=primary.astype(np.int64),
                         causes=causes, notes=notes)  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 30), min_size=1, max_size=6))
def test_the_fold_is_ttft_figures_of_the_gathered_rows(seed, sizes):
    rng = np.random.default_rng(seed)
    pieces = [_piece(rng, n) for n in sizes]
    fold = TtftFold()
    for p in pieces:
        fold.add(p)
    whole = ttft_figures(gathered_ttft_rows(pieces))
    folded = fold.figures(None)
    fold.close()
    assert folded is not None
    assert _differences(_plain(whole), _plain(folded)) == []
    # exact: counts, percentiles, the maximum, the notes
    for k in ("requests", "unsplit", "p50_ms", "p90_ms", "p99_ms", "max_ms", "tail_requests",
              "tail_count", "all_count", "notes"):  # fmt: skip
        assert repr(getattr(whole, k)) == repr(getattr(folded, k)), k


def test_no_slice_gives_no_figures_and_empty_slices_give_the_empty_figures():
    fold = TtftFold()
    assert fold.figures(True) is None
    empty = _piece(np.random.default_rng(0), 0)
    fold.add(empty)
    whole = ttft_figures(gathered_ttft_rows([empty]))
    assert repr(dataclasses.asdict(fold.figures(None))) == repr(dataclasses.asdict(whole))
