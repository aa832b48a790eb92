"""The serve wire contract: the names a multi-process server's per-process logs share.

The vLLM serve plugin (`engine_adapters.vllm_serve`) writes these names into each
process's log; the merge (`tracekit.log.merge`) and the analyses of a merged run
(`tracekit.analysis.unrecorded`, `tracekit.attribution.client`) read them back. They are
defined here only (tests/test_layout.py checks that no other module spells them out).
"""

from __future__ import annotations

#: Separates the client id from the engine id in the API server's request names
#: (``CLIENT_ID<US>ENGINE_ID``).
FRONT_SEP = "\x1f"
#: Joins a repeated client id to the number of its use (``cmpl-x-0~2``: the second).
REPEAT_SEP = "~"

#: Counter names of the paired stamps that check the processes' clocks against each other:
#: the API server sent a request (value: its request index), the engine core added it
#: (value: its request index), the engine core built a step's outputs (value: vLLM's
#: ``EngineCoreOutputs.timestamp``), the API server received them (the same value).
SENT, ADDED, OUT, RECV = "serve.sent", "serve.added", "serve.out", "serve.recv"
#: Counter (value: the API server's request index) stamped when the request's handler ran.
HANDLER = "serve.handler"

#: Process roles (``config["process"]["role"]``).
CORE, FRONTEND, WORKER = "engine_core", "api_server", "worker"
ROLES = (FRONTEND, CORE, WORKER)

#: ``config["process"]["clock"]`` of a recorder whose ``perf_counter`` is the boot's one
#: CLOCK_MONOTONIC (Linux): every process of one boot then reads one clock.
SHARED_CLOCK = "clock_gettime(CLOCK_MONOTONIC)"
