"""The router's configuration: its instances, addresses, handoff policy and timeouts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pdd.control.curve import CurveKeys, encrypt_problem
from pdd.control.ports import rank_control_port
from pdd.control.secret import ENV_SECRET, bind_problem, read_secret, warn_if_readable
from pdd.policy.handoff import MODES, HandoffPolicy
from pdd.policy.path import DEFAULT_PATHS, PathPolicy
from pdd.router.tokenizer import check_tokenizer_dir


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http://host:port URL, got {url!r}")
    return url.rstrip("/")


def _port(value: str | int, what: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise ValueError(f"{what} must be in 1-65535, got {port}")
    return port


def _tokenizer_dir(path: Path | None) -> Path | None:
    # Checked at parsing, so a wrong path is a usage error, not a transformers traceback.
    if path is not None:
        check_tokenizer_dir(path)
    return path


@dataclass(frozen=True)
class PrefillTarget:
    url: str
    bootstrap_port: int

    @property
    def bootstrap_host(self) -> str:
        host = urlsplit(self.url).hostname
        assert host is not None
        return host


@dataclass(frozen=True)
class RelayTarget:
    url: str


@dataclass(frozen=True)
class MainTarget:
    """One MD: a server, or one DP rank of a server with DP attention (its requests carry
    SGLang's `routed_dp_rank`; its control socket is the server's port plus the rank)."""

    url: str
    control_port: int  # the server's --pdd-control-port
    dp_rank: int | None = None

    @property
    def control_addr(self) -> str:
        port = rank_control_port(self.control_port, self.dp_rank or 0)
        return f"tcp://{urlsplit(self.url).hostname}:{port}"


def _main_targets(main: list[list[str]], main_dp: list[list[str]]) -> tuple[MainTarget, ...]:
    targets = [MainTarget(_check_url(u), _port(p, "control port")) for u, p in main]
    for url, port, size in main_dp:
        ranks = int(size) if size.isdigit() else 0
        if not 1 <= ranks <= 64:
            raise ValueError(f"--main-dp {url}: DP size must be in 1-64, got {size!r}")
        base = _port(port, "control port")
        _port(rank_control_port(base, ranks - 1), f"DP rank {ranks - 1}'s control port")
        targets += [MainTarget(_check_url(url), base, rank) for rank in range(ranks)]
    return tuple(targets)


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0  # TCP connect to an instance
    ready: float = 60.0  # request start -> MD's READY; after it RLD finishes the request alone
    ack: float = 30.0  # Catch-Up CHUNK -> MD's ACK
    stream_idle: float = 300.0  # longest silence inside a stream
    request: float = 1800.0  # a whole request
    abort: float = 5.0  # best-effort /abort_request calls


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[PrefillTarget, ...]
    relay: tuple[RelayTarget, ...] = ()
    main: tuple[MainTarget, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    control_host: str = "127.0.0.1"
    control_port: int = 0  # 0: any free port
    control_advertise: str | None = None  # the host MD reaches the router at, if not control_host
    path: str = "auto"
    handoff: HandoffPolicy = field(default_factory=HandoffPolicy)
    timeouts: Timeouts = field(default_factory=Timeouts)
    secret: bytes | None = None
    control_insecure: bool = False  # allow an unauthenticated control socket beyond loopback
    control_encrypt: bool = False  # CURVE on the control sockets (pdd.control.curve)
    # The OpenAI endpoints (/v1/...): the router tokenizes their prompts itself. The name and
    # the prompt limit default to the tokenizer directory's name and its config.json.
    tokenizer: Path | None = None
    served_model_name: str | None = None
    max_prompt_tokens: int | None = None
    # Feed MD only once the client has this many tokens from RLD: emulates a slow WAN transfer
    # without a testbed, so tests can force Catch-Up deterministically; 0 in production.
    md_feed_after_tokens: int = 0
    # Honour the requests' test controls (pdd_hold_relay: pdd.router.hold); off in production.
    test_controls: bool = False
    # How often the router asks each MD what its radix cache holds (also a heartbeat).
    cache_sync_interval_s: float = 5.0
    path_policy: PathPolicy = field(default_factory=PathPolicy)
    relay_capacity: int | None = None  # requests per RLD; None: what each server reports
    health_interval_s: float = 2.0
    # How often the router asks each server for its load (SGLang's /v1/loads).
    load_interval_s: float = 0.5
    wan_mbit: float | None = None  # a first guess of the WAN's bandwidth, until measured
    prefill_index_blocks: int = 200_000  # 16-token blocks the router remembers per P
    prefix_slack: int = 2  # requests more than the least loaded that a better prefix may cost
    # Admission control: requests beyond this many in flight get 503 and Retry-After at once,
    # instead of queueing without bound behind the servers' own queues.
    max_active: int = 1024

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ValueError("at least one --prefill instance is needed")
        flags = ("--secret-file", "--control-insecure")
        problem = bind_problem(self.control_host, self.secret, self.control_insecure, flags)
        if problem:
            raise ValueError(problem)
        if self.control_encrypt:
            problem = encrypt_problem(self.secret, ("--control-encrypt", "--secret-file"))
            if problem:
                raise ValueError(problem)
        if self.max_active < 1:
            raise ValueError("--max-active must be at least 1")
        name, limit = self.served_model_name, self.max_prompt_tokens
        if self.tokenizer is None and (name, limit) != (None, None):
            raise ValueError("--served-model-name and --max-prompt-tokens need --tokenizer")
        if name == "" or (limit is not None and limit < 1):
            raise ValueError("--served-model-name must be non-empty, --max-prompt-tokens >= 1")
        if self.path not in DEFAULT_PATHS:
            raise ValueError(f"--path must be one of {DEFAULT_PATHS}, got {self.path!r}")
        if self.path in ("pdd", "relay") and not self.relay:
            raise ValueError(f"--path {self.path} needs at least one --relay instance")
        if self.path in ("pdd", "main") and not self.main:
            raise ValueError(f"--path {self.path} needs at least one --main instance")
        if self.path == "auto" and not (self.relay or self.main):
            raise ValueError("--path auto needs a --relay or a --main instance")
        if self.relay_capacity is not None and self.relay_capacity < 0:
            raise ValueError("--relay-max-load must be >= 0")
        if self.load_interval_s <= 0:
            raise ValueError("--load-interval must be > 0")
        if self.health_interval_s <= 0 or self.prefill_index_blocks < 1 or self.prefix_slack < 0:
            raise ValueError("--health-interval > 0, --prefix-slack >= 0 needed")
        if self.wan_mbit is not None and self.wan_mbit <= 0:
            raise ValueError("--wan-mbit must be > 0")
        if self.cache_sync_interval_s <= 0:
            raise ValueError("--cache-sync-interval must be > 0")
        if self.md_feed_after_tokens < 0:
            raise ValueError("--md-feed-after-tokens must be >= 0")

    def curve(self) -> CurveKeys | None:
        """The router's CURVE keys when the control plane is encrypted, else None."""
        return CurveKeys.derive(self.secret, "router") if self.control_encrypt else None

    @property
    def advertise_host(self) -> str:
        if self.control_advertise:
            return self.control_advertise
        if self.control_host in ("0.0.0.0", "*", "::"):
            raise ValueError("--control-host binds every address: give --control-advertise")
        return self.control_host


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add(
        "--prefill",
        nargs=2,
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill (P) server and its disaggregation bootstrap port; repeatable",
    )
    add(
        "--relay",
        action="append",
        default=[],
        metavar="URL",
        help="a RelayDecode (RLD) server: a plain SGLang decode server; repeatable",
    )
    add(
        "--main",
        nargs=2,
        action="append",
        default=[],
        metavar=("URL", "CONTROL_PORT"),
        help="a MainDecode (MD) server and its --pdd-control-port; repeatable",
    )
    add(
        "--main-dp",
        nargs=3,
        action="append",
        default=[],
        metavar=("URL", "CONTROL_PORT", "DP_SIZE"),
        help="an MD server started with --enable-dp-attention --dp-size DP_SIZE: each DP rank is "
        "an MD of its own (its queue, KV pool and radix cache; control socket CONTROL_PORT + "
        "rank), its requests pinned with SGLang's routed_dp_rank; repeatable",
    )
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--control-host", default="127.0.0.1", help="where the router's control socket binds")
    add("--control-port", type=int, default=0, help="its port (0: any free port)")
    add(
        "--control-advertise",
        default=None,
        help="the host MD servers reach the control socket at (default: --control-host)",
    )
    add(
        "--path",
        choices=DEFAULT_PATHS,
        default="auto",
        help="default path when a request has no pdd_path: auto (chosen per request from MD's "
        "cached prefix, the WAN's measured speed, RLD's load and the output length), pdd "
        "(P->RLD->MD), relay (P->RLD), main (P->MD)",
    )
    add(
        "--ttft-sla",
        type=float,
        default=PathPolicy.ttft_sla_s,
        help="auto: the TTFT SLA in seconds; P->MD whenever its predicted first token meets it, "
        "P->RLD->MD (RLD hides the WAN) otherwise (default %(default)s)",
    )
    add(
        "--relay-max-load",
        type=int,
        default=None,
        help="auto: requests an RLD runs at once (default: what each RLD server reports, its "
        f"max running requests; {PathPolicy.relay_max_load} when it reports none); a full RLD "
        "takes no new request and low-hit ones go P->MD",
    )
    add(
        "--no-relay-guard",
        action="store_true",
        help="auto: let low-hit requests onto a full RLD (they queue there): shows the overload "
        "the guard prevents; never in production",
    )
    add(
        "--max-active",
        type=int,
        default=1024,
        help="admission control: requests in flight beyond this get 503 with Retry-After",
    )
    add(
        "--relay-only-share",
        type=float,
        default=PathPolicy.relay_only_share,
        help="auto: relay-only (P->RLD) traffic stops at this share of an RLD's capacity, so it "
        "cannot swamp RLD (default %(default)s)",
    )
    add(
        "--singular-max-new",
        type=int,
        default=PathPolicy.singular_max_new,
        help="auto: a request RLD finishes before its KV reaches MD stays on RLD alone only "
        "with at most this many output tokens; a longer answer's prompt is sent to MD as well, "
        "for the next turn (default %(default)s)",
    )
    add(
        "--wan-mbit",
        type=float,
        default=None,
        help="a first guess of the WAN bandwidth to MD, until the router has measured it",
    )
    add("--health-interval", type=float, default=2.0, help="seconds between health checks")
    add(
        "--load-interval",
        type=float,
        default=0.5,
        help="seconds between asking each server its load (/v1/loads): routers sharing "
        "servers balance on the servers' own counts",
    )
    add(
        "--prefix-slack",
        type=int,
        default=2,
        help="requests above the least-loaded instance a longer cached prefix may cost",
    )
    add("--handoff-mode", choices=MODES, default="auto")
    add("--catchup-chunk", type=int, default=64, help="tokens per Catch-Up chunk")
    add(
        "--catchup-max-chunks",
        type=int,
        default=32,
        help="after this many Catch-Up chunks the rest goes in the final handoff",
    )
    add(
        "--finish-on-relay",
        type=int,
        default=8,
        help="when MD is ready with at most this many tokens left, RLD finishes the answer",
    )
    add(
        "--catchup-threshold",
        type=int,
        default=64,
        help="hand off in one extend when at most this many tokens are pending",
    )
    add(
        "--auto-max-relay-load",
        type=int,
        default=4,
        help="auto mode uses Catch-Up while an RLD runs at most this many relay requests",
    )
    add(
        "--ready-timeout",
        type=float,
        default=Timeouts.ready,
        help="seconds from a request's start to MD's READY; RLD finishes the request alone after",
    )
    add("--ack-timeout", type=float, default=Timeouts.ack)
    add("--connect-timeout", type=float, default=Timeouts.connect)
    add("--stream-idle-timeout", type=float, default=Timeouts.stream_idle)
    add("--request-timeout", type=float, default=Timeouts.request)
    add(
        "--secret-file",
        type=Path,
        default=None,
        help=f"the control-plane HMAC secret (else ${ENV_SECRET}; unset: unsigned messages, "
        "allowed only on a loopback --control-host or with --control-insecure)",
    )
    add(
        "--control-insecure",
        action="store_true",
        help="allow an unauthenticated control socket on a non-loopback --control-host "
        "(anyone who reaches it can forge READYs and ACKs); a warning is logged",
    )
    add(
        "--control-encrypt",
        action="store_true",
        help="encrypt the control plane with ZeroMQ's CURVE, keys derived from --secret-file "
        "(which it needs); every MD must run with --pdd-control-encrypt too",
    )
    add(
        "--tokenizer",
        type=Path,
        default=None,
        help="a local model directory with the served model's tokenizer: enables the OpenAI "
        "endpoints (/v1/chat/completions, /v1/completions, /v1/models)",
    )
    add(
        "--served-model-name",
        default=None,
        help="the model name the OpenAI endpoints answer to (default: the tokenizer's directory)",
    )
    add(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longest prompt the OpenAI endpoints accept (default: max_position_embeddings in "
        "the tokenizer directory's config.json, else 32768)",
    )
    add(
        "--cache-sync-interval",
        type=float,
        default=5.0,
        help="seconds between the router's cache-sync requests to each MD (a heartbeat too)",
    )
    add(
        "--md-feed-after-tokens",
        type=int,
        default=0,
        help="testing: feed MD only after RLD has streamed this many tokens (emulates a slow WAN)",
    )
    add(
        "--test-controls",
        action="store_true",
        help="for tests only: honour the requests' test controls (pdd_hold_relay: k, the "
        "P->RLD->MD handoff once the client has k tokens); without it such a request gets 400",
    )
    add("--log-level", default="info")
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    warn_if_readable(args.secret_file)
    return RouterConfig(
        prefill=tuple(
            PrefillTarget(_check_url(u), _port(p, "bootstrap port")) for u, p in args.prefill
        ),
        relay=tuple(RelayTarget(_check_url(u)) for u in args.relay),
        main=_main_targets(args.main, args.main_dp),
        host=args.host,
        port=args.port,
        control_host=args.control_host,
        control_port=args.control_port,
        control_advertise=args.control_advertise,
        path=args.path,
        handoff=HandoffPolicy(
            mode=args.handoff_mode,
            chunk=args.catchup_chunk,
            threshold=args.catchup_threshold,
            auto_max_relay_load=args.auto_max_relay_load,
            max_chunks=args.catchup_max_chunks,
            finish_on_relay=args.finish_on_relay,
        ),
        timeouts=Timeouts(
            connect=args.connect_timeout,
            ready=args.ready_timeout,
            ack=args.ack_timeout,
            stream_idle=args.stream_idle_timeout,
            request=args.request_timeout,
        ),
        secret=read_secret(args.secret_file),
        control_insecure=args.control_insecure,
        control_encrypt=args.control_encrypt,
        tokenizer=_tokenizer_dir(args.tokenizer),
        served_model_name=args.served_model_name,
        max_prompt_tokens=args.max_prompt_tokens,
        md_feed_after_tokens=args.md_feed_after_tokens,
        test_controls=args.test_controls,
        cache_sync_interval_s=args.cache_sync_interval,
        path_policy=PathPolicy(
            ttft_sla_s=args.ttft_sla,
            relay_only_share=args.relay_only_share,
            singular_max_new=args.singular_max_new,
            guard=not args.no_relay_guard,
        ),
        relay_capacity=args.relay_max_load,
        health_interval_s=args.health_interval,
        load_interval_s=args.load_interval,
        wan_mbit=args.wan_mbit,
        prefix_slack=args.prefix_slack,
        max_active=args.max_active,
    )
