"""Markers shared by test modules."""

from __future__ import annotations

import os

import pytest

# The emulated WAN testbed creates network namespaces, veth and TUN devices.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the testbed needs root (network namespaces, veth and TUN devices)"
)


def without_gpu(why: str) -> pytest.MarkDecorator:
    """For a test that only means something on a machine with no GPU; `why` is printed."""
    from pdd.srt.cpu_support import has_gpu

    return pytest.mark.skipif(has_gpu(), reason=f"a GPU is present: {why}")
