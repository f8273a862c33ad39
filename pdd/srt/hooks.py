"""The SGLang hooks pdd applies, and the start-up check that every one of them took effect.

SGLang's hook registry only logs a target it cannot resolve (renamed in an upgrade, say), and a
server would then run without part of pdd. So each module of pdd.srt lists its hooks here, and a
server with a PDD role stops at start-up, naming the hook, if one was not applied or if the
installed SGLang is not the version pdd is pinned to.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

SGLANG_VERSION = "0.5.23"  # pinned in requirements/ and launch/setup.sh


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path of the SGLang function or method
    fn: Callable[..., Any]
    kind: HookType


_registered: list[Hook] = []


def register(hooks: Iterable[Hook]) -> None:
    for hook in hooks:
        HookRegistry.register(hook.target, hook.fn, hook.kind)
        _registered.append(hook)


def missing() -> list[str]:
    """Targets of the registered hooks that SGLang did not patch."""
    applied = HookRegistry._patched  # the registry's own record of what it patched
    return [h.target for h in _registered if h.target not in applied]


def startup_problem(where: str) -> str | None:
    """Why this process cannot run a PDD role, or None."""
    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        return f"pdd needs sglang=={SGLANG_VERSION}, but {version} is installed ({where})"
    gone = missing()
    if gone:
        return (f"SGLang hook(s) not applied ({where}): {', '.join(gone)}; this SGLang does not "
                f"have what pdd patches, see the server log for why")  # fmt: skip
    return None


def check_startup(where: str) -> None:
    problem = startup_problem(where)
    if problem is not None:
        raise SystemExit(f"error: {problem}")
