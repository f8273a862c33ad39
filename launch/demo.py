"""The local two-datacenter demo: PDD versus naive cross-datacenter PD, live, on SmolLM2-135M.

    python -m pdd.launch.demo [--model models/smollm2] [--turns 4] [--rate-mbit 10]

Needs root. Builds the emulated-WAN testbed (datacenter A and B in network namespaces), starts P
and RelayDecode in A, MainDecode in B and the PDD router in A, then runs a short agentic session
(a coding assistant that reads documentation through a tool, turn after turn, so the context
grows) twice: once through naive cross-datacenter PD (P -> MD: all of the KV crosses the WAN
before the first token) and once through PDD (P -> RLD -> MD: RLD answers at once while the KV
crosses, then MD takes over). Prints a table per turn and a summary, writes a PNG, tears down.

Scale: this CPU prefills ~1000x slower than a GPU, so the WAN is scaled alike (default 10 Mbit/s
standing for 10 Gbit/s) for the KV transfer to weigh what it weighs in production, and so is each
TCP flow's window (default 64 KB for production's 64 MB socket buffers), so that one flow carries
the share of the line it carries in production. Each decoder gets one torch thread and P all
cores: in production each has a chip of its own, and here two decoders with two threads each
would stall each other at every OpenMP barrier.
"""

from __future__ import annotations

import json
import os
import pydoc_data.topics
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdd.eval.client import stream_generate
from pdd.launch.cli import command_parser
from pdd.launch.pd_local import format_seconds
from pdd.launch.pdd_deploy import PDDDeployment
from pdd.launch.process import exit_on_sigterm
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import kv_bytes_per_token

SYSTEM = (
    "You are a concise coding assistant. You can call the tool read_doc(topic), which returns "
    "a section of the Python language reference. After each tool result, explain it to the "
    "user in two plain sentences."
)
TASK = "I am reviewing a Python code base. Read the documentation I point you to and explain it."
# Two sessions of the same shape; each path gets its own, so neither profits from the other's
# prefix cache on P.
TOPICS = {
    "naive": ["if", "for", "with", "function", "return", "global"],
    "pdd": ["while", "try", "class", "import", "raise", "lambda"],
}
TOOL_CHARS = 700
PATHS = {"naive": ("naive cross-DC PD", "main"), "pdd": ("PDD", "pdd")}


@dataclass
class Turn:
    context_tokens: int
    ttft_s: float
    total_s: float
    relay_tokens: int
    main_tokens: int
    handoff: str | None
    answer: str
    pdd: dict  # the router's meta_info["pdd"]: path, timings, WAN bytes


@dataclass
class Session:
    name: str
    turns: list[Turn] = field(default_factory=list)


def run_session(url: str, tokenizer: object, key: str, turns: int, max_new: int) -> Session:
    label, path = PATHS[key]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    session = Session(label)
    for topic in TOPICS[key][:turns]:
        doc = " ".join(pydoc_data.topics.topics[topic].split())[:TOOL_CHARS]
        messages.append({"role": "user", "content": f"read_doc({topic!r}) returned:\n{doc}"})
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        sampling = {"temperature": 0, "max_new_tokens": max_new}
        got = stream_generate(url, {"input_ids": ids, "sampling_params": sampling,
                                    "pdd_path": path})  # fmt: skip
        final = got.final
        meta = final["meta_info"]["pdd"]
        answer = final["text"].strip()
        messages.append({"role": "assistant", "content": answer})
        turn = Turn(len(ids), got.ttft_s or got.total_s, got.total_s, meta["relay_tokens"],
                    meta["main_tokens"], meta["handoff_mode"], answer, meta)  # fmt: skip
        session.turns.append(turn)
        print(f"[{label}] turn {len(session.turns)}: {turn.context_tokens} context tokens, "
              f"TTFT {turn.ttft_s:.2f}s, total {turn.total_s:.2f}s, tokens from RLD "
              f"{turn.relay_tokens} / MD {turn.main_tokens}: {answer[:90]!r}",
              flush=True)  # fmt: skip
    return session


