"""CPU-only support for DP attention and expert parallelism (`--enable-dp-attention --dp N
--ep-size N`, the layout 1T-class MLA models are served with), on machines with no GPU.

SGLang 0.5.23's CPU engine starts with DP attention but fails on the first batches in four places:
- a DP rank with fewer tokens than the others pads its batch, asking the attention backend for
  the sequence length of a padding row (`get_cpu_graph_seq_len_fill_value`); only the AMX backend
  (sgl_kernel CPU ops) answers, the portable torch-native one has no such method. It gets the AMX
  backend's answer, 1: a padding row is a one-token sequence, which every attention loop accepts;
- with expert parallelism the MoE output returns to each DP rank by `reduce_scatterv`, which
  needs PyNccl (turned off on CPU, see cpu_tp). Where a group has no PyNccl it takes SGLang's own
  deterministic variant: an all-reduce (gloo) and each rank's slice of the result;
- when every DP rank has as many tokens as the others, the logits take an all-to-all that SGLang
  registers for CUDA only; on CPU they take its other path, the all-gather it uses for unequal
  counts;
- under expert parallelism a token's choices of experts held by other ranks arrive as expert -1,
  which the CPU's native MoE loop indexes with (and it assumes a token's experts are distinct).
  The MoE sum is linear in the choices, so it runs once per choice column, a -1 given weight 0 on
  a local expert: this rank adds nothing for it, the rank holding it adds its share in the
  reduction.
And the DP controller, the process that hands each request to its DP rank, polls its socket in
a loop that never waits: a whole core per server, which on a testbed of two cores starves the
schedulers. On CPU it waits on the socket (feeding its soft watchdog each second) and then
dispatches what came, as SGLang's loop does.
Nothing here runs when torch sees a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.cpu_support import has_gpu
from pdd.srt.hooks import Hook

PADDING_SEQ_LEN = 1
DP_CONTROLLER_POLL_MS = 1000  # the DP controller's longest wait: its soft watchdog is fed then


def _after_backend_init(result: None, backend: Any, *args: Any, **kwargs: Any) -> None:
    if not has_gpu() and not hasattr(backend, "get_cpu_graph_seq_len_fill_value"):
        backend.get_cpu_graph_seq_len_fill_value = lambda: PADDING_SEQ_LEN


def _around_reduce_scatterv(
    original: Callable[..., torch.Tensor],
    group: Any,
    input_: torch.Tensor,
    output: torch.Tensor | None = None,
    sizes: list[int] | None = None,
) -> torch.Tensor:
    if group.pynccl_comm is None:
        return group._deterministic_reduce_scatterv(input_, output, sizes)
    return original(group, input_, output, sizes)


def _around_moe_forward_native(
    original: Callable[..., torch.Tensor],
    layer: Any,
    x: torch.Tensor,
    topk_output: Any,
    moe_runner_config: Any,
) -> torch.Tensor:
    elsewhere = topk_output.topk_ids < 0
    if not bool(elsewhere.any()):
        return original(layer, x, topk_output, moe_runner_config)
    weights = topk_output.topk_weights.masked_fill(elsewhere, 0)
    ids = topk_output.topk_ids.masked_fill(elsewhere, 0)
    total: torch.Tensor | None = None
    for k in range(ids.shape[1]):
        one = slice(k, k + 1)
        column = topk_output._replace(topk_weights=weights[:, one], topk_ids=ids[:, one])
        part = original(layer, x, column, moe_runner_config)
        total = part if total is None else total + part
    assert total is not None
    return total


def _around_can_use_lm_head_all_to_all(original: Callable[..., bool], *args: Any) -> bool:
    return False if not has_gpu() else original(*args)


def _around_dp_controller_loop(original: Callable[..., None], controller: Any) -> None:
    if has_gpu():
        return original(controller)
    import zmq
    from sglang.srt.managers.data_parallel_controller import sock_recv

    sock = controller.recv_from_tokenizer
    while True:
        controller.soft_watchdog.feed()
        if not sock.poll(DP_CONTROLLER_POLL_MS, zmq.POLLIN):
            continue
        while True:
            try:
                request = sock_recv(sock, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            controller._request_dispatcher(request)


HOOKS = (
    Hook("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.__init__",
         _after_backend_init, HookType.AFTER, "(self, model_runner)"),
    Hook("sglang.srt.distributed.parallel_state.GroupCoordinator.reduce_scatterv",
         _around_reduce_scatterv, HookType.AROUND, "(self, input_, output, sizes)"),
    Hook("sglang.srt.layers.moe.fused_moe_native.moe_forward_native", _around_moe_forward_native,
         HookType.AROUND, "(layer, x, topk_output, moe_runner_config)"),
    Hook("sglang.srt.layers.logits_processor.LogitsProcessor._can_use_tp_lm_head_all_to_all",
         _around_can_use_lm_head_all_to_all, HookType.AROUND,
         "(self, logits, local_hidden_states, lm_head, logits_metadata)"),
    Hook("sglang.srt.managers.data_parallel_controller.DataParallelController.event_loop",
         _around_dp_controller_loop, HookType.AROUND, "(self)"),
)  # fmt: skip
