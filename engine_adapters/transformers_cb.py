"""Record Hugging Face transformers' continuous batching with a `tracekit.Recorder`.

    rec = tracekit.Recorder("raw/cb.npz", config={"engine": "transformers-cb"})
    with rec, instrument_transformers(rec, manager):   # one manager, or None: every
        manager.start()                                  # manager started meanwhile
        ...                                              # (model.generate_batch included)

Leaving the `with` block (also on an exception) puts every original method back; the
adapter leaves the recorder running or stopped as it found it.

What is recorded (module ``transformers.generation.continuous_batching``, read in 5.19):

- **step**: one iteration of ``ContinuousBatchingManager._generation_loop_body`` (on the
  manager's background thread) that has work: a request in the input queue, or an active
  or waiting request in the scheduler. Idle iterations (the loop waits up to 0.1 s for
  work) are not steps. Two rare races are documented in docs/adapters.md: a request that
  lands between the check and the queue drain opens the step after scheduling; pending
  requests that all get cancelled leave an empty step.
- **segments**, exclusive in time within a step:
  ``schedule``: ``ContinuousBatchProcessor.prepare_next_batch`` (queue drain, scheduling,
  cancellations) minus the windows below;
  ``prepare``: building the batch tensors (``inputs_and_outputs.prepare_batch_tensors``);
  ``swap``: ``OffloadingManager.offload_requests`` (evicting, copying KV out) and
  ``restore_scheduled_requests`` when it copies KV back in;
  ``prefill`` / ``decode``: the forward pass, from the start of
  ``ContinuousBatchProcessor._generation_step`` to the start of ``ModelRunner._sample``,
  split by the batch's token mix (see `engine_adapters._common.add_forward`);
  ``sample``: ``ModelRunner._sample`` to the end of ``_generation_step`` (device to host
  copy of the new tokens included);
  ``update``: ``ContinuousBatchProcessor.update_batch`` (token bookkeeping, delivering
  outputs to the caller's queue, forks).
- **emissions**: right after ``_generation_step`` returns, one row per request of the
  batch that gets a token (``FutureRequestState.has_new_token``), all at one time. The
  engine's own per-token timestamps (``record_timestamps=True``) are taken later in the
  same step, in ``update_batch``.
- **evictions**: a request that ``offload_requests`` moved from the active to the waiting
  requests: ``mode="swap"`` when its KV went to the CPU pool (needs pinned memory, so a
  GPU), ``mode="recompute"`` for a soft reset (it is prefilled again with its generated
  tokens as prompt). Its cause (docs/capture.md, "Eviction causes"), read before the call
  changes anything: ``kv_full``, the requests still starved of blocks after it (the
  offload's victims are taken from the starved, newest first, until the rest fit: those
  rest are its evictors), and for a soft reset the victim's ``position_offset`` (its
  computed positions, all thrown away; 0 for a CPU copy); the pool's blocks are not told.
  **Readmission**: when the scheduler next puts it in a batch.
- **TTFT events**: admission (a request's first batch from ``schedule_batch``, at the
  start of that call), prefill chunks (every row that is not a decode row, with its query
  tokens) and why the requests still waiting were left out (see
  ``TransformersCBAdapter._record_admissions``).
- **requests**: ``ContinuousBatchingManager.add_request`` (``add_requests`` calls it):
  arrival at entry, prompt length and max new tokens. The first token is the first
  emission.
- **step attributes**: decode rows (rows with one query token and tokens generated
  already), prefill tokens (the query tokens of every other row), graph size (0, eager,
  unless the model runner uses CUDA graphs for that path: then the padded query size).

Asynchronous batching (``use_async_batching=True``) runs step N's update after step N+1
starts: it is refused with a ValueError at install.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._common import Patches, add_forward, complement

_ENGINE = "transformers.generation.continuous_batching"


def _cb_module() -> Any:
    try:
        from transformers.generation.continuous_batching import continuous_api
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "engine_adapters.transformers_cb needs transformers with continuous batching "
            "(written against 5.19): pip install -e '.[adapters]'"
        ) from e
    return continuous_api


class TransformersCBAdapter:
    """Instruments continuous-batching managers; see the module docstring.

    manager: one `ContinuousBatchingManager`; None patches
        ``ContinuousBatchingManager.start`` so every manager started while installed is
        instrumented (what ``model.generate_batch`` needs: it builds its own manager).
    """

    def __init__(self, rec: Any, manager: Any = None) -> None:
        self.rec = rec
        self.manager = manager
        self._patches = Patches()
        self._installed = False
        self._managers: dict[int, Any] = {}
        self._processors: dict[int, Any] = {}
        self._evicted: set[str] = set()
        # request id -> the recorder's handle, resolved once (at arrival): the per-step
        # calls then pass integers (the recorder's vectorised fast path)
        self._handles: dict[Any, int] = {}
        # the open step (touched only by the loop thread)
        self._step_open = False
        self._in_prepare = False
        self._inner: list[tuple[int, int]] = []
        self._num_decode = 0
        self._num_prefill_tokens = 0
        self._graph_size = 0
        self._sample_t0: int | None = None
        #: evictions recorded, by mode (tests compare them with the engine's own counts)
        self.num_evictions = {"swap": 0, "recompute": 0}
        # TTFT events (docs/ttft.md): requests admitted so far; per schedule_batch call,
        # whether the cache met its safety margin and which requests failed allocation;
        # the wait rows to write once the step is open
        self._admitted: set[str] = set()
        self._margin_ok = True
        self._alloc_failed: set[str] = set()
        self._waits: dict[str, str] = {}
        #: first admissions recorded (tests compare them with the engine's request state)
        self.num_admissions = 0

    # -- install / uninstall ------------------------------------------------------------

    def _handle(self, rid: Any) -> int:
        """The recorder's handle of request `rid` (interned at first sight if its arrival
        was not seen: what the id-based calls would have done)."""
        h = self._handles.get(rid)
        if h is None:
            h = self.rec.handle(rid)
            self._handles[rid] = h
        return h

    def install(self) -> TransformersCBAdapter:
        if self._installed:
            return self
        api = _cb_module()
        try:
            if self.manager is None:
                self._patches.wrap(api.ContinuousBatchingManager, "start", self._wrap_start)
            else:
                self._instrument_manager(self.manager)
        except BaseException:
            self._patches.restore()
            raise
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Put every original method back (safe to call twice)."""
        self._installed = False
        self._patches.restore()
        self._managers.clear()
        self._processors.clear()

    def __enter__(self) -> TransformersCBAdapter:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # -- the manager ---------------------------------------------------------------------
    def _wrap_start(self, start: Callable[..., Any]) -> Callable[..., Any]:
        adapter = self

        def start_instrumented(manager: Any, *args: Any, **kwargs: Any) -> Any:
            adapter._instrument_manager(manager)
            return start(manager, *args, **kwargs)

        return start_instrumented

    def _instrument_manager(self, manager: Any) -> None:
        if id(manager) in self._managers:
            return
        cfg = getattr(manager, "continuous_batching_config", None)
        if getattr(cfg, "use_async_batching", False):
            raise ValueError(
                "tracekit's transformers adapter records synchronous batching only: with "
                "use_async_batching=True step N's update runs after step N+1 starts. Pass "
                "ContinuousBatchingConfig(use_async_batching=False)."
            )
        self._managers[id(manager)] = manager
        p = self._patches
        p.wrap(manager, "add_request", self._wrap_add_request(manager))
        p.wrap(manager, "_generation_loop_body", self._wrap_loop_body(manager))
        p.wrap(manager, "_create_batch_processor", self._wrap_create_processor)
        if getattr(manager, "batch_processor", None) is not None:  # warmed up already
            self._instrument_processor(manager.batch_processor)

    def _wrap_add_request(self, manager: Any) -> Callable[..., Callable[..., Any]]:
        rec = self.rec

        def make(add_request: Callable[..., Any]) -> Callable[..., Any]:
            def add_request_instrumented(*args: Any, **kwargs: Any) -> Any:
                t_arrival = rec.now()
                rid = add_request(*args, **kwargs)
                if rid is not None:
                    input_ids = args[0] if args else kwargs.get("input_ids", ())
                    max_new = args[2] if len(args) > 2 else kwargs.get("max_new_tokens")
                    if max_new is None:
                        max_new = getattr(manager.generation_config, "max_new_tokens", None)
                    self._handles[rid] = rec.request(
                        rid,
                        prompt_tokens=len(input_ids),
                        max_new_tokens=-1 if max_new is None else int(max_new),
                        arrival_tick=t_arrival,
                    )
                return rid

            return add_request_instrumented

        return make

    def _wrap_create_processor(self, create: Callable[[], Any]) -> Callable[[], Any]:
        def create_instrumented() -> Any:
            bp = create()
            self._instrument_processor(bp)
            return bp

        return create_instrumented

    def _wrap_loop_body(self, manager: Any) -> Callable[..., Callable[..., Any]]:
        rec = self.rec
        step_cm = rec.step()

        def make(body: Callable[..., Any]) -> Callable[..., Any]:
            def loop_body_instrumented(batch_processor: Any, bootstrapping: bool) -> Any:
                has_work = (
                    not manager.input_queue.empty()
                    or batch_processor.scheduler.has_pending_requests()
                )
                if not has_work:  # an idle iteration: not a step
                    return body(batch_processor, bootstrapping)
                self._open_step(step_cm)
                try:
                    return body(batch_processor, bootstrapping)
                finally:
                    self._close_step(step_cm)

            return loop_body_instrumented

        return make

    def _open_step(self, step_cm: Any) -> None:
        step_cm.__enter__()
        self._step_open = True

    def _close_step(self, step_cm: Any) -> None:
        if not self._step_open:
            return
        self._step_open = False
        self.rec.step_info(
            num_decode=self._num_decode,
            num_prefill_tokens=self._num_prefill_tokens,
            graph_size=self._graph_size if self._num_decode else -1,
        )
        step_cm.__exit__(None, None, None)

    # -- the batch processor -------------------------------------------------------------
    def _instrument_processor(self, bp: Any) -> None:
        if id(bp) in self._processors:
            return
        self._processors[id(bp)] = bp
        p = self._patches
        p.wrap(bp, "prepare_next_batch", self._wrap_prepare(bp))
        p.wrap(bp.scheduler, "schedule_batch", self._wrap_schedule_batch)
        p.wrap(bp.scheduler, "_try_to_meet_safety_margin", self._wrap_margin)
        p.wrap(bp.scheduler.cache, "can_store_request_tokens", self._wrap_can_store)
        p.wrap(bp.offloading_manager, "offload_requests", self._wrap_offload(bp))
        p.wrap(bp.offloading_manager, "restore_scheduled_requests", self._wrap_restore)
        p.wrap(bp.inputs_and_outputs, "prepare_batch_tensors", self._wrap_inner("prepare"))
        p.wrap(bp.model_runner, "_sample", self._wrap_sample)
        p.wrap(bp.model_runner, "maybe_pad_inputs", self._wrap_pad(bp))
        p.wrap(bp, "_generation_step", self._wrap_generation_step(bp))
        p.wrap(bp, "update_batch", self._wrap_update(bp))
        if hasattr(bp.scheduler, "clear_cancelled_requests"):
            p.wrap(bp.scheduler, "clear_cancelled_requests", self._wrap_cancelled)

    def _wrap_prepare(self, bp: Any) -> Callable[..., Callable[..., Any]]:
        rec = self.rec
        step_cm = rec.step()

        def make(prepare: Callable[[], bool]) -> Callable[[], bool]:
            def prepare_instrumented() -> bool:
                self._num_decode = self._num_prefill_tokens = self._graph_size = 0
                self._in_prepare = True
                self._inner = []
                t0 = rec.now()
                try:
                    has_batch = prepare()
                finally:
                    t1 = rec.now()
                    self._in_prepare = False
                if has_batch and not self._step_open:
                    # a request arrived between the loop's work check and the queue drain
                    self._open_step(step_cm)
                if not self._step_open:
                    return has_batch  # an idle iteration polling for work: not recorded
                for a, b in complement(t0, t1, self._inner):
                    rec.add_segment("schedule", a, b)
                if has_batch:
                    self._describe_batch(bp)
                return has_batch

            return prepare_instrumented

        return make

    def _describe_batch(self, bp: Any) -> None:
        """Decode rows, prefill tokens and graph size of the batch just prepared."""
        num_decode = num_prefill = 0
        rec = self.rec
        chunks, sizes = [], []
        for fs in bp.inputs_and_outputs.requests_in_batch:
            if fs.query_length == 1 and fs.state.generated_tokens:
                num_decode += 1
            else:
                num_prefill += fs.query_length
                chunks.append(self._handle(fs.state.request_id))  # a prompt chunk
                sizes.append(fs.query_length)
        if chunks:
            rec.prefill_handles(chunks, sizes)
        self._num_decode, self._num_prefill_tokens = num_decode, num_prefill
        by_reason: dict[str, list[str]] = {}
        for rid, reason in self._waits.items():
            by_reason.setdefault(reason, []).append(rid)
        for reason, rids in by_reason.items():
            rec.wait_handles([self._handle(r) for r in rids], reason)
        self._waits = {}

    def _wrap_pad(self, bp: Any) -> Callable[..., Callable[..., Any]]:
        runner = bp.model_runner

        def make(pad: Callable[..., Any]) -> Callable[..., Any]:
            def pad_instrumented(
                num_q_tokens: int, max_kv_read: int, use_decode_fast_path: bool
            ) -> Any:
                out = pad(num_q_tokens, max_kv_read, use_decode_fast_path)
                if use_decode_fast_path:
                    graphed = getattr(runner, "use_cuda_graph_decode", False)
                else:
                    graphed = getattr(runner, "use_cuda_graph_varlen", False)
                # a graph replays at the padded query size; without graphs the step is eager
                self._graph_size = int(out[0]) if graphed else 0
                return out

            return pad_instrumented

        return make

    def _wrap_inner(self, label: str) -> Callable[..., Callable[..., Any]]:
        rec = self.rec

        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def inner_instrumented(*args: Any, **kwargs: Any) -> Any:
                if not self._step_open:  # e.g. the warmup of CUDA graphs: not serving
                    return fn(*args, **kwargs)
                t0 = rec.now()
                try:
                    return fn(*args, **kwargs)
                finally:
                    t1 = rec.now()
                    rec.add_segment(label, t0, t1)
                    if self._in_prepare:
                        self._inner.append((t0, t1))

            return inner_instrumented

        return make

    def _wrap_schedule_batch(self, schedule_batch: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        def schedule_batch_instrumented(*args: Any, **kwargs: Any) -> Any:
            t0 = rec.now()
            self._margin_ok, self._alloc_failed = True, set()
            out = schedule_batch(*args, **kwargs)
            self._record_admissions(schedule_batch.__self__, out, t0, args, kwargs)
            batch = out[0]
            if batch and self._evicted:
                for fs in batch:
                    rid = fs.state.request_id
                    if rid in self._evicted:
                        self._evicted.discard(rid)
                        rec.readmit(rid)
            return out

        return schedule_batch_instrumented

    def _record_admissions(self, scheduler: Any, out: Any, t0: int, args: Any, kw: Any) -> None:
        """First admissions of one ``schedule_batch`` call (stamped at its start, where the
        engine stamps ``RequestState.lifespan[0]`` when the request leaves PENDING), and why
        it left the still-waiting requests out, from that call's own state: the cache under
        its safety margin, new requests blocked after an offload, or a failed allocation ->
        ``kv_blocks``; ``max_requests_per_batch`` reached -> ``max_num_seqs``; the token
        budget spent -> ``token_budget``; else ``other``. Wait rows are written when the
        step's batch is described (`_describe_batch`): the engine may call this twice in
        one step (after an offload)."""
        batch, _, num_q_tokens, _ = out
        for fs in batch or ():
            rid = fs.state.request_id
            if rid not in self._admitted and rid not in self._evicted:
                self._admitted.add(rid)
                self.rec.admit_handle(self._handle(rid), at_tick=t0)
                self.num_admissions += 1
        token_budget = args[0] if args else kw.get("token_budget", 0)
        if scheduler.block_new_requests or not self._margin_ok:
            reason = "kv_blocks"
        elif len(batch or ()) >= scheduler.max_requests_per_batch:
            reason = "max_num_seqs"
        elif num_q_tokens >= token_budget:
            reason = "token_budget"
        elif batch is None or self._alloc_failed:
            reason = "kv_blocks"
        else:
            reason = "other"
        self._waits = {
            rid: "kv_blocks" if rid in self._alloc_failed else reason
            for rid in scheduler.waiting_requests
            if rid not in self._admitted
        }

    def _wrap_margin(self, margin: Callable[[], bool]) -> Callable[[], bool]:
        def margin_instrumented() -> bool:
            ok = margin()
            self._margin_ok = ok
            return ok

        return margin_instrumented

    def _wrap_can_store(self, can_store: Callable[..., bool]) -> Callable[..., bool]:
        def can_store_instrumented(state: Any, *args: Any, **kwargs: Any) -> bool:
            fits = can_store(state, *args, **kwargs)
            if not fits:
                self._alloc_failed.add(state.request_id)
            return fits

        return can_store_instrumented

    def _wrap_offload(self, bp: Any) -> Callable[..., Callable[..., Any]]:
        rec = self.rec
        scheduler = bp.scheduler

        def make(offload: Callable[[], bool]) -> Callable[[], bool]:
            def offload_instrumented() -> bool:
                active_before = list(scheduler.active_requests)
                # the decision's inputs, before it changes them: each active request's
                # computed positions and the requests starved of blocks (whose needs the
                # offload makes room for: its victims are taken from them, newest first)
                computed = {rid: getattr(st, "position_offset", None)
                            for rid, st in scheduler.active_requests.items()}  # fmt: skip
                starved = [st.request_id for st, _ in getattr(scheduler, "starved_requests", [])]
                t0 = rec.now()
                try:
                    return offload()
                finally:
                    t1 = rec.now()
                    rec.add_segment("swap", t0, t1)
                    if self._in_prepare:
                        self._inner.append((t0, t1))
                    active, waiting = scheduler.active_requests, scheduler.waiting_requests
                    victims = {r for r in active_before if r not in active and r in waiting}
                    needers = list(dict.fromkeys(r for r in starved if r not in victims))
                    for rid in active_before:
                        if rid in victims:
                            mode = "swap" if waiting[rid].is_cpu_offloaded else "recompute"
                            lost = 0 if mode == "swap" else computed.get(rid)
                            rec.evict(rid, mode=mode, reason="kv_full", by=needers,
                                      num_computed_tokens_lost=lost)  # fmt: skip
                            self.num_evictions[mode] += 1
                            self._evicted.add(rid)

            return offload_instrumented

        return make

    def _wrap_restore(self, restore: Callable[..., Any]) -> Callable[..., Any]:
        timed = self._wrap_inner("swap")(restore)

        def restore_instrumented(requests_in_batch: Any, *args: Any, **kwargs: Any) -> Any:
            if any(fs.state.is_cpu_offloaded for fs in requests_in_batch):
                return timed(requests_in_batch, *args, **kwargs)
            return restore(requests_in_batch, *args, **kwargs)  # nothing to copy back

        return restore_instrumented

    def _wrap_sample(self, sample: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        def sample_instrumented(*args: Any, **kwargs: Any) -> Any:
            if self._sample_t0 is None:
                self._sample_t0 = rec.now()
            return sample(*args, **kwargs)

        return sample_instrumented

    def _wrap_generation_step(self, bp: Any) -> Callable[..., Callable[..., Any]]:
        rec = self.rec

        def make(generation_step: Callable[..., Any]) -> Callable[..., Any]:
            def generation_step_instrumented(*args: Any, **kwargs: Any) -> Any:
                if not self._step_open:
                    return generation_step(*args, **kwargs)
                self._sample_t0 = None
                t0 = rec.now()
                out = generation_step(*args, **kwargs)
                t1 = rec.now()
                # the engine-emission boundary: forward and sampling have returned
                rec.emit_handles(
                    [
                        self._handle(fs.state.request_id)
                        for fs in bp.inputs_and_outputs.requests_in_batch
                        if fs.has_new_token
                    ]
                )
                ts = self._sample_t0 if self._sample_t0 is not None else t1
                add_forward(rec, t0, ts, self._num_prefill_tokens, self._num_decode)
                if ts < t1:
                    rec.add_segment("sample", ts, t1)
                return out

            return generation_step_instrumented

        return make

    def _wrap_update(self, bp: Any) -> Callable[..., Callable[..., Any]]:
        timed = self._wrap_inner("update")

        def make(update: Callable[..., Any]) -> Callable[..., Any]:
            inner = timed(update)

            def update_instrumented(*args: Any, **kwargs: Any) -> Any:
                batch = (
                    [fs.state.request_id for fs in bp.inputs_and_outputs.requests_in_batch]
                    if self._step_open
                    else []
                )
                out = inner(*args, **kwargs)
                # finished: `update_batch` took them out of the scheduler (a request it
                # offloads stays among the waiting, under the same id)
                sched = bp.scheduler
                active, waiting = sched.active_requests, sched.waiting_requests
                self._finish([r for r in batch if r not in active and r not in waiting])
                return out

            return update_instrumented

        return make

    def _wrap_cancelled(self, clear: Callable[[], Any]) -> Callable[[], Any]:
        def clear_instrumented() -> Any:
            states = clear()
            self._finish([st.request_id for st in states or ()])  # cancelled: finished too
            return states

        return clear_instrumented

    def _finish(self, rids: list[Any]) -> None:
        """Requests the engine is done with: the recorder and this adapter forget their
        ids (flat memory over a long run); ids never recorded are skipped."""
        for rid in rids:
            h = self._handles.pop(rid, None)
            self._admitted.discard(rid)
            self._evicted.discard(rid)
            self._alloc_failed.discard(rid)
            self._waits.pop(rid, None)
            if h is not None:
                self.rec.finish_handle(h)


def instrument_transformers(rec: Any, manager: Any = None) -> TransformersCBAdapter:
    """Install the adapter and return it; use it as a context manager to uninstall."""
    return TransformersCBAdapter(rec, manager).install()


__all__ = ["TransformersCBAdapter", "instrument_transformers"]
