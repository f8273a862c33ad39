"""A real TCP connection within the test process, on a loopback address of the test's choosing."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def connection(host: str) -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the connecting end, the accepted end) of one connection to `host`, closed after."""
    with socket.create_server((host, 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                yield client, accepted
