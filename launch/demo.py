"""The local demo: a real prefill server and decode server (mooncake_tcp) behind SGLang's router,
serving SmolLM2-135M-Instruct, answering a few chat questions; then everything is torn down.

    python -m pdd.launch.demo --model models/smollm2
"""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

from pdd.launch.cli import command_parser
from pdd.launch.pd_local import LocalPD, format_seconds
from pdd.launch.process import exit_on_sigterm

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
]


def chat(url: str, question: str, max_tokens: int) -> tuple[str, float, float]:
    """Streams one chat completion; returns (answer, time to first token, total seconds)."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.monotonic()
    ttft = None
    parts: list[str] = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            delta = json.loads(line[5:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.monotonic() - start
            parts.append(delta)
    total = time.monotonic() - start
    return "".join(parts).strip(), ttft if ttft is not None else total, total


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("pdd.launch.demo", __doc__)
    parser.add_argument("--model", type=Path, default=Path("models/smollm2"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--run-dir", type=Path, default=None, help="logs (default: a temp dir)")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="pdd-demo-"))
    pd = LocalPD.create(args.model, run_dir)
    print(f"[demo] starting prefill + decode (mooncake_tcp) + router; logs in {run_dir}")
    try:
        times = pd.up()
        print(f"[demo] up; start-up seconds: {format_seconds(times)}")
        print(f"{'question':36s} {'TTFT s':>7s} {'total s':>8s}  answer")
        for q in QUESTIONS:
            answer, ttft, total = chat(pd.url, q, args.max_tokens)
            print(f"{q:36s} {ttft:7.2f} {total:8.2f}  {answer!r}")
    finally:
        pd.down()
        print("[demo] stopped every server")


if __name__ == "__main__":
    main()
