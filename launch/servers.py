"""Command lines for SGLang servers and SGLang's PD router, as this project launches them."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdd.control.secret import ENV_SECRET, is_loopback, write_secret
from pdd.launch.process import DP_ATTENTION_PORTS, ManagedProcess, check_reserved, free_port
from pdd.srt.cpu_support import has_gpu

# The KV pool of a CPU server otherwise takes ~15 GB of RAM.
CPU_MAX_TOTAL_TOKENS = 8192
SERVER_START_TIMEOUT_S = 300.0
# The dtype of every server this launcher starts, unless its arguments name one. The test suite
# sets float32: in bf16 a greedy near-tie can flip with the batch a request shares, so two correct
# paths (P->D and colocated) may then differ, and an equality test would flake.
DTYPE_ENV = "PDD_SERVER_DTYPE"
# SGLang picks its torch rendezvous port (22000-29999) in one process and binds it seconds later
# in another; a server started meanwhile can take it. Such a start is retried with a fresh pick.
PORT_RACE_MARKER = "EADDRINUSE"
PORT_RACE_RETRIES = 2


@dataclass(frozen=True)
class Placement:
    """Where a server runs: the address it serves on, and the command prefix that puts it there
    (e.g. `ip netns exec pdd-a` for datacenter A of the testbed)."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()

    def on_cpus(self, cpus: str | None) -> Placement:
        """The same place with the server's processes (and their children) held to `cpus`
        (taskset's list form, e.g. "0" or "2-3"); None: wherever the kernel runs them."""
        if not cpus:
            return self
        return replace(self, prefix=(*self.prefix, "taskset", "--cpu-list", cpus))


LOCAL = Placement()


SECRET_FLAG = "--pdd-secret-file"
SECRET_FILE = "control.secret"


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after `flag` in a command line, or None when the flag is absent."""
    return args[args.index(flag) + 1] if flag in args else None


def control_secret_file(server: SGLangServer) -> str | None:
    """The secret file of a MainDecode server's control socket, if it has one."""
    return flag_value(server.argv(), SECRET_FLAG)


def device_env() -> dict[str, str]:
    """SGLang reads SGLANG_USE_CPU_ENGINE at import time, so it must be set before start."""
    return {} if has_gpu() else {"SGLANG_USE_CPU_ENGINE": "1"}


class HttpService:
    """What a server and the router share: an address, one managed process, a readiness probe."""

    name: str
    port: int
    log_dir: Path
    placement: Placement
    process: ManagedProcess | None

    @property
    def host(self) -> str:
        return self.placement.host

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def launch(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = self.log_dir / f"{self.name}.log"
        self.process = ManagedProcess(self.name, argv, log, env or {})
        self.process.start()

    def wait_ready(self, timeout: float = SERVER_START_TIMEOUT_S) -> float:
        """Seconds until /health answers; a start that lost a port race is retried."""
        process = self.process
        assert process is not None, f"{self.name} was never started"
        waited = 0.0
        for attempt in range(PORT_RACE_RETRIES + 1):
            try:
                return waited + process.wait_http_ok(f"{self.url}/health", timeout)
            except RuntimeError:
                lost_race = process.exited() and PORT_RACE_MARKER in process.log_tail(200)
                if not lost_race or attempt == PORT_RACE_RETRIES:
                    raise
            print(f"{self.name} lost a port race at start-up; starting it again", flush=True)
            waited += process.restart()
        raise AssertionError("unreachable")


@dataclass
class SGLangServer(HttpService):
    """One `python -m sglang.launch_server` process (colocated, prefill or decode)."""

    name: str
    model: Path
    port: int
    log_dir: Path
    placement: Placement = LOCAL
    mode: str | None = None  # None (colocated), "prefill" or "decode"
    bootstrap_port: int | None = None
    transfer_backend: str = "mooncake_tcp"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment
    process: ManagedProcess | None = None

    def argv(self) -> list[str]:
        argv = [
            *self.placement.prefix, sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model),
            "--host", self.host,
            "--port", str(self.port),
        ]  # fmt: skip
        if not has_gpu():
            # An idle scheduler otherwise busy-polls a whole core; CPU machines here have two.
            argv += ["--device", "cpu", "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
            argv += ["--sleep-on-idle"]
        if self.mode is not None:
            argv += [
                "--disaggregation-mode", self.mode,
                "--disaggregation-transfer-backend", self.transfer_backend,
            ]  # fmt: skip
        if self.bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        dtype = os.environ.get(DTYPE_ENV)
        if dtype and "--dtype" not in self.extra_args:
            argv += ["--dtype", dtype]
        return argv + self.extra_args + self.secret_args()

    def secret_args(self) -> list[str]:
        """MainDecode's control socket binds its --host, which beyond loopback needs a secret:
        one per run directory, which the router of these servers uses too."""
        args = self.extra_args
        if flag_value(args, "--pdd-role") != "main":
            return []
        if SECRET_FLAG in args or is_loopback(self.host) or os.environ.get(ENV_SECRET):
            return []
        return [SECRET_FLAG, str(write_secret(self.log_dir / SECRET_FILE))]

    def server_info(self) -> dict[str, object]:
        """The running server's settings, as SGLang resolved them (`/server_info`)."""
        with urllib.request.urlopen(f"{self.url}/server_info", timeout=30) as resp:
            info: dict[str, object] = json.loads(resp.read())
        return info

    def start(self) -> None:
        if "--enable-dp-attention" in self.extra_args:
            check_reserved(self.port, DP_ATTENTION_PORTS)
        # Mooncake advertises SGLANG_HOST_IP to its peers; without it SGLang guesses from the
        # NICs, which may not be the address this server was asked to serve on.
        self.launch(self.argv(), {**device_env(), "SGLANG_HOST_IP": self.host, **self.env})


@dataclass
class PDRouter(HttpService):
    """SGLang's router (PyPI sglang-router) in prefill-decode mode."""

    name: str
    port: int
    log_dir: Path
    prefill: list[SGLangServer]
    decode: list[SGLangServer]
    placement: Placement = LOCAL
    process: ManagedProcess | None = None
    # Its Prometheus exporter binds 0.0.0.0:29000 unless told: a second router on the machine
    # would die at start-up ("Address already in use").
    metrics_port: int = field(default_factory=free_port)

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
        for p in self.prefill:
            argv += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in self.decode:
            argv += ["--decode", d.url]
        metrics = ["--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port)]
        return [*self.placement.prefix, *argv, "--host", self.host, "--port", str(self.port),
                *metrics]  # fmt: skip

    def start(self) -> None:
        self.launch(self.argv())
