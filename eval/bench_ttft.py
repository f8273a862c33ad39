"""TTFT of same-datacenter PD versus naive cross-datacenter PD, live on the testbed.

    python -m pdd.eval.bench_ttft [--model models/tiny] [--rate-mbit 100] [--delay-ms 20]
                                  [--prompt-tokens 3000] [--requests 8] [--out runs/bench_ttft]

Needs root. Brings up its own testbed (name `pddttft`), then, one after the other:
- same-DC PD: P and D both in datacenter A (the KV moves over A's local, unshaped path);
- naive cross-DC PD: P in A, D in B (all of the KV crosses the emulated WAN).
Each gets the same fresh prompts (no shared prefixes, so every token's KV is sent), one at a
time, with max_new_tokens 1: the latency is the time to first token. Prints a table (P50, P90,
P99, mean, ratio to same-DC) and writes JSON and a PNG plot to --out. This is the problem PDD
exists to solve; PDD itself joins the table once it exists.

Scale: on this project's 2-core CPU machines a prefill runs ~1000x slower than on a GPU (SmolLM2
takes ~25 ms per prompt token here), so the WAN must be scaled down alike for the KV transfer to
weigh what it weighs in production; the tiny model (fast prefill, 512 B of KV per token) at
100 Mbit/s shows the effect without that.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdd.eval.prompts import random_ids
from pdd.launch.cli import command_parser
from pdd.launch.pd_local import LocalPD, generate
from pdd.launch.process import exit_on_sigterm
from pdd.launch.testbed import Testbed
from pdd.launch.wan import LinkParams
from pdd.models.kv import kv_bytes_per_token


@dataclass
class Row:
    deployment: str
    ttft_s: list[float]

    def pct(self, q: float) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.ttft_s)


def measure(name: str, pd: LocalPD, prompts: list[list[int]]) -> Row:
    print(f"[{name}] starting P + D + router", flush=True)
    times = pd.up()
    print(f"[{name}] up in {times['deployment']:.0f}s; warming up", flush=True)
    try:
        generate(pd.url, {"input_ids": prompts[0][:64], "sampling_params": {"max_new_tokens": 1}})
        ttft = []
        for i, ids in enumerate(prompts, 1):
            start = time.monotonic()
            generate(pd.url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
            ttft.append(time.monotonic() - start)
            print(f"[{name}] request {i}/{len(prompts)}: TTFT {ttft[-1]:.2f}s", flush=True)
    finally:
        pd.down()
    return Row(name, ttft)


def table(rows: list[Row]) -> str:
    base = rows[0].pct(50)
    lines = [
        f"{'deployment':18s} {'P50 s':>7s} {'P90 s':>7s} {'P99 s':>7s} {'mean s':>7s} "
        f"{'P50 vs same-DC':>15s}"
    ]
    for r in rows:
        lines.append(
            f"{r.deployment:18s} {r.pct(50):7.2f} {r.pct(90):7.2f} {r.pct(99):7.2f} "
            f"{r.mean:7.2f} {r.pct(50) / base:14.2f}x"
        )
    return "\n".join(lines)


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
    parser.add_argument("--model", type=Path, default=Path("models/tiny"))
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_ttft"))
    args = parser.parse_args(argv)
    exit_on_sigterm()

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = [random_ids(args.prompt_tokens, 1000 + i, vocab) for i in range(args.requests)]
    kv_mb = args.prompt_tokens * kv_bytes_per_token(args.model) / 1e6
    wire_s = kv_mb * 8 / args.rate_mbit
    title = (f"{args.model.name}, {args.prompt_tokens}-token prompts ({kv_mb:.1f} MB of KV), "
             f"WAN {args.rate_mbit:.0f} Mbit/s, RTT {2 * args.delay_ms:.0f} ms")  # fmt: skip
    print(f"{title}: the KV alone needs {wire_s:.2f}s on the WAN", flush=True)

    tb = Testbed("pddttft", LinkParams(args.rate_mbit, args.delay_ms), net="10.215")
    tb.down()
    tb.up()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        a, b = tb.placement("a"), tb.placement("b")
        same = LocalPD.create(args.model, args.out / "same-dc", prefill_at=a, decode_at=a)
        naive = LocalPD.create(args.model, args.out / "cross-dc", prefill_at=a, decode_at=b)
        rows = [measure("same-DC PD", same, prompts), measure("naive cross-DC PD", naive, prompts)]
    finally:
        tb.down()

    print(f"\n{title}\n{table(rows)}")
    data = {"title": title, "kv_mb": kv_mb, "wire_s": wire_s, "rows": [asdict(r) for r in rows]}
    (args.out / "ttft.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(rows, args.out / "ttft.png", title)
    print(f"wrote {args.out / 'ttft.json'} and {args.out / 'ttft.png'}")


if __name__ == "__main__":
    main()
