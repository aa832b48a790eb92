"""A busy GPU server, simulated through the public `Recorder` with a fake clock: an hour of
serving in seconds, deterministically (for the long-run benchmarks and tests).

    from busy_server import FakeClock, serve
    clock = FakeClock()
    rec = tracekit.Recorder("raw/hour.npz", clock=clock, seconds_per_tick=1e-9, gc=False,
                            handle_signals=False)
    with rec:
        serve(rec, clock, minutes=60)

The workload (the one issue "runs of any length" describes): up to `batch` running requests
(256), ~19 ms steps with `schedule`, `prefill` (on steps that compute a prompt chunk),
`decode` and `sample` segments, chunked prefill under a token budget, Poisson arrivals at
the rate that keeps the batch nearly full, one `emit_handles` of the decoding batch a step,
a recompute eviction now and then (readmitted a few steps later), and each request finished
(`Recorder.finish_handle`) after its last token, as an engine's adapter does (a recorder
without `finish`, an older checkout's, is just not told). ~0.8 M emitted tokens a simulated
minute at batch 256, ~2,700 requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

MS = 1_000_000  # ticks (ns) a millisecond


class FakeClock:
    """A clock that moves only when told (integer nanoseconds)."""

    def __init__(self, t_ns: int = 1_000_000_000) -> None:
        self.t_ns = t_ns

    def __call__(self) -> int:
        return self.t_ns

    def advance_ms(self, ms: float) -> None:
        self.t_ns += int(ms * MS)


@dataclass(frozen=True, slots=True)
class Workload:
    batch: int = 256  # the most requests running at once
    step_ms: float = 19.0  # a decode step's length at a full batch
    prompt_tokens: tuple[int, int] = (256, 2048)  # uniform
    output_tokens_mean: float = 300.0  # geometric
    prefill_budget: int = 2048  # prompt tokens a step may compute
    eviction_every_steps: int = 400  # a recompute eviction this often (on average)
    seed: int = 0


def serve(
    rec: object,
    clock: FakeClock,
    minutes: float,
    workload: Workload = Workload(),
    *,
    on_minute: Callable[[int], None] | None = None,
    speedup: float | None = None,
    frontend: object | None = None,
) -> dict[str, int]:
    """Run the simulated server on `rec` (started, on `clock`) for `minutes` of its clock.
    Returns counts: steps, tokens (emissions), requests, evictions. `on_minute(m)` is
    called at each simulated minute's end (to sample memory, say).

    `speedup`: at most this many simulated seconds per wall second (the engine sleeps at
    each simulated second to keep it). A real server gives the recorder's writer a whole
    second for each second of rows; an engine simulated hundreds of times faster than the
    writer can encode would have rows pile up in flight, a state no server is in. None:
    as fast as the machine runs.

    `frontend`: an API server's recorder (started, on `clock`) beside the engine core's
    `rec`, as `vllm serve` records them (docs/adapters.md): each request named
    ``req-N<US>req-N`` there and sent (``serve.sent``) as the core adds it
    (``serve.added``); each step's outputs built (``serve.out``, keyed by the step) and
    received 0.1 ms later (``serve.recv``), then a chunk per emitting request written in an
    ``sse_write`` window of 0.05 ms: the API server records as many rows as the core."""
    if frontend is not None:  # (a checkout before the serve contract records no frontend)
        from tracekit.log.serve_contract import ADDED, FRONT_SEP, OUT, RECV, SENT
    w = workload
    rng = np.random.default_rng(w.seed)
    finish = getattr(rec, "finish_handle", None)  # None: a recorder from before it existed
    # arrivals per simulated ms that keep the batch nearly full
    rate_per_ms = w.batch / (w.output_tokens_mean * w.step_ms)
    end_ns = clock.t_ns + int(minutes * 60_000 * MS)
    next_minute_ns = clock.t_ns + 60_000 * MS
    minute = 0
    waiting: list[tuple[int, int, int]] = []  # (handle, prompt tokens left, output tokens)
    running_h = np.empty(0, np.int64)  # decoding requests
    running_left = np.empty(0, np.int64)  # their output tokens still to emit
    prefilling: list[list[int]] = []  # [handle, prompt tokens left, output tokens]
    evicted: list[tuple[int, int, int]] = []  # (handle, readmit at step, output tokens left)
    counts = {"steps": 0, "tokens": 0, "requests": 0, "evictions": 0}
    n_req = 0
    start_ns, wall0 = clock.t_ns, time.perf_counter()
    next_second_ns = start_ns + 1000 * MS
    while clock.t_ns < end_ns:
        # arrivals since the last step
        for _ in range(int(rng.poisson(rate_per_ms * w.step_ms))):
            h = rec.request(  # type: ignore[attr-defined]
                f"req-{n_req}",
                prompt_tokens=int(rng.integers(*w.prompt_tokens)),
                max_new_tokens=4096,
            )
            n_req += 1
            if frontend is not None:
                fh = frontend.request(f"req-{h}{FRONT_SEP}req-{h}")  # type: ignore[attr-defined]
                frontend.counter(SENT, fh)  # type: ignore[attr-defined]
                rec.counter(ADDED, h)  # type: ignore[attr-defined]
            waiting.append(
                (
                    h,
                    int(rng.integers(*w.prompt_tokens)),
                    1 + int(rng.geometric(1 / w.output_tokens_mean)),
                )
            )
        with rec.step():  # type: ignore[attr-defined]
            with rec.segment("schedule"):  # type: ignore[attr-defined]
                clock.advance_ms(0.3)
                room = w.batch - len(running_h) - len(prefilling)
                while room > 0 and waiting:
                    h, prompt, out = waiting.pop(0)
                    rec.admit_handle(h)  # type: ignore[attr-defined]
                    prefilling.append([h, prompt, out])
                    room -= 1
                back = [e for e in evicted if e[1] <= counts["steps"]]
                for h, _, left in back:  # readmitted: decodes again (recompute not modelled)
                    rec.readmit(rec_id(h))  # type: ignore[attr-defined]
                    running_h = np.append(running_h, h)
                    running_left = np.append(running_left, left)
                evicted = [e for e in evicted if e[1] > counts["steps"]]
            budget = w.prefill_budget
            chunk_h, chunk_n, done = [], [], []
            for p in prefilling:
                if budget <= 0:
                    break
                n = min(budget, p[1])
                chunk_h.append(p[0])
                chunk_n.append(n)
                p[1] -= n
                budget -= n
                if p[1] == 0:
                    done.append(p)
            if chunk_h:
                with rec.segment("prefill"):  # type: ignore[attr-defined]
                    clock.advance_ms(0.004 * sum(chunk_n))
                rec.prefill_handles(chunk_h, chunk_n)  # type: ignore[attr-defined]
            with rec.segment("decode"):  # type: ignore[attr-defined]
                clock.advance_ms(
                    w.step_ms
                    * (0.4 + 0.6 * len(running_h) / w.batch)
                    * float(rng.uniform(0.95, 1.05))
                )
            with rec.segment("sample"):  # type: ignore[attr-defined]
                clock.advance_ms(0.5)
            # the decoding batch emits one token each; requests whose prompt finished emit
            # their first token
            first = np.array([p[0] for p in done], np.int64)
            emitting = np.concatenate((running_h, first))
            if len(emitting):
                rec.emit_handles(emitting)  # type: ignore[attr-defined]
                if frontend is not None:
                    rec.counter(OUT, float(counts["steps"]))  # type: ignore[attr-defined]
            counts["tokens"] += len(emitting)
            running_left = running_left - 1
            keep = running_left > 0
            if finish is not None:  # their last token is out
                for h in running_h[~keep].tolist():
                    finish(h)
            running_h, running_left = running_h[keep], running_left[keep]
            for p in done:
                prefilling.remove(p)
                if p[2] > 1:
                    running_h = np.append(running_h, p[0])
                    running_left = np.append(running_left, p[2] - 1)
                elif finish is not None:  # one output token: done with its first
                    finish(p[0])
            if len(running_h) and rng.random() < 1 / w.eviction_every_steps:
                i = int(rng.integers(len(running_h)))
                h = int(running_h[i])
                rec.evict(rec_id(h), mode="recompute")  # type: ignore[attr-defined]
                evicted.append(
                    (h, counts["steps"] + int(rng.integers(5, 50)), int(running_left[i]))
                )
                running_h = np.delete(running_h, i)
                running_left = np.delete(running_left, i)
                counts["evictions"] += 1
        if frontend is not None and len(emitting):  # the outputs reach the API server
            clock.advance_ms(0.1)
            frontend.counter(RECV, float(counts["steps"]))  # type: ignore[attr-defined]
            with frontend.segment("sse_write"):  # type: ignore[attr-defined]
                clock.advance_ms(0.05)
            frontend.emit_handles(emitting)  # type: ignore[attr-defined]
        counts["steps"] += 1
        clock.advance_ms(0.2)  # the loop between steps
        if speedup is not None and clock.t_ns >= next_second_ns:
            next_second_ns += 1000 * MS
            ahead_s = (clock.t_ns - start_ns) / 1e9 / speedup - (time.perf_counter() - wall0)
            if ahead_s > 0:
                time.sleep(ahead_s)
        if clock.t_ns >= next_minute_ns:
            minute += 1
            next_minute_ns += 60_000 * MS
            if on_minute is not None:
                on_minute(minute)
    counts["requests"] = n_req
    return counts


def rec_id(handle: int) -> str:
    """The request id behind a handle (`serve` names requests ``req-<arrival number>`` and
    the recorder interns them in arrival order, so handle i is request i)."""
    return f"req-{handle}"
