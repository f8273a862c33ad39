"""The hooks' start-up checks, without a server: each hook's target has the parameters the hook
expects in the installed SGLang, a changed one stops registration naming it, and every
`sglang==` pin in the repository is the version pdd.srt names."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.server_args import ServerArgs

from pdd.srt import SGLANG_VERSION, cpu_fork, hooks
from pdd.srt.plugin import all_hooks

ROOT = Path(__file__).resolve().parent.parent
ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What `hooks.register` hands SGLang's registry, recorded instead of registered: the test
    process's own registry (and pdd's record of it) stays untouched."""
    calls: list[str] = []
    monkeypatch.setattr(HookRegistry, "register", lambda target, *a, **kw: calls.append(target))
    monkeypatch.setattr(hooks, "_registered", [])
    return calls


def test_every_hook_fits_the_installed_sglang(registered: list[str]) -> None:
    every = all_hooks()
    assert hooks.signature_problems(every) == []
    hooks.register(every)
    assert registered == [h.target for h in every]


def test_a_changed_signature_stops_registration_naming_the_function(
    monkeypatch: pytest.MonkeyPatch, registered: list[str]
) -> None:
    def on_idle(self: Any, now: float = 0.0) -> None: ...

    monkeypatch.setattr(Scheduler, "on_idle", on_idle)
    with pytest.raises(SystemExit) as stop:
        hooks.register(all_hooks())
    message = str(stop.value.code)
    assert f"{ON_IDLE}: expected (self), found (self, now)" in message
    assert f"pinned to {SGLANG_VERSION}" in message
    assert "get_loads" not in message  # only the changed function is named
    assert registered == []  # no hook at all on a process that stops


def test_a_changed_classmethod_and_a_missing_function_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ServerArgs, "from_cli_args", classmethod(lambda cls, args, extra: None))
    monkeypatch.delattr(Scheduler, "on_idle")
    assert hooks.signature_problems(all_hooks()) == [
        "sglang.srt.server_args.ServerArgs.from_cli_args: expected (cls, args), "
        "found (cls, args, extra)",
        f"{ON_IDLE}: not found",
    ]


def test_another_plugins_wrapper_is_looked_past(monkeypatch: pytest.MonkeyPatch) -> None:
    # What SGLang's registry leaves behind when another plugin hooked the same function first.
    inner = Scheduler.on_idle

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    monkeypatch.setattr(Scheduler, "on_idle", wrapper)
    assert hooks.signature_problems(all_hooks()) == []


def test_a_hook_sglang_did_not_apply_is_named_for_a_role(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = hooks.Hook(ON_IDLE, lambda *a: None, HookType.AFTER, "(self)")
    monkeypatch.setattr(hooks, "_registered", [hook])
    monkeypatch.setattr(HookRegistry, "_patched", set())
    with pytest.raises(SystemExit, match=rf"hook\(s\) not applied \(here\): {ON_IDLE}"):
        hooks.check_startup("here")


def sglang_pins(path: Path) -> list[str]:
    # `sglang==X`, not `sglang-router==X`.
    return re.findall(r"(?<![\w-])sglang==([0-9][\w.]*)", path.read_text())


def test_every_sglang_pin_is_the_version_pdd_srt_names() -> None:
    files = [ROOT / "setup.py", ROOT / "launch" / "setup.sh", ROOT / "README.md",
             *sorted((ROOT / "requirements").glob("*.txt"))]  # fmt: skip
    pins = {str(f.relative_to(ROOT)): sglang_pins(f) for f in files}
    assert pins["setup.py"] and pins["launch/setup.sh"], pins  # the two that install it
    assert {v for found in pins.values() for v in found} == {SGLANG_VERSION}, pins


def test_cpu_servers_fork_their_subprocesses_and_others_keep_spawn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    methods: list[str] = []
    monkeypatch.setattr(
        cpu_fork.multiprocessing, "set_start_method", lambda m, force: methods.append(m)
    )
    monkeypatch.setattr(cpu_fork, "has_gpu", lambda: False)
    assert cpu_fork.start_method("cpu") == "fork"
    assert cpu_fork.start_method("cuda") is None
    assert cpu_fork.start_method(None) is None
    cpu_fork._after_set_envs_and_config(None, SimpleNamespace(device="cuda"))
    cpu_fork._after_set_envs_and_config(None, SimpleNamespace(device="cpu"))
    assert methods == ["fork"]
    monkeypatch.setattr(cpu_fork, "has_gpu", lambda: True)
    assert cpu_fork.start_method("cpu") is None
