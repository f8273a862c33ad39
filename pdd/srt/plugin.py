"""The SGLang plugin entry point (group `sglang.srt.plugins`), run in every SGLang process."""

from __future__ import annotations


def load() -> None:
    from pdd.srt import cpu_disagg, flags, idle, main_decode

    flags.register()
    cpu_disagg.register()
    idle.register()
    main_decode.register()
