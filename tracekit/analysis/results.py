"""Typed results of a merged server run's client boundary and of speculative decoding, as
`RunAnalysis` carries them (`tracekit.analysis.figures`).

The attribution stage computes the figures (`tracekit.attribution.client.client_summary`,
`itl_conventions`, `spec_acceptance`); here they become objects with named, unit-suffixed
fields that renderers read by attribute. Each type's `to_record` writes the JSON object
`analyze --format jsonl`, `export`, `compare` and `report` have always written for it: the
same keys in the same order (the record's keys are the attribution stage's names, kept
for the files already written). Non-finite numbers stay NaN here; `RunAnalysis.to_dict`
makes them null.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.attribution.client import ClientPartition, client_summary, spec_acceptance
from tracekit.attribution.client_ttft import ClientTtft, client_ttft_figures
from tracekit.log.rawlog import RawLog


@dataclass(frozen=True, slots=True)
class ItlStats:
    """One ITL convention's distribution (ms): numpy's linear percentiles and the mean."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    num_values: int  # gaps (per token: tokens, each chunk gap counted once per token)

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> ItlStats:
        """From `tracekit.attribution.client`'s ``{"p50", "p90", "p99", "mean", "n"}``."""
        return cls(p50_ms=d["p50"], p90_ms=d["p90"], p99_ms=d["p99"], mean_ms=d["mean"],
                   num_values=d["n"])  # fmt: skip

    def to_record(self) -> dict[str, Any]:
        return {"p50": self.p50_ms, "p90": self.p90_ms, "p99": self.p99_ms,
                "mean": self.mean_ms, "n": self.num_values}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ItlConventions:
    """ITL three ways (`tracekit.attribution.client.itl_conventions`): per chunk the client
    received, per token (a chunk's gap over its tokens), per engine step (the engine
    boundary's gaps)."""

    per_chunk: ItlStats
    per_token: ItlStats
    per_engine_step: ItlStats
    tokens_per_chunk_mean: float

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> ItlConventions:
        return cls(
            per_chunk=ItlStats.of(d["per_chunk"]),
            per_token=ItlStats.of(d["per_token"]),
            per_engine_step=ItlStats.of(d["per_engine_step"]),
            tokens_per_chunk_mean=d["tokens_per_chunk_mean"],
        )

    def named(self) -> tuple[tuple[str, ItlStats], ...]:
        """The three conventions in order, each with its record key."""
        return (
            ("per_chunk", self.per_chunk),
            ("per_token", self.per_token),
            ("per_engine_step", self.per_engine_step),
        )

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: stats.to_record() for key, stats in self.named()}
        out["tokens_per_chunk_mean"] = self.tokens_per_chunk_mean
        return out


@dataclass(frozen=True, slots=True)
class SpecAcceptance:
    """Speculative decoding over a run (`tracekit.attribution.client.spec_acceptance`):
    draft tokens proposed and accepted, drafts checked, and per draft position the drafts
    whose token there was accepted. A log recorded before drafts were counted has NaN
    `num_drafts` and no per-position figures."""

    num_drafted_tokens: float
    num_accepted_tokens: float
    num_drafts: float  # NaN: not recorded
    acceptance: float  # accepted / drafted draft tokens (NaN: none drafted)
    mean_accepted_length_tokens: float  # 1 + accepted / drafts: tokens a checked draft yielded
    num_accepted_per_pos: tuple[float, ...]  # per position K (0-based): drafts accepted there
    acceptance_per_pos: tuple[float, ...]  # the same / drafts (empty without drafts)
    tokens_per_emission: float  # tokens per engine emission, every emission of the run

    @classmethod
    def of(cls, d: Mapping[str, Any]) -> SpecAcceptance:
        return cls(
            num_drafted_tokens=d["drafted"],
            num_accepted_tokens=d["accepted"],
            num_drafts=d["drafts"],
            acceptance=d["acceptance"],
            mean_accepted_length_tokens=d["mean_accepted_length"],
            num_accepted_per_pos=tuple(d["accepted_per_pos"]),
            acceptance_per_pos=tuple(d["acceptance_per_pos"]),
            tokens_per_emission=d["tokens_per_emission"],
        )

    def to_record(self) -> dict[str, Any]:
        return {
            "drafted": self.num_drafted_tokens,
            "accepted": self.num_accepted_tokens,
            "drafts": self.num_drafts,
            "acceptance": self.acceptance,
            "mean_accepted_length": self.mean_accepted_length_tokens,
            "accepted_per_pos": list(self.num_accepted_per_pos),
            "acceptance_per_pos": list(self.acceptance_per_pos),
            "tokens_per_emission": self.tokens_per_emission,
        }


