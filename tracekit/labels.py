"""Labels, causes, their precedence and their colours: written down once, used everywhere.

A *segment label* is what an engine calls a window of a step (`tok`, `swap`, `prefill`,
`decode`, `schedule`, ...). The *cause map* turns segment labels into the labels a gap is
partitioned into. Unknown segment labels keep their own name as their cause.

The labels of a partition are the causes plus `forward` (the decode forward pass on a
captured shape) and `residual` (time no instrument covered). `decode` is never a part by
itself: it is split into `graph` (excess over a captured step) and `forward`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Segment label -> partition label, for the labels every engine shares.
DEFAULT_CAUSE_MAP: dict[str, str] = {
    "tok": "tok",
    "swap": "preempt",
    "recompute": "preempt",
    "prefill": "prefill",
    "decode": "decode",
    # the forward pass of a speculative-decoding step, checking draft tokens: decode work
    "verify": "decode",
}

#: The labels every analysis reports, in display order, even when a run has none of them.
STANDARD_LABELS: tuple[str, ...] = (
    "preempt",
    "gc",
    "tok",
    "prefill",
    "graph",
    "forward",
    "residual",
)

#: Time the operating system took from the engine's loop thread, from its own counters
#: (docs/partition.md, "OS evidence"): runnable but waiting for a CPU, and off the CPU
#: for no recorded wait (I/O, locks, sleeps, page faults). They are not in the overlap
#: order below: the kernel says how much, not when, so they take their share of every
#: instant of the interval they were measured over, ahead of every label there (`gc`
#: included: a collection does not progress while its thread is off the CPU), except the
#: request's own evicted time (`preempt`) and, for `os_blocked`, explicit waits
#: (`wait`, `sync`), whose off-CPU time is what they are.
OS_RUNQUEUE = "os_runqueue"
OS_BLOCKED = "os_blocked"
OS_LABELS: tuple[str, ...] = (OS_RUNQUEUE, OS_BLOCKED)

#: The OS's time at the API server (docs/partition.md, "Unrecorded windows", rule 5).
FRONTEND_OS_LABELS: tuple[str, ...] = tuple(f"frontend_{lb}" for lb in OS_LABELS)


def is_os_label(label: str) -> bool:
    """Whether a partition label is time the OS took from a thread: `os_runqueue`,
    `os_blocked`, their API server (`frontend_...`) and tensor-parallel rank (`rankR:...`)
    forms, and `os` (a label an engine's cause map may name)."""
    base = label.split(":", 1)[1] if label.startswith("rank") and ":" in label else label
    return base == "os" or base in OS_LABELS or base in FRONTEND_OS_LABELS


#: Labels that are not causes: the forward pass itself and uncovered time.
NON_CAUSES: frozenset[str] = frozenset({"forward", "residual"})

#: The segment label of a re-prefill after a recompute eviction (the demo engine's; an
#: engine that re-prefills inside its `prefill` segments has none).
RECOMPUTE_LABEL = "recompute"
#: The timeline class of a `recompute` segment the cause map sends to `preempt`: never a
#: partition label. Each partition gives its time to `preempt` in the windows of the request
#: re-prefilling there and to others' prefill in everyone else's (docs/partition.md, "Who
#: evicted whom"). It owns overlaps right after `preempt` (a KV swap) and before `tok`.
RECOMPUTE_CLASS = "preempt:recompute"


#: Where windows of different labels overlap in time (threads, async device work, nested
#: segments), the label that comes first here owns the overlap. This is the one place the
#: order is written. Rationale: an eviction of the gap's own request (`preempt` from
#: eviction windows, applied before this order) and a GC pause stop the whole interpreter;
#: KV swaps, tokenizer calls and prefill are the stalls the partition exists to find;
#: labels an engine adds (`schedule`, `sample`, ...) come next, in alphabetical order so
#: the result never depends on the order they were first seen; `decode` is last because it
#: is the work every gap is expected to contain. A re-prefill (`RECOMPUTE_CLASS`) sits
#: where the cause map's `preempt` put it before, after a KV swap.
PRECEDENCE_HEAD: tuple[str, ...] = ("gc", "preempt", RECOMPUTE_CLASS, "tok", "prefill")
PRECEDENCE_TAIL: tuple[str, ...] = ("decode",)

#: One colour per label, the same in every chart and trace (Okabe-Ito based, colour-blind safe).
COLOURS: dict[str, str] = {
    "preempt": "#D55E00",
    "gc": "#CC79A7",
    "tok": "#E69F00",
    "prefill": "#0072B2",
    "graph": "#009E73",
    "forward": "#56B4E9",  # forward, clean and residual: three distinct colours, not greys
    "residual": "#F0E442",
    "decode": "#56B4E9",
    "clean": "#BBBBBB",
    "os_runqueue": "#999933",
    "os_blocked": "#888888",
}
_EXTRA_COLOURS = ("#882255", "#44AA99", "#117733", "#332288", "#AA4499", "#661100", "#6699CC")

#: One character per primary cause for terminal histograms (`.` is clean).
GLYPHS: dict[str, str] = {
    "preempt": "S",
    "gc": "G",
    "tok": "T",
    "prefill": "P",
    "graph": "C",
    "os_runqueue": "Q",
    "os_blocked": "B",
    "clean": "\u00b7",
}


#: Labels only the partitions produce, from evidence other than a recorded window: the
#: decode split (`graph`), time no window covered (`residual`), the OS's counters, a
#: request's own prefill, others' work and waits in its TTFT, its stages before the engine
#: had it (`http`, `frontend`), the client boundary's hop and the API server's other time,
#: a gap's primary cause `clean`, time a process did not record (`unrecorded:...`) and the
#: re-prefill's timeline class (`RECOMPUTE_CLASS`). An engine may not record a window
#: under one (the recorder refuses it at the call); a log that has one (recorded before
#: the rule) keeps that window's time as its own cause,
#: `engine_<label>`, never the partition's (docs/input-validation.md, "Labels").
#: `forward` is not among them: a forward pass an engine records (vLLM's workers) is what
#: the partition calls forward.
PRODUCED_LABELS: frozenset[str] = frozenset(
    {"graph", "residual", "clean", "prefill_own", "prefill_other", "decode_other", "http",
     "frontend", "hop", "frontend_other", *OS_LABELS, *FRONTEND_OS_LABELS, RECOMPUTE_CLASS}
)  # fmt: skip
#: ... and every label with one of these prefixes (a TTFT's `wait_<reason>`, the client
#: boundary's `unrecorded:<process>`)
PRODUCED_PREFIXES: tuple[str, ...] = ("wait_", "unrecorded:")


def is_produced(label: str) -> bool:
    """Whether only a partition may produce `label` (`PRODUCED_LABELS`)."""
    return label in PRODUCED_LABELS or label.startswith(PRODUCED_PREFIXES)


def segment_cause(label: str, cause_map: Mapping[str, str]) -> str:
    """A segment's timeline cause: `cause_of`, except a `recompute` segment the cause map
    sends to `preempt`, which is `RECOMPUTE_CLASS` (whose re-prefill it is decides its label
    window by window)."""
    cause = cause_of(label, cause_map)
    return RECOMPUTE_CLASS if label == RECOMPUTE_LABEL and cause == "preempt" else cause


def cause_of(label: str, cause_map: Mapping[str, str]) -> str:
    """The partition label a segment label maps to; unknown labels are their own cause. A
    cause only the partitions produce (`PRODUCED_LABELS`) is the engine's own instead:
    `engine_<cause>`, so a window recorded under it never passes for the partition's."""
    cause = cause_map.get(label, label)
    return f"engine_{cause}" if is_produced(cause) else cause


def precedence(causes: Iterable[str]) -> list[str]:
    """Every cause in `causes` (plus `gc`), ordered from the one that owns an overlap first."""
    present = set(causes) | {"gc"}
    head = [c for c in PRECEDENCE_HEAD if c in present]
    tail = [c for c in PRECEDENCE_TAIL if c in present]
    middle = sorted(present - set(head) - set(tail))
    return head + middle + tail


def colour(label: str) -> str:
    """A stable colour for any label; unknown labels get one from a fixed palette by hash."""
    if label in COLOURS:
        return COLOURS[label]
    h = 0
    for ch in label:  # a hash that does not change between interpreter runs
        h = (h * 131 + ord(ch)) % 1_000_003
    return _EXTRA_COLOURS[h % len(_EXTRA_COLOURS)]


#: Characters for labels whose own letters are taken, in order: lower-case letters and
#: digits, ASCII symbols, capitals the standard causes do not use, then Greek and Latin
#: letters (all one terminal cell wide). Past these (some 200 labels) a label shares `?`.
_SPARE_GLYPHS = (
    "abcdefghijklmnopqrstuvwxyz0123456789+*#@%&=~^"
    + "".join(c for c in "ABDEFHIJKLMNOQRUVWXYZ" if c not in GLYPHS.values())
    + "".join(chr(c) for c in range(0x3B1, 0x3CA))  # Greek small alpha..omega
    + "".join(chr(c) for c in range(0x100, 0x180))  # Latin Extended-A
)


def glyphs(labels: Iterable[str]) -> dict[str, str]:
    """One distinct character per label: the fixed ones for the standard causes, then each
    engine label's lower-case initial, or its next unused letter, or a spare character
    (`_SPARE_GLYPHS`), however many labels a run has."""
    out: dict[str, str] = {}
    used: set[str] = set()
    for lb in sorted(labels, key=lambda x: (x not in GLYPHS, x)):
        options = [GLYPHS[lb]] if lb in GLYPHS else [ch.lower() for ch in lb if ch.isalnum()]
        pick = next((c for c in options if c not in used and len(c) == 1), None)
        if pick is None:
            pick = next((c for c in _SPARE_GLYPHS if c not in used), "?")
        out[lb] = pick
        used.add(pick)
    return out


def partition_labels(causes: Iterable[str]) -> list[str]:
    """The labels a partition reports: the standard ones first, then the OS labels where
    the run has OS evidence (`OS_LABELS`, in that order), then any extra cause."""
    present = set(causes)
    os_labels = [lb for lb in OS_LABELS if lb in present]
    extra = sorted(present - set(STANDARD_LABELS) - set(OS_LABELS) - {"decode"})
    return list(STANDARD_LABELS) + os_labels + extra