def summary(sessions: list[Session]) -> str:
    naive, pdd = sessions
    lines = [f"{'turn':>4} {'context':>8} {'naive TTFT':>10} {'PDD TTFT':>9} {'speed-up':>8} "
             f"{'naive E2E':>9} {'PDD E2E':>8} "
             f"{'PDD tokens RLD/MD':>17} {'handoff':>8}"]  # fmt: skip
    for i, (a, b) in enumerate(zip(naive.turns, pdd.turns, strict=True), 1):
        lines.append(
            f"{i:>4} {b.context_tokens:>8} {a.ttft_s:>9.2f}s {b.ttft_s:>8.2f}s "
            f"{a.ttft_s / b.ttft_s:>7.1f}x {a.total_s:>8.2f}s {b.total_s:>7.2f}s "
            f"{b.relay_tokens:>8}/{b.main_tokens:<8} {b.handoff or 'none':>8}"
        )
    mean_a = statistics.fmean(t.ttft_s for t in naive.turns)
    mean_b = statistics.fmean(t.ttft_s for t in pdd.turns)
    lines.append(f"mean TTFT: naive cross-DC PD {mean_a:.2f}s, PDD {mean_b:.2f}s "
                 f"({mean_a / mean_b:.1f}x faster to first token)")  # fmt: skip
    e2e_a = statistics.fmean(t.total_s for t in naive.turns)
    e2e_b = statistics.fmean(t.total_s for t in pdd.turns)
    faster = sum(b.total_s < a.total_s for a, b in zip(naive.turns, pdd.turns, strict=True))
    lines.append(f"mean end-to-end: naive cross-DC PD {e2e_a:.2f}s, PDD {e2e_b:.2f}s; PDD "
                 f"finished first in {faster} of {len(pdd.turns)} turns")  # fmt: skip
    return "\n".join(lines)


def plot(sessions: list[Session], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    width = 0.38
    for k, s in enumerate(sessions):
        xs = [i + (k - 0.5) * width for i in range(len(s.turns))]
        ax.bar(xs, [t.ttft_s for t in s.turns], width, label=s.name)
    ax.set_xticks(
        range(len(sessions[0].turns)), [f"turn {i + 1}" for i in range(len(sessions[0].turns))]
    )
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pdd.launch.demo", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/smollm2"))
    parser.add_argument("--turns", type=int, default=4, choices=range(1, 7))
    parser.add_argument("--max-new", type=int, default=96, help="output tokens per turn (at most)")
    parser.add_argument("--rate-mbit", type=float, default=10.0)
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one way")
    add_flow_window_argument(parser)
    parser.add_argument(
        "--prefill-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads of P (default: every core; P computes alone, between turns)",
    )
    parser.add_argument(
        "--decode-threads",
        type=int,
        default=1,
        help="torch threads of RLD and of MD (default 1: each decoder has a core to itself, "
        "as each has its own chip in production; more make them fight over these cores, "
        "which costs each far more than the extra thread gains)",
    )
    parser.add_argument("--run-dir", type=Path, default=None, help="logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if min(args.prefill_threads, args.decode_threads) < 1:
        parser.error("--prefill-threads and --decode-threads must be at least 1")
    exit_on_sigterm()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="pdd-demo-"))
    kv_kb = kv_bytes_per_token(args.model) / 1024
    title = (f"{args.model.name} ({kv_kb:.0f} KiB of KV per token), WAN {args.rate_mbit:g} Mbit/s, "
             f"RTT {2 * args.delay_ms:g} ms, "
             f"TCP window {args.flow_window_mb:g} MB per flow, "
             f"threads: P {args.prefill_threads}, RLD and MD {args.decode_threads}")  # fmt: skip
    print(f"[demo] {title}; logs in {run_dir}", flush=True)
    tb = Testbed(
        "pdddemo",
        LinkParams(args.rate_mbit, args.delay_ms),
        net="10.221",
        flow_window_mb=args.flow_window_mb,
    )
    tb.down()
    tb.up()
    # Both sessions share MD; its decode-side cache would make the naive path less naive.
    threads = {"prefill": args.prefill_threads, "relay": args.decode_threads,
               "main": args.decode_threads}  # fmt: skip
    env = {role: {"OMP_NUM_THREADS": str(n)} for role, n in threads.items()}
    pdd = PDDDeployment.create(args.model, run_dir, tb.placement("a"), tb.placement("b"),
                               decode_cache=False, server_env=env)  # fmt: skip
    try:
        print("[demo] starting P + RelayDecode in datacenter A, MainDecode in B, router in A",
              flush=True)  # fmt: skip
        print(f"[demo] up; start-up seconds: {format_seconds(pdd.up())}", flush=True)
        sessions = [run_session(pdd.url, tokenizer, key, args.turns, args.max_new)
                    for key in ("naive", "pdd")]  # fmt: skip
    finally:
        pdd.down()
        tb.down()
        print("[demo] stopped every server and removed the testbed", flush=True)
    print(f"\n{title}\n{summary(sessions)}")
    record = run_dir / "demo.json"
    record.write_text(json.dumps([asdict(s) for s in sessions], indent=1))
    print(f"each turn's record (the router's timings and WAN bytes): {record}")
    png = run_dir / "demo_ttft.png"
    plot(sessions, png, title)
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