def spec_result(log: RawLog) -> SpecAcceptance | None:
    """The run's speculative decoding figures; None without ``spec.drafted`` counters."""
    d = spec_acceptance(log)
    return None if d is None else SpecAcceptance.of(d)


@dataclass(frozen=True, slots=True)
class ClientSummary:
    """The client boundary of a merged server run (`tracekit.attribution.client`): its
    chunks and the gaps between them, ITL in three conventions, and the share of client-gap
    time by label. The tail figures exist only for a run with at least one client gap
    (None otherwise, and absent from the record)."""

    num_gaps: int  # gaps between two chunks of one request
    num_chunks: int  # chunks the clients received
    itl_ms: ItlConventions
    all_share: dict[str, float]  # per label: its time / all client-gap time
    p99_ms: float | None = None  # client-gap p99: the tail threshold
    tail_share: dict[str, float] | None = None  # the same over gaps >= p99_ms
    frontend_share: float | None = None  # the API server's part of all client-gap time
    reconcile_max_err_ms: float | None = None  # max over gaps of |gap - sum(parts)|
    spec: SpecAcceptance | None = None  # speculative decoding, where recorded
    #: processes whose evidence is partial or missing (`tracekit.analysis.unrecorded`)
    unrecorded: tuple[Mapping[str, Any], ...] = ()
    #: TTFT at the client boundary (arrival to the first chunk's write, docs/ttft.md, "The
    #: client boundary"), numpy's linear percentiles over the requests with one, and the
    #: engine boundary's (arrival to the first token) over the same requests; NaN: none
    ttft_p50_ms: float = float("nan")
    ttft_p99_ms: float = float("nan")
    ttft_engine_p50_ms: float = float("nan")
    ttft_engine_p99_ms: float = float("nan")
    #: per label: its time / all client-boundary TTFT time
    ttft_share: dict[str, float] | None = None

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "gaps": self.num_gaps,
            "chunks": self.num_chunks,
            "itl_ms": self.itl_ms.to_record(),
            "all_share": dict(self.all_share),
        }
        if self.p99_ms is not None:  # the four exist together: a run with client gaps
            out["p99_ms"] = self.p99_ms
            out["tail_share"] = dict(self.tail_share or {})
            out["frontend_share"] = self.frontend_share
            out["reconcile_max_err_ms"] = self.reconcile_max_err_ms
        out["spec"] = self.spec.to_record() if self.spec is not None else None
        if self.unrecorded:
            out["unrecorded"] = [dict(u) for u in self.unrecorded]
        out["ttft_p50_ms"] = self.ttft_p50_ms
        out["ttft_p99_ms"] = self.ttft_p99_ms
        out["ttft_engine_p50_ms"] = self.ttft_engine_p50_ms
        out["ttft_engine_p99_ms"] = self.ttft_engine_p99_ms
        out["ttft_share"] = dict(self.ttft_share or {})
        return out


def client_result(
    log: RawLog,
    cp: ClientPartition,
    engine_gap_ms: np.ndarray,
    spec: SpecAcceptance | None,
    unrecorded: Sequence[Mapping[str, Any]],
    ttft: ClientTtft | None = None,
) -> ClientSummary:
    """The run's client-boundary figures (`tracekit.attribution.client.client_summary`),
    with its speculative decoding, its unrecorded processes and its client-boundary TTFT
    (`tracekit.attribution.client_ttft`, if given)."""
    d = client_summary(log, cp, engine_gap_ms)
    t = client_ttft_figures(ttft) if ttft is not None else None
    return ClientSummary(
        num_gaps=d["gaps"],
        num_chunks=d["chunks"],
        itl_ms=ItlConventions.of(d["itl_ms"]),
        all_share=d["all_share"],
        p99_ms=d.get("p99_ms"),
        tail_share=d.get("tail_share"),
        frontend_share=d.get("frontend_share"),
        reconcile_max_err_ms=d.get("reconcile_max_err_ms"),
        spec=spec,
        unrecorded=tuple(unrecorded),
        **(
            {"ttft_p50_ms": t["p50_ms"], "ttft_p99_ms": t["p99_ms"],
             "ttft_engine_p50_ms": t["engine_p50_ms"], "ttft_engine_p99_ms": t["engine_p99_ms"],
             "ttft_share": t["share"]}
            if t is not None
            else {}
        ),
    )  # fmt: skip


__all__ = [
    "ClientSummary",
    "ItlConventions",
    "ItlStats",
    "SpecAcceptance",
    "client_result",
    "spec_result",
]
