"""The decode-side radix cache on an agentic workload: hit rates on P and MD, WAN bytes.

    python -m pdd.eval.bench_decode_cache [--model models/wide] [--requests 80] [--pool 6000]
                                          [--sessions 8] [--max-new 32] [--out runs/bench_drc]

Needs root. Brings up its own testbed (name `pddbdrc`) and runs the same agentic request stream
(pdd.eval.agentic: sessions over a shared system prompt, skewed popularity, a low-hit tail)
through two PDD deployments in turn:
- no decode cache: MD frees each request's KV when it ends, so every prompt crosses the WAN whole;
- decode cache: MD keeps a radix tree of what it holds (SGLang's decode radix cache, kept in step
  with P's: MD also caches the prompts of requests RLD finished alone) and P sends only the
  suffix MD lacks; the router's cache-sync view predicts MD's hit before sending.
P and MD get the same small KV pool (`--pool` tokens), so both must evict. For each request it
records P's hit (P's own `cached_tokens`), MD's hit (READY), the router's prediction and the KV
bytes that crossed; the WAN link's byte counter checks the total against this benchmark's own
count of the KV MD lacked (prompt minus MD's hit, times the KV bytes per token the model's
config gives: K and V per head, or MLA's latent + rope). `--path main` sends every request
P -> MD (the decode cache alone), `pdd` (default) through the router's policy. Prints a table
and writes JSON and a PNG (hit rates over the run, WAN bytes per request) to --out.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdd.eval.agentic import AgenticConfig, AgenticWorkload
from pdd.eval.prompts import random_ids
from pdd.launch.cli import command_parser
from pdd.launch.pd_local import generate
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import exit_on_sigterm
from pdd.launch.servers import DTYPE_ENV
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import DTYPE_BYTES, kv_bytes_per_token

WINDOW = 10  # requests per point of the hit-rate plot
BLOCK = 16  # MD's --pdd-cache-block (the default)


@dataclass
class Sample:
    slot: int
    prompt: int
    p_cached: int
    md_cached: int
    md_predicted: int
    wan_kv_bytes: int
    path: str
    latency_s: float


@dataclass
class Run:
    name: str
    samples: list[Sample] = field(default_factory=list)
    wan_link_bytes: int = 0  # the WAN's own counter, A -> B, over the whole run
    kv_bytes_per_token: int = 0  # from the model's config and the servers' dtype
    failures: int = 0

    @property
    def link_over_own_count(self) -> float:
        """The link's bytes over the KV MD lacked by this benchmark's own count."""
        lacked = sum(s.prompt - s.md_cached for s in self.samples) * self.kv_bytes_per_token
        return self.wan_link_bytes / max(1, lacked)

    def hit(self, side: str, samples: list[Sample] | None = None) -> float:
        rows = self.samples if samples is None else samples
        cached = sum(s.p_cached if side == "P" else s.md_cached for s in rows)
        return cached / max(1, sum(s.prompt for s in rows))

    def windows(self, side: str) -> list[float]:
        rows = self.samples
        return [self.hit(side, rows[i : i + WINDOW]) for i in range(0, len(rows), WINDOW)]

    @property
    def worst_window_gap(self) -> float:
        """The lowest MD-minus-P hit rate over the run's windows (negative: MD behind)."""
        return min(m - p for m, p in zip(self.windows("MD"), self.windows("P"), strict=True))

    @property
    def wan_per_request(self) -> float:
        return statistics.fmean(s.wan_kv_bytes for s in self.samples)

    @property
    def predicted_within_block(self) -> float:
        ok = [s.md_predicted <= s.md_cached < s.md_predicted + BLOCK for s in self.samples]
        return sum(ok) / max(1, len(ok))


def run_stream(name: str, pdd: PDDDeployment, tb: Testbed, cfg: AgenticConfig, n: int,
               max_new: int) -> Run:  # fmt: skip
    run = Run(name)
    work = AgenticWorkload(cfg)
    before = int(tb.wan.status()["counters"]["a_to_b"]["bytes"])
    sampling = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    for i in range(n):
        slot, prompt = work.next_prompt()
        try:
            got = generate(pdd.url, {"input_ids": prompt, "sampling_params": sampling}, 600)
        except OSError as err:
            run.failures += 1
            print(f"[{name} {i + 1}/{n}] FAILED: {err}", flush=True)
            if run.failures > 3:
                raise RuntimeError("too many failed requests; see the server logs") from err
            work.record(slot, [])
            continue
        meta = got["meta_info"]["pdd"]
        s = Sample(slot, len(prompt), meta["p_cached_tokens"] or 0, meta["md_cached_tokens"] or 0,
                   meta["md_predicted_cached_tokens"] or 0, meta["wan_kv_bytes"] or 0,
                   meta["path"], meta["timings"].get("end", 0.0))  # fmt: skip
        run.samples.append(s)
        work.record(slot, got["output_ids"])
        print(f"[{name} {i + 1}/{n}] session {slot} prompt {s.prompt:5d}  P hit "
              f"{s.p_cached / s.prompt:4.0%}  MD hit {s.md_cached / s.prompt:4.0%} (predicted "
              f"{s.md_predicted})  WAN KV {s.wan_kv_bytes / 1e6:6.2f} MB  {s.path}",
              flush=True)  # fmt: skip
    run.wan_link_bytes = int(tb.wan.status()["counters"]["a_to_b"]["bytes"]) - before
    return run


