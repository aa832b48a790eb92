"""The previous main's tracekit (a checkout of it, /work/base by default), imported into this
process beside the working tree's, so a bench can time both in interleaved rounds.

Both packages are named `tracekit`; the previous one is imported once with its checkout
first on the path, its modules are then taken out of `sys.modules` (kept here) and the
working tree's restored. `BaseMain.call` swaps the previous package's modules back in for
the length of one call, so that imports a function makes at call time resolve to its own
package, then restores the working tree's.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

DEFAULT_CHECKOUT = os.environ.get("TRACEKIT_BASE", "/work/base")


def _ours() -> dict[str, Any]:
    return {k: v for k, v in sys.modules.items() if k == "tracekit" or k.startswith("tracekit.")}


class BaseMain:
    """The previous main's `analyze` and `load`, callable through `call`."""

    def __init__(
        self,
        checkout: str = DEFAULT_CHECKOUT,
        modules: tuple[str, ...] = ("tracekit.analysis", "tracekit.rawlog"),
    ) -> None:
        if not os.path.isdir(os.path.join(checkout, "tracekit")):
            raise SystemExit(f"{checkout}: no tracekit package there (set TRACEKIT_BASE)")
        self.checkout = checkout
        current = _ours()
        for k in current:
            del sys.modules[k]
        sys.path.insert(0, checkout)
        try:
            self.mods = {m: importlib.import_module(m) for m in modules}
            self._theirs = _ours()
        finally:
            sys.path.remove(checkout)
            for k in _ours():
                del sys.modules[k]
            sys.modules.update(current)
        pkg = self._theirs["tracekit"]
        if not os.path.realpath(pkg.__file__).startswith(os.path.realpath(checkout)):
            raise SystemExit(f"{checkout}: imported {pkg.__file__} instead")

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        current = _ours()
        sys.modules.update(self._theirs)
        try:
            return fn(*args, **kwargs)
        finally:
            self._theirs.update(_ours())  # modules it imported at call time stay its own
            for k in _ours():
                del sys.modules[k]
            sys.modules.update(current)

    def analyze_path(self, path: str) -> Any:
        """The previous main's ``analyze(load(path))``."""
        return self.call(lambda: self.mods["tracekit.analysis"].analyze(
            self.mods["tracekit.rawlog"].load(path)))  # fmt: skip
