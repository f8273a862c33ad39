"""KV writes over Mooncake's TCP transport: several TCP flows per request, and no spinning.

SGLang's Mooncake sender hands each chunk of a request's KV to one synchronous batch write
(`MooncakeTransferEngine.batch_transfer_sync`; with unequal TP, one per layer's head slices, on
several threads at once), which has two costs across a WAN:
- Mooncake's TCP transport gives each entry of a batch to one of the peer's connections
  ("lanes", `MC_TCP_LANES_PER_PEER`, at most 16) and never splits an entry, so a request whose
  KV is a few large blocks rides one or two TCP flows. A flow carries at most its window per
  round trip: with stock Linux windows (a few MB) at 25-80 ms RTT that is 0.5-2 Gbit/s of a
  10-100 Gbit/s line.
- The synchronous call busy-polls the transfer status in C++ for as long as the transfer runs:
  a whole core per sender, taken from the servers that compute.

With the TCP transport (`mooncake_tcp`), pdd writes instead: blocks larger than a piece are
split into pieces so that there is about one per lane, each piece is submitted on its own
(`transfer_submit_write`), at most a few per lane in flight at once, and the sender polls their
status with a short, growing sleep. How many flows each write uses is chosen per peer
(`pdd.srt.wan_flows`) unless `--pdd-wan-flows` fixes it. Nothing changes on other transports
(RDMA posts a batch in one go and completes fast).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from pdd.srt.hooks import Hook
from pdd.srt.wan_flows import AUTO_FLOWS, FlowChooser, fixed_flows, sysctl_max
from pdd.srt.wan_write import MAX_FLOWS, Block, mooncake_env, watchdog_s, write

logger = logging.getLogger(__name__)

ENV_FLOWS = "PDD_WAN_FLOWS"
# SGLang's switch that sends a request's aux data (its first token, its metadata) over the
# connector's ZMQ socket, ahead of the transfer status on that same ordered socket, instead of
# as a Mooncake write that P waits for: over a WAN that wait is one more round trip before the
# status leaves, and so before every first token a decoder streams.
ENV_AUX_OVER_ZMQ = "SGLANG_MOONCAKE_SEND_AUX_TCP"
# How long a decoder holds the slots of a request whose KV transfer it gave up on, unless P
# acknowledges the abort first (SGLang's default: 30 s).
ENV_RELEASE_HOLD = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
RELEASE_HOLD_MARGIN_S = 60.0  # P's watchdog grows 2 s per GB: covers writes up to 30 GB
WANT_WINDOW = 16 << 20  # per-flow socket buffer below which start-up warns


def tcp_transport() -> bool:
    """Whether this process's Mooncake engine uses its TCP transport."""
    return os.environ.get("MC_FORCE_TCP") == "1" or os.environ.get("MOONCAKE_PROTOCOL") == "tcp"


def flows() -> int | None:
    """The flows `--pdd-wan-flows` fixed (passed on in ENV_FLOWS), or None: chosen per peer."""
    value = os.environ.get(ENV_FLOWS) or AUTO_FLOWS
    try:
        return fixed_flows(value)
    except ValueError as err:
        logger.warning("pdd: ignoring %s=%r (%s): flows chosen per peer", ENV_FLOWS, value, err)
        return None


_chooser: FlowChooser | None = None
_chooser_lock = threading.Lock()


def chooser() -> FlowChooser:
    """This process's flow chooser, made at its first KV write. Under a lock: SGLang's transfer
    threads make their first writes at once, and a second chooser replacing the first would
    lose the writes begun on it (their `end` found no peer and killed P's transfer thread)."""
    global _chooser
    with _chooser_lock:
        if _chooser is None:
            _chooser = FlowChooser(flows())
        return _chooser


