"""A PDD deployment: P and RelayDecode in datacenter A, MainDecode in datacenter B, the PDD router
in A (next to the users and P). On the testbed, MD reaches P's KV and the router's control socket
only across the emulated WAN; elsewhere everything runs on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdd.launch.pd_local import bring_up
from pdd.launch.process import free_port, stop_groups
from pdd.launch.router import RouterService
from pdd.launch.servers import (
    CPU_MAX_TOTAL_TOKENS,
    LOCAL,
    SERVER_START_TIMEOUT_S,
    Placement,
    SGLangServer,
    flag_value,
)

DECODE_CACHE_FLAG = "--disaggregation-decode-enable-radix-cache"
# RelayDecode is a small tier beside P that only hides the WAN (the paper: 6.2% of output
# tokens): by default it runs an eighth of MD's requests with an eighth of MD's KV pool.
RELAY_FRACTION = 1 / 8
MAIN_MAX_RUNNING = 64  # MD's running requests unless its arguments say otherwise
# RLD's pool must still hold one long request (prompt and answer) of the testbed's models.
RELAY_MIN_POOL = 4096


def thread_env(prefill: int, decode: int) -> dict[str, dict[str, str]]:
    """`PDDDeployment.create`'s server_env giving P `prefill` torch threads and RLD and MD
    `decode` each: on a testbed whose servers share the cores, more threads than a server's
    share make every OpenMP barrier wait on a core another server holds."""
    threads = {"prefill": prefill, "relay": decode, "main": decode}
    return {role: {"OMP_NUM_THREADS": str(n)} for role, n in threads.items()}


def relay_capacity_args(main_args: tuple[str, ...], fraction: float) -> tuple[str, ...]:
    """RLD's --max-running-requests and --max-total-tokens: `fraction` of MD's."""
    if not 0 < fraction <= 1:
        raise ValueError(f"relay_fraction must be in (0, 1], got {fraction}")
    args = list(main_args)
    running = flag_value(args, "--max-running-requests")
    pool = flag_value(args, "--max-total-tokens")
    md_running = int(running) if running else MAIN_MAX_RUNNING
    md_pool = int(pool) if pool else CPU_MAX_TOTAL_TOKENS
    rld_pool = min(md_pool, max(round(md_pool * fraction), RELAY_MIN_POOL))
    return ("--max-running-requests", str(max(1, round(md_running * fraction))),
            "--max-total-tokens", str(rld_pool))  # fmt: skip


@dataclass
class PDDDeployment:
    prefill: SGLangServer
    relay: SGLangServer
    main: SGLangServer
    router: RouterService
    other_prefills: list[SGLangServer] = field(default_factory=list)  # more P in datacenter A

    @classmethod
    def create(
        cls,
        model: Path,
        run_dir: Path,
        a: Placement = LOCAL,
        b: Placement = LOCAL,
        main_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = (),
        decode_cache: bool = True,
        prefill_args: tuple[str, ...] = (),
        path: str | None = None,
        server_args: tuple[str, ...] = (),
        server_env: dict[str, dict[str, str]] | None = None,
        prefills: int = 1,
        relay_fraction: float = RELAY_FRACTION,
        relay_args: tuple[str, ...] = (),
        server_cpus: dict[str, str] | None = None,
    ) -> PDDDeployment:
        """`a` and `b` place the two datacenters (e.g. `Testbed.placement("a")`). With
        `decode_cache`, MD keeps a radix tree of the KV it holds (SGLang's decode radix cache),
        so only the prompt suffix it lacks crosses the WAN. `server_args` go to P, RLD and MD,
        `server_env["prefill" | "relay" | "main"]` into that server's environment. `prefills` P
        servers serve behind the router, the first one `prefill`. RLD runs `relay_fraction` of
        MD's requests with that share of its KV pool (1.0: a decoder as large as MD, as same-DC
        PD has); `relay_args` go to RLD last. `server_cpus[role]` holds that role's servers to
        those CPUs (see `Placement.on_cpus`)."""
        given, cpus = server_env or {}, server_cpus or {}
        env = {role: dict(given.get(role, {})) for role in ("prefill", "relay", "main")}
        if decode_cache:
            main_args = (DECODE_CACHE_FLAG, *main_args)
        prefill, *others = [SGLangServer(
            f"prefill{i or ''}", model, free_port(), run_dir, a.on_cpus(cpus.get("prefill")),
            mode="prefill",
            bootstrap_port=free_port(), env=env["prefill"],
            extra_args=["--pdd-role", "prefill", *server_args, *prefill_args],
        ) for i in range(prefills)]  # fmt: skip
        if "--max-running-requests" not in main_args:
            main_args = (*main_args, "--max-running-requests", str(MAIN_MAX_RUNNING))
        relay = SGLangServer("relay", model, free_port(), run_dir,
                             a.on_cpus(cpus.get("relay")), mode="decode",
                             extra_args=["--pdd-role", "relay", *server_args,
                                         *relay_capacity_args(main_args, relay_fraction),
                                         *relay_args],
                             env=env["relay"])  # fmt: skip
        main = SGLangServer(
            "main", model, free_port(), run_dir, b.on_cpus(cpus.get("main")), mode="decode",
            extra_args=["--pdd-role", "main", "--pdd-control-port", str(free_port()),
                        *server_args, *main_args], env=env["main"],
        )  # fmt: skip
        router = RouterService("router", free_port(), run_dir, [prefill, *others], [relay],
                               [main], a, path=path, extra_args=list(router_args))  # fmt: skip
        return cls(prefill, relay, main, router, others)

    @property
    def url(self) -> str:
        return self.router.url

    def servers(self) -> list[SGLangServer]:
        return [self.prefill, *self.other_prefills, self.relay, self.main]

    def up(self, timeout: float = SERVER_START_TIMEOUT_S) -> dict[str, float]:
        """Starts every part (servers in parallel) and waits until the router serves; returns
        start-up seconds."""
        return bring_up(self.servers(), self.router, self.down, timeout)

    def pgids(self) -> dict[str, int]:
        parts = [self.router, *self.servers()]
        return {p.name: p.process.pgid for p in parts if p.process is not None}

    def down(self) -> None:
        stop_groups(list(self.pgids().values()))
