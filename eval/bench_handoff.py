"""The handoff microbenchmark: hand 100 tokens over to MainDecode by shipping their KV across the
WAN, or by Extend-Decode (send the token ids; MD recomputes their KV in one extend forward).

    python -m pdd.eval.bench_handoff [--model models/wide] [--tokens 100] [--rounds 20]
                                     [--rate-mbit 100] [--delay-ms 20] [--jitter-ms 10]

Needs root. On a testbed with a jittery WAN (name `pddhand`):
- ship: Mooncake TCP writes of the 100 tokens' KV bytes from datacenter A to B, on a warm
  connection (what moving RLD's incremental KV would cost);
- recompute: P in A and MD in B; a driver in A (where the router lives) parks a request on MD,
  then sends HANDOFF with 100 tokens over the control plane and times it until MD's stream
  delivers the first token after them (control message over the WAN, MD's extend of the 100
  tokens plus one decode step, the streamed token back over the WAN).
Prints bytes on the WAN, mean, P50, max and standard deviation for each, next to the paper's
figures, and writes JSON to --out.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import zmq

from pdd.control.channel import ControlSocket
from pdd.control.messages import Handoff, Ready, encode, route_hint
from pdd.control.secret import read_secret
from pdd.eval.bench_wan_mooncake import transfer
from pdd.eval.client import stream_generate
from pdd.eval.prompts import random_ids
from pdd.launch.cli import command_parser
from pdd.launch.pd_local import generate
from pdd.launch.process import exit_on_sigterm, free_port, stop_groups
from pdd.launch.servers import SGLangServer, control_secret_file
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import kv_bytes_per_token

MODULE = "pdd.eval.bench_handoff"
MARK = "RESULT "
PROMPT_TOKENS = 256
# The paper's 100-token handoff (see DESIGN.md): shipping the KV vs local recompute.
PAPER: dict[str, dict[str, Any]] = {
    "ship": {"bytes": 4649 * 1024, "mean_ms": 185.0, "max_ms": 512.6, "std_ms": None},
    "recompute": {"bytes": 1536, "mean_ms": 305.0, "max_ms": 321.4, "std_ms": 4.8},
}


@dataclass
class Method:
    name: str
    wan_bytes: int
    seconds: list[float]

    def stats_ms(self) -> dict[str, float]:
        ms = [s * 1000 for s in self.seconds]
        return {
            "mean_ms": statistics.fmean(ms),
            "p50_ms": statistics.median(ms),
            "max_ms": max(ms),
            "std_ms": statistics.pstdev(ms),
        }


# -- the driver, inside datacenter A -------------------------------------------------------------


def drive(prefill_url: str, bootstrap_port: int, main_url: str, main_control: str, ip: str,
          tokens: int, rounds: int, secret: bytes | None) -> None:  # fmt: skip
    """Parks a request on MD, hands `tokens` tokens over, times MD's answer; `rounds` times."""
    control = ControlSocket(secret)
    reply_to = control.bind(f"tcp://{ip}:{free_port()}")
    vocab = 1000
    for i in range(rounds):
        ids = random_ids(PROMPT_TOKENS, 7000 + i, vocab)
        rid = f"hand{i}-{random.randrange(1 << 30)}"
        sampling = {"temperature": 0, "max_new_tokens": tokens + 2, "ignore_eos": True}
        room = random.randrange(1 << 62)
        body = {"input_ids": ids, "sampling_params": sampling, "bootstrap_host": ip,
                "bootstrap_port": bootstrap_port, "bootstrap_room": room}  # fmt: skip
        md_body = {**body, "rid": rid, "kv_hints": route_hint(role="main", park=True,
                                                              reply_to=reply_to)}  # fmt: skip
        timing: dict[str, float] = {}

        def consume(md_body: dict = md_body, timing: dict = timing) -> None:
            got = stream_generate(main_url, md_body, timeout=120)
            for chunk in got.chunks:  # the first chunk past the handed-over tokens
                if len(chunk["output_ids"]) > tokens:
                    timing.setdefault("first", time.monotonic())

        thread = threading.Thread(target=consume)
        thread.start()
        generate(prefill_url, {**body, "rid": f"{rid}-p"})
        if not control.socket.poll(60_000, zmq.POLLIN):
            raise TimeoutError(f"no READY for {rid}")
        ready = control.recv_nowait()[0]
        assert isinstance(ready, Ready), ready
        handed = (ready.first_token, *random_ids(tokens - 1, 9000 + i, vocab))
        msg = Handoff(rid=rid, start=0, tokens=handed)
        sent = time.monotonic()
        control.send(main_control, msg)
        thread.join(120)
        print(MARK + json.dumps({"seconds": timing["first"] - sent,
                                 "bytes": len(encode(msg))}), flush=True)  # fmt: skip
    control.close()


# -- the benchmark -------------------------------------------------------------------------------


