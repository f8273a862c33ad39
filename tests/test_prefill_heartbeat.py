"""pdd.srt.prefill_heartbeat: a decoder forgives missed heartbeats to a prefill server whose data
still arrives, on real loopback connections, and fails it as SGLang does once nothing arrives."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

from pdd.srt import prefill_heartbeat
from tests.loopback import connection

P_HOST = "127.0.0.82"
RANK_HOST = "127.0.0.83"


class Manager:
    """The fields of SGLang's CommonKVManager the hook reads (decode side)."""

    def __init__(self, bootstrap_addr: str) -> None:
        self.heartbeat_interval = 0.2
        self.max_failures = 2
        self.heartbeat_failures: dict[str, int] = {bootstrap_addr: 2}
        self.connection_lock = threading.Lock()
        self.connection_pool: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.connection_pool[f"{bootstrap_addr}_0_0"].append({"rank_ip": RANK_HOST})
        self.failed: list[str] = []

    def handle_node_failure(self, addr: str) -> None:  # SGLang's, unpatched
        self.failed.append(addr)


def fail(manager: Manager, addr: str) -> None:
    prefill_heartbeat._around_handle_node_failure(Manager.handle_node_failure, manager, addr)


def test_the_ranks_kv_arriving_forgives_missed_heartbeats_until_it_stops() -> None:
    addr = f"{P_HOST}:8998"
    manager = Manager(addr)
    assert prefill_heartbeat.prefill_addresses(manager, addr) == {
        *prefill_heartbeat.peer_addresses(f"{P_HOST}:0"),
        *prefill_heartbeat.peer_addresses(f"{RANK_HOST}:0"),
    }
    # Only the rank's address, not the bootstrap host's, has a connection: the KV's.
    with connection(RANK_HOST) as (sender, receiver):
        sender.sendall(b"kv")
        assert receiver.recv(2) == b"kv"
        fail(manager, addr)
        assert manager.failed == [] and manager.heartbeat_failures[addr] == 0
        time.sleep(0.5)  # longer than the misses' span: nothing arrived meanwhile
        manager.heartbeat_failures[addr] = 2
        fail(manager, addr)
    assert manager.failed == [addr]


def test_a_prefill_without_connections_fails_as_sglang_fails_it() -> None:
    addr = "127.0.0.84:8998"
    manager = Manager(addr)
    manager.connection_pool.clear()
    fail(manager, addr)
    assert manager.failed == [addr]
