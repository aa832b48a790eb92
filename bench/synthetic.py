"""A synthetic engine log of any size, generated vectorised (for benchmarks)."""

from __future__ import annotations

import numpy as np

from tracekit.log.rawlog import (
    Counters,
    Emissions,
    Evictions,
    GcPauses,
    RawLog,
    Requests,
    Segments,
    Steps,
)


def synthetic_log(num_steps: int, batch: int = 32, seed: int = 0) -> RawLog:
    """`num_steps` steps, each decoding `batch` requests (so ~num_steps * batch gaps), with
    tokenizer and prefill windows on some steps, eager steps, GC pauses and evictions."""
    rng = np.random.default_rng(seed)
    dur = rng.gamma(4.0, 3.0, num_steps) * 1e-3  # step lengths, s
    t0 = np.concatenate([[0.0], np.cumsum(dur + 2e-4)[:-1]])
    t1 = t0 + dur
    has_tok = rng.random(num_steps) < 0.05
    has_pre = rng.random(num_steps) < 0.3
    eager = rng.random(num_steps) < 0.05
    dec_start = t0 + dur * np.where(has_pre, 0.4, 0.1)
    dec_end = t1 - dur * 0.02
    emit_t = dec_end
    seg_step, seg_label, seg_a, seg_b = [], [], [], []
    idx = np.arange(num_steps)
    for sel, label, a, b in (
        (has_tok, 0, t0, t0 + dur * 0.05),
        (has_pre, 2, t0 + dur * 0.08, t0 + dur * 0.38),
        (np.ones(num_steps, bool), 3, dec_start, dec_end),
    ):
        seg_step.append(idx[sel])
        seg_label.append(np.full(sel.sum(), label))
        seg_a.append(a[sel])
        seg_b.append(b[sel])
    order = np.lexsort((np.concatenate(seg_a), np.concatenate(seg_step)))
    segments = Segments(
        step=np.concatenate(seg_step)[order],
        label=np.concatenate(seg_label)[order],
        t_start_s=np.concatenate(seg_a)[order],
        t_end_s=np.concatenate(seg_b)[order],
        thread=np.zeros(len(order), np.int64),
        is_device=np.zeros(len(order), np.int8),
    )
    # requests live `life` steps each; `batch` slots, each slot replaced when its request ends
    life = 300
    per_slot = (num_steps + 7 * batch) // life + 1  # requests each slot serves in turn
    n_req = batch * per_slot
    slot = np.tile(np.arange(batch), num_steps)
    step_of = np.repeat(idx, batch)
    req = slot * per_slot + (step_of + slot * 7) // life
    keep = rng.random(len(req)) > 0.001  # a few evicted tokens
    em = Emissions(
        request=req[keep], t_s=emit_t[step_of][keep], step=step_of[keep],
        num_tokens=np.ones(keep.sum(), np.int64),
    )  # fmt: skip
    miss = np.flatnonzero(~keep)
    ev = Evictions(
        request=req[miss],
        t_evict_s=t0[step_of[miss]],
        t_readmit_s=t1[step_of[miss]],
        mode=np.zeros(len(miss), np.int64),
    )
    g_at = rng.choice(num_steps, size=max(1, num_steps // 200), replace=False)
    g_len = rng.exponential(5e-3, len(g_at))
    gcs = GcPauses(t0[g_at] + dur[g_at] * 0.5, t0[g_at] + dur[g_at] * 0.5 + g_len,
                   rng.integers(0, 3, len(g_at)))  # fmt: skip
    steps = Steps(
        t_start_s=t0,
        t_end_s=t1,
        num_decode=np.full(num_steps, batch),
        num_prefill_tokens=np.where(has_pre, 256, 0),
        graph_size=np.where(eager, 0, batch),
        num_preempted=np.zeros(num_steps, np.int64),
        num_swapped_in=np.zeros(num_steps, np.int64),
    )
    steps.num_preempted[step_of[miss]] += 1
    steps.graph_size[: num_steps // 2][~eager[: num_steps // 2]] = batch // 2  # two sizes
    return RawLog(
        steps=steps,
        segments=segments,
        gc_pauses=gcs,
        emissions=em,
        evictions=ev,
        requests=Requests(
            arrival_s=np.zeros(n_req),
            prompt_tokens=np.full(n_req, 100),
            max_new_tokens=np.full(n_req, life),
            first_token_s=np.full(n_req, np.nan),
        ),  # fmt: skip
        counters=Counters.empty(),
        labels=("tok", "swap", "prefill", "decode"),
        request_ids=tuple(str(i) for i in range(n_req)),
        config={"rung": "synthetic", "seed": seed},
        wall_s=float(t1[-1]),
    )
