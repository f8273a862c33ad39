"""The PDD router (`python -m pdd.router`) as a launchable service, like the SGLang servers."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdd.control.secret import ENV_SECRET, is_loopback, write_secret
from pdd.launch.process import ManagedProcess, free_port
from pdd.launch.servers import (
    LOCAL,
    SECRET_FILE,
    HttpService,
    Placement,
    SGLangServer,
    control_secret_file,
    flag_value,
)

CONTROL_PORT_FLAG = "--pdd-control-port"


def main_control_port(server: SGLangServer) -> int:
    """The control port an MD server was started with (its --pdd-control-port)."""
    port = flag_value(server.extra_args, CONTROL_PORT_FLAG)
    if port is None:
        raise ValueError(f"{server.name} has no {CONTROL_PORT_FLAG}: it is not a MainDecode server")
    return int(port)


@dataclass
class RouterService(HttpService):
    name: str
    port: int
    log_dir: Path
    prefill: list[SGLangServer]
    relay: list[SGLangServer] = field(default_factory=list)
    main: list[SGLangServer] = field(default_factory=list)
    placement: Placement = LOCAL
    # Where the router's control socket binds (default: the router's own host), and the host MD
    # servers reach it at, when that differs (e.g. a wildcard bind).
    control_host: str | None = None
    control_advertise: str | None = None
    control_port: int = 0  # 0: a free port, picked now
    path: str | None = None  # default path; None: auto, or the only one the tiers allow
    extra_args: list[str] = field(default_factory=list)
    process: ManagedProcess | None = None

    def __post_init__(self) -> None:
        if not self.control_port:
            self.control_port = free_port()

    def default_path(self) -> str:
        if self.path is not None:
            return self.path
        if self.relay and self.main:
            return "auto"
        return "relay" if self.relay else "main"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "pdd.router"]
        for p in self.prefill:
            argv += ["--prefill", p.url, str(p.bootstrap_port)]
        for r in self.relay:
            argv += ["--relay", r.url]
        for m in self.main:
            dp = flag_value(m.extra_args, "--dp-size")
            if "--enable-dp-attention" in m.extra_args and dp is not None:
                argv += ["--main-dp", m.url, str(main_control_port(m)), dp]
            else:
                argv += ["--main", m.url, str(main_control_port(m))]
        argv += [
            "--host", self.host,
            "--port", str(self.port),
            "--control-host", self.control_host or self.host,
            "--control-port", str(self.control_port),
            "--path", self.default_path(),
        ]  # fmt: skip
        if self.control_advertise:
            argv += ["--control-advertise", self.control_advertise]
        return [*self.placement.prefix, *argv, *self.secret_args(), *self.extra_args]

    def secret_args(self) -> list[str]:
        """The secret of the MainDecode servers' control sockets, which the router's own needs
        too beyond loopback (the run directory's, as `SGLangServer.secret_args` makes it)."""
        if "--secret-file" in self.extra_args or os.environ.get(ENV_SECRET):
            return []
        for m in self.main:
            secret = control_secret_file(m)
            if secret is not None:
                return ["--secret-file", secret]
        if is_loopback(self.control_host or self.host):
            return []
        return ["--secret-file", str(write_secret(self.log_dir / SECRET_FILE))]

    def start(self) -> None:
        self.launch(self.argv())
