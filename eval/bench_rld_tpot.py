"""RelayDecode's time per output token while MainDecode's KV crosses the WAN, against P -> RLD
alone, with the CPU every server used meanwhile.

    python -m pdd.eval.bench_rld_tpot [--model models/wide] [--prompt 1000] [--max-new 300]
                                      [--rate-mbit 10] [--delay-ms 20] [--rounds 2]

Needs root. A PDD deployment on a testbed (name `pddtpot`): P and RLD in datacenter A, MD in
B. Each round sends one fresh prompt on P -> RLD (the router's `pdd_path: relay`), then another
on P -> RLD -> MD (`pdd_path: pdd`). With the defaults MD's KV takes ~25 s to cross while RLD
decodes all 300 tokens in a few seconds, so every RLD token of the second request is made while
P sends MD's KV (and MD receives it). Nothing but waiting on the network should cost CPU then:
RLD should decode as fast as alone. The table shows RLD's time per output token from the
streamed chunks' arrival times and the cores each server's processes used while RLD decoded,
and P's and MD's scheduler processes alone (while RLD decodes on P -> RLD -> MD they only wait on
the WAN: each should cost well under a tenth of a core); its first row is the same servers with
no request at all, the floor under the others. The last line is `rld tpot ratio X` (P -> RLD ->
MD over P -> RLD, medians; target <= 1.3).

What it stands for: a WAN far slower than the datacenter's compute, the case PDD is for (a
1000-token prompt of a 32 KB/token model is 32 MB of KV: ~25 s at 10 Mbit/s, as 3 GB of a
large model's KV takes ~2.5 s at 10 Gbit/s), with P, RLD and MD sharing this machine's cores
as servers would share a host's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdd.eval.client import Streamed, stream_generate
from pdd.eval.cpu import SCHEDULER_TITLE, CpuSampler, Watched
from pdd.eval.prompts import random_ids
from pdd.launch.cli import command_parser
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.servers import HttpService
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import DTYPE_BYTES, kv_bytes_per_token

TARGET = 1.3
PATHS = {"relay": "P->RLD", "pdd": "P->RLD->MD"}
IDLE_S = 10.0


@dataclass
class Run:
    path: str
    relay_tokens: int
    tpot_s: float  # RLD's time per output token
    seconds: float
    cores: dict[str, float]  # each server's processes: CPU seconds per second while RLD decodes


def relay_window(out: Streamed, relay_tokens: int) -> tuple[tuple[int, float], tuple[int, float]]:
    """(tokens, seconds) at RLD's first and last streamed token (cumulative chunks)."""
    first = last = None
    for chunk, t in zip(out.chunks, out.times, strict=True):
        n = len(chunk.get("output_ids") or [])
        if n >= 1 and first is None:
            first = (n, t)
        if 0 < n <= relay_tokens:
            last = (n, t)
    if first is None or last is None or last[0] <= first[0]:
        raise RuntimeError(f"RLD streamed too few tokens to time ({relay_tokens})")
    return first, last


def watched(dep: PDDDeployment) -> dict[str, Watched]:
    """Every server's processes, and P's and MD's schedulers alone: with RLD decoding, each of
    those two only waits on the WAN."""
    parts: dict[str, HttpService] = {"P": dep.prefill, "RLD": dep.relay, "MD": dep.main,
                                     "router": dep.router}  # fmt: skip
    out = {k: Watched(v.process.pgid) for k, v in parts.items() if v.process is not None}
    for k in ("P", "MD"):
        if k in out:
            out[f"{k} sched"] = Watched(out[k].pgid, SCHEDULER_TITLE)
    return out


def idle(dep: PDDDeployment, seconds: float) -> Run:
    """The CPU every server costs with no request at all: the floor under the other rows."""
    sampler = CpuSampler(watched(dep))
    sampler.start()
    start = time.monotonic()
    time.sleep(seconds)
    sampler.stop.set()
    sampler.join()
    return Run("idle", 0, float("nan"), seconds, sampler.cores(start, start + seconds))


