"""Which of SGLang's model modules a server needs.

At start-up SGLang's model registry imports every module under `sglang.srt.models` (~260 on
the pinned version) unless SGLANG_DISABLED_MODEL_ARCHS names it: importing the registry took
24.7 s of CPU here, 19.3 s with only the three modules the suite's models need. The test
command names all but the modules that define its models' architectures, so each of the
suite's many server start-ups skips the rest. Found by reading the modules' source, without
importing SGLang.

    python -m pdd.srt.model_archs MODEL_DIR... prints the modules to disable, comma-separated.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path


def models_dir() -> Path:
    """sglang/srt/models of the installed SGLang (finding a top-level package imports nothing)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SGLang is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"


def architectures(model_dir: Path) -> list[str]:
    """The architectures a Hugging Face model directory's config.json names."""
    config = json.loads((model_dir / "config.json").read_text())
    archs = config.get("architectures")
    if not archs or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{model_dir}/config.json names no architectures")
    return list(archs)


def defining_modules(archs: list[str], models: Path) -> set[str]:
    """The model modules that define a class of each name in `archs`."""
    found: dict[str, set[str]] = {arch: set() for arch in archs}
    for path in models.glob("*.py"):
        source = path.read_text(errors="replace")
        for arch in archs:
            if re.search(rf"^class {re.escape(arch)}\b", source, re.MULTILINE):
                found[arch].add(path.stem)
    missing = [arch for arch, modules in found.items() if not modules]
    if missing:
        raise ValueError(f"no module under {models} defines {', '.join(missing)}")
    return set().union(*found.values())


def disabled_modules(model_dirs: list[Path], models: Path) -> list[str]:
    """Every model module but those that the models in `model_dirs` need."""
    needed = defining_modules([a for d in model_dirs for a in architectures(d)], models)
    return sorted(p.stem for p in models.glob("*.py")
                  if p.stem not in needed and not p.stem.startswith("_"))  # fmt: skip


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m pdd.srt.model_archs MODEL_DIR...", file=sys.stderr)
        return 2
    print(",".join(disabled_modules([Path(a) for a in argv], models_dir())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
