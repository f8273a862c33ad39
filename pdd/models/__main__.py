"""python -m pdd.models {tiny,wide,mla,mla-wide,smollm2} --out DIR: build a model offline."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdd.models", description=__doc__)
    parser.add_argument("name", choices=["tiny", "wide", "mla", "mla-wide", "smollm2"])
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    args = parser.parse_args(argv)
    start = time.monotonic()
    if args.name in ("tiny", "wide"):
        from pdd.models.tiny import SHAPES, make_tiny

        out = make_tiny(args.out, SHAPES[args.name])
    elif args.name in ("mla", "mla-wide"):
        from pdd.models.mla import MLA_SHAPES, make_mla

        out = make_mla(args.out, MLA_SHAPES[args.name])
    else:
        from pdd.models.smollm2 import make_smollm2

        out = make_smollm2(args.out)
    print(f"{args.name} model written to {out} in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    main()
