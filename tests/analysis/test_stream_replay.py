"""The what-if's replayed timeline built stretch by stretch (`tracekit.analysis.stream_replay`;
docs/whatif.md, "Second order"): each stretch continues the one before from what it
carries across the edge (the last bound, `R` there, the covers' running sums, the windows
still open), so `R` at every bound is `replay_removed`'s on all the windows at once, bit
for bit, wherever the edges fall."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracekit.analysis.stream_replay import ReplayCarry, advance
from tracekit.analysis.whatif import Windows, replay_removed


def _in_stretches(
    w: Windows, is_gc: bool, edges: list[float], early: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`R` built stretch by stretch, the stretches ending at `edges` (then the run's end),
    each given, as the parts hand them over, the windows not yet ended (in the run's order):
    those starting before its end, and those `early` marks (read a part ahead)."""
    ok = w.end_s > w.start_s
    s, e, f, k = w.start_s[ok], w.end_s[ok], w.frac[ok], w.kind[ok]
    ahead = np.zeros(len(s), bool) if early is None else early[ok]
    carry = ReplayCarry(is_gc)
    out_b, out_c = [], []
    before = -np.inf
    for until in [*edges, np.inf]:
        on = (e >= before) & ((s < until) | ahead)
        bounds, cum = advance(carry, s[on], e[on], f[on], k[on], until)
        before = until
        out_b.append(bounds)
        out_c.append(cum)
    return np.concatenate(out_b), np.concatenate(out_c)


def test_a_window_open_across_an_edge_by_hand():
    """docs/whatif.md: a removable host window [0, 4] (f = 1) under a device window [2, 6]
    that is not removable (f = 0), and a half-removable host window [6, 8] (f = 0.5).
    Rates: [0, 2] 1 (only the removable window), [2, 4] 0 (the device window stays), [4,
    6] 0, [6, 8] 0.5. R at the bounds 0, 2, 4, 6, 8: 0, 2, 2, 2, 3. Cut at 3 (inside both
    open windows) and at 5: the same values."""
    w = Windows(start_s=np.array([0.0, 2.0, 6.0]), end_s=np.array([4.0, 6.0, 8.0]),
                frac=np.array([1.0, 0.0, 0.5]), kind=np.array([0, 1, 0]))  # fmt: skip
    bounds, cum = _in_stretches(w, False, [3.0, 5.0])
    assert bounds.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert cum.tolist() == pytest.approx([0.0, 2.0, 2.0, 2.0, 3.0])
    whole = replay_removed(w, False)
    assert bounds.tolist() == whole[0].tolist() and cum.tolist() == whole[1].tolist()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 60), n_edges=st.integers(0, 8),
       is_gc=st.booleans())  # fmt: skip
def test_stretches_give_the_whole_runs_replay_bit_for_bit(seed, n, n_edges, is_gc):
    """Random windows on a coarse grid (many share an end: several fractions summed at one
    bound), random fractions in (0, 1) as an eager step's excess or a readmission share,
    GC pauses among them, cut anywhere (on a bound or between): `R` equals the whole run's
    with `==`."""
    rng = np.random.default_rng(seed)
    s = np.round(rng.uniform(0, 50, n), 0) + rng.choice([0.0, 0.1, 1 / 3], n)
    e = s + np.round(rng.uniform(-1, 12, n), 0) * rng.choice([1.0, 0.7], n)
    frac = rng.choice([0.0, 1.0, 0.1, 0.3, 1 / 3, 0.7], n)
    kind = rng.choice([0, 1, 2], n)
    frac[kind == 2] = 1.0 if is_gc else 0.0
    w = Windows(start_s=s, end_s=e, frac=frac, kind=kind)
    edges = sorted(np.round(rng.uniform(-1, 65, n_edges), int(rng.integers(0, 2))).tolist())
    bounds, cum = _in_stretches(w, is_gc, edges, rng.random(n) < 0.3)
    whole_b, whole_c = replay_removed(w, is_gc)
    if not (e > s).any():
        assert not len(bounds)  # the whole run's: one bound at 0, R = 0
        assert whole_b.tolist() == [0.0] and whole_c.tolist() == [0.0]
        return
    assert bounds.tolist() == whole_b.tolist()
    assert cum.tolist() == whole_c.tolist()
