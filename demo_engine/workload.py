"""The arrival trace: who arrives when, with what prompt text, wanting how many tokens.

Arrivals with a sinusoidal swell, stratified so every seed gives the same count, on the
workload's clock (seconds, or engine steps: `WorkloadConfig.clock`); prompts of about 1,000
characters, and a fixed share of pasted documents (spread evenly) of 150k-400k characters
that are truncated to the model length only after tokenising (so their tokenizer cost is
real).
Everything is deterministic in the seed: the same seed and rate give the same trace.

The text is drawn from a synthetic lexicon (pseudo-words with Zipf frequencies) that the
tokenizer is also trained on; documents mix in identifiers and numbers, the way pasted
logs and code do, which is what makes them slow to tokenise.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .config import WorkloadConfig

_SYLLABLES = (
    "ka ri to me na lo su vi de ra po li mu ne ta sa ko ru zi fe ga hi jo be "
    "wa yu ce do pe qu xa bi lu mo ni te va so ge ho fi za ju ke ly ot an er "
    "in us el ar om ix str pra tho gle ment tion able ing est ful ness"
).split()
_PUNCT = (",", ".", ",", ".", "?", ";", ":", "!")
NUM_LEXICON_WORDS = 20_000


@lru_cache(maxsize=4)
def lexicon(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(words, cumulative Zipf weights): deterministic pseudo-words, frequent ones short."""
    rng = np.random.default_rng(seed)
    words: list[str] = []
    seen: set[str] = set()
    syl = np.array(_SYLLABLES)
    while len(words) < NUM_LEXICON_WORDS:
        n = 1 + min(int(rng.geometric(0.45)), 5) + (len(words) > 2000)
        w = "".join(syl[rng.integers(0, len(syl), n)])
        if w not in seen:
            seen.add(w)
            words.append(w)
    weights = 1.0 / (np.arange(len(words)) + 2.7)
    cum = np.cumsum(weights)
    return np.array(words, dtype=object), cum / cum[-1]


