"""The one argparse set-up every `python -m pdd...` command shares."""

from __future__ import annotations

import argparse


def command_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help shows the module's docstring as written (usage examples included)."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
