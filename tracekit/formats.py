"""How values are written out, in one place: JSON-safe copies and numbers in tables.

`json_safe` is what every JSON tracekit writes goes through (the raw log's config and
meta, `analyze --format jsonl`, the HTML report's data); `num` is how every table (the
terminal's, the HTML report's) shows a number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def json_safe(obj: Any) -> Any:
    """A copy of `obj` that `json.dumps(..., allow_nan=False)` accepts: mappings become
    dicts with string keys, tuples and lists lists, numpy scalars Python numbers,
    non-finite floats None (JSON has no NaN), anything else unknown its `str`."""
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        return json_safe(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def num(x: float | None, nd: int = 1) -> str:
    """`x` with `nd` decimals, or ``-`` for a figure that does not exist (None, NaN)."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.{nd}f}"