def make_text(rng: np.random.Generator, num_chars: int, lexicon_seed: int, *, is_doc: bool) -> str:
    """About `num_chars` characters of prose (and, in documents, identifiers and numbers)."""
    words, cum = lexicon(lexicon_seed)
    n_words = max(1, int(num_chars / 6.3))
    picked = words[np.searchsorted(cum, rng.random(n_words))]
    if is_doc:  # one token in five is an identifier or a number: slow, uncacheable BPE work
        k = n_words // 5
        where = rng.integers(0, n_words, k)
        vals = rng.integers(0, 2**40, k)
        idents = np.array([f"{v:x}" if v & 1 else str(v % 100_000) for v in vals.tolist()])
        picked[where] = idents
    punct = rng.random(n_words) < 0.08
    if punct.any():
        marks = np.array(_PUNCT, dtype=object)[rng.integers(0, len(_PUNCT), int(punct.sum()))]
        picked[punct] = picked[punct] + marks
    text = " ".join(picked.tolist())
    return text[:num_chars] if len(text) > num_chars else text


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One arrival. `arrival` is when, from the start of serving, on the workload's clock:
    seconds of engine clock, or engine steps (`WorkloadConfig.clock`)."""

    index: int
    arrival: float
    text: str
    max_new_tokens: int
    is_doc: bool


def rate_at(t: float, cfg: WorkloadConfig) -> float:
    """The instantaneous arrival rate at `t` (requests per unit of the workload's clock):
    a share `1 - burst_frac` of the mean rate on the swell, and `burst_frac` of it
    concentrated into the first `burst_width` of every `burst_period` from `burst_start`
    on (so over a whole number of periods the mean rate is `cfg.rate`)."""
    swell = 1.0 + cfg.swell_frac * math.sin(2 * math.pi * t / cfg.swell_period)
    since = t - cfg.burst_start
    is_burst = since >= 0 and (since % cfg.burst_period) < cfg.burst_width
    burst = cfg.burst_period / cfg.burst_width if is_burst else 0.0
    return cfg.rate * ((1.0 - cfg.burst_frac) * swell + cfg.burst_frac * burst)


def cumulative_arrivals(t: np.ndarray, cfg: WorkloadConfig) -> np.ndarray:
    """Expected arrivals in [0, t]: the integral of `rate_at`."""
    w = 2 * math.pi / cfg.swell_period
    swell = t + cfg.swell_frac * (1.0 - np.cos(w * t)) / w
    period, width = cfg.burst_period, cfg.burst_width
    since = np.maximum(np.asarray(t, dtype=np.float64) - cfg.burst_start, 0.0)
    in_burst = np.floor(since / period) * width + np.minimum(np.mod(since, period), width)
    return cfg.rate * ((1.0 - cfg.burst_frac) * swell + cfg.burst_frac * in_burst * period / width)


def make_trace(seed: int, span: float, cfg: WorkloadConfig) -> list[TraceRequest]:
    """Arrivals in [0, span) on the workload's clock, deterministic in (seed, cfg).

    Stratified, so that every seed puts the same pressure on the engine and only the
    details differ: the i-th arrival falls at a uniformly random point of the i-th unit of
    expected arrivals (`cumulative_arrivals`), so the count over any stretch is what the
    rate says, give or take one, while the times stay irregular and follow the swell;
    output lengths are the exponential's quantiles at stratified random levels, in a
    random order; documents come one every 1/doc_frac requests from a seeded phase."""
    rng = np.random.default_rng([seed, 0x7EACE])
    grid = np.linspace(0.0, span, 20_001)
    expected = cumulative_arrivals(grid, cfg)
    levels = np.arange(int(math.floor(expected[-1])) + 1) + rng.random(int(expected[-1]) + 1)
    times = np.interp(levels[levels < expected[-1]], expected, grid)
    n = len(times)
    q = (rng.permutation(n) + rng.random(n)) / max(n, 1)  # stratified quantiles, shuffled
    outs = cfg.output_tokens_min + np.floor(-cfg.output_tokens_exp_mean * np.log1p(-q))
    outs = np.minimum(outs, cfg.output_tokens_max).astype(np.int64)
    phase = float(rng.random()) / max(cfg.doc_frac, 1e-9)
    out: list[TraceRequest] = []
    for i, (t, n_out) in enumerate(zip(times.tolist(), outs.tolist(), strict=True)):
        k = i + phase
        is_doc = math.floor(k * cfg.doc_frac) > math.floor((k - 1) * cfg.doc_frac)
        if is_doc:
            n_chars = int(rng.integers(cfg.doc_chars_min, cfg.doc_chars_max + 1))
        else:  # gamma(4) around the mean: ~1k characters, rarely below 200
            n_chars = max(40, int(rng.gamma(4.0, cfg.prompt_chars_mean / 4.0)))
        text = make_text(rng, n_chars, cfg.lexicon_seed, is_doc=is_doc)
        out.append(TraceRequest(i, float(t), text, int(n_out), is_doc))
    return out


def mean_output_tokens(cfg: WorkloadConfig) -> float:
    """E[min(min + Exp(mean), max)]: the expected output length of one request."""
    span = cfg.output_tokens_max - cfg.output_tokens_min
    return cfg.output_tokens_min + cfg.output_tokens_exp_mean * (
        1.0 - math.exp(-span / cfg.output_tokens_exp_mean)
    )


def step_capacity_req(max_num_seqs: int, cfg: WorkloadConfig) -> float:
    """Requests per engine step the engine retires with its batch full: `max_num_seqs`
    requests decode one token each per step, and an average request needs
    `mean_output_tokens` decode steps (its prefill is one or a few steps more). The demo's
    KV pool holds fewer requests than the batch limit once their contexts grow, so it runs
    dry below this: the demo's default load, 0.5 of it with bursts (`STEP_WORKLOAD`,
    `demo_engine.cli.DEFAULT_LOAD`), fills the pool during a burst only; 1.8 keeps it
    full (the overload sidebar)."""
    return max_num_seqs / mean_output_tokens(cfg)


#: The step-paced workload of `tracekit demo` (the reference post's main regime, scaled to
#: runs of ~700 steps): a flat base rate carrying a tenth of the arrivals, and the rest in
#: bursts of 30 steps every 360 steps from step 20 (two bursts in a 700-step run). The
#: engine is below its capacity on average; a burst fills the KV pool for a while
#: (preemptions, batches past the largest captured size) and the queue drains before the
#: next one. Outputs are shorter than the post's (~102 tokens on average, at most 300,
#: against ~300), so that a request's life is a small part of a run: the queue drains
#: between two bursts and most requests finish within the run. `--load` scales the mean
#: rate of the same shape (1.8: the post's overload sidebar, where the queue only grows).
STEP_WORKLOAD: dict[str, float] = {
    "swell_frac": 0.0,
    "burst_frac": 0.9,
    "burst_period_steps": 360.0,
    "burst_width_steps": 30.0,
    "burst_start_steps": 20.0,
    "output_tokens_exp_mean": 90.0,
    "output_tokens_max": 300,
}


def step_workload(load: float, max_num_seqs: int) -> WorkloadConfig:
    """`STEP_WORKLOAD` paced in engine steps at `load` times the engine's batch capacity
    (`step_capacity_req`)."""
    shape = WorkloadConfig(clock="steps", **STEP_WORKLOAD)  # type: ignore[arg-type]
    return dataclasses.replace(shape, rate_req_step=load * step_capacity_req(max_num_seqs, shape))


def training_corpus(cfg: WorkloadConfig, num_lines: int = 2000) -> list[str]:
    """The tokenizer's training text: the same lexicon, prose and document-like lines."""
    rng = np.random.default_rng([cfg.lexicon_seed, 1])
    return [make_text(rng, 1000, cfg.lexicon_seed, is_doc=(i % 10 == 0)) for i in range(num_lines)]
