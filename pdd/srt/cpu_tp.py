"""CPU-only support for tensor parallelism (`--tp-size N --device cpu`, machines with no GPU).

SGLang 0.5.23's CPU engine does not start at TP > 1 on a machine like a small VM:
- every model-parallel group asks for a PyNccl communicator, which needs a CUDA device
  (`ValueError: Expected a cuda device, but got: cpu`); on CPU the groups' all-reduce is gloo's
  (or SGLang's shared-memory kernel where the CPU has AMX), so PyNccl is turned off;
- each TP rank binds its OpenMP threads to one NUMA node unless SGLANG_CPU_OMP_THREADS_BIND says
  otherwise, and refuses more ranks than nodes: with one node, the ranks get disjoint slices of
  this process's CPUs instead.
Nothing here runs when torch sees a GPU.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.cpu_support import has_gpu
from pdd.srt.hooks import Hook

logger = logging.getLogger(__name__)

ENV_THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"
ENV_THREADS = "OMP_NUM_THREADS"


def threads_bind(ranks: int, cpus: list[int]) -> str:
    """SGLang's bind string giving each of `ranks` ranks a contiguous slice of `cpus` (sorted);
    with fewer CPUs than ranks, ranks share CPUs round-robin."""
    if len(cpus) < ranks:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(ranks))
    per = len(cpus) // ranks
    slices = [cpus[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(_cpu_list(s) for s in slices)


def _cpu_list(cpus: list[int]) -> str:
    if cpus[-1] - cpus[0] == len(cpus) - 1:  # contiguous: SGLang's "a-b" form
        return str(cpus[0]) if len(cpus) == 1 else f"{cpus[0]}-{cpus[-1]}"
    return ",".join(str(c) for c in cpus)


def adjust_cpu_tp_args(args: argparse.Namespace) -> None:
    """Bind each TP rank's threads to its own CPUs unless the user already did."""
    if has_gpu() or getattr(args, "device", None) != "cpu":
        return
    ranks = int(getattr(args, "tp_size", 1) or 1) * int(getattr(args, "pp_size", 1) or 1)
    if ranks <= 1 or os.environ.get(ENV_THREADS_BIND):
        return
    cpus = sorted(os.sched_getaffinity(0))
    bind = threads_bind(ranks, cpus)
    os.environ[ENV_THREADS_BIND] = bind
    # Without AMX SGLang binds nothing, and each rank's torch would start a thread per CPU.
    threads = os.environ.setdefault(ENV_THREADS, str(max(1, len(cpus) // ranks)))
    logger.info("pdd cpu: %d ranks on CPU, %s=%s, %s=%s", ranks, ENV_THREADS_BIND, bind,
                ENV_THREADS, threads)  # fmt: skip


def _around_init_model_parallel_group(original: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    if not has_gpu():
        kw["use_pynccl"] = False
    return original(*args, **kw)


HOOKS = (
    Hook("sglang.srt.distributed.parallel_state.init_model_parallel_group",
         _around_init_model_parallel_group, HookType.AROUND,
         "(group_ranks, local_rank, backend, use_pynccl, use_custom_allreduce, "
         "use_message_queue_broadcaster, group_name, use_mscclpp, use_torch_symm_mem_allreduce, "
         "recovered_rank, rank_offset, max_world_size)"),
)  # fmt: skip
