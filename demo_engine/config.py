"""Engine and workload settings, and the fix ladder: each rung keeps every fix above it.

Both configs are slotted dataclasses that check themselves on construction, so a bad
value fails where it is set, not three modules later. Counts start with `num_`, flags
with `is_`, and every quantity with a unit carries it in its name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

#: The captured ("CUDA graph", emulated) decode batch sizes of the baseline.
BASE_GRAPH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32)
#: Capture sizes up to max_num_seqs (48), the `+graphs to 48` rung.
FULL_GRAPH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 40, 48)

PREEMPTION_MODES = ("swap", "recompute")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    # model
    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    vocab_size: int = 8192  # BPE target; the model uses the trained tokenizer's real size
    model_seed: int = 0  # random weights; fixed so every run has the same model
    # KV pool and scheduling
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 580  # sized to the demo's short requests (see workload.py)
    max_num_seqs: int = 48  # running requests (decoding or prefilling) at most
    max_num_batched_tokens: int = 2048  # per-step token budget: decode rows + prefill chunks
    max_prompt_tokens: int = 2048  # prompts are truncated to this after tokenising
    max_new_tokens: int = 1000  # cap on any request's output
    captured_graph_sizes: tuple[int, ...] = BASE_GRAPH_SIZES
    preemption_mode: str = "swap"  # "swap" (KV copied to host and back) or "recompute"
    admit_free_frac: float = 0.0  # admit only if this fraction of KV blocks stays free
    # runtime
    is_gc_freeze: bool = False  # gc.collect(); gc.freeze() after startup
    is_compact_history: bool = False  # per-token history in a flat array('d'), not objects
    is_tokenize_off_loop: bool = False  # tokenize in a worker process, not on the loop
    num_startup_objects: int = 400_000  # long-lived GC-tracked objects built at startup
    num_topk_logprobs: int = 5  # top-k logprobs kept per token in the history
    idle_sleep_s: float = 0.001  # the loop's nap when it has nothing to do
    is_async_scheduling: bool = False  # schedule step N+1 while the device runs step N

    def __post_init__(self) -> None:
        positive = (
            "num_layers", "d_model", "num_heads", "vocab_size", "block_size", "num_kv_blocks",
            "max_num_seqs", "max_num_batched_tokens", "max_prompt_tokens", "max_new_tokens",
            "num_topk_logprobs",
        )  # fmt: skip
        for name in positive:
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"EngineConfig.d_model ({self.d_model}) must be a multiple of "
                f"num_heads ({self.num_heads})"
            )
        sizes = self.captured_graph_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(
                f"EngineConfig.captured_graph_sizes must be increasing positive sizes, got {sizes}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"EngineConfig.preemption_mode must be one of {PREEMPTION_MODES}, "
                f"got {self.preemption_mode!r}"
            )
        if not 0.0 <= self.admit_free_frac < 1.0:
            raise ValueError(
                f"EngineConfig.admit_free_frac must be in [0, 1), got {self.admit_free_frac}"
            )
        if self.num_startup_objects < 0 or self.idle_sleep_s < 0:
            raise ValueError("EngineConfig.num_startup_objects and idle_sleep_s must be >= 0")
        # one request alone must always fit, or the scheduler could deadlock
        longest = self.max_prompt_tokens + self.max_new_tokens
        if -(-longest // self.block_size) > self.num_kv_blocks:
            raise ValueError(
                f"EngineConfig: a {longest}-token request needs more than num_kv_blocks "
                f"({self.num_kv_blocks}) blocks of {self.block_size}"
            )

    @property
    def num_admit_free_blocks(self) -> int:
        """Blocks that must stay free after admitting a request (the watermark)."""
        return int(round(self.admit_free_frac * self.num_kv_blocks))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


#: The workload's clocks: arrivals in seconds of engine clock, or in engine steps.
CLOCKS = ("seconds", "steps")


@dataclass(slots=True, frozen=True)
class WorkloadConfig:
    """The arrival trace: non-homogeneous Poisson arrivals with a sinusoidal swell.

    `clock` says what arrival times count. `"seconds"`: engine-clock seconds, at
    `rate_req_s`; the pressure then depends on how fast this machine runs the engine.
    `"steps"`: engine steps, at `rate_req_step`; a request arriving at step k is admitted
    at the start of step k whatever a step costs, so the scheduler sees the same sequence
    of arrivals, KV occupancy, batch sizes and preemptions on a slow, fast or contended
    machine (`demo_engine.workload.step_capacity_req` sets the rate from the engine's
    batch limit)."""

    clock: str = "seconds"
    rate_req_s: float = 6.5  # mean arrival rate per second (clock "seconds")
    rate_req_step: float = 0.17  # mean arrival rate per engine step (clock "steps")
    swell_period_s: float = 15.0
    swell_period_steps: float = 500.0
    swell_frac: float = 0.6  # rate(t) = rate * (1 + swell_frac * sin(2 pi t / period))
    # bursts: this share of all arrivals comes in a window of `burst_width` at the start of
    # every `burst_period` (in units of `clock`); the rest follows the swell
    burst_frac: float = 0.0
    burst_period_steps: float = 400.0
    burst_width_steps: float = 40.0
    burst_period_s: float = 20.0
    burst_width_s: float = 2.0
    burst_start_steps: float = 0.0  # when the first burst begins
    burst_start_s: float = 0.0
    prompt_chars_mean: float = 1000.0
    doc_frac: float = 0.02  # share of requests that paste a document (one in 50)
    doc_chars_min: int = 150_000
    doc_chars_max: int = 400_000
    output_tokens_min: int = 16  # outputs ~ min + Exponential(mean), capped
    output_tokens_exp_mean: float = 280.0
    output_tokens_max: int = 1000
    lexicon_seed: int = 12345  # the words every trace and the tokenizer's corpus draw from

    @property
    def rate(self) -> float:
        """Mean arrivals per unit of `clock`."""
        return self.rate_req_step if self.clock == "steps" else self.rate_req_s

    @property
    def burst_period(self) -> float:
        """The bursts' period in units of `clock`."""
        return self.burst_period_steps if self.clock == "steps" else self.burst_period_s

    @property
    def burst_width(self) -> float:
        """How long each burst lasts, in units of `clock`."""
        return self.burst_width_steps if self.clock == "steps" else self.burst_width_s

    @property
    def burst_start(self) -> float:
        """When the first burst begins, in units of `clock`."""
        return self.burst_start_steps if self.clock == "steps" else self.burst_start_s

    @property
    def swell_period(self) -> float:
        """The swell's period in units of `clock`."""
        return self.swell_period_steps if self.clock == "steps" else self.swell_period_s

    def __post_init__(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"WorkloadConfig.clock must be one of {CLOCKS}, got {self.clock!r}")
        for name in ("rate_req_s", "rate_req_step", "swell_period_s", "swell_period_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkloadConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.swell_frac < 1:
            raise ValueError("WorkloadConfig: swell_frac must be in [0, 1)")
        if not 0 <= self.burst_frac <= 1:
            raise ValueError(f"WorkloadConfig.burst_frac must be in [0, 1], got {self.burst_frac}")
        for unit in ("steps", "s"):
            period = getattr(self, f"burst_period_{unit}")
            width = getattr(self, f"burst_width_{unit}")
            if getattr(self, f"burst_start_{unit}") < 0:
                raise ValueError(f"WorkloadConfig.burst_start_{unit} must be >= 0")
            if not 0 < width <= period:
                raise ValueError(
                    f"WorkloadConfig: 0 < burst_width_{unit} <= burst_period_{unit}, "
                    f"got {width} and {period}"
                )
        if not 0 <= self.doc_frac <= 1 or not 0 < self.doc_chars_min <= self.doc_chars_max:
            raise ValueError("WorkloadConfig: doc_frac in [0, 1], 0 < doc_chars_min <= max")
        if not 0 < self.output_tokens_min <= self.output_tokens_max:
            raise ValueError("WorkloadConfig: 0 < output_tokens_min <= output_tokens_max")
        if self.prompt_chars_mean <= 0 or self.output_tokens_exp_mean <= 0:
            raise ValueError("WorkloadConfig: prompt_chars_mean and output_tokens_exp_mean > 0")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(slots=True, frozen=True)
class Rung:
    name: str
    changes: dict[str, Any] = field(default_factory=dict)
    #: the cause (a partition label, or a cause family of docs/whatif.md) this rung's fix
    #: removes; written into each run's config as `fixes`, where `tracekit compare` checks
    #: the what-if prediction of removing it against the rung's measured runs
    fixes: str | None = None


#: The fix ladder, in order. Each rung keeps every fix above it (see `rung_config`).
RUNGS: tuple[Rung, ...] = (
    Rung("baseline"),
    Rung("+gc.freeze", {"is_gc_freeze": True}, fixes="gc"),
    Rung("+compact history", {"is_compact_history": True}, fixes="gc"),
    Rung("+graphs to 48", {"captured_graph_sizes": FULL_GRAPH_SIZES}, fixes="graph"),
    Rung("+budget 256", {"max_num_batched_tokens": 256}, fixes="prefill"),
    Rung("+tokenize off-loop", {"is_tokenize_off_loop": True}, fixes="tok"),
    Rung("+admit watermark", {"admit_free_frac": 0.10}, fixes="preempt"),
)
RUNG_NAMES: tuple[str, ...] = tuple(r.name for r in RUNGS)
#: Rung name -> the cause its fix removes (None for the baseline).
RUNG_FIXES: dict[str, str | None] = {r.name: r.fixes for r in RUNGS}


def rung_slug(name: str) -> str:
    """A file-name-safe form: `+gc.freeze` -> `gc-freeze`, `+budget 256` -> `budget-256`."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def find_rung(name: str) -> str:
    """The rung's canonical name, from its name or its slug."""
    for r in RUNG_NAMES:
        if name in (r, rung_slug(r)):
            return r
    raise ValueError(f"unknown rung {name!r}; rungs: {', '.join(RUNG_NAMES)}")


def rung_config(name: str, base: EngineConfig | None = None) -> EngineConfig:
    """The engine config of rung `name`: `base` with this rung's fix and every one above it."""
    name = find_rung(name)
    cfg = base or EngineConfig()
    for r in RUNGS:
        cfg = cfg.replace(**r.changes)
        if r.name == name:
            return cfg
    raise AssertionError("unreachable")
