"""A synthetic serving run with every cause in it, for report and trace tests (and bench/).

Not an engine: a small discrete simulation of continuous batching on a fake clock, written
straight into `RawLog` tables. It has requests arriving at random, tokenizer calls on the
loop, chunked prefill within a token budget, decode steps whose batch may miss a captured
graph size, KV swaps (explicit evictions and readmissions), GC pauses of every
generation, and `batch_size` / `kv_free_blocks` counters, so every chart and track has
something to show. Deterministic for a seed.
"""

from __future__ import annotations

import math
import random

import numpy as np

from tracekit.log.rawlog import (
    MODE_SWAP,
    Counters,
    Emissions,
    Evictions,
    GcPauses,
    RawLog,
    Requests,
    Segments,
    Steps,
)

GRAPH_SIZES = (1, 2, 4, 8)  # captured sizes; a larger decode batch runs eager


def synthetic_log(
    *,
    seed: int = 1,
    rung: str = "baseline",
    duration_s: float = 5.0,
    rate_per_s: float = 20.0,
    num_kv_blocks: int = 500,
    gc_every_steps: int = 60,
    extra_label: str | None = "schedule",
    config: dict | None = None,
    path: str = "<synthetic>",
) -> RawLog:
    rng = random.Random(seed)
    labels = ["tok", "swap", "prefill", "decode"]
    if extra_label:
        labels.append(extra_label)
    lab = {name: i for i, name in enumerate(labels)}

    steps: list[tuple] = []
    segs: list[tuple] = []
    gcs: list[tuple] = []
    ems: list[tuple] = []
    evs: list[list] = []
    ctr: list[tuple] = []
    arrival: list[float] = []
    prompt: list[int] = []
    max_new: list[int] = []

    # arrivals (Poisson)
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= duration_s * 0.9:
            break
        arrival.append(t)
        prompt.append(rng.randint(64, 1200))
        max_new.append(rng.randint(20, 250))
    n_req = len(arrival)

    waiting: list[int] = []  # arrived, tokenized, waiting for prefill
    prefilled = [0] * n_req
    generated = [0] * n_req
    running: list[int] = []  # decoding
    swapped: list[int] = []
    open_evict: dict[int, int] = {}  # request -> row in evs
    next_arrival = 0
    blocks_free = num_kv_blocks

    def blocks_of(r: int) -> int:
        return math.ceil((prefilled[r] + generated[r] + 1) / 16)

    now = 0.002
    step_no = 0
    while now < duration_s:
        t0 = now
        n_pre = n_swapped_in = n_preempted = 0
        # tokenizer on the loop for every request that arrived
        while next_arrival < n_req and arrival[next_arrival] <= now:
            d = 0.0004 + prompt[next_arrival] * 4e-6 * (1 + rng.random())
            segs.append((step_no, lab["tok"], now, now + d))
            now += d
            waiting.append(next_arrival)
            next_arrival += 1
        if extra_label:
            d = 0.0002 + 0.0001 * rng.random()
            segs.append((step_no, lab[extra_label], now, now + d))
            now += d
        # readmit swapped requests when there is room
        while swapped and blocks_free > blocks_of(swapped[0]) + 40:
            r = swapped.pop(0)
            d = 0.002 + 0.003 * rng.random()
            segs.append((step_no, lab["swap"], now, now + d))
            now += d
            evs[open_evict.pop(r)][2] = now
            blocks_free -= blocks_of(r)
            running.append(r)
            n_swapped_in += 1
        # a GC pause now and then: young often, old rarely and long
        if step_no and step_no % gc_every_steps == 0:
            gen = (
                2
                if step_no % (gc_every_steps * 12) == 0
                else (1 if step_no % (gc_every_steps * 5) == 0 else 0)
            )
            d = {0: 0.0015, 1: 0.006, 2: 0.12}[gen] * (1 + rng.random())
            gcs.append((now, now + d, gen))
            now += d
        # chunked prefill within the token budget
        budget = 2048 - len(running)
        finished_prefill: list[int] = []
        for r in list(waiting):
            if budget <= 0:
                break
            need = blocks_of(r) + math.ceil(prompt[r] / 16)
            if blocks_free < need and prefilled[r] == 0:
                break
            chunk = min(budget, prompt[r] - prefilled[r])
            if prefilled[r] == 0:
                blocks_free -= math.ceil(prompt[r] / 16)
            prefilled[r] += chunk
            budget -= chunk
            n_pre += chunk
            if prefilled[r] >= prompt[r]:
                waiting.remove(r)
                finished_prefill.append(r)
        if n_pre:
            d = 0.001 + n_pre * 1.2e-5
            segs.append((step_no, lab["prefill"], now, now + d))
            now += d
        # decode every running request
        n_dec = len(running)
        graph = -1
        if n_dec:
            padded = next((g for g in GRAPH_SIZES if g >= n_dec), 0)
            graph = padded
            d = 0.006 + 0.00022 * (padded or n_dec) + 0.0003 * rng.random()
            if padded == 0:
                d *= 1.35
            segs.append((step_no, lab["decode"], now, now + d))
            now += d
        emit_t = now
        for r in running + finished_prefill:
            ems.append((r, emit_t, step_no, 1))
            generated[r] += 1
        running += finished_prefill
        # finished requests free their blocks; growing ones may force a swap
        for r in list(running):
            if generated[r] >= max_new[r]:
                running.remove(r)
                blocks_free += blocks_of(r)
            elif (prefilled[r] + generated[r]) % 16 == 0:
                blocks_free -= 1
        while blocks_free < 0 and running:
            victim = running.pop()
            d = 0.003 + 0.004 * rng.random()
            evs.append([victim, now, math.nan, MODE_SWAP])
            open_evict[victim] = len(evs) - 1
            segs.append((step_no, lab["swap"], now, now + d))
            now += d
            blocks_free += blocks_of(victim)
            swapped.append(victim)
            n_preempted += 1
        now += 0.0001
        steps.append((t0, now, n_dec, n_pre, graph, n_preempted, n_swapped_in))
        ctr.append((0, now, float(n_dec)))
        ctr.append((1, now, float(blocks_free)))
        step_no += 1
        if not running and not waiting and not swapped:
            nxt = arrival[next_arrival] if next_arrival < n_req else duration_s
            now = max(now + 0.001, min(nxt, duration_s))

    st = np.array(steps, dtype=float).reshape(-1, 7)
    sg = np.array(segs, dtype=float).reshape(-1, 4)
    g = np.array(gcs, dtype=float).reshape(-1, 3)
    em = np.array(ems, dtype=float).reshape(-1, 4)
    ev = np.array(evs, dtype=float).reshape(-1, 4)
    ct = np.array(ctr, dtype=float).reshape(-1, 3)
    first = np.full(n_req, np.nan)
    if len(em):
        order = np.lexsort((em[:, 1], em[:, 0]))
        r = em[order, 0].astype(int)
        head = np.ones(len(r), bool)
        head[1:] = r[1:] != r[:-1]
        first[r[head]] = em[order, 1][head]
    cfg = {
        "rung": rung,
        "seed": seed,
        "duration": duration_s,
        "rate": rate_per_s,
        "engine": {"num_kv_blocks": num_kv_blocks},
    }
    cfg.update(config or {})
    return RawLog(
        steps=Steps.from_rows(st),
        segments=Segments.from_rows(sg, thread=0, is_device=0),
        gc_pauses=GcPauses.from_rows(g),
        emissions=Emissions.from_rows(em),
        evictions=Evictions.from_rows(ev),
        requests=Requests(
            arrival_s=np.array(arrival),
            prompt_tokens=np.array(prompt, dtype=np.int64),
            max_new_tokens=np.array(max_new, dtype=np.int64),
            first_token_s=first,
        ),
        counters=Counters.from_rows(ct),
        labels=tuple(labels),
        request_ids=tuple(f"req-{i}" for i in range(n_req)),
        counter_names=("batch_size", "kv_free_blocks"),
        config=cfg,
        wall_s=float(now),
        path=path,
    )
