"""The recorder's argument checks: every hook converts its arguments here before it touches
a buffer, so a wrong argument raises at the call (naming the argument) and records nothing.

Integers are what the raw log stores: Python and numpy integers pass, integral floats
(``12.0``, ``np.float64(12)``) are taken as the integer they hold; fractions, NaN, None,
strings and bools raise `TypeError`; values outside what the log accepts
(`tracekit.log.validate`: counts in ``[0, MAX_COUNT]``) raise `ValueError`. Vectors are
checked once, with numpy (one pass for the type, two reductions for the range), never
element by element in Python: the checks stay cheap on the per-step path.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import Any

import numpy as np

from tracekit.labels import is_produced
from tracekit.log.rawlog import WAIT_REASON_CODES
from tracekit.log.validate import MAX_COUNT

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_recorder_args(out: Any, seconds_per_tick: Any, os_evidence: Any, retain_s: Any) -> None:
    """`Recorder`'s arguments that a typo would turn into a wrong run, checked at
    construction (TypeError/ValueError naming the argument)."""
    if isinstance(seconds_per_tick, bool) or not isinstance(seconds_per_tick, (int, float)):
        raise TypeError(
            f"Recorder(seconds_per_tick=): expected a number of seconds, got "
            f"{type(seconds_per_tick).__name__} {seconds_per_tick!r:.80}"
        )
    if not 0 < seconds_per_tick < 1e6:
        raise ValueError(f"Recorder(seconds_per_tick=): {seconds_per_tick!r} is not > 0")
    if os_evidence is not None and not isinstance(os_evidence, bool):
        raise TypeError(
            f"Recorder(os_evidence=): expected True, False or None (the default: on where "
            f"the clock is wall time), got {type(os_evidence).__name__} {os_evidence!r:.80}"
        )
    if retain_s is not None and (
        isinstance(retain_s, bool)
        or not isinstance(retain_s, (int, float))
        or not 0 < retain_s < math.inf
    ):
        raise ValueError(
            f"Recorder(retain_s=): expected a positive number of seconds or None (keep "
            f"every part), got {type(retain_s).__name__} {retain_s!r:.80}"
        )
    if retain_s is not None and out is None:
        raise ValueError("Recorder(retain_s=): parts are kept on disk only (give out=PATH)")


def check_label(label: Any, name: str) -> str:
    """A label (or counter name) is a str, or TypeError naming `name`."""
    if not isinstance(label, str):
        raise TypeError(f"{name}: expected a str, got {type(label).__name__} {label!r:.80}")
    return label


def engine_label(label: str) -> str:
    """A label an engine may record a window under: not one only the partitions produce."""
    if is_produced(label):
        raise ValueError(
            f"label {label!r:.80}: only tracekit's partitions produce it (time no window "
            f"covered, the OS's, a request's stages and waits...): record the window under a "
            f'name of its own (docs/input-validation.md, "Labels")'
        )
    return label


def wait_code(reason: Any) -> int:
    """A wait reason's code (`tracekit.log.rawlog.WAIT_REASONS`), or ValueError."""
    code = WAIT_REASON_CODES.get(reason) if isinstance(reason, str) else None
    if code is None:
        raise ValueError(f"wait reason {reason!r:.80} is not one of {list(WAIT_REASON_CODES)}")
    return code


def step_attrs(
    num_decode: Any, num_prefill_tokens: Any, graph_size: Any, num_preempted: Any,
    num_swapped_in: Any,
) -> dict[str, int]:  # fmt: skip
    """`Recorder.step_info`'s attributes that were given, each checked (all before any is
    kept: a wrong one raises and sets none)."""
    # one `if` a keyword, names spelled out: a call per step, no string built per call
    given = {}
    if num_decode is not None:
        given["num_decode"] = as_int(num_decode, "step_info(num_decode=)")
    if num_prefill_tokens is not None:
        given["num_prefill_tokens"] = as_int(num_prefill_tokens, "step_info(num_prefill_tokens=)")
    if graph_size is not None:
        given["graph_size"] = as_int(graph_size, "step_info(graph_size=)", -1)
    if num_preempted is not None:
        given["num_preempted"] = as_int(num_preempted, "step_info(num_preempted=)")
    if num_swapped_in is not None:
        given["num_swapped_in"] = as_int(num_swapped_in, "step_info(num_swapped_in=)")
    return given


