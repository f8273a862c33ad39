"""python -m pdd.models NAME... (--out DIR | --into DIR): build models offline.

NAME is one of tiny, wide, mla, mla-wide, smollm2. `--out DIR` writes the one model named;
`--into DIR` writes each named model to DIR/NAME, in one process (torch and transformers load once).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

NAMES = ["tiny", "wide", "mla", "mla-wide", "smollm2"]


def build(name: str, out: Path) -> Path:
    if name in ("tiny", "wide"):
        from pdd.models.tiny import SHAPES, make_tiny

        return make_tiny(out, SHAPES[name])
    if name in ("mla", "mla-wide"):
        from pdd.models.mla import MLA_SHAPES, make_mla

        return make_mla(out, MLA_SHAPES[name])
    from pdd.models.smollm2 import make_smollm2

    return make_smollm2(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pdd.models", description=__doc__)
    parser.add_argument("names", nargs="+", choices=NAMES, metavar="NAME")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="directory to write the one model named")
    where.add_argument("--into", type=Path, help="write each model named to INTO/NAME")
    args = parser.parse_args(argv)
    if args.out is not None and len(args.names) > 1:
        parser.error(f"--out takes one model, {len(args.names)} named: use --into DIR")
    for name in args.names:
        start = time.monotonic()
        out = build(name, args.out if args.out is not None else args.into / name)
        print(f"{name} model written to {out} in {time.monotonic() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
