"""Where a MainDecode server's control sockets listen.

With DP attention each DP rank of an MD server has its own waiting queue, KV pool and radix
cache, so to the router each is an MD of its own, with its own control socket: DP rank k of a
server started with `--pdd-control-port PORT` listens on PORT + k (PORT alone without DP).
"""

from __future__ import annotations


def rank_control_port(port: int, dp_rank: int) -> int:
    return port + dp_rank
