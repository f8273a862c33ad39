"""CPU-only adjustments to SGLang's prefill/decode disaggregation path (machines with no GPU).

SGLang 0.5.23's disaggregation path has CUDA-only calls that the CPU engine does not avoid:
- prefill: MooncakeKVSender stages page indices in pinned memory behind a CUDA event, so on CPU
  the sender must report `supports_host_tensor_indices = False`;
- prefill: the overlap scheduler records a CUDA event on a prefix-cache hit, so overlap is off;
- decode: the default retraction backup registers host memory with CUDA, so `cpu_tensor` is used.
Nothing here runs when torch sees a GPU.
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.cpu_support import has_gpu
from pdd.srt.hooks import Hook

logger = logging.getLogger(__name__)


def adjust_cpu_args(args: argparse.Namespace) -> None:
    """Fill in the settings a CPU disaggregation server needs, saying so in the log."""
    if has_gpu() or getattr(args, "device", None) != "cpu":
        return
    mode = getattr(args, "disaggregation_mode", None)
    if mode == "prefill" and not args.disable_overlap_schedule:
        args.disable_overlap_schedule = True
        logger.info("pdd cpu: prefill on CPU runs with --disable-overlap-schedule")
    if mode == "decode" and args.disaggregation_decode_retraction_backup is None:
        args.disaggregation_decode_retraction_backup = "cpu_tensor"
        logger.info(
            "pdd cpu: decode on CPU uses --disaggregation-decode-retraction-backup cpu_tensor"
        )


@functools.cache
def _cpu_sender(sender_cls: type) -> type:
    return type(f"Cpu{sender_cls.__name__}", (sender_cls,), {"supports_host_tensor_indices": False})


def _around_get_kv_class(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    cls = original(*args, **kwargs)
    if getattr(cls, "supports_host_tensor_indices", False) and not has_gpu():
        return _cpu_sender(cls)
    return cls


HOOKS = (
    Hook("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, HookType.AROUND,
         "(transfer_backend, class_type)"),
)  # fmt: skip
