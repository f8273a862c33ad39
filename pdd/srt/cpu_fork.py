"""On CPU, SGLang's subprocesses (scheduler ranks, detokenizer) are forked, not spawned.

SGLang spawns them because CUDA cannot survive a fork. A spawned child imports SGLang again
(about 10 s of CPU each on a 2-core machine, so a 3-server testbed spends most of its start-up
importing), while the launcher has already imported everything the children run. With no GPU
there is no CUDA state to protect, so the launcher forks them: a server starts ~1.7x faster.
The environment SGLang sets up before forking (its own and pdd's, e.g. SGLANG_USE_CPU_ENGINE,
which the launcher already had at import time) is what a spawned child would have seen.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.cpu_support import has_gpu
from pdd.srt.hooks import Hook


def start_method(device: str | None) -> str | None:
    """The start method SGLang's subprocesses should use instead of spawn, or None to keep it."""
    return "fork" if device == "cpu" and not has_gpu() else None


def _after_set_envs_and_config(result: None, server_args: Any) -> None:
    method = start_method(getattr(server_args, "device", None))
    if method is not None:
        multiprocessing.set_start_method(method, force=True)


HOOKS = (
    Hook("sglang.srt.entrypoints.engine._set_envs_and_config", _after_set_envs_and_config,
         HookType.AFTER, "(server_args)"),
)  # fmt: skip
