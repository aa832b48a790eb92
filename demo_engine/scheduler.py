"""Requests and the scheduler: decode first, then prefill chunks within the token budget.

Each step the scheduler decides, in this order (the reference post's order):

1. readmission: preempted requests come back, oldest first, when their KV fits again
   (swap: copy back in; recompute: blocks for a full re-prefill);
2. KV reservation for every decoding request, oldest first: one more slot each; when the
   pool is dry, the newest running request is preempted (swap or recompute) until it fits.
   The decision keeps its cause (`Eviction`): the request whose growth needed the block
   (none when the victim is that request itself), the victim's computed tokens thrown
   away (0 with swap: its KV is copied out) and the pool when it decided;
3. prefill chunks for running requests still in prefill, oldest first, within the budget
   left after the decode rows (`max_num_batched_tokens - num_decode`);
4. admission of waiting requests (FCFS, none while a preempted request waits), under
   `max_num_seqs`, if their first chunk's blocks are free; with the watermark rung, only
   if the whole prompt fits and `admit_free_frac` of the pool would still be free.

`schedule()` only decides and does the block bookkeeping; the engine's `step()` carries
out the KV copies, the forward passes and the recording. `update()` takes the sampled
tokens back and retires finished requests.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .block_manager import BlockManager
from .config import EngineConfig


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One request. `token_ids` = prompt + output; positions < `num_computed_tokens` have KV."""

    rid: int
    arrival_tick: int
    token_ids: list[int]
    max_new_tokens: int
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    host_kv: np.ndarray | None = None  # the swapped-out KV while preempted by swap
    is_recomputing: bool = False  # re-prefilling after a recompute preemption
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if not self.token_ids:
            raise ValueError(f"request {self.rid}: empty prompt")

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing its context. The last token of a decoding request has no KV yet,
        so a request with one position left is a decode row, not a prefill chunk."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def num_remaining_prefill(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.num_output_tokens >= self.max_new_tokens


@dataclass(slots=True, frozen=True)
class Eviction:
    """Why the scheduler preempted a request, as it stood when it decided: the reason
    (tracekit's PREEMPT_REASONS: this scheduler evicts only when the KV pool is dry), the
    request whose decode growth needed the block (None: the victim itself could not grow),
    the victim's computed tokens thrown away, and the pool's free and used blocks."""

    evictor: Request | None
    num_computed_tokens_lost: int
    num_free_blocks: int
    num_used_blocks: int
    reason: str = "kv_full"


@dataclass(slots=True)
class KvOp:
    """A KV move the engine must carry out, in order: `swap_in`, `swap_out`, `readmit`
    (recompute: nothing to copy) or `drop` (recompute eviction). `slots` are where the KV
    is (swap_out) or goes (swap_in), fixed when the scheduler decided; `cause`: why an
    eviction (swap_out, drop) was decided."""

    kind: str
    req: Request
    slots: np.ndarray | None = None
    cause: Eviction | None = None


@dataclass(slots=True)
class SchedulerOutput:
    kv_ops: list[KvOp] = field(default_factory=list)
    prefill_chunks: list[tuple[Request, int]] = field(default_factory=list)  # (req, tokens)
    decode_reqs: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # taken off the waiting queue
    wait_reason: str | None = None  # why the waiting queue stopped (tracekit's WAIT_REASONS)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill_chunks)

    @property
    def num_preempted(self) -> int:
        return sum(op.kind in ("swap_out", "drop") for op in self.kv_ops)

    @property
    def num_readmitted(self) -> int:
        return sum(op.kind in ("swap_in", "readmit") for op in self.kv_ops)

    @property
    def is_empty(self) -> bool:
        return not (self.kv_ops or self.prefill_chunks or self.decode_reqs)


