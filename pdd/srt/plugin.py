"""The SGLang plugin entry point (group `sglang.srt.plugins`), run in every SGLang process."""

from __future__ import annotations


def load() -> None:
    from pdd.srt import (
        cpu_disagg,
        cpu_tp,
        flags,
        hooks,
        idle,
        main_decode_hooks,
        request_guard,
        wan_transfer,
    )

    hooks.register(
        [*flags.HOOKS, *cpu_disagg.HOOKS, *cpu_tp.HOOKS, *idle.HOOKS, *main_decode_hooks.HOOKS,
         *request_guard.HOOKS, *wan_transfer.HOOKS]
    )  # fmt: skip