def adjust_wan_args(args: argparse.Namespace) -> None:
    """Passes `--pdd-wan-flows` to this server's processes and Mooncake (unless the user set
    Mooncake's variables), sends aux data with the status over TCP (ENV_AUX_OVER_ZMQ), makes a
    decoder hold abandoned KV slots past P's write watchdog, and warns when the socket buffers
    cap each flow low."""
    given = str(getattr(args, "pdd_wan_flows", AUTO_FLOWS))
    os.environ[ENV_FLOWS] = given
    n = fixed_flows(given) or MAX_FLOWS  # Mooncake opens a peer's lanes as writes use them
    for key, value in mooncake_env(n).items():
        os.environ.setdefault(key, value)
    mode = getattr(args, "disaggregation_mode", None)
    if mode in (None, "null"):
        return
    backend = getattr(args, "disaggregation_transfer_backend", None)
    tcp = tcp_transport() or backend == "mooncake_tcp"
    if tcp:
        os.environ.setdefault(ENV_AUX_OVER_ZMQ, "1")
    if mode == "decode" and tcp:
        hold_released_slots()
    for key in ("net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem"):
        window = sysctl_max(key)
        if window is not None and window < WANT_WINDOW:
            logger.warning(
                "pdd: %s allows each TCP flow %.1f MB in flight: %d flows carry at most %.1f "
                "Gbit/s at 50 ms RTT. For a long fat WAN raise it, e.g. sysctl -w %s=\"4096 "
                "131072 %d\" (docs/wan.md)", key, window / 2**20, n,
                n * window * 8 / 0.05 / 1e9, key, WANT_WINDOW)  # fmt: skip


def hold_released_slots() -> None:
    """A decoder that gave up on a request's KV frees its slots once P acknowledges the abort,
    or after ENV_RELEASE_HOLD. P's write can still deliver pieces until its watchdog
    (`wan_write.watchdog_s`, 8 minutes by default) ends P: the hold must outlast that, or a late
    piece lands in slots another request owns (docs/wan.md, "When a write fails")."""
    floor = watchdog_s(0) + RELEASE_HOLD_MARGIN_S
    given = os.environ.get(ENV_RELEASE_HOLD)
    if given is None:
        os.environ[ENV_RELEASE_HOLD] = f"{floor:g}"
        return
    try:
        short = float(given) < floor
    except ValueError:
        short = True
    if short:
        logger.warning("pdd: %s=%s is shorter than P's write watchdog (%gs): a KV piece of a "
                       "request this decoder gave up on can still land after its slots are "
                       "reused", ENV_RELEASE_HOLD, given, floor)  # fmt: skip


def _around_batch_transfer_sync(
    original: Any,
    engine: Any,
    session: str,
    buffers: Sequence[int],
    peer_addresses: Sequence[int],
    lengths: Sequence[int],
) -> int:
    if not buffers or not tcp_transport():
        return int(original(engine, session, buffers, peer_addresses, lengths))
    blocks: list[Block] = list(zip(buffers, peer_addresses, lengths, strict=True))
    flow_chooser = chooser()
    started = flow_chooser.begin(session)
    rc = -1
    try:
        rc = write(engine.engine, session, blocks, started.flows)
    finally:
        flow_chooser.end(started, sum(lengths), rc == 0)
    return rc


def _around_poison_unsettled_send(original: Any, manager: Any, room: int) -> None:
    # SGLang withholds P's acknowledgement of a decoder's abort after a failed send, because its
    # own synchronous write can return with pieces still running; the decoder then holds the
    # request's slots for its whole release timeout (hold_released_slots: 9 minutes). pdd's
    # write returns only once no byte of it can land, so the acknowledgement is safe at once.
    if not tcp_transport():
        original(manager, room)


# SGLang's own wrapper of the Mooncake engine: every KV and aux write of its Mooncake connector
# (whole pages, and the head slices of unequal TP) goes through it.
HOOKS = (
    Hook("sglang.srt.distributed.device_communicators.mooncake_transfer_engine."
         "MooncakeTransferEngine.batch_transfer_sync", _around_batch_transfer_sync,
         HookType.AROUND, "(self, session_id, buffers, peer_buffer_addresses, lengths)"),
    Hook("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._poison_unsettled_send",
         _around_poison_unsettled_send, HookType.AROUND, "(self, room)"),
)  # fmt: skip
