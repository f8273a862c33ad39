"""Where MainDecode meets SGLang's decode scheduler (hooks run in each of MD's scheduler
processes, one per TP rank)."""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.flags import PddConfig
from pdd.srt.hooks import Hook
from pdd.srt.main_decode import MainDecode


def check_supported(scheduler: Any) -> None:
    """What MD cannot run yet, and why (each a start-up error naming the flag)."""
    if not scheduler.spec_algorithm.is_none():
        # A handed-off request would need its draft model's KV for the handed-over tokens too.
        raise RuntimeError("--pdd-role main does not support speculative decoding yet")
    if getattr(scheduler.server_args, "pp_size", 1) != 1:
        raise RuntimeError("--pdd-role main does not support --pp-size > 1 yet")


def main_decode(scheduler: Any) -> MainDecode | None:
    """This scheduler's MainDecode, made on first use; None on servers of other roles."""
    md = scheduler.__dict__.get("_pdd_main_decode")
    if md is None:
        config = PddConfig.from_env()
        md = False
        if config.role == "main":
            check_supported(scheduler)
            md = MainDecode(scheduler, config)
        scheduler._pdd_main_decode = md
    return md or None


# This process's MainDecode (one scheduler per process), for the load report's hook.
_process_md: list[MainDecode] = []


def _after_init(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    # Made at start-up on every rank: a follower must be able to dispatch the first broadcast.
    md = main_decode(scheduler)
    if md is not None:
        _process_md.append(md)


def _after_get_loads(result: Any, inquirer: Any, *args: Any, **kwargs: Any) -> Any:
    # Parked requests wait outside SGLang's queues but are MD's work to come (and hold KV):
    # routers balancing on /v1/loads must see them.
    if _process_md:
        result.num_waiting_reqs += len(_process_md[0].parked)
    return result


def _after_poll_timeout_aborts(result: list[Any], scheduler: Any) -> list[Any]:
    # TP rank 0 only (SGLang asks it for the aborts that ride its request broadcast).
    md = main_decode(scheduler)
    batch = md.gather() if md is not None else None
    return result if batch is None else [*result, batch]


def _after_pop_transferred(result: list[Any], queue: Any, *args: Any, **kwargs: Any) -> Any:
    md = main_decode(queue.scheduler)
    return md.take_parkable(result) if md is not None and result else result


def _around_next_decode_batch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    md = main_decode(scheduler)
    extend = md.poll() if md is not None else None
    if extend is None:
        return original(scheduler, *args, **kwargs)
    # This step runs the handoff extend; decoding (and new arrivals) go on next step, as
    # SGLang's own scheduler runs a prefill before the next decode step.
    running = kwargs.get("running_batch", args[0] if args else scheduler.running_batch)
    # With DP attention every DP rank's forward joins the same MoE collectives: SGLang's own
    # sync tells the other ranks this step's token count (a no-op without DP attention).
    extend = scheduler.dp_attn_adapter.maybe_prepare_mlp_sync_batch(extend)
    return NextBatchPlan(batch_to_run=extend, running_batch=running)


def _around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    md = main_decode(scheduler)
    flight = md.launched(batch) if md is not None else None
    if flight is None:
        return original(scheduler, batch, *args, **kwargs)
    return md.run(flight, lambda: original(scheduler, batch, *args, **kwargs))  # type: ignore[union-attr]


def _around_process_batch_result(
    original: Any, scheduler: Any, batch: Any, result: Any, *args: Any, **kwargs: Any
) -> Any:
    md = main_decode(scheduler)
    if md is not None and md.take_result(batch, result):
        return None
    return original(scheduler, batch, result, *args, **kwargs)


def _after_is_fully_idle(result: bool, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
    md = main_decode(scheduler)
    # Parked requests hold KV: the scheduler is not idle (its idle leak check would fire); a
    # cache-sync batch still to send, or handoffs held for the batching window, keep the loop
    # going until they are sent.
    return result and not (md is not None and md.busy())


def _after_abort_request(result: None, scheduler: Any, recv_req: Any) -> None:
    md = main_decode(scheduler)
    if md is not None:
        md.abort(recv_req.rid or "", bool(recv_req.abort_all))


_SCHED = "sglang.srt.managers.scheduler.Scheduler"
HOOKS = (
    Hook(f"{_SCHED}.__init__", _after_init, HookType.AFTER, "(self, server_args, port_args)"),
    Hook(f"{_SCHED}._poll_timeout_aborts", _after_poll_timeout_aborts, HookType.AFTER,
         "(self)"),
    Hook("sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred",
         _after_pop_transferred, HookType.AFTER, "(self, rids_to_check)"),
    Hook(f"{_SCHED}.get_next_disagg_decode_batch_to_run", _around_next_decode_batch,
         HookType.AROUND, "(self, running_batch)"),
    Hook(f"{_SCHED}.run_batch", _around_run_batch, HookType.AROUND,
         "(self, batch, pp_proxy_tensors)"),
    Hook(f"{_SCHED}.process_batch_result", _around_process_batch_result, HookType.AROUND,
         "(self, batch, result)"),
    Hook(f"{_SCHED}.is_fully_idle", _after_is_fully_idle, HookType.AFTER,
         "(self, for_health_check, ignore_waiting)"),
    Hook(f"{_SCHED}.abort_request", _after_abort_request, HookType.AFTER, "(self, recv_req)"),
    Hook("sglang.srt.managers.scheduler_components.load_inquirer.SchedulerLoadInquirer."
         "get_loads", _after_get_loads, HookType.AFTER, "(self)"),
)  # fmt: skip
