"""The merge's tensor-parallel rule on synthetic per-process logs (docs/adapters.md):
at each collective the ranks that entered first wait until the last one enters; the last
rank's lateness goes to its stalls since its forward call began (at most their length),
the rest to what it was doing during the wait, labelled with its rank, carved out of the
engine core's forward window of the step."""

from __future__ import annotations

import numpy as np
import pytest

import tracekit
from tracekit.attribution.itl import partition
from tracekit.log.merge import merge_dir

SHARED = "clock_gettime(CLOCK_MONOTONIC)"


class Clock:
    def __init__(self) -> None:
        self.true_s = 0.0

    def __call__(self) -> int:
        return round((100.0 + self.true_s) * 1e9)


def _rec(path, clock, role, pid, **ident):
    config = {"process": {"role": role, "pid": pid, "host": "h", "name": role,
                          "boot_id": "b", "clock": SHARED, **ident}}  # fmt: skip
    rec = tracekit.Recorder(str(path), clock=clock, gc=False, handle_signals=False,
                            flush_interval_s=1e9, config=config)  # fmt: skip
    rec.start()
    return rec


def record_tp(tmp_path, n_steps=6, stall_step=3):
    """An engine core and two TP workers on one clock, times in ms from 0: step k runs
    [10k, 10k+8], its forward window (the core waits for the workers) [10k+1, 10k+7], one
    request emits at 10k+7.5. Both workers' forward runs [10k+1.2, 10k+6.8]; one collective
    per step: rank 0 enters at 10k+2, rank 1 at 10k+2.1 (0.1 ms late, in its forward).
    In `stall_step` rank 1 stalls [10k+1.5, 10k+3.5] (an injected window) and enters at
    10k+3.9."""
    clk = Clock()
    core = _rec(tmp_path / "engine_core-1.npz", clk, "engine_core", 1, dp_rank=0)
    w = [_rec(tmp_path / f"worker-{10 + r}.npz", clk, "worker", 10 + r, tp_rank=r, rank=r)
         for r in (0, 1)]  # fmt: skip
    ms = 1e-3

    def at(t_ms):
        clk.true_s = t_ms * ms

    def tick(t_ms):
        return round((100.0 + t_ms * ms) * 1e9)

    at(0.5)
    core.request("r0")
    for k in range(n_steps):
        b = 10.0 * k + 1.0
        at(b - 1.0)
        with core.step():
            core.add_segment("decode", tick(b), tick(b + 6.0))
            at(b + 6.5)
            core.emit(["r0"])
        for r, rec in enumerate(w):
            rec.add_segment("forward", tick(b + 0.2), tick(b + 5.8))
            enter = b + 1.0 + (0.1 if r else 0.0)
            if r == 1 and k == stall_step:
                rec.add_segment("injected", tick(b + 0.5), tick(b + 2.5))
                enter = b + 2.9
            rec.add_segment("collective", tick(enter), tick(b + 3.0))
    at(10.0 * n_steps + 1)
    for rec in (core, *w):
        rec.stop()
    return str(tmp_path)


def test_the_wait_on_the_last_rank_is_charged_to_its_own_cause(tmp_path):
    run = merge_dir(record_tp(tmp_path))
    p = partition(run)
    assert p.reconcile_max_err_ms < 1e-6
    by = {lb: p.column(lb) for lb in ("rank1:injected", "rank1:forward")}
    # gaps: between emissions at 10k+7.5; gap k-1 -> k holds step k
    # the stalled step 3: rank 0 entered at 32.0, rank 1 at 33.9: rank 1 was 1.9 ms late;
    # since its forward began (31.2) it stalled 2.0 ms (31.5-33.5), which explains all of
    # it (without the stall it would have entered at 31.9): 1.9 ms to its stall, none to
    # its forward
    g3 = int(np.flatnonzero(np.isclose(p.t1_s, 37.5e-3))[0])
    assert by["rank1:injected"][g3] == pytest.approx(1.9, abs=1e-6)
    assert by["rank1:forward"][g3] == pytest.approx(0.0, abs=1e-6)
    # every other gap: rank 1 was 0.1 ms late, in its forward
    others = np.arange(len(p)) != g3
    assert np.allclose(by["rank1:forward"][others], 0.1, atol=1e-6)
    assert np.allclose(by["rank1:injected"][others], 0.0)
    # carved out of the forward window, never added: each gap is still 10 ms
    assert np.allclose(p.gap_ms, 10.0)
    rep = run.meta["tensor_parallel"]
    assert rep["ranks"] == [1]
    assert rep["charged_s"]["rank1:injected"] == pytest.approx(1.9e-3)
