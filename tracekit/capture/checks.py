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


__all__ = ["INT64_MAX", "INT64_MIN", "as_int", "as_int_vector", "as_tick", "small_ints"]