def as_int(value: Any, name: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """`value` as an int in [lo, hi], or TypeError/ValueError naming `name`."""
    if type(value) is int:  # the common cases first (an ABC check costs a microsecond)
        v = value
    elif isinstance(value, np.integer):
        v = int(value)
    elif isinstance(value, bool) or isinstance(value, np.bool_):
        raise TypeError(f"{name}: expected an integer, got the bool {value!r}")
    elif isinstance(value, Integral):
        v = int(value)
    elif isinstance(value, (float, np.floating)):
        f = float(value)
        if not (math.isfinite(f) and f.is_integer()):
            raise TypeError(f"{name}: expected an integer, got {value!r}")
        v = int(f)
    else:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r:.80}")
    if not lo <= v <= hi:
        raise ValueError(f"{name}: {v} is outside [{lo}, {hi}]")
    return v


def small_ints(values: Any, lo: int = 0, hi: int = MAX_COUNT) -> list[int] | None:
    """A few `values` (a list, a tuple, a 1-D integer array) as a list of Python ints, when
    every one is a plain int in [lo, hi]; None otherwise (then check them one by one with
    `as_int`, which names the wrong one). The fast path of calls on a handful of values."""
    if type(values) is np.ndarray:
        if values.ndim != 1 or values.dtype.kind not in "iu":
            return None
        values = values.tolist()
    for v in values:
        if type(v) is not int or not lo <= v <= hi:
            return None
    return values if type(values) is list else list(values)


def as_tick(value: Any, name: str) -> int:
    """A clock reading: an integer that fits int64 (integral floats taken as ints)."""
    return as_int(value, name, INT64_MIN + 1, INT64_MAX)


def as_int_vector(values: Any, name: str, lo: int = 0, hi: int = MAX_COUNT) -> np.ndarray:
    """`values` (a numpy array, a list, any iterable of integers) as a 1-D int64 array with
    every element in [lo, hi]; integral float arrays are converted, anything else raises."""
    if type(values) is np.ndarray:
        a = values
    else:
        if not isinstance(values, (list, tuple)):
            values = list(values)
        try:
            a = np.asarray(values)
        except (ValueError, TypeError) as e:
            raise TypeError(f"{name}: expected integers ({e})") from None
    if a.ndim != 1:
        raise TypeError(f"{name}: expected a flat sequence of integers, got shape {a.shape}")
    kind = a.dtype.kind
    if kind == "i" or kind == "u":
        if a.dtype != np.int64:
            if kind == "u" and a.size and int(a.max()) > INT64_MAX:
                raise ValueError(f"{name}: {int(a.max())} is outside [{lo}, {hi}]")
            a = a.astype(np.int64)
    elif kind == "f":
        if not np.all(np.isfinite(a)) or not np.all(a == np.floor(a)):
            bad = a[~(np.isfinite(a) & (a == np.floor(np.nan_to_num(a))))][0]
            raise TypeError(f"{name}: expected integers, got {float(bad)!r}")
        if a.size and (a.min() < INT64_MIN or a.max() > INT64_MAX):
            raise ValueError(f"{name}: values outside [{lo}, {hi}]")
        a = a.astype(np.int64)
    elif a.size == 0:
        return np.zeros(0, dtype=np.int64)
    else:  # bools, strings, None, objects
        first = next((v for v in a.reshape(-1) if not isinstance(v, Integral | float)), a[0])
        raise TypeError(f"{name}: expected integers, got {type(first).__name__} {first!r:.80}")
    if a.size:
        # one reduction: below `lo` wraps around to the top of the unsigned range
        if int((a - lo).view(np.uint64).max() if lo else a.view(np.uint64).max()) > hi - lo:
            bad = a[(a < lo) | (a > hi)][0]
            raise ValueError(f"{name}: {int(bad)} is outside [{lo}, {hi}]")
    return a


__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "as_int",
    "as_int_vector",
    "as_tick",
    "check_label",
    "engine_label",
    "small_ints",
    "step_attrs",
    "wait_code",
]
