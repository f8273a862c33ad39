"""The local two-datacenter demo: PDD versus naive cross-datacenter PD, live, on SmolLM2-135M.

    python -m pdd.launch.demo [--model models/smollm2] [--turns 4] [--rate-mbit 10]

Needs root. Builds the emulated-WAN testbed (datacenter A and B in network namespaces), starts P
and RelayDecode in A, MainDecode (with its decode-side radix cache) in B and the PDD router in A,
then runs a short agentic session (a coding assistant that reads documentation through a tool
and explains each section at length, turn after turn, so the context grows) twice, as a chat
client would, through the router's OpenAI chat endpoint (each turn sends the whole conversation
again): once through naive cross-datacenter PD (P -> MD with no decode-side cache: MD's cache is
flushed before each turn, so all of the prompt's KV crosses the WAN before the first token) and
once through PDD (the router picks each turn's path: P -> RLD -> MD answers at once while the KV
MD lacks crosses, then MD takes over; MD keeps each turn's context, so later turns send only the
new suffix). Prints a table per turn and a summary, writes a PNG, tears down.

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
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdd.eval.client import sse_events
from pdd.launch.cli import command_parser
from pdd.launch.pd_local import format_seconds
from pdd.launch.pdd_deploy import PDDDeployment, thread_env
from pdd.launch.process import exit_on_sigterm
from pdd.launch.testbed import Testbed, add_flow_window_argument
from pdd.launch.wan import LinkParams
from pdd.models.kv import kv_bytes_per_token

SYSTEM = (
    "You are a patient coding assistant. You can call the tool read_doc(topic), which returns "
    "a section of the Python language reference. After each tool result, explain it to the "
    "user in detail: what the statement does, how to use it, a short code example, and the "
    "mistakes people make with it."
)
TASK = "I am reviewing a Python code base. Read the documentation I point you to and explain it."
# Both paths run the same conversation (greedy: the same answers, so each turn's time compares
# the same work); every tier's cache is flushed before each, so neither profits from the other.
TOPICS = ["while", "try", "class", "import", "raise", "lambda"]
TOOL_CHARS = 700
# Each session's name and the path its requests ask for (None: the router's own choice).
PATHS: dict[str, tuple[str, str | None]] = {"naive": ("naive cross-DC PD", "main"),
                                           "pdd": ("PDD", None)}  # fmt: skip
MODEL_NAME = "demo"
THINK_S = 1.0  # the user reads the answer before the next turn (MD's cache sync lands meanwhile)


@dataclass
class Turn:
    context_tokens: int
    ttft_s: float
    total_s: float
    relay_tokens: int
    main_tokens: int
    handoff: str | None
    answer: str
    pdd: dict  # the router's meta_info["pdd"]: path, timings, WAN bytes, MD's cache hit

    @property
    def md_cached(self) -> int:
        return int(self.pdd.get("md_cached_tokens") or 0)


@dataclass
class Chat:
    text: str
    ttft_s: float | None
    total_s: float
    prompt_tokens: int
    pdd: dict


def stream_chat(url: str, body: dict, timeout: float = 600.0) -> Chat:
    """POSTs a streamed chat completion to the router's OpenAI endpoint and reads it."""
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps({**body, "stream": True,
                         "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    start = time.monotonic()
    text, ttft = "", None
    usage: dict = {}
    meta: dict = {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for event in sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"the chat failed: {event['error']}")
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.monotonic() - start
                text += piece
            meta = event.get("pdd") or meta
            usage = event.get("usage") or usage
    return Chat(text, ttft, time.monotonic() - start, int(usage.get("prompt_tokens", 0)), meta)


def flush_cache(url: str, timeout_s: float = 60.0) -> None:
    """Empties a server's radix cache (MD's: as if it had none, for naive cross-DC PD)."""
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(f"{url}/flush_cache", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                if resp.status == 200:
                    return
        except urllib.error.HTTPError:
            pass  # requests still running (a transfer the router let finish): try again
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cache of {url} could not be flushed")
        time.sleep(0.5)


@dataclass
class Session:
    name: str
    turns: list[Turn] = field(default_factory=list)


def run_session(pdd: PDDDeployment, key: str, turns: int, max_new: int) -> Session:
    """One chat, turn after turn; the client sends the whole conversation each time, with the
    answers as it got them (the router reuses the ids it generated for them)."""
    label, path = PATHS[key]
    naive = key == "naive"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    session = Session(label)
    for server in (pdd.prefill, pdd.relay, pdd.main):
        flush_cache(server.url)  # each session starts with nothing of the other cached
    for topic in TOPICS[:turns]:
        if naive and session.turns:
            flush_cache(pdd.main.url)
        time.sleep(THINK_S)
        doc = " ".join(pydoc_data.topics.topics[topic].split())[:TOOL_CHARS]
        messages.append({"role": "user", "content": f"read_doc({topic!r}) returned:\n{doc}"})
        body: dict = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_new,
                      "temperature": 0}  # fmt: skip
        if path is not None:
            body["pdd_path"] = path
        got = stream_chat(pdd.url, body)
        meta = got.pdd
        messages.append({"role": "assistant", "content": got.text})
        turn = Turn(got.prompt_tokens, got.ttft_s or got.total_s, got.total_s,
                    meta["relay_tokens"], meta["main_tokens"], meta["handoff_mode"], got.text,
                    meta)  # fmt: skip
        session.turns.append(turn)
        print(f"[{label}] turn {len(session.turns)}: {turn.context_tokens} context tokens, "
              f"{turn.md_cached} cached on MD, {meta['path']}, TTFT {turn.ttft_s:.2f}s, total "
              f"{turn.total_s:.2f}s, tokens from RLD {turn.relay_tokens} / MD "
              f"{turn.main_tokens}: {got.text[:70]!r}", flush=True)  # fmt: skip
    return session


def summary(sessions: list[Session]) -> str:
    naive, pdd = sessions
    lines = [f"{'turn':>4} {'context':>7} {'on MD':>6} {'naive TTFT':>10} {'PDD TTFT':>9} "
             f"{'speed-up':>8} {'naive E2E':>9} {'PDD E2E':>8} {'PDD path':>10} "
             f"{'PDD tokens RLD/MD':>17} {'handoff':>7}"]  # fmt: skip
    for i, (a, b) in enumerate(zip(naive.turns, pdd.turns, strict=True), 1):
        lines.append(
            f"{i:>4} {b.context_tokens:>7} {b.md_cached:>6} {a.ttft_s:>9.2f}s {b.ttft_s:>8.2f}s "
            f"{a.ttft_s / b.ttft_s:>7.1f}x {a.total_s:>8.2f}s {b.total_s:>7.2f}s "
            f"{b.pdd.get('path', '?'):>10} {b.relay_tokens:>8}/{b.main_tokens:<8} "
            f"{b.handoff or 'none':>7}"
        )
    mean_a = statistics.fmean(t.ttft_s for t in naive.turns)
    mean_b = statistics.fmean(t.ttft_s for t in pdd.turns)
    lines.append(f"mean TTFT: naive cross-DC PD {mean_a:.2f}s, PDD {mean_b:.2f}s "
                 f"({mean_a / mean_b:.1f}x faster to first token)")  # fmt: skip
    e2e_a = statistics.fmean(t.total_s for t in naive.turns)
    e2e_b = statistics.fmean(t.total_s for t in pdd.turns)
    faster = sum(b.total_s < a.total_s for a, b in zip(naive.turns, pdd.turns, strict=True))
    same = sum(a.answer == b.answer for a, b in zip(naive.turns, pdd.turns, strict=True))
    lines.append(f"mean end-to-end: naive cross-DC PD {e2e_a:.2f}s, PDD {e2e_b:.2f}s; PDD "
                 f"finished first in {faster} of {len(pdd.turns)} turns (same answer on both "
                 f"paths in {same})")  # fmt: skip
    main = sum(t.main_tokens for t in pdd.turns)
    total = main + sum(t.relay_tokens for t in pdd.turns)
    later = pdd.turns[1:]
    context = sum(t.context_tokens for t in later)
    cached = sum(t.md_cached for t in later)
    lines.append(f"PDD: MD decoded {main} of {total} tokens ({main / max(total, 1):.0%}); MD's "
                 f"cache held {cached} of the {context} context tokens of turns 2-"
                 f"{len(pdd.turns)} ({cached / max(context, 1):.0%}), so only the rest crossed "
                 f"the WAN")  # fmt: skip
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
    parser.add_argument("--max-new", type=int, default=320, help="output tokens per turn (at most)")
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
    # Both sessions share the servers; the naive one flushes MD's cache before each turn.
    env = thread_env(args.prefill_threads, args.decode_threads)
    router_args = ("--tokenizer", str(args.model), "--served-model-name", MODEL_NAME)
    pdd = PDDDeployment.create(args.model, run_dir, tb.placement("a"), tb.placement("b"),
                               server_env=env, router_args=router_args)  # fmt: skip
    try:
        print("[demo] starting P + RelayDecode in datacenter A, MainDecode in B, router in A",
              flush=True)  # fmt: skip
        print(f"[demo] up; start-up seconds: {format_seconds(pdd.up())}", flush=True)
        sessions = [run_session(pdd, key, args.turns, args.max_new) for key in ("naive", "pdd")]
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
