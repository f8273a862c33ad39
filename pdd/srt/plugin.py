"""The SGLang plugin entry point (group `sglang.srt.plugins`), run in every SGLang process."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdd.srt.hooks import Hook


def all_hooks() -> list[Hook]:
    """Every hook pdd applies (imported here, not at module level: SGLang loads the plugin early
    in each process, and the hook modules import SGLang's)."""
    from pdd.srt import (
        cpu_disagg,
        cpu_dp,
        cpu_fork,
        cpu_tp,
        flags,
        idle,
        main_decode_hooks,
        mla_cpu,
        prefill_heartbeat,
        request_guard,
        wan_transfer,
    )

    return [*flags.HOOKS, *cpu_disagg.HOOKS, *cpu_dp.HOOKS, *cpu_fork.HOOKS, *cpu_tp.HOOKS,
            *idle.HOOKS, *main_decode_hooks.HOOKS, *mla_cpu.HOOKS, *prefill_heartbeat.HOOKS,
            *request_guard.HOOKS, *wan_transfer.HOOKS]  # fmt: skip


def load() -> None:
    from pdd.srt import hooks

    # Stops the process (SystemExit passes SGLang's plugin loader) if a target's parameters
    # differ from the pinned SGLang's, before any hook is installed.
    hooks.register(all_hooks())
