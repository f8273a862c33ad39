"""CPU-only support so that real SGLang servers run with `--device cpu` on machines without a GPU.

What it is: SGLang 0.5.23's CPU engine imports `sgl_kernel`, which has no CPU build on PyPI. A
`.pth` file (written by `install_pth()`; launch/setup.sh calls it) adds an import finder at the
END of `sys.meta_path`, so it is asked only when no real `sgl_kernel` is installed; it then
serves `pdd.srt.cpu_kernels` under that name, and only if torch sees no GPU. On GPU machines
with the normal SGLang stack it never answers. This module must stay light: every interpreter
imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

SHIM_NAME = "sgl_kernel"
PTH_NAME = "pdd_cpu_support.pth"
PTH_LINE = "import pdd.srt.cpu_support; pdd.srt.cpu_support.install_finder()\n"


def has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def triton_interpreted() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1): Triton kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class CpuKernelFinder(importlib.abc.MetaPathFinder):
    """Serves pdd.srt.cpu_kernels as `sgl_kernel` when nothing else provides it."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != SHIM_NAME or has_gpu():
            return None
        spec = importlib.util.find_spec("pdd.srt.cpu_kernels")
        if spec is None or spec.loader is None:
            return None
        return importlib.util.spec_from_file_location(SHIM_NAME, spec.origin)


def install_finder() -> None:
    if not any(isinstance(f, CpuKernelFinder) for f in sys.meta_path):
        sys.meta_path.append(CpuKernelFinder())


def install_pth() -> Path:
    target = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text(PTH_LINE)
    return target
