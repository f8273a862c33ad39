"""A same-datacenter PD deployment on this machine: prefill + decode (mooncake_tcp) + router.

    python -m pdd.launch.pd_local up --model DIR      # start, wait until it serves, return
    python -m pdd.launch.pd_local status
    python -m pdd.launch.pd_local down                # stop everything it started

`up` records each process group (and the model and ports) in RUN_DIR/state.json; `down` stops
those groups, so it also cleans up after a launcher that crashed.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdd.launch.cli import command_parser
from pdd.launch.process import free_port, group_alive, stop_groups
from pdd.launch.servers import (
    LOCAL,
    SERVER_START_TIMEOUT_S,
    HttpService,
    PDRouter,
    Placement,
    SGLangServer,
)

DEFAULT_RUN_DIR = Path("runs/pd_local")
STATE_FILE = "state.json"


def generate(url: str, payload: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_serving(url: str, timeout: float) -> None:
    """The router answers /health before it has registered its workers: wait for a real answer."""
    deadline = time.monotonic() + timeout
    probe = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    while True:
        try:
            generate(url, probe, timeout=30)
            return
        except OSError as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not serving after {timeout:.0f}s: {err}") from err
            time.sleep(1.0)


def bring_up(
    servers: list[SGLangServer], router: HttpService, down: Callable[[], None], timeout: float
) -> dict[str, float]:
    """Starts the servers (in parallel) and the router, waits until the router serves a real
    request, and returns the seconds from the start until each was ready; `down` on failure."""
    start = time.monotonic()
    for part in [*servers, router]:
        part.start()  # type: ignore[attr-defined]
    try:
        times = {}
        for server in servers:
            server.wait_ready(timeout)
            times[server.name] = time.monotonic() - start
        router.wait_ready(timeout)
        wait_serving(router.url, timeout)
        times["deployment"] = time.monotonic() - start
    except BaseException:
        down()
        raise
    return times


def format_seconds(times: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in times.items())


@dataclass
class LocalPD:
    prefill: SGLangServer
    decode: SGLangServer
    router: PDRouter

    @classmethod
    def create(
        cls,
        model: Path,
        run_dir: Path,
        ports: dict[str, int] | None = None,
        prefill_at: Placement = LOCAL,
        decode_at: Placement = LOCAL,
    ) -> LocalPD:
        """P and D on this machine, or wherever their placements put them (the router stays in
        the root namespace, which reaches every placement)."""
        ports = ports or {}
        get = lambda name: ports.get(name) or free_port()  # noqa: E731
        prefill = SGLangServer(
            "prefill", model, get("prefill"), run_dir, prefill_at, mode="prefill",
            bootstrap_port=get("bootstrap"),
        )  # fmt: skip
        decode = SGLangServer("decode", model, get("decode"), run_dir, decode_at, mode="decode")
        router = PDRouter("router", get("router"), run_dir, [prefill], [decode],
                          metrics_port=get("metrics"))  # fmt: skip
        return cls(prefill, decode, router)

    @classmethod
    def from_state(cls, run_dir: Path) -> LocalPD:
        """The deployment `up` started from `run_dir` (local placements), to talk to; `down`
        stops it by the recorded process groups."""
        state = load_state(run_dir)
        if "ports" not in state:
            raise SystemExit(f"no deployment recorded in {run_dir}: run `up` first")
        return cls.create(Path(state["model"]), run_dir, state["ports"])

    @property
    def ports(self) -> dict[str, int]:
        bootstrap = self.prefill.bootstrap_port
        assert bootstrap is not None, "P has a bootstrap port"
        return {"prefill": self.prefill.port, "bootstrap": bootstrap, "decode": self.decode.port,
                "router": self.router.port, "metrics": self.router.metrics_port}  # fmt: skip

    @property
    def url(self) -> str:
        return self.router.url

    def up(self, timeout: float = SERVER_START_TIMEOUT_S) -> dict[str, float]:
        """Start all parts (servers in parallel), wait until the router serves; start-up seconds."""
        return bring_up([self.prefill, self.decode], self.router, self.down, timeout)

    def parts(self) -> list[SGLangServer | PDRouter]:
        return [self.router, self.decode, self.prefill]

    def pgids(self) -> dict[str, int]:
        return {p.name: p.process.pgid for p in self.parts() if p.process is not None}

    def down(self) -> None:
        stop_groups(list(self.pgids().values()))

    def save_state(self, run_dir: Path) -> None:
        model = str(self.prefill.model.resolve())
        state = {"url": self.url, "groups": self.pgids(), "model": model, "ports": self.ports}
        (run_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")


def load_state(run_dir: Path) -> dict:
    path = run_dir / STATE_FILE
    if not path.exists():
        return {"groups": {}}
    return json.loads(path.read_text())


def cmd_up(args: argparse.Namespace) -> None:
    if any(group_alive(g) for g in load_state(args.run_dir)["groups"].values()):
        raise SystemExit(f"a deployment from {args.run_dir} is still running: run `down` first")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    ports = {"router": args.port} if args.port else None
    pd = LocalPD.create(args.model, args.run_dir, ports)
    times = pd.up()
    pd.save_state(args.run_dir)
    print(f"router serving at {pd.url}; logs in {args.run_dir}")
    print(f"start-up seconds: {format_seconds(times)}")


def cmd_status(args: argparse.Namespace) -> None:
    state = load_state(args.run_dir)
    if not state["groups"]:
        print("no deployment recorded")
    for name, pgid in state["groups"].items():
        print(f"{name:8s} pgid {pgid:7d} {'running' if group_alive(pgid) else 'stopped'}")


def cmd_down(args: argparse.Namespace) -> None:
    groups = load_state(args.run_dir)["groups"]
    stop_groups(list(groups.values()))
    for name, pgid in groups.items():
        print(f"stopped {name} (pgid {pgid})")
    (args.run_dir / STATE_FILE).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pdd.launch.pd_local", __doc__)
    parser.add_argument("--run-dir", type=Path, default=DEFAULT_RUN_DIR)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the deployment and wait until it serves")
    up.add_argument("--model", type=Path, required=True)
    up.add_argument("--port", type=int, default=None, help="router port (default: a free one)")
    up.set_defaults(func=cmd_up)
    sub.add_parser("status").set_defaults(func=cmd_status)
    sub.add_parser("down").set_defaults(func=cmd_down)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