def recompute(tb: Testbed, model: Path, run_dir: Path, tokens: int, rounds: int) -> Method:
    prefill = SGLangServer("prefill", model, free_port(), run_dir, tb.placement("a"),
                           mode="prefill", bootstrap_port=free_port())  # fmt: skip
    control_port = free_port()
    main = SGLangServer("main", model, free_port(), run_dir, tb.placement("b"), mode="decode",
                        extra_args=["--pdd-role", "main", "--pdd-control-port",
                                    str(control_port)])  # fmt: skip
    try:
        for server in (prefill, main):
            server.start()
        for server in (prefill, main):
            print(f"{server.name} ready in {server.wait_ready():.0f}s", flush=True)
        argv = [sys.executable, "-m", MODULE, "drive", "--prefill-url", prefill.url,
                "--bootstrap-port", str(prefill.bootstrap_port), "--main-url", main.url,
                "--main-control", f"tcp://{main.host}:{control_port}", "--ip", tb.ip("a"),
                "--tokens", str(tokens), "--rounds", str(rounds)]  # fmt: skip
        secret = control_secret_file(main)
        argv += [] if secret is None else ["--secret-file", secret]
        proc = tb.popen("a", argv, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        seconds, nbytes = [], 0
        for line in proc.stdout:
            if line.startswith(MARK):
                result = json.loads(line[len(MARK) :])
                seconds.append(result["seconds"])
                nbytes = result["bytes"]
                print(f"recompute {len(seconds)}/{rounds}: {seconds[-1] * 1000:.1f} ms",
                      flush=True)  # fmt: skip
        if proc.wait(timeout=60) != 0 or len(seconds) != rounds:
            raise RuntimeError(f"the driver failed (exit {proc.returncode})")
    finally:
        stop_groups([s.process.pgid for s in (prefill, main) if s.process is not None])
    return Method("recompute (Extend-Decode)", nbytes, seconds)


def ship(tb: Testbed, nbytes: int, rounds: int) -> Method:
    results = transfer(tb, nbytes, warm_rounds=rounds)
    warm = [r.seconds for r in results if r.round == "warm"]
    if not all(r.intact for r in results):
        raise RuntimeError("a Mooncake write arrived corrupted")
    return Method("ship the KV (Mooncake)", nbytes, warm)


def table(methods: list[Method], paper: list[dict[str, Any]]) -> str:
    lines = [
        f"{'method':28s} {'WAN bytes':>10s} {'mean ms':>8s} {'P50 ms':>7s} {'max ms':>7s} "
        f"{'std ms':>7s} | paper: {'bytes':>8s} {'mean':>6s} {'max':>6s} {'std':>5s}"
    ]
    for m, p in zip(methods, paper, strict=True):
        s = m.stats_ms()
        std = "-" if p["std_ms"] is None else f"{p['std_ms']:.1f}"
        lines.append(
            f"{m.name:28s} {m.wan_bytes:>10,d} {s['mean_ms']:8.1f} {s['p50_ms']:7.1f} "
            f"{s['max_ms']:7.1f} {s['std_ms']:7.1f} | {p['bytes']:>15,d} {p['mean_ms']:6.1f} "
            f"{p['max_ms']:6.1f} {std:>5s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(MODULE, __doc__)
    sub = parser.add_subparsers(dest="role", help="internal: the driver inside datacenter A")
    dr = sub.add_parser("drive")
    dr.add_argument("--prefill-url", required=True)
    dr.add_argument("--bootstrap-port", type=int, required=True)
    dr.add_argument("--main-url", required=True)
    dr.add_argument("--main-control", required=True)
    dr.add_argument("--ip", required=True)
    dr.add_argument("--secret-file", default=None, help="MD's control-plane secret")
    for p in (parser, dr):
        p.add_argument("--tokens", type=int, default=100)
        p.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model", type=Path, default=Path("models/wide"))
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    add_flow_window_argument(parser)
    parser.add_argument("--jitter-ms", type=float, default=10.0, help="one way, uniform +-")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_handoff"))
    args = parser.parse_args(argv)
    if args.role == "drive":
        drive(args.prefill_url, args.bootstrap_port, args.main_url, args.main_control, args.ip,
              args.tokens, args.rounds, read_secret(args.secret_file))  # fmt: skip
        return
    exit_on_sigterm()
    nbytes = args.tokens * kv_bytes_per_token(args.model)
    link = LinkParams(args.rate_mbit, args.delay_ms, jitter_ms=args.jitter_ms)
    title = (f"{args.tokens}-token handoff, {args.model.name} ({nbytes / 1024:.0f} KiB of KV), "
             f"WAN {args.rate_mbit:.0f} Mbit/s, RTT {2 * args.delay_ms:.0f} ms "
             f"+-{2 * args.jitter_ms:.0f} ms jitter")  # fmt: skip
    print(title, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tb = Testbed("pddhand", link, net="10.219", flow_window_mb=args.flow_window_mb)
    tb.down()
    tb.up()
    try:
        methods = [ship(tb, nbytes, args.rounds),
                   recompute(tb, args.model, args.out, args.tokens, args.rounds)]  # fmt: skip
    finally:
        tb.down()
    paper = [PAPER["ship"], PAPER["recompute"]]
    print(f"\n{title}\n{table(methods, paper)}")
    data = {"title": title, "methods": [{**asdict(m), **m.stats_ms()} for m in methods],
            "paper": PAPER}  # fmt: skip
    (args.out / "handoff.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {args.out / 'handoff.json'}")


if __name__ == "__main__":
    main()
