"""TTFT of same-datacenter PD, naive cross-datacenter PD and PDD, live on the testbed.

    python -m pdd.eval.bench_ttft [--model models/wide] [--rate-mbit 100] [--delay-ms 20]
                                  [--prompt-tokens 1200] [--requests 10] [--max-new 96]
                                  [--out runs/bench_ttft]

Needs root. Brings up its own testbed (name `pddttft`) and one PDD deployment on it: P and
RelayDecode (RLD) in datacenter A, MainDecode (MD) in B, the PDD router in A. Each request takes
one of three paths through the same servers:
- same-DC PD (`pdd_path: relay`, P -> RLD): the KV moves inside datacenter A;
- naive cross-DC PD (`pdd_path: main`, P -> MD): all of the KV crosses the WAN before the first
  decode step, exactly as SGLang's own PD does with P and D in different datacenters;
- PDD (`pdd_path: pdd`, P -> RLD -> MD): RLD streams at once while the KV crosses the WAN, then
  MD takes over (Extend-Decode or Catch-Up handoff).
Prompts are fresh (no shared prefixes, so every token's KV is sent), requests one at a time and
the three paths interleaved, so background noise hits them alike. TTFT is measured by a client
next to the router: request sent -> first streamed token. Prints a table (P50/P90/P99 TTFT,
ratios to same-DC, end-to-end latency, tokens made by RLD) and writes JSON and a PNG to --out.

Scale: a 2-core CPU prefills ~1000x slower than a GPU, so the default model is `wide` (a tiny
model's compute with 32 KB of KV per token, like a large model): then, as in production, the
WAN transfer rather than the prefill decides TTFT.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdd.eval.client import stream_generate
from pdd.eval.prompts import random_ids
from pdd.launch.cli import command_parser
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import exit_on_sigterm
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import kv_bytes_per_token


@dataclass
class Row:
    deployment: str
    ttft_s: list[float]
    total_s: list[float] = field(default_factory=list)
    relay_tokens: list[int] = field(default_factory=list)
    handoffs: list[str | None] = field(default_factory=list)
    failures: int = 0

    def add(self, ttft: float, total: float, meta: dict) -> None:
        self.ttft_s.append(ttft)
        self.total_s.append(total)
        self.relay_tokens.append(meta["relay_tokens"])
        self.handoffs.append(meta["handoff_mode"])

    def pct(self, q: float) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ttft_s)


PATHS = {"same-DC PD": "relay", "naive cross-DC PD": "main", "PDD": "pdd"}
MAX_FAILURES = 3


def measure(url: str, prompts: dict[str, list[list[int]]], max_new: int) -> list[Row]:
    rows = {name: Row(name, []) for name in PATHS}
    count = len(next(iter(prompts.values())))
    for i in range(count):
        for name, path in PATHS.items():
            sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
            try:
                got = stream_generate(url, {"input_ids": prompts[path][i], "pdd_path": path,
                                            "sampling_params": sampling})  # fmt: skip
            except OSError as err:  # reported, and the run goes on
                rows[name].failures += 1
                print(f"[{i + 1}/{count}] {name:18s} FAILED: {err}", flush=True)
                if sum(r.failures for r in rows.values()) > MAX_FAILURES:
                    raise RuntimeError("too many failed requests; see the server logs") from err
                continue
            assert got.ttft_s is not None
            meta = got.final["meta_info"]["pdd"]
            rows[name].add(got.ttft_s, got.total_s, meta)
            print(f"[{i + 1}/{count}] {name:18s} TTFT {got.ttft_s:5.2f}s  total "
                  f"{got.total_s:5.2f}s  path {meta['path']:10s} RLD tokens "
                  f"{meta['relay_tokens']}", flush=True)  # fmt: skip
    return list(rows.values())


def table(rows: list[Row]) -> str:
    base = rows[0]
    lines = [
        f"{'deployment':18s} {'TTFT P50':>8s} {'P90':>6s} {'P99':>6s} {'P50 ratio':>9s} "
        f"{'P99 ratio':>9s} {'e2e P50':>7s} {'RLD tokens':>10s} {'handoffs':>8s} {'failed':>6s}"
    ]
    for r in rows:
        handoffs = sum(h is not None for h in r.handoffs)
        lines.append(
            f"{r.deployment:18s} {r.pct(50):8.2f} {r.pct(90):6.2f} {r.pct(99):6.2f} "
            f"{r.pct(50) / base.pct(50):8.2f}x {r.pct(99) / base.pct(99):8.2f}x "
            f"{statistics.median(r.total_s):7.2f} {statistics.fmean(r.relay_tokens):10.1f} "
            f"{handoffs:8d} {r.failures:6d}"
        )
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    same, naive, pdd = (r.pct(99) for r in rows)
    return (
        f"target PDD TTFT P99 <= 1.2x same-DC: {pdd / same:.2f}x "
        f"({'met' if pdd <= 1.2 * same else 'NOT met'}); "
        f"naive cross-DC P99 >= 3x same-DC: {naive / same:.2f}x "
        f"({'met' if naive >= 3 * same else 'NOT met'})"
    )


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([r.ttft_s for r in rows], tick_labels=[r.deployment for r in rows], vert=False)
    ax.set_xlabel("time to first token (s)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pdd.eval.bench_ttft", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/wide"))
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    add_flow_window_argument(parser)
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--max-new", type=int, default=96, help="output tokens per request")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_ttft"))
    args = parser.parse_args(argv)
    exit_on_sigterm()

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    # Fresh prompts for every request and path: P's prefix cache must not favour any path.
    prompts = {
        path: [random_ids(args.prompt_tokens, 1000 * (j + 1) + i, vocab)
               for i in range(args.requests)]
        for j, path in enumerate(PATHS.values())
    }  # fmt: skip
    kv_mb = args.prompt_tokens * kv_bytes_per_token(args.model) / 1e6
    wire_s = kv_mb * 8 / args.rate_mbit
    title = (f"{args.model.name}, {args.prompt_tokens}-token prompts ({kv_mb:.1f} MB of KV), "
             f"WAN {args.rate_mbit:.0f} Mbit/s, RTT {2 * args.delay_ms:.0f} ms")  # fmt: skip
    print(f"{title}: the KV alone needs {wire_s:.2f}s on the WAN", flush=True)

    tb = Testbed(
        "pddttft",
        LinkParams(args.rate_mbit, args.delay_ms),
        net="10.215",
        flow_window_mb=args.flow_window_mb,
    )
    tb.down()
    tb.up()
    args.out.mkdir(parents=True, exist_ok=True)
    pdd = PDDDeployment.create(args.model, args.out, tb.placement("a"), tb.placement("b"))
    try:
        print("starting P + RLD (datacenter A), MD (B) and the router (A)", flush=True)
        times = pdd.up()
        print(f"up in {times['deployment']:.0f}s; warming up", flush=True)
        for path in PATHS.values():
            generate(pdd.url, {"input_ids": random_ids(64, 7, vocab), "pdd_path": path,
                               "sampling_params": {"max_new_tokens": 4}})  # fmt: skip
        rows = measure(pdd.url, prompts, args.max_new)
    finally:
        pdd.down()
        tb.down()

    print(f"\n{title}\n{table(rows)}\n{verdict(rows)}")
    data = {"title": title, "kv_mb": kv_mb, "wire_s": wire_s, "rows": [asdict(r) for r in rows]}
    (args.out / "ttft.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(rows, args.out / "ttft.png", title)
    print(f"wrote {args.out / 'ttft.json'} and {args.out / 'ttft.png'}")


if __name__ == "__main__":
    main()
