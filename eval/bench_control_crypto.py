"""What encrypting the control plane costs: HMAC only against CURVE + HMAC, per message.

    python -m pdd.eval.bench_control_crypto [--rounds 3000] [--blocks 4]

Two processes on loopback, each with the control plane's real sockets (pdd.control.channel):
this one sends a message and waits for the echo process to send it back, one at a time. For a
small message (READY) and a larger one (a Catch-Up CHUNK of 64 token ids), with HMAC only and
with CURVE + HMAC, it prints the round trip's P50 and P99 and the CPU both processes spent per
message carried (user + system, ZMQ's I/O threads included; two messages per round trip; the
warm-up's messages and each block's connection handshake count too, as in a live router). The
cases run interleaved in `--blocks` blocks, so load from elsewhere on the machine falls on all
alike. The last line gives CURVE + HMAC over HMAC only, averaged over the two messages.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import zmq

from pdd.control.channel import ControlSocket
from pdd.control.curve import CurveKeys, Role
from pdd.control.messages import Chunk, Message, Ready, encode
from pdd.launch.cli import command_parser

SECRET = b"bench-control-crypto-secret-0123456789"
MESSAGES: dict[str, Message] = {
    "READY": Ready("bench-request-0001", 2048, 1024, 8 << 20, 42),
    "CHUNK 64": Chunk("bench-request-0001", 128, tuple(range(151_000, 151_064))),
}
MODES = ("HMAC only", "CURVE + HMAC")
WARMUP = 200
WAIT_MS = 5000


def _socket(mode: str, role: Role) -> ControlSocket:
    curve = CurveKeys.derive(SECRET, role) if mode == MODES[1] else None
    return ControlSocket(SECRET, curve=curve)


def _recv_one(sock: ControlSocket) -> Message:
    if not sock.socket.poll(WAIT_MS):
        raise TimeoutError("no message within 5 s")
    [msg] = sock.recv_nowait(1)
    return msg


def _echo(pipe: Connection) -> None:
    """Echo every message back, one case at a time: ("run", mode, reply_to), then "stop"."""
    while (cmd := pipe.recv()) is not None:
        _, mode, reply_to = cmd
        sock = _socket(mode, "md")
        pipe.send(sock.bind("tcp://127.0.0.1:*"))
        cpu0 = time.process_time()
        while not pipe.poll(0):
            if sock.socket.poll(50):
                for msg in sock.recv_nowait():
                    sock.send(reply_to, msg)
        pipe.recv()  # "stop"
        pipe.send(time.process_time() - cpu0)
        sock.close()


@dataclass
class Case:
    mode: str
    message: str
    rtts_us: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    messages: int = 0  # carried, both ways

    def percentile(self, p: int) -> float:
        return statistics.quantiles(self.rtts_us, n=100, method="inclusive")[p - 1]

    @property
    def cpu_us(self) -> float:
        return self.cpu_s / self.messages * 1e6


def _run(case: Case, rounds: int, pipe: Connection) -> None:
    sock = _socket(case.mode, "router")
    reply_to = sock.bind("tcp://127.0.0.1:*")
    pipe.send(("run", case.mode, reply_to))
    addr, msg = pipe.recv(), MESSAGES[case.message]
    cpu0 = time.process_time()
    for _ in range(WARMUP):  # connections up, handshakes done, caches warm
        sock.send(addr, msg)
        _recv_one(sock)
    for _ in range(rounds):
        t0 = time.perf_counter()
        sock.send(addr, msg)
        _recv_one(sock)
        case.rtts_us.append((time.perf_counter() - t0) * 1e6)
    mine = time.process_time() - cpu0
    pipe.send("stop")
    case.cpu_s += mine + pipe.recv()
    case.messages += 2 * (rounds + WARMUP)
    sock.close()


def table(cases: list[Case]) -> str:
    lines = [f"{'mode':<14}{'message':<10}{'bytes':>7}{'P50 us':>9}{'P99 us':>9}{'CPU us/msg':>12}"]
    for c in cases:
        size = len(encode(MESSAGES[c.message], SECRET))
        lines.append(f"{c.mode:<14}{c.message:<10}{size:>7}{c.percentile(50):>9.0f}"
                     f"{c.percentile(99):>9.0f}{c.cpu_us:>12.1f}")  # fmt: skip
    return "\n".join(lines)


def ratios(cases: list[Case]) -> tuple[float, float]:
    """CURVE + HMAC over HMAC only: P50 round trip and CPU, averaged over the messages."""
    by = {(c.mode, c.message): c for c in cases}
    pairs = [(by[(MODES[0], m)], by[(MODES[1], m)]) for m in MESSAGES]
    latency = statistics.mean(b.percentile(50) / a.percentile(50) for a, b in pairs)
    return latency, statistics.mean(b.cpu_us / a.cpu_us for a, b in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("pdd.eval.bench_control_crypto", __doc__)
    parser.add_argument("--rounds", type=int, default=3000, help="timed round trips per case")
    parser.add_argument("--blocks", type=int, default=4, help="interleaved blocks per case")
    args = parser.parse_args(argv)
    if not zmq.has("curve"):
        parser.error("this libzmq has no CURVE: nothing to compare")
    cases = [Case(mode, message) for message in MESSAGES for mode in MODES]
    parent, child = mp.get_context("spawn").Pipe()
    echo = mp.get_context("spawn").Process(target=_echo, args=(child,), daemon=True)
    echo.start()
    try:
        for _ in range(args.blocks):
            for case in cases:
                _run(case, max(1, args.rounds // args.blocks), parent)
    finally:
        parent.send(None)
        echo.join(5)
    print(f"control messages over loopback, {len(cases[0].rtts_us)} round trips per case")
    print(table(cases))
    latency, cpu = ratios(cases)
    print(f"curve latency ratio {latency:.2f} cpu ratio {cpu:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