def _by_rid(r: Request) -> int:
    return r.rid


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first (by rid, which is arrival order)
        self.preempted: list[Request] = []  # oldest first
        self.num_preemptions = 0

    # -- queues ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    # -- the decision ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.bm
        out = SchedulerOutput()
        # 1. readmit preempted requests, oldest first, while their KV fits
        while self.preempted and len(self.running) < cfg.max_num_seqs:
            r = self.preempted[0]
            is_swap = self.config.preemption_mode == "swap"
            if is_swap:  # its computed KV + room for the next token
                need_tokens = r.num_computed_tokens + 1
            else:  # recompute: blocks for the whole re-prefill
                need_tokens = len(r.token_ids)
            if not bm.can_allocate(bm.blocks_for(need_tokens)):
                break
            self.preempted.pop(0)
            bm.allocate(r, need_tokens)
            r.status = Status.RUNNING
            bisect.insort(self.running, r, key=_by_rid)
            if is_swap:
                out.kv_ops.append(KvOp("swap_in", r, bm.slots(r, r.num_computed_tokens)))
            else:
                out.kv_ops.append(KvOp("readmit", r))
        # 2. reserve one slot per decoding request, preempting the newest when the pool is dry
        for r in list(self.running):
            if r.status is not Status.RUNNING or r.is_prefill:
                continue
            while not bm.can_append(r, r.num_computed_tokens + 1):
                victim = self.running[-1]
                self._preempt(victim, out, None if victim is r else r)
                if victim is r:
                    break
            else:
                bm.allocate(r, r.num_computed_tokens + 1)
                out.decode_reqs.append(r)
        # 3. prefill chunks of running requests, within the budget left after the decodes
        budget = cfg.max_num_batched_tokens - len(out.decode_reqs)
        for r in self.running:
            if budget <= 0:
                break
            if not r.is_prefill:
                continue
            room = (len(r.block_table) + bm.num_free_blocks) * bm.block_size - r.num_computed_tokens
            n = min(r.num_remaining_prefill, budget, room)
            if n <= 0:
                continue
            bm.allocate(r, r.num_computed_tokens + n)
            out.prefill_chunks.append((r, n))
            budget -= n
        # 4. admit new requests, first come first served
        while (
            self.waiting
            and not self.preempted
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
        ):
            r = self.waiting[0]
            n = min(len(r.token_ids), budget)
            if cfg.num_admit_free_blocks > 0:  # watermark: whole prompt + headroom
                need = bm.blocks_for(len(r.token_ids)) + cfg.num_admit_free_blocks
            else:  # just the first chunk
                need = bm.blocks_for(n)
            if not bm.can_allocate(need):
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)  # the newest: rids grow with arrival
            bm.allocate(r, n)
            out.prefill_chunks.append((r, n))
            out.admitted.append(r)
            budget -= n
        if self.waiting:  # the first condition of the loop above that stopped it
            if self.preempted:
                out.wait_reason = "preempted_first"
            elif budget <= 0:
                out.wait_reason = "token_budget"
            elif len(self.running) >= cfg.max_num_seqs:
                out.wait_reason = "max_num_seqs"
            else:
                out.wait_reason = "kv_blocks"  # the head's blocks (or the watermark) do not fit
        return out

    def _preempt(self, victim: Request, out: SchedulerOutput, evictor: Request | None) -> None:
        """Take `victim` off the running list and free its blocks (its KV is copied out
        first by the engine, from the slots recorded here); `evictor`: the request whose
        decode growth needed the block."""
        bm = self.bm
        cause = Eviction(
            evictor=evictor,
            num_computed_tokens_lost=(
                0 if self.config.preemption_mode == "swap" else victim.num_computed_tokens
            ),
            num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_blocks - bm.num_free_blocks,
        )
        self.running.remove(victim)
        victim.status = Status.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.preemption_mode == "swap":
            slots = self.bm.slots(victim, victim.num_computed_tokens)
            out.kv_ops.append(KvOp("swap_out", victim, slots, cause))
        else:
            victim.num_computed_tokens = 0
            victim.is_recomputing = True
            victim.host_kv = None
            out.kv_ops.append(KvOp("drop", victim, cause=cause))
        self.bm.free(victim)
        # a victim whose chunk was already planned this step cannot happen: victims are
        # taken while reserving decode slots, before any chunk is planned
        bisect.insort(self.preempted, victim, key=_by_rid)

    # -- results -------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Request]:
        """Advance the requests that ran; `sampled` maps rid -> new token for every request
        that produced one. Returns the requests that finished (their blocks are freed)."""
        for r, n in out.prefill_chunks:
            r.num_computed_tokens += n
        for r in out.decode_reqs:
            r.num_computed_tokens += 1
        finished: list[Request] = []
        for r in (*(c[0] for c in out.prefill_chunks), *out.decode_reqs):
            tok = sampled.get(r.rid)
            if tok is None:
                continue
            r.token_ids.append(tok)
            r.is_recomputing = False
            if r.is_finished and r.status is Status.RUNNING:
                r.status = Status.FINISHED
                self.running.remove(r)
                self.bm.free(r)
                finished.append(r)
        return finished
