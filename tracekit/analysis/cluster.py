"""Per-run work as Ray tasks (`--ray [ADDRESS]` on analyze, compare, report, export, fleet).

Each run is one task; results come back in the order of the runs, so the output is the
same records, byte for byte, as the local path (`--jobs`). A bad log fails inside its task
with tracekit's own one-line error, which travels back as a value and is raised here: the
user sees the same line as locally, never a Ray traceback.

Ray is an optional extra (`pip install 'tracekit[ray]'`); only this module imports it, and
only when `--ray` is given. ADDRESS is anything `ray.init(address=...)` takes (`auto`,
`ray://head:10001`, `head:6379`); without it a local Ray is started for the call and shut
down after it. docs/fleet.md: pointing it at a cluster, sizing, what breaks first.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tracekit.errors import TracekitError

#: `--ray` with no address: start a local Ray for this call.
LOCAL = ""
#: How long to wait for a cluster's address to answer before giving up.
CONNECT_TIMEOUT_S = 5.0


class ClusterError(TracekitError):
    """Ray is missing, the cluster cannot be reached, or a task died (not a bad log)."""


@dataclass(frozen=True)
class _Failed:
    """A tracekit error raised inside a task, carried back as a value."""

    error: TracekitError


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    try:
        return fn(*args)
    except TracekitError as e:  # LogError, DatasetError...: pickled by value (__reduce__)
        return _Failed(e)


def _ray():
    try:
        import ray  # optional extra: ray only with --ray
    except ImportError:
        raise ClusterError(
            "--ray needs Ray: pip install 'tracekit[ray]' (or run without --ray)"
        ) from None
    return ray


def _check_reachable(address: str) -> None:
    """Fail fast on an address nothing listens at (Ray itself retries for minutes)."""
    if address in ("auto", "local"):
        return
    hostport = address[len("ray://") :] if address.startswith("ray://") else address
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(
            f"--ray {address}: expected auto, HOST:PORT (the GCS, 6379) or ray://HOST:PORT "
            "(Ray Client, 10001)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ClusterError(
            f"--ray {address}: cannot reach {host}:{port} ({e.strerror or e}); is the cluster "
            "up? `ray status` on its head node prints the address"
        ) from None


def ray_map(
    fn: Callable[..., Any],
    arg_tuples: Sequence[tuple],
    address: str = LOCAL,
    *,
    on_result: Callable[[], None] | None = None,
) -> list[Any]:
    """`[fn(*a) for a in arg_tuples]`, each call a Ray task, results in input order."""
    out = []
    for r in ray_imap(fn, arg_tuples, address):
        out.append(r)
        if on_result is not None:
            on_result()
    return out


def ray_imap(
    fn: Callable[..., Any],
    arg_tuples: Iterable[tuple],
    address: str = LOCAL,
    ahead: int | None = None,
) -> Iterator[Any]:
    """`fn(*a)` for each of `arg_tuples` as Ray tasks (all submitted at once, or with
    `ahead` at most that many submitted and not yet yielded, `arg_tuples` taken as they
    are needed), yielded in input order as they are fetched, so a caller can combine and
    drop each result.

    Uses the Ray this process is already connected to if there is one; else connects to
    `address` (or starts a local Ray when it is empty) and disconnects when done."""
    ray = _ray()
    started = False
    if not ray.is_initialized():
        opts: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,  # tasks print nothing; keep Ray's worker logs out of ours
            "logging_level": logging.WARNING,
            "configure_logging": True,
        }
        try:
            if address:
                _check_reachable(address)
                ray.init(address=address, **opts)
            else:
                # "local": a new Ray even where RAY_ADDRESS names a cluster
                ray.init(address="local", num_cpus=os.cpu_count() or 1, **opts)
        except ClusterError:
            raise
        except Exception as e:  # ConnectionError, RuntimeError, ValueError from ray.init
            where = address or "a local Ray"
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise ClusterError(
                f"--ray {address}: cannot start or reach {where} ({msg}); check the address "
                "(`ray status` on the head node prints it)"
            ) from None
        started = True
    try:
        task = ray.remote(_call)
        args = iter(arg_tuples)
        refs: collections.deque[Any] = collections.deque()

        def submit() -> None:
            for a in itertools.islice(args, None if ahead is None else ahead - len(refs)):
                refs.append(task.remote(fn, tuple(a)))

        submit()
        while refs:  # in order: the same order as the local path
            try:
                r = ray.get(refs.popleft())  # fetched: Ray frees it once the caller is done
            except ray.exceptions.RayError as e:  # a task that died (OOM, node lost)
                msg = str(e).strip().splitlines()[-1][:200] if str(e) else type(e).__name__
                raise ClusterError(f"a Ray task failed: {type(e).__name__}: {msg}") from None
            if isinstance(r, _Failed):
                for rest in refs:
                    try:
                        ray.cancel(rest)
                    except Exception:  # already finished: nothing to stop
                        pass
                raise r.error
            submit()  # the next ones run while the caller takes this one
            yield r
    finally:
        if started:
            ray.shutdown()
