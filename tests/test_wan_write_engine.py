"""pdd.srt.wan_write against real Mooncake engines over loopback TCP: no byte of a failed write
lands after the write returned.

The receiver is a child process (so that it can be stalled: SIGSTOP), its KV buffer a file both
processes map, so this process sees what lands even while the receiver is stopped. The source
holds 0xBB, the destination 0xCC. While the receiver is stopped, a write is sent whose third
piece aims outside the receiver's registered memory (Mooncake's receiver rejects it): nothing
settles until the receiver runs again, longer than Mooncake's synchronous limit (5 s here).
Before the fix the write returned -1 at that limit with its pieces still queued, and they landed
afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdd.srt.wan_write import mooncake_env, write

pytest.importorskip("mooncake.engine")

MIB = 1 << 20
VALID = 4  # pieces of 1 MiB aimed into the receiver's buffer
FLOWS = 4
STALL_S = 7.0  # longer than the synchronous limit the old write gave up at (MC_TRANSFER_TIMEOUT)
SETTLE_S = 2.0  # how long the destination is watched after the write returned

RECEIVER = """
import sys
import numpy as np
from mooncake.engine import TransferEngine

buf = np.memmap(sys.argv[1], dtype=np.uint8, mode="r+")
engine = TransferEngine()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert engine.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(f"127.0.0.1:{engine.get_rpc_port()} {buf.ctypes.data}", flush=True)
sys.stdin.read()  # until the test is done
"""


def start_engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine


def test_no_byte_of_a_failed_write_lands_after_it_returned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in {**mooncake_env(FLOWS), "MC_TRANSFER_TIMEOUT": "5"}.items():
        monkeypatch.setenv(key, value)  # read by this process's engine as it starts
    size = (VALID + 1) * MIB
    dest_file = tmp_path / "dest"
    dest_file.write_bytes(b"\xcc" * size)
    dest = np.memmap(dest_file, dtype=np.uint8, mode="r")
    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(dest_file)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        peer, addr = child.stdout.readline().split()
        remote = int(addr)
        engine = start_engine()
        src = np.full(size + MIB, 0xBB, dtype=np.uint8)
        src[size:] = 0xCC
        local = int(src.ctypes.data)
        assert engine.register_memory(local, src.nbytes) == 0
        # Opening the session needs the receiver running: a first write, of 0xCC.
        assert write(engine, peer, [(local + size, remote, MIB)], FLOWS) == 0
        blocks = [(local + i * MIB, remote + i * MIB, MIB) for i in range(VALID)]
        blocks.insert(2, (local + VALID * MIB, remote + 64 * size, MIB))  # not registered there
        os.kill(child.pid, signal.SIGSTOP)
        resume = threading.Timer(STALL_S, os.kill, (child.pid, signal.SIGCONT))
        resume.start()
        start = time.monotonic()
        try:
            rc = write(engine, peer, blocks, FLOWS)
        finally:
            took = time.monotonic() - start
            landed = int(np.count_nonzero(dest == 0xBB))
            resume.join()
        time.sleep(SETTLE_S)
        later = int(np.count_nonzero(dest == 0xBB))
        print(f"rc {rc} after {took:.1f}s; 0xBB bytes then {landed}, {SETTLE_S}s later {later}")
        assert later == landed, "bytes of the write landed after it returned"
        assert rc == -1 and took >= STALL_S
        assert landed == VALID * MIB  # the valid pieces, all submitted before the failure
        assert (dest[VALID * MIB :] == 0xCC).all()  # the rejected piece wrote nothing
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.communicate(timeout=30)
