"""The --pdd-* flags of `python -m sglang.launch_server`.

SGLang rejects unknown flags and drops unknown fields when it builds ServerArgs, so the plugin
adds its flags to SGLang's parser and copies the parsed values into the environment, which every
SGLang subprocess inherits.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from pdd.srt.cpu_disagg import adjust_cpu_args

ROLES = ("prefill", "relay", "main")
# The SGLang disaggregation mode each role needs.
ROLE_MODE = {"prefill": "prefill", "relay": "decode", "main": "decode"}
ENV_ROLE = "PDD_ROLE"


@dataclass(frozen=True)
class PddConfig:
    role: str | None = None

    @classmethod
    def from_env(cls) -> PddConfig:
        return cls(role=os.environ.get(ENV_ROLE) or None)

    def to_env(self) -> None:
        if self.role is None:
            os.environ.pop(ENV_ROLE, None)
        else:
            os.environ[ENV_ROLE] = self.role


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("PDD (cross-datacenter prefill-decode disaggregation)")
    group.add_argument(
        "--pdd-role",
        choices=ROLES,
        default=None,
        help="This server's PDD tier: prefill (P, datacenter A), relay (RelayDecode, datacenter A) "
        "or main (MainDecode, datacenter B). Unset: a plain SGLang server.",
    )


def config_from_args(args: argparse.Namespace) -> PddConfig:
    """Validate the PDD flags against SGLang's own and return them; exits with a clear error."""
    role = getattr(args, "pdd_role", None)
    if role is not None:
        mode = getattr(args, "disaggregation_mode", None)
        if mode != ROLE_MODE[role]:
            raise SystemExit(
                f"error: --pdd-role {role} needs --disaggregation-mode {ROLE_MODE[role]} "
                f"(got {mode!r})"
            )
    return PddConfig(role=role)


def _after_add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    add_args(parser)
    return result


def _before_from_cli_args(cls: type, args: argparse.Namespace) -> None:
    config_from_args(args).to_env()
    adjust_cpu_args(args)


def register() -> None:
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", _before_from_cli_args, HookType.BEFORE
    )