def table(runs: list[Run]) -> str:
    lines = [f"{'deployment':16s} {'requests':>8s} {'P hit':>6s} {'MD hit':>6s} {'MD-P':>6s} "
             f"{'worst window':>14s} {'KV MB/req':>9s} {'link MB':>8s} {'ratio':>6s} "
             f"{'predicted':>9s} {'link/own':>8s} {'failed':>6s}"]  # fmt: skip
    base = runs[0].wan_per_request
    for r in runs:
        gap = r.worst_window_gap
        lines.append(
            f"{r.name:16s} {len(r.samples):8d} {r.hit('P'):6.1%} {r.hit('MD'):6.1%} "
            f"{100 * (r.hit('MD') - r.hit('P')):+5.1f}pp {100 * gap:+13.1f}pp "
            f"{r.wan_per_request / 1e6:9.2f} {r.wan_link_bytes / 1e6:8.1f} "
            f"{base / max(r.wan_per_request, 1):5.1f}x {r.predicted_within_block:9.0%} "
            f"{r.link_over_own_count:8.3f} {r.failures:6d}"
        )
    return "\n".join(lines)


def verdict(runs: list[Run]) -> str:
    plain, drc = runs
    gap = 100 * drc.worst_window_gap
    fewer = plain.wan_per_request / max(drc.wan_per_request, 1)
    return (
        f"target MD hit never more than 2 pp below P's (worst {WINDOW}-request window): "
        f"{gap:+.1f} pp ({'met' if gap >= -2 else 'NOT met'}); "
        f"WAN bytes per request >= 5x fewer than without "
        f"the decode cache: {fewer:.1f}x ({'met' if fewer >= 5 else 'NOT met'}) at an average "
        f"P-side hit of {drc.hit('P'):.0%}; link bytes over the KV MD lacked (own count): "
        f"{drc.link_over_own_count:.3f} (target <= 1.05: "
        f"{'met' if drc.link_over_own_count <= 1.05 else 'NOT met'})"
    )


def plot(runs: list[Run], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain, drc = runs
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = [WINDOW * (i + 1) for i in range(len(drc.windows("P")))]
    left.plot(xs, [100 * h for h in drc.windows("P")], "o-", label="P-side hit")
    left.plot(xs, [100 * h for h in drc.windows("MD")], "s-", label="MD-side hit (decode cache)")
    left.set_xlabel(f"requests (points: {WINDOW}-request windows)")
    left.set_ylabel("prefix hit rate (%)")
    left.set_ylim(0, 100)
    left.legend(fontsize=8)
    right.bar([r.name for r in runs], [r.wan_per_request / 1e6 for r in runs],
              color=["tab:gray", "tab:green"])  # fmt: skip
    right.set_ylabel("KV over the WAN per request (MB)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pdd.eval.bench_decode_cache", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/wide"))
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--pool", type=int, default=6000, help="KV tokens on P and on MD")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--rate-mbit", type=float, default=200.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    add_flow_window_argument(parser)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--path", choices=("pdd", "main"), default="pdd",
                        help="main: every request P -> MD; pdd: the router's policy")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("runs/bench_drc"))
    args = parser.parse_args(argv)
    exit_on_sigterm()

    config = json.loads((args.model / "config.json").read_text())
    vocab = config["vocab_size"]
    dtype = os.environ.get(DTYPE_ENV) or config.get("dtype") or config.get("torch_dtype")
    kvb = kv_bytes_per_token(args.model, DTYPE_BYTES[dtype])
    cfg = AgenticConfig(vocab=vocab, seed=args.seed, sessions=args.sessions,
                        max_context=args.pool // 2)  # fmt: skip
    pool = ("--max-total-tokens", str(args.pool))
    title = (
        f"{args.model.name}, {args.sessions} agentic sessions, {args.requests} requests, "
        f"{args.pool}-token KV pools on P and MD, WAN {args.rate_mbit:.0f} Mbit/s, "
        f"{kvb} KV bytes per token ({dtype}), path {args.path}"
    )
    tb = Testbed(
        "pddbdrc",
        LinkParams(args.rate_mbit, args.delay_ms),
        net="10.225",
        flow_window_mb=args.flow_window_mb,
    )
    tb.down()
    tb.up()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for name, decode_cache in (("no decode cache", False), ("decode cache", True)):
            pdd = PDDDeployment.create(args.model, args.out / name.replace(" ", "_"),
                                       tb.placement("a"), tb.placement("b"), main_args=pool,
                                       prefill_args=pool, decode_cache=decode_cache,
                                       path=args.path)  # fmt: skip
            try:
                print(f"starting P + RLD (A), MD (B), router (A): {name}", flush=True)
                pdd.up()
                generate(pdd.url, {"input_ids": random_ids(64, 7, vocab),
                                   "sampling_params": {"max_new_tokens": 4}})  # fmt: skip
                runs.append(run_stream(name, pdd, tb, cfg, args.requests, args.max_new))
                runs[-1].kv_bytes_per_token = kvb
            finally:
                pdd.down()
    finally:
        tb.down()

    print(f"\n{title}\n{table(runs)}\n{verdict(runs)}")
    data = {"title": title, "config": asdict(cfg), "runs": [asdict(r) for r in runs]}
    (args.out / "decode_cache.json").write_text(json.dumps(data, indent=2) + "\n")
    plot(runs, args.out / "decode_cache.png", title)
    print(f"wrote {args.out / 'decode_cache.json'} and {args.out / 'decode_cache.png'}")


if __name__ == "__main__":
    main()
