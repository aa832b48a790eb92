"""The engine: `step()` coordinates Scheduler, BlockManager and ModelRunner, and tags.

One step, in the reference post's order, each part inside its segment:

    intake      arrivals whose time has passed on the engine clock: tokenised on the
                loop (`tok`), or handed to the worker process and its results collected
    schedule    decide readmissions, KV reservations (may evict), prefill chunks, decodes
    swap        KV copies for readmissions (`readmit` at the end of the copy) and for
                evictions (`evict` at the moment the victim stops running)
    prefill     one chunk per request (`recompute` for a re-prefill after a recompute
                preemption, which tracekit maps to preempt)
    decode      prepare the rows, one forward pass (batched on a captured size or eager
                per sequence), greedy sampling with top-k logprobs
    emit        one emission time for every token of the step, right after the decode
                forward pass returns (after the prefill when the step has no decode row)
    bookkeeping step info, counters, per-token history, retiring finished requests

The engine clock is the recorder's clock (`rec.now()`), which still ticks when the
recorder is disabled, so a run with `Recorder(enabled=False)` runs the same engine.
Arrivals are due on the workload's clock: engine-clock seconds, or engine steps (then the
schedule does not depend on how long a step takes; see `serve`). With async scheduling
`step()` emits the previous step's tokens: the same function, reading one step later.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .block_manager import BlockManager
from .config import EngineConfig
from .history import CompactHistory, History, ObjectHistory, build_startup_heap
from .model import DecodeRow, ModelRunner, NumpyModelRunner, Samples, prev_token_ref
from .scheduler import KvOp, Request, Scheduler, SchedulerOutput
from .tokenizer import OffLoopTokenizer
from .workload import TraceRequest

NS_PER_S = 1_000_000_000


@dataclass(slots=True)
class Progress:
    """A snapshot for progress lines: where the run is and what the engine holds."""

    elapsed_s: float
    num_steps: int
    clock: str  # the workload's clock: "seconds" or "steps"
    span: float  # the run's length on that clock
    num_tokens: int
    num_running: int
    num_waiting: int
    num_preempted_now: int
    num_preemptions: int
    num_arrived: int


@dataclass(slots=True)
class RunStats:
    """What one `serve` did, counted by the engine itself (tracekit recomputes from the log)."""

    wall_s: float = 0.0
    num_steps: int = 0
    num_tokens: int = 0
    num_arrived: int = 0
    num_finished: int = 0
    num_preemptions: int = 0
    num_eager_steps: int = 0
    num_max_decode_batch: int = 0

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s > 0 else 0.0


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        rec: Any,
        tokenizer: Any,
        *,
        runner: ModelRunner | None = None,
    ) -> None:
        self.config = config
        self.rec = rec
        self.tokenizer = tokenizer
        self.runner: ModelRunner = runner or NumpyModelRunner(config, tokenizer.get_vocab_size())
        if config.is_async_scheduling and not hasattr(self.runner, "decode_launch"):
            raise ValueError(
                "async scheduling needs a runner that launches without waiting "
                "(TorchModelRunner, --backend torch)"
            )
        self.bm = BlockManager(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.bm)
        self.history: History = (
            CompactHistory(config.num_topk_logprobs)
            if config.is_compact_history
            else ObjectHistory()
        )
        self.off_loop: OffLoopTokenizer | None = None
        self.startup_heap: list[Any] = []
        self.stats = RunStats()
        self._is_frozen = False
        # the trace being served and where we are in it
        self._trace: list[TraceRequest] = []
        self._is_step_clock = False
        self._due: list[float] = []  # arrival times on the workload clock (ticks or steps)
        self._next_arrival = 0
        self._step_clock = 0.0  # steps run, plus idle stretches skipped to the next arrival
        self.arrival_ticks: dict[int, int] = {}  # request index -> when it arrived (tick)
        # segment handles, looked up once (a disabled recorder hands back a shared no-op);
        # the runner's work is device work: with a device timer (torch on CUDA) the
        # recorder also times its execution, without one these are plain host windows
        self._seg_tok = rec.segment("tok")
        self._seg_swap = rec.segment("swap", device=True)
        self._seg_prefill = rec.segment("prefill", device=True)
        self._seg_recompute = rec.segment("recompute", device=True)
        self._seg_decode = rec.segment("decode", device=True)
        # async scheduling: the step launched last, not read yet (see `step`)
        self._inflight: _Launched | None = None
        # requests handed to the off-loop tokenizer and not back yet (their TTFT waits)
        self._tokenizing: set[int] = set()

    # -- lifecycle ---------------------------------------------------------------------------
    def startup(self) -> None:
        """Build the long-lived heap, start the tokenizer worker, freeze the heap (by rung).
        Run it inside the recorder so startup collections are recorded before step 0."""
        cfg = self.config
        self.startup_heap = build_startup_heap(cfg.num_startup_objects)
        if cfg.is_tokenize_off_loop:
            self.off_loop = OffLoopTokenizer(self.tokenizer, cfg.max_prompt_tokens)
            self.off_loop.warm_up()
        if cfg.is_gc_freeze:
            gc.collect()
            gc.freeze()
            self._is_frozen = True

    def close(self) -> None:
        """Stop the worker and undo the freeze, so the interpreter is as it was."""
        if self.off_loop is not None:
            self.off_loop.close()
            self.off_loop = None
        if self._is_frozen:
            gc.unfreeze()
            self._is_frozen = False
        self.startup_heap = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- intake ----------------------------------------------------------------------------------
    def _now(self) -> float:
        """Now on the workload's clock: engine-clock ticks, or engine steps."""
        return self._step_clock if self._is_step_clock else self.rec.now()

    def _intake(self, *, in_step: bool = True) -> None:
        """Requests whose arrival time has passed: tokenise (on the loop or off it).

        Off the loop on the step clock, the worker keeps up with the loop (a tokenizer on
        its own core, the reference post's advice): what was handed to it in one step is
        back by the next step's intake, which waits for it if need be (inside `tok`: on
        the CPU clock the wait costs nothing, on wall time it is the loop waiting for the
        tokenizer), so every prompt is schedulable one step after it arrived, whatever the
        machine's load. On the seconds clock results are taken whenever they are ready."""
        if self.off_loop is not None and self._is_step_clock and self.off_loop.num_pending:
            if in_step:
                with self._seg_tok:
                    ready = self.off_loop.wait_all()
            else:
                ready = self.off_loop.wait_all()
            for index, ids in ready:
                if index >= 0:
                    self._tokenizing.discard(index)
                    self._add_request(index, ids)
        now = self._now()
        due = self._due
        while self._next_arrival < len(due) and due[self._next_arrival] <= now:
            tr = self._trace[self._next_arrival]
            self._next_arrival += 1
            self.stats.num_arrived += 1
            # on the step clock a request arrives when its step starts; on the wall
            # clock at its scheduled time, even if the loop was busy then
            self.arrival_ticks[tr.index] = (
                self.rec.now() if self._is_step_clock else int(due[self._next_arrival - 1])
            )
            if self.off_loop is not None:
                self.off_loop.submit(tr.index, tr.text)
                self._tokenizing.add(tr.index)
            else:
                with self._seg_tok:
                    ids = self.tokenizer.encode(tr.text).ids[: self.config.max_prompt_tokens]
                self._add_request(tr.index, ids)
        if self.off_loop is not None and self.off_loop.num_pending and not self._is_step_clock:
            for index, ids in self.off_loop.poll():
                if index >= 0:
                    self._tokenizing.discard(index)
                    self._add_request(index, ids)

    def _add_request(self, index: int, ids: list[int]) -> None:
        tr = self._trace[index]
        max_new = min(tr.max_new_tokens, self.config.max_new_tokens)
        req = Request(
            rid=index,
            arrival_tick=self.arrival_ticks[index],
            token_ids=list(ids) or [0],
            max_new_tokens=max_new,
        )
        self.rec.request(
            index,
            prompt_tokens=req.num_prompt_tokens,
            max_new_tokens=max_new,
            arrival_tick=req.arrival_tick,
        )
        self.scheduler.add(req)

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> int:
        """One engine iteration. Returns the number of tokens emitted.

        Synchronous (the default): the step's forward passes run to completion and their
        tokens are emitted in the same step. With async scheduling the step launches its
        forward passes without waiting (the runner must be `TorchModelRunner`), hands the
        scheduler placeholder tokens so it can move on, and then reads and emits the
        *previous* step's samples, so the host's work for step N overlaps the device's for
        N-1. Placeholders (`prev_token_ref`, a row of the samples still on the device) are
        filled in when read; requests finish by count, so the scheduler needs no values."""
        rec, runner = self.rec, self.runner
        is_async = self.config.is_async_scheduling
        with rec.step():
            self._intake()
            out = self.scheduler.schedule()
            self._record_schedule(out)
            for op in out.kv_ops:
                self._do_kv_op(op)
            num_decode = len(out.decode_reqs)
            graph_size = runner.graph_size_for(num_decode)
            launched = self._forward(out, graph_size, is_async=is_async)
            if is_async:  # the scheduler moves on now; the token values follow when read
                launched.finished = self.scheduler.update(
                    out, {r.rid: prev_token_ref(i) for i, r in enumerate(launched.reqs)}
                )
                if launched.reqs:
                    runner.set_step_outputs(launched.pending)  # type: ignore[attr-defined]
                ready, self._inflight = self._inflight, (launched if launched.reqs else None)
            else:
                ready = launched
            num_emitted = self._emit(ready, None if is_async else out)
            self._tag_step(out, num_decode, graph_size)
            st = self.stats
            st.num_steps += 1
            self._step_clock += 1
            st.num_preemptions += out.num_preempted
            st.num_eager_steps += graph_size == 0
            st.num_max_decode_batch = max(st.num_max_decode_batch, num_decode)
        return num_emitted

    def _forward(self, out: SchedulerOutput, graph_size: int, *, is_async: bool) -> _Launched:
        """The step's prefill chunks (each in its segment), then its decode batch. Sync:
        each call returns its samples; async: each launch returns pending samples. Rows are
        ordered decode first, then the prefills that completed a sequence."""
        runner: Any = self.runner
        bm = self.bm
        prefill = runner.prefill_launch if is_async else runner.prefill
        decode = runner.decode_launch if is_async else runner.decode
        reqs: list[Request] = []
        pending: list[Any] = []
        for r, n in out.prefill_chunks:
            start = r.num_computed_tokens
            with self._seg_recompute if r.is_recomputing else self._seg_prefill:
                p = prefill(
                    r.token_ids[start : start + n],
                    start,
                    bm.slots(r, start + n),
                    is_last=start + n == len(r.token_ids),
                )
            if p is not None:
                reqs.append(r)
                pending.append(p)
        if out.decode_reqs:
            rows = [
                DecodeRow(
                    r.token_ids[-1], r.num_computed_tokens, bm.slots(r, r.num_computed_tokens + 1)
                )
                for r in out.decode_reqs
            ]
            with self._seg_decode:
                pending.insert(0, decode(rows, graph_size))
            reqs[:0] = out.decode_reqs
        return _Launched(reqs, [len(r.token_ids) for r in reqs], pending, self.rec.current_step)

    def _emit(self, ready: _Launched | None, sync_out: SchedulerOutput | None) -> int:
        """Emit `ready`'s tokens (this step's, or under async scheduling the previous
        step's) and keep their history. Sync (`sync_out` is this step's schedule): the
        scheduler takes the real tokens now; async: they fill in the placeholders the
        scheduler took at launch. Returns the number of tokens emitted."""
        if ready is None or not ready.reqs:
            if sync_out is not None:
                self.scheduler.update(sync_out, {})  # prefill chunks still advance
            return 0
        samples = [p if isinstance(p, Samples) else p.result() for p in ready.pending]
        rids = [r.rid for r in ready.reqs]
        # the engine-emission boundary: all tokens of the step, when the host has them;
        # they are the results of the step that launched them (the partition's rule 6)
        self.rec.emit(rids, reads_step=ready.step)
        s = samples[0] if len(samples) == 1 else _concat(samples)
        tokens = s.token_ids.tolist()
        if sync_out is not None:
            finished = self.scheduler.update(sync_out, dict(zip(rids, tokens, strict=True)))
        else:
            for r, i, tok in zip(ready.reqs, ready.token_index, tokens, strict=True):
                r.token_ids[i] = tok
            finished = ready.finished or []
        st = self.stats
        self.history.record(
            rids, st.num_steps, s.token_ids, s.logprobs, s.topk_ids, s.topk_logprobs
        )
        for r in finished:
            self.history.close(r.rid)
            self.rec.finish(r.rid)  # its last token is out: the recorder may forget its id
        st.num_tokens += len(rids)
        st.num_finished += len(finished)
        return len(rids)

    def _record_schedule(self, out: SchedulerOutput) -> None:
        """What the scheduler decided, for the TTFT partition: first admissions (now),
        the prompt chunks this step prefills (recompute chunks are `recompute`, not
        prefill), and why the requests still waiting were not admitted."""
        rec = self.rec
        for r in out.admitted:
            rec.admit(r.rid)
        for r, n in out.prefill_chunks:
            if not r.is_recomputing:
                rec.prefill(r.rid, n)
        if out.wait_reason is not None:
            rec.wait([r.rid for r in self.scheduler.waiting], out.wait_reason)
        if self._tokenizing:  # arrived, not tokenised yet: the scheduler cannot take them
            rec.wait(sorted(self._tokenizing), "tokenizing")

    def _tag_step(self, out: SchedulerOutput, num_decode: int, graph_size: int) -> None:
        """What the step did, for the recorder: its attributes and the engine's counters."""
        self.rec.step_info(
            num_decode=num_decode,
            num_prefill_tokens=out.num_prefill_tokens,
            graph_size=graph_size,
            num_preempted=out.num_preempted,
            num_swapped_in=out.num_readmitted,
        )
        self.rec.counter("batch_size", num_decode)
        self.rec.counter("kv_free_blocks", self.bm.num_free_blocks)

    def _do_kv_op(self, op: KvOp) -> None:
        r, rec = op.req, self.rec
        if op.kind in ("swap_out", "drop"):
            self._record_eviction(op)  # it stops running now
            if op.kind == "swap_out":
                with self._seg_swap:
                    r.host_kv = self.runner.swap_out(op.slots)  # type: ignore[arg-type]
        elif op.kind == "swap_in":
            with self._seg_swap:
                self.runner.swap_in(r.host_kv, op.slots)  # type: ignore[arg-type]
            r.host_kv = None
            rec.readmit(r.rid)  # running again once its KV is back
        elif op.kind == "readmit":
            rec.readmit(r.rid)
        else:
            raise ValueError(f"unknown KV op {op.kind!r}")

    def _record_eviction(self, op: KvOp) -> None:
        """The eviction, with the cause the scheduler kept when it decided (docs/capture.md,
        "Eviction causes")."""
        mode = "swap" if op.kind == "swap_out" else "recompute"
        c = op.cause
        if c is None:
            self.rec.evict(op.req.rid, mode=mode)
            return
        self.rec.evict(
            op.req.rid,
            mode=mode,
            reason=c.reason,
            by=[] if c.evictor is None else [c.evictor.rid],
            num_computed_tokens_lost=c.num_computed_tokens_lost,
            num_free_blocks=c.num_free_blocks,
            num_used_blocks=c.num_used_blocks,
        )

    # -- serving -------------------------------------------------------------------------------
    def serve(
        self,
        trace: list[TraceRequest],
        span: float,
        *,
        clock: str = "seconds",
        progress: Callable[[Progress], None] | None = None,
        progress_interval_s: float = 1.0,
        is_drain: bool = False,
    ) -> RunStats:
        """Serve `trace` for `span` units of `clock`, the clock its arrival times count:
        `"seconds"` of engine clock, or engine `"steps"`. Each request is admitted when its
        arrival time passes; the loop steps while there is work. When there is none it
        naps (seconds) or skips ahead to the next arrival (steps: an idle engine runs no
        steps, so waiting for an arrival costs none).
        `is_drain`: stop early once every request has arrived and finished (benchmarks
        and tests serve a fixed amount of work this way)."""
        if clock not in ("seconds", "steps"):
            raise ValueError(f"clock must be 'seconds' or 'steps', got {clock!r}")
        rec, sched = self.rec, self.scheduler
        t0 = rec.now()
        wall_t0 = time.perf_counter()
        self._trace = trace
        self._is_step_clock = clock == "steps"
        self._step_clock = 0.0
        if self._is_step_clock:
            self._due = [tr.arrival for tr in trace]
            end = float(span)
        else:
            self._due = [t0 + int(tr.arrival * NS_PER_S) for tr in trace]
            end = t0 + int(span * NS_PER_S)
        self._next_arrival = 0
        next_report = t0 + int(progress_interval_s * NS_PER_S)
        idle_ns = int(self.config.idle_sleep_s * NS_PER_S)
        due = self._due
        while True:
            wall = rec.now()
            now = self._now()
            if now >= end:
                break
            is_due = self._next_arrival < len(due) and due[self._next_arrival] <= now
            is_tokenizing = self.off_loop is not None and self.off_loop.num_pending > 0
            if is_due or sched.has_work or self._inflight is not None:
                self.step()
            elif is_drain and self._next_arrival == len(due) and not is_tokenizing:
                break
            elif is_tokenizing:
                self._intake(in_step=False)  # collect finished tokenisations outside any step
                if not sched.has_work:
                    time.sleep(self.config.idle_sleep_s)
            elif self._is_step_clock:
                if self._next_arrival == len(due):
                    break  # nothing will ever arrive: the rest of the run is idle
                self._step_clock = max(now, due[self._next_arrival])
            else:
                wait_ns = idle_ns
                if self._next_arrival < len(due):
                    wait_ns = min(wait_ns, max(0, int(due[self._next_arrival] - now)))
                time.sleep(wait_ns / NS_PER_S)
            if progress is not None and wall >= next_report:
                next_report += int(progress_interval_s * NS_PER_S)
                progress(self.progress((wall - t0) / NS_PER_S, clock, span))
        self.stats.wall_s = time.perf_counter() - wall_t0  # wall time, whatever rec's clock
        return self.stats

    def progress(self, elapsed_s: float, clock: str, span: float) -> Progress:
        s = self.scheduler
        return Progress(
            elapsed_s=elapsed_s,
            num_steps=self.stats.num_steps,
            clock=clock,
            span=span,
            num_tokens=self.stats.num_tokens,
            num_running=len(s.running),
            num_waiting=len(s.waiting) + (self.off_loop.num_pending if self.off_loop else 0),
            num_preempted_now=len(s.preempted),
            num_preemptions=s.num_preemptions,
            num_arrived=self.stats.num_arrived,
        )


@dataclass(slots=True)
class _Launched:
    """A step's forward passes: their requests and samples (async: pending on the device)."""

    reqs: list[Request]  # in sample-row order: decode rows, then completed prefills
    token_index: list[int]  # where each request's new token goes (appended after launch)
    pending: list[Any]  # Samples (sync) or the runner's PendingSamples (async), same order
    step: int  # the recorder's index of the step that launched them
    finished: list[Request] | None = None  # async: retired by count at launch


def _concat(samples: list[Samples]) -> Samples:
    return Samples(*(np.concatenate([getattr(x, f) for x in samples]) for f in Samples.__slots__))
