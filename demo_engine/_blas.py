"""Keep BLAS to one thread: the engine is a single-core loop on a shared 2-core machine.

The environment variables only work if set before numpy is first imported; `demo_engine.cli`
sets them at import. When numpy was already imported (say, by `tracekit` before it
registered the `demo` group), `limit_blas_threads` asks the loaded OpenBLAS directly.
"""

from __future__ import annotations

import ctypes
import os
import sys

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def set_thread_env(num_threads: int = 1) -> None:
    for var in THREAD_VARS:
        os.environ[var] = str(num_threads)


def limit_blas_threads(num_threads: int = 1) -> bool:
    """Set the loaded OpenBLAS's thread count; True if it took effect (or was not needed)."""
    set_thread_env(num_threads)
    if "numpy" not in sys.modules:
        return True  # the env vars above will be read when numpy loads
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line and ".so" in line}
    except OSError:
        return False
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for sym in (
            "scipy_openblas_set_num_threads64_",
            "openblas_set_num_threads64_",
            "openblas_set_num_threads",
        ):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn(ctypes.c_int(num_threads))
                return True
    return False
