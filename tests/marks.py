"""Markers shared by test modules."""

from __future__ import annotations

import os

import pytest

# The emulated WAN testbed creates network namespaces, veth and TUN devices.
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="the testbed needs root (network namespaces, veth and TUN devices)"
)
