"""The PDD eval harness: traces, the cluster simulator, and live runs.

    python -m pdd.eval trace --requests 2000 --out trace.jsonl
    python -m pdd.eval import mooncake_trace.jsonl --format mooncake --out trace.jsonl
    python -m pdd.eval sim --help

Commands:
  trace    generate an agentic trace (JSONL) and print its hit-rate summary
  import   convert a user's trace (Mooncake-style or simple JSONL) to ours; print its summary
  sim      simulate a PDD cluster on a trace, or check it against a live run (pdd.eval.sim)
  plan     size a deployment with the simulator (pdd.eval.sim)
  repro    rerun the paper's scenarios in the simulator (pdd.eval.sim)
  live     run a workload through four deployments on the testbed (pdd.eval.live)
  faults   inject WAN cuts and server kills under load; count lost requests (pdd.eval.faults)

`python -m pdd.eval COMMAND --help` shows a command's options.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from pdd.launch.cli import command_parser

SIM_COMMANDS = ("sim", "plan", "repro")


def _trace_parser() -> argparse.ArgumentParser:
    from pdd.eval.workload import WorkloadConfig

    default = WorkloadConfig()
    parser = command_parser(
        "pdd.eval trace",
        "Generates an agentic multi-turn trace whose per-request prefix hit rate follows the\n"
        "given shape (defaults: the paper's production traces) and prints its summary.",
    )
    parser.add_argument("--out", type=Path, required=True, help="trace file to write (JSONL)")
    parser.add_argument("--requests", type=int, default=default.requests)
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument(
        "--sessions",
        type=int,
        default=default.sessions,
        help="agent sessions active at once (default %(default)s)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=default.rate,
        help="mean arrivals per second, Poisson (default %(default)s)",
    )
    parser.add_argument(
        "--mean-hit",
        type=float,
        default=default.mean_hit,
        help="mean prefix hit rate, 0-1 (default %(default)s)",
    )
    parser.add_argument(
        "--above-95",
        type=float,
        default=default.above_95,
        help="share of requests with a hit above 95%% (default %(default)s)",
    )
    parser.add_argument(
        "--low-share",
        type=float,
        default=default.low_share,
        help="share of requests aimed below 50%%, singular ones aside (default %(default)s)",
    )
    parser.add_argument(
        "--singular-share",
        type=float,
        default=default.singular_share,
        help="share of singular requests: long fresh input, 1-4 output tokens "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--max-context",
        type=int,
        default=default.max_context,
        help="longest prompt in tokens (default %(default)s)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every prompt-side token length (max context too), e.g. 0.015 for a "
        "small model on a CPU; decoded (output) lengths stay",
    )
    return parser


def _trace(argv: list[str]) -> int:
    from pdd.eval.trace import write_trace
    from pdd.eval.workload import WorkloadConfig, format_summary, generate, hit_rate_summary

    parser = _trace_parser()
    args = parser.parse_args(argv)
    try:
        cfg = WorkloadConfig(
            seed=args.seed,
            requests=args.requests,
            sessions=args.sessions,
            rate=args.rate,
            mean_hit=args.mean_hit,
            above_95=args.above_95,
            low_share=args.low_share,
            singular_share=args.singular_share,
            max_context=args.max_context,
        )
        if args.scale != 1.0:
            cfg = cfg.scaled(args.scale)
    except ValueError as err:
        parser.error(str(err))
    requests = generate(cfg)
    config = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    write_trace(args.out, requests, {"generator": "pdd.eval.workload", "config": config})
    print(format_summary(hit_rate_summary(requests)))
    print(f"wrote {len(requests)} requests to {args.out}")
    return 0


def _import(argv: list[str]) -> int:
    from pdd.eval.trace import BLOCK_SIZE, FORMATS, TraceError, import_trace, write_trace
    from pdd.eval.workload import format_summary, hit_rate_summary

    parser = command_parser(
        "pdd.eval import",
        "Reads a user's trace (formats: see pdd/eval/trace.py), derives cached tokens, prints\n"
        "the hit-rate summary and, with --out, writes it in our format.",
    )
    parser.add_argument("path", type=Path, help="the user's trace (JSONL)")
    parser.add_argument("--format", choices=FORMATS, default="auto")
    parser.add_argument(
        "--block-size",
        type=int,
        default=BLOCK_SIZE,
        help="tokens per hash_ids block (default %(default)s, Mooncake's)",
    )
    parser.add_argument("--out", type=Path, help="trace file to write in our format")
    args = parser.parse_args(argv)
    try:
        requests = import_trace(args.path, args.format, args.block_size)
    except (OSError, TraceError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(format_summary(hit_rate_summary(requests)))
    if args.out is not None:
        write_trace(args.out, requests, {"imported_from": str(args.path), "format": args.format})
        print(f"wrote {len(requests)} requests to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "trace":
        return _trace(rest)
    if command == "import":
        return _import(rest)
    if command in SIM_COMMANDS:
        from pdd.eval.sim.cli import main as sim_main

        return sim_main(argv)
    if command == "live":
        from pdd.eval.live import main as live_main

        return live_main(rest)
    if command == "faults":
        from pdd.eval.faults import main as faults_main

        return faults_main(rest)
    print(f"error: unknown command {command!r}\n\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
