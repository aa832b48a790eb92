"""What both engine adapters share: reversible method patches and window arithmetic.

`Patches` replaces methods on objects (instances or classes) and puts every original back
in reverse order, also when one restore fails. Restoring refuses (RuntimeError, nothing
changed) while another wrapper sits on top of one of its own: two instrumentations of one
engine must be removed last in, first out, or the later one's wrappers would be dropped and
the earlier one's put back silently. Instance patches shadow the class method
with an attribute on the instance; restoring deletes that attribute again (or puts back
the instance attribute that was there before, e.g. vLLM's ``EngineCore.step_fn``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_MISSING = object()
#: Patches installed and not yet restored, over all `Patches` (tests check it returns to 0).
_installed = [0]


def installed_patches() -> int:
    return _installed[0]


class Patches:
    """A stack of reversible attribute replacements."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any, Any]] = []

    def wrap(
        self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """Replace ``obj.name`` with ``make(original)``; `original` is what ``obj.name`` was
        (a bound method for an instance)."""
        original = getattr(obj, name)
        own = vars(obj).get(name, _MISSING)
        wrapper = make(original)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__tracekit_patch__ = True  # type: ignore[attr-defined]
        setattr(obj, name, wrapper)
        self._undo.append((obj, name, own, wrapper))
        _installed[0] += 1

    def restore(self) -> None:
        """Undo every patch, newest first. Raises the first failure after trying them all.

        Raises RuntimeError and changes nothing if another wrapper was installed over one
        of these since (uninstall that one first: last in, first out)."""
        covered = [
            f"{type(obj).__name__}.{name}"
            for obj, name, _own, wrapper in self._undo
            if vars(obj).get(name, _MISSING) is not wrapper
        ]
        if covered:
            raise RuntimeError(
                "cannot uninstall: another instrumentation wrapped "
                + ", ".join(sorted(set(covered)))
                + " after this one; uninstall the one installed last first (last in, first out)"
            )
        first_error: BaseException | None = None
        while self._undo:
            obj, name, own, _wrapper = self._undo.pop()
            try:
                if own is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, own)
                _installed[0] -= 1  # a failed restore stays counted
            except BaseException as e:  # keep restoring the others
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def __len__(self) -> int:
        return len(self._undo)


def is_patched(fn: Any) -> bool:
    """True if `fn` is a wrapper installed by `Patches` (tests use it to check restores)."""
    return bool(getattr(fn, "__tracekit_patch__", False))


def complement(t0: int, t1: int, inner: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[t0, t1]`` not covered by the (possibly unsorted) `inner` windows."""
    out = []
    cur = t0
    for a, b in sorted(inner):
        a, b = max(a, t0), min(b, t1)
        if a > cur:
            out.append((cur, a))
        cur = max(cur, b)
    if t1 > cur:
        out.append((cur, t1))
    return out


def add_forward(
    rec: Any,
    t0: int,
    t1: int,
    num_prefill_tokens: int,
    num_decode: int,
    decode_label: str = "decode",
) -> None:
    """Record the forward window ``[t0, t1]`` as `prefill` and/or `decode` (`decode_label`:
    ``verify`` when the decode rows carry speculative draft tokens to check).

    One forward pass runs a mixed batch; the host cannot time its prefill rows apart from
    its decode rows. The window is split by token mix: the first
    ``num_prefill_tokens / (num_prefill_tokens + num_decode)`` of it is `prefill`, the
    rest `decode` (a prefill-only batch is all `prefill`, a decode-only one all `decode`).
    """
    if t1 <= t0:
        return
    total = num_prefill_tokens + num_decode
    if total <= 0 or num_prefill_tokens <= 0:
        rec.add_segment(decode_label, t0, t1)
        return
    if num_decode <= 0:
        rec.add_segment("prefill", t0, t1)
        return
    # split point, in ticks: integer arithmetic keeps the two parts exactly adjacent
    cut = t0 + (t1 - t0) * num_prefill_tokens // total
    rec.add_segment("prefill", t0, cut)
    rec.add_segment(decode_label, cut, t1)


def seconds_per_tick(rec: Any) -> float:
    """The recorder's tick length (the `Recorder` keeps it private; 1 ns by default)."""
    return float(getattr(rec, "seconds_per_tick", getattr(rec, "_seconds_per_tick", 1e-9)))