def one(dep: PDDDeployment, path: str, ids: list[int], max_new: int) -> Run:
    sampler = CpuSampler(watched(dep))
    sampler.start()
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    start = time.monotonic()
    try:
        out = stream_generate(dep.url, {"input_ids": ids, "sampling_params": sampling,
                                        "pdd_path": path}, timeout=600)  # fmt: skip
    finally:
        sampler.stop.set()
        sampler.join()
    relay = int(out.final["meta_info"]["pdd"]["relay_tokens"])
    first, last = relay_window(out, relay)
    tpot = (last[1] - first[1]) / (last[0] - first[0])
    cores = sampler.cores(start + first[1], start + last[1])  # while RLD decodes
    # Labelled by the path asked for: when RLD finishes first, the router reports P->RLD.
    return Run(PATHS[path], relay, tpot, out.total_s, cores)


def table(runs: list[Run]) -> str:
    names = list(runs[0].cores)
    lines = [
        f"{'path':<11} {'RLD tokens':>10} {'RLD TPOT':>9} {'seconds':>8} "
        + " ".join(f"{n + ' CPU':>10}" for n in names)
    ]
    for r in runs:
        tpot = "-" if r.path == "idle" else f"{r.tpot_s * 1000:.1f} ms"
        lines.append(
            f"{r.path:<11} {r.relay_tokens:>10} {tpot:>9} {r.seconds:>8.1f} "
            + " ".join(f"{r.cores[n]:>10.2f}" for n in names)
        )
    return "\n".join(lines)


def ratio(runs: list[Run]) -> float:
    alone = statistics.median(r.tpot_s for r in runs if r.path == "P->RLD")
    with_md = statistics.median(r.tpot_s for r in runs if r.path == "P->RLD->MD")
    return with_md / alone


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pdd.eval.bench_rld_tpot", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/wide"))
    parser.add_argument("--prompt", type=int, default=1000, help="prompt tokens")
    parser.add_argument("--max-new", type=int, default=300)
    parser.add_argument("--rate-mbit", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way (RTT: twice this)")
    add_flow_window_argument(parser)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench_rld_tpot"))
    args = parser.parse_args(argv)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    kv = kv_bytes_per_token(args.model, DTYPE_BYTES[args.dtype])
    landed_s = args.prompt * kv * 8 / (args.rate_mbit * 1e6) + 5  # MD's KV crossed by then
    tb = Testbed(
        "pddtpot",
        LinkParams(args.rate_mbit, args.delay_ms),
        net="10.214",
        flow_window_mb=args.flow_window_mb,
    )
    tb.down()
    tb.up()
    dep = None
    try:
        args.run_dir.mkdir(parents=True, exist_ok=True)
        a, b = tb.placement("a"), tb.placement("b")
        dep = PDDDeployment.create(
            args.model.resolve(), args.run_dir, a, b, server_args=("--dtype", args.dtype)
        )
        dep.up()
        runs = [idle(dep, IDLE_S)]
        for k in range(args.rounds):
            for path in ("relay", "pdd"):
                ids = random_ids(args.prompt, seed=1000 * k + len(path), vocab_size=vocab)
                print(f"round {k + 1}: {path} ...", file=sys.stderr, flush=True)
                runs.append(one(dep, path, ids, args.max_new))
                time.sleep(landed_s)  # the next request does not share the WAN with this one
    finally:
        if dep is not None:
            dep.down()
        tb.down()
    print(
        f"RLD while MD's KV crosses: {args.model.name}, {args.prompt}-token prompts, "
        f"{args.max_new} tokens, WAN {args.rate_mbit:g} Mbit/s RTT {2 * args.delay_ms:g} ms"
    )
    print(table(runs))
    print(f"rld tpot ratio {ratio(runs):.2f} (target <= {TARGET})")


if __name__ == "__main__":
    main()
