"""The SGLang hooks pdd applies, and the start-up checks that they fit the installed SGLang.

A hook reads its target's arguments by position or name, so an SGLang upgrade that changes a
target's parameters would make it misread them, and one that renames a target would only be
logged by SGLang's registry, leaving the server without part of pdd. So each Hook carries its
target's parameters as the pinned SGLang has them, and `register` (run by the plugin in every
SGLang process, plain servers too) refuses to install any hook, naming the function, if a target
is missing or its parameters differ. A server with a PDD role also stops if a hook was not
applied or if the installed SGLang is not the pinned version.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from pdd.srt import SGLANG_VERSION


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path of the SGLang function or method
    fn: Callable[..., Any]
    kind: HookType
    # The target's parameters in the pinned SGLang, as `parameters` writes them: "(self, batch)".
    signature: str


_registered: list[Hook] = []


def original(target: str) -> Callable[..., Any] | None:
    """The function `target` names, unpatched, or None if this SGLang has no such function."""
    owner_path, _, name = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(owner_path)
        # Static lookup, as the registry does: a classmethod's function keeps its `cls`.
        found = inspect.getattr_static(owner, name)
    except (ImportError, AttributeError, ValueError):
        return None
    if isinstance(found, classmethod | staticmethod):
        found = found.__func__
    return found if callable(found) else None


def parameters(fn: Callable[..., Any]) -> str:
    """`fn`'s parameter names and kinds ("(self, a, *args, b, **kw)"), without annotations or
    defaults: what a hook depends on, and stable across how annotations are written."""
    try:
        sig = inspect.signature(fn)  # follows __wrapped__: another plugin's wrapper is looked past
    except (TypeError, ValueError):
        return "(?)"
    empty = inspect.Parameter.empty
    bare = [p.replace(annotation=empty, default=empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def signature_problems(hooks: Iterable[Hook]) -> list[str]:
    """One line per hook whose target this SGLang lacks or has with other parameters."""
    problems: list[str] = []
    for hook in hooks:
        fn = original(hook.target)
        if fn is None:
            problems.append(f"{hook.target}: not found")
            continue
        found = parameters(fn)
        if found != hook.signature:
            problems.append(f"{hook.target}: expected {hook.signature}, found {found}")
    return problems


def register(hooks: Iterable[Hook]) -> None:
    """Checks every hook's target, then registers them all, or none: a hook on a changed
    function would misread its arguments, so the process stops before serving anything."""
    every = list(hooks)
    problems = signature_problems(every)
    if problems:
        version = importlib.metadata.version("sglang")
        raise SystemExit(
            f"error: pdd's SGLang hooks do not fit sglang {version} (pdd is pinned to "
            f"{SGLANG_VERSION}): {'; '.join(problems)}"
        )
    for hook in every:
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
