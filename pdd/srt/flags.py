"""The --pdd-* flags of `python -m sglang.launch_server`.

SGLang rejects unknown flags and drops unknown fields when it builds ServerArgs, so the plugin
adds its flags to SGLang's parser and copies the parsed values into the environment, which every
SGLang subprocess inherits.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.control.curve import CurveKeys, encrypt_problem
from pdd.control.messages import MAX_BLOCK
from pdd.control.ports import rank_control_port
from pdd.control.secret import ENV_SECRET, bind_problem, read_secret, warn_if_readable
from pdd.srt.cpu_disagg import adjust_cpu_args
from pdd.srt.cpu_support import has_gpu, triton_interpreted
from pdd.srt.cpu_tp import adjust_cpu_tp_args
from pdd.srt.hooks import Hook, check_startup
from pdd.srt.wan_flows import AUTO_FLOWS, fixed_flows
from pdd.srt.wan_transfer import MAX_FLOWS, adjust_wan_args

logger = logging.getLogger(__name__)

ROLES = ("prefill", "relay", "main")
# The SGLang disaggregation mode each role needs.
ROLE_MODE = {"prefill": "prefill", "relay": "decode", "main": "decode"}
ENV_ROLE = "PDD_ROLE"
ENV_CONTROL_HOST = "PDD_CONTROL_HOST"
ENV_CONTROL_PORT = "PDD_CONTROL_PORT"
ENV_PARK_TIMEOUT = "PDD_PARK_TIMEOUT_S"
ENV_SECRET_FILE = "PDD_CONTROL_SECRET_FILE"
ENV_CONTROL_ENCRYPT = "PDD_CONTROL_ENCRYPT"
ENV_CACHE_BLOCK = "PDD_CACHE_BLOCK"
ENV_EXTEND_KERNEL = "PDD_EXTEND_KERNEL"
ENV_HANDOFF_BATCH = "PDD_HANDOFF_BATCH_S"
ENV_TREE_CORE = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
# MD's handoff-extend attention (pdd.srt.handoff_attention); the first is the default.
EXTEND_KERNELS = ("auto", "triton", "sglang")
DEFAULT_PARK_TIMEOUT_S = 120.0
DEFAULT_CACHE_BLOCK = 16


@dataclass(frozen=True)
class PddConfig:
    role: str | None = None
    control_host: str = "127.0.0.1"  # SGLang's default --host
    control_port: int | None = None
    park_timeout_s: float = DEFAULT_PARK_TIMEOUT_S
    secret_file: str | None = None
    control_encrypt: bool = False  # CURVE on the control sockets (pdd.control.curve)
    cache_block: int = DEFAULT_CACHE_BLOCK
    extend_kernel: str = EXTEND_KERNELS[0]
    handoff_batch_s: float = 0.0

    @classmethod
    def from_env(cls) -> PddConfig:
        env = os.environ
        port = env.get(ENV_CONTROL_PORT)
        return cls(
            role=env.get(ENV_ROLE) or None,
            control_host=env.get(ENV_CONTROL_HOST) or cls.control_host,
            control_port=int(port) if port else None,
            park_timeout_s=float(env.get(ENV_PARK_TIMEOUT) or DEFAULT_PARK_TIMEOUT_S),
            secret_file=env.get(ENV_SECRET_FILE) or None,
            control_encrypt=env.get(ENV_CONTROL_ENCRYPT) == "1",
            cache_block=int(env.get(ENV_CACHE_BLOCK) or DEFAULT_CACHE_BLOCK),
            extend_kernel=env.get(ENV_EXTEND_KERNEL) or EXTEND_KERNELS[0],
            handoff_batch_s=float(env.get(ENV_HANDOFF_BATCH) or 0.0),
        )

    def to_env(self) -> None:
        values = {
            ENV_ROLE: self.role,
            ENV_CONTROL_HOST: self.control_host,
            ENV_CONTROL_PORT: None if self.control_port is None else str(self.control_port),
            ENV_PARK_TIMEOUT: str(self.park_timeout_s),
            ENV_SECRET_FILE: self.secret_file,
            ENV_CONTROL_ENCRYPT: "1" if self.control_encrypt else None,
            ENV_CACHE_BLOCK: str(self.cache_block),
            ENV_EXTEND_KERNEL: self.extend_kernel,
            ENV_HANDOFF_BATCH: str(self.handoff_batch_s),
        }
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def secret(self) -> bytes | None:
        """The control plane's shared secret (HMAC key), or None when it is not authenticated."""
        return read_secret(self.secret_file)

    def curve(self) -> CurveKeys | None:
        """MD's CURVE keys when the control plane is encrypted, else None."""
        return CurveKeys.derive(self.secret(), "md") if self.control_encrypt else None


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("PDD (cross-datacenter prefill-decode disaggregation)")
    group.add_argument(
        "--pdd-role",
        choices=ROLES,
        default=None,
        help="This server's PDD tier: prefill (P, datacenter A), relay (RelayDecode, datacenter A) "
        "or main (MainDecode, datacenter B). Unset: a plain SGLang server.",
    )
    group.add_argument(
        "--pdd-control-port",
        type=int,
        default=None,
        help="MainDecode: port of the control-plane socket (ZMQ PULL) on which the router sends "
        "handoffs. Required with --pdd-role main.",
    )
    group.add_argument(
        "--pdd-control-host",
        default=None,
        help="MainDecode: address the control-plane socket binds to (default: the server's "
        "--host). Beyond loopback it needs --pdd-secret-file or --pdd-control-insecure.",
    )
    group.add_argument(
        "--pdd-control-insecure",
        action="store_true",
        help="MainDecode: allow an unauthenticated control socket on a non-loopback address "
        "(anyone who reaches it can send handoffs and cancels); a warning is logged.",
    )
    group.add_argument(
        "--pdd-control-encrypt",
        action="store_true",
        help="MainDecode: encrypt the control plane with ZeroMQ's CURVE, keys derived from "
        "--pdd-secret-file (which it needs); the router must give --control-encrypt too.",
    )
    group.add_argument(
        "--pdd-park-timeout",
        type=float,
        default=DEFAULT_PARK_TIMEOUT_S,
        help="MainDecode: seconds a request whose KV has landed waits for its handoff before MD "
        "frees it (default: %(default)s).",
    )
    group.add_argument(
        "--pdd-secret-file",
        default=None,
        help="File holding the control plane's shared secret (HMAC-SHA256); the router must use "
        f"the same. Alternatively set {ENV_SECRET}. Unset: messages are not authenticated.",
    )
    group.add_argument(
        "--pdd-cache-block",
        type=int,
        default=DEFAULT_CACHE_BLOCK,
        help="MainDecode: tokens per block when MD tells routers what its radix cache holds; "
        "smaller is more precise, larger is more compact (default: %(default)s).",
    )
    group.add_argument(
        "--pdd-extend-kernel",
        choices=EXTEND_KERNELS,
        default=EXTEND_KERNELS[0],
        help="MainDecode: attention of the handoff extend. auto: pdd's Triton kernel on GPUs, "
        "SGLang's attention backend elsewhere; triton: always the kernel (on a CPU only with "
        "TRITON_INTERPRET=1); sglang: always SGLang's backend (default: %(default)s).",
    )
    group.add_argument(
        "--pdd-handoff-batch-ms",
        type=float,
        default=0.0,
        help="MainDecode: hold handoffs and Catch-Up chunks up to this long after the first "
        "arrives, so that those arriving close together share one extend forward; 0 runs each "
        "scheduler step's arrivals together (default: %(default)s).",
    )
    group.add_argument(
        "--pdd-wan-flows",
        default=AUTO_FLOWS,
        help="KV sent over Mooncake's TCP transport (mooncake_tcp): TCP connections to each "
        "peer, and a request's KV is cut into pieces that use them all at once. "
        f"'{AUTO_FLOWS}' (default) chooses per peer from the measured round trip, the socket "
        f"buffers and what earlier writes reached; 1-{MAX_FLOWS} fixes the number.",
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
    port = getattr(args, "pdd_control_port", None)
    if role == "main" and port is None:
        raise SystemExit("error: --pdd-role main needs --pdd-control-port")
    if port is not None and not 0 < port < 65536:
        raise SystemExit(f"error: --pdd-control-port {port} is not a port number")
    dp_attention = getattr(args, "enable_dp_attention", False)
    last_rank = int(getattr(args, "dp_size", 1) or 1) - 1 if dp_attention else 0
    if port is not None and rank_control_port(port, last_rank) > 65535:
        raise SystemExit(
            f"error: --pdd-control-port {port}: DP rank {last_rank} would listen "
            f"on {rank_control_port(port, last_rank)}, beyond 65535"
        )
    park_timeout = getattr(args, "pdd_park_timeout", DEFAULT_PARK_TIMEOUT_S)
    if park_timeout <= 0:
        raise SystemExit("error: --pdd-park-timeout must be positive")
    secret_file = getattr(args, "pdd_secret_file", None)
    if secret_file is not None and not os.path.isfile(secret_file):
        raise SystemExit(f"error: --pdd-secret-file {secret_file} does not exist")
    control_host = getattr(args, "pdd_control_host", None) or getattr(args, "host", None)
    control_host = control_host or PddConfig.control_host
    encrypt = bool(getattr(args, "pdd_control_encrypt", False))
    secret = read_secret(secret_file) if role == "main" or encrypt else None
    if encrypt:
        problem = encrypt_problem(secret, ("--pdd-control-encrypt", "--pdd-secret-file"))
        if problem:
            raise SystemExit(f"error: {problem}")
    if role == "main":
        warn_if_readable(secret_file)
        insecure = bool(getattr(args, "pdd_control_insecure", False))
        flags = ("--pdd-secret-file", "--pdd-control-insecure")
        problem = bind_problem(control_host, secret, insecure, flags)
        if problem:
            raise SystemExit(f"error: {problem}")
    cache_block = getattr(args, "pdd_cache_block", DEFAULT_CACHE_BLOCK)
    if not 1 <= cache_block <= MAX_BLOCK:
        raise SystemExit(f"error: --pdd-cache-block must be in 1-{MAX_BLOCK}")
    extend_kernel = getattr(args, "pdd_extend_kernel", EXTEND_KERNELS[0])
    if extend_kernel == "triton" and not _triton_can_run(getattr(args, "device", None)):
        raise SystemExit(
            "error: --pdd-extend-kernel triton needs a CUDA GPU, or TRITON_INTERPRET=1 on a CPU"
        )
    batch_ms = getattr(args, "pdd_handoff_batch_ms", 0.0)
    if not 0 <= batch_ms <= 10_000:
        raise SystemExit("error: --pdd-handoff-batch-ms must be in 0-10000")
    try:
        fixed_flows(str(getattr(args, "pdd_wan_flows", AUTO_FLOWS)))
    except ValueError as err:
        raise SystemExit(f"error: --pdd-wan-flows {err}") from None
    return PddConfig(
        role=role,
        control_host=control_host,
        control_port=port,
        park_timeout_s=park_timeout,
        secret_file=secret_file,
        control_encrypt=encrypt,
        cache_block=cache_block,
        extend_kernel=extend_kernel,
        handoff_batch_s=batch_ms / 1000,
    )


def _triton_can_run(device: str | None) -> bool:
    return triton_interpreted() or (device != "cpu" and has_gpu())


def adjust_role_args(args: argparse.Namespace) -> None:
    """MainDecode reports its radix tree node by node, which SGLang's Python tree core does (the
    Rust one keeps its tree events inside Rust)."""
    if getattr(args, "pdd_role", None) != "main":
        return
    if os.environ.get(ENV_TREE_CORE) != "python":
        os.environ[ENV_TREE_CORE] = "python"
        logger.info("pdd: --pdd-role main uses the Python radix tree core (%s=python)",
                    ENV_TREE_CORE)  # fmt: skip


def _after_add_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    add_args(parser)
    return result


def _before_from_cli_args(cls: type, args: argparse.Namespace) -> None:
    config = config_from_args(args)
    if config.role is not None:
        check_startup("launch_server")
    config.to_env()
    adjust_role_args(args)
    adjust_wan_args(args)
    adjust_cpu_args(args)
    adjust_cpu_tp_args(args)


def _after_scheduler_init(result: None, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    # Each scheduler process loads the plugin and applies the hooks anew: check again there.
    if PddConfig.from_env().role is not None:
        check_startup(f"scheduler, TP rank {getattr(scheduler, 'tp_rank', 0)}")


HOOKS = (
    Hook("sglang.srt.managers.scheduler.Scheduler.__init__", _after_scheduler_init,
         HookType.AFTER, "(self, server_args, port_args)"),
    Hook("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER,
         "(parser)"),
    Hook("sglang.srt.server_args.ServerArgs.from_cli_args", _before_from_cli_args,
         HookType.BEFORE, "(cls, args)"),
)  # fmt: skip
