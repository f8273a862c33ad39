"""A fork server for SGLang servers: one process imports SGLang once, then forks each server.

    python -m pdd.launch.forkserver --socket PATH    # the test suite starts one per worker

Importing SGLang (torch, transformers, the model registry...) is ~21 of the ~23 CPU-seconds a
tiny-model server takes to start on this project's CPU machines, and the test suite starts 55
servers on two cores. A server forked from a process that has imported it skips that; from the fork
on it is an ordinary `python -m sglang.launch_server` (its own session and process group, its log,
its network namespace, its environment), so the servers under test are real SGLang servers started
by SGLang's own entry point.

What an import reads from the environment stays as the fork server read it, so a server is
forked only when its environment differs from the fork server's in RUNTIME_ENV alone (read
after start-up); any other server, and anything that is not `-m sglang.launch_server` (alone
or behind `ip netns exec NAME`), is started as before. `ManagedProcess` asks for a fork when
FORKSERVER_ENV names the socket (tests/conftest.py sets it); nothing else uses this.

Protocol: one JSON request per connection on a Unix socket, one JSON answer.
  {"op": "spawn", "args": [...], "env": {...}, "cwd": ..., "log": ..., "append": bool,
   "netns": NAME | null}                        -> {"pid": N} | {"error": "..."}
  {"op": "exit", "pid": N}                      -> {"code": int | null}  (null: still running)
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.util
import json
import os
import random
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import setproctitle

from pdd.launch import netns

FORKSERVER_ENV = "PDD_FORKSERVER"
# Set per server or per test and read only after start-up (never at import), or a shell's own.
RUNTIME_ENV = frozenset({"SGLANG_HOST_IP", "PYTEST_CURRENT_TEST", FORKSERVER_ENV, "SHLVL", "_"})
ENTRY = "sglang.launch_server"
# What `python -m sglang.launch_server` imports before it serves (measured: ~21 CPU-s); not the
# entry module itself, which each server runs as __main__.
PRELOAD = (
    "sglang.srt.arg_groups.overrides",
    "sglang.srt.plugins",
    "sglang.srt.server_args",
    "sglang.srt.utils.common",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.models.registry",
)
REAP_EVERY_S = 0.2  # a forked server that exited is collected within this (no zombie lingers)
REQUEST_TIMEOUT_S = 30.0
# The socket is bound before SGLang is imported: a spawn sent meanwhile waits for the import
# (~20 s alone, more on busy cores) rather than starting a server that imports it again.
SPAWN_TIMEOUT_S = 180.0
MAX_REQUEST = 1 << 20


# --- the client side ----------------------------------------------------------------------------


def server_args(argv: list[str]) -> tuple[str | None, list[str]] | None:
    """(network namespace or None, SGLang's arguments) if `argv` starts an SGLang server the fork
    server can fork, else None."""
    ns = None
    if argv[:3] == ["ip", "netns", "exec"] and len(argv) > 3:
        ns, argv = argv[3], argv[4:]
    if argv[:3] != [sys.executable, "-m", ENTRY]:
        return None
    return ns, argv[3:]


def env_difference(env: dict[str, str], base: dict[str, str]) -> set[str]:
    """The variables set, changed or unset in `env` against `base`."""
    return {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}


def request(path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(json.dumps(body).encode())
        sock.shutdown(socket.SHUT_WR)
        answer: dict[str, Any] = json.loads(_read_all(sock))
    return answer


class ForkedServer:
    """A forked server as `subprocess.Popen` shows a child: pid, poll, wait, returncode."""

    def __init__(self, path: str, pid: int) -> None:
        self.path = path
        self.pid = pid
        self.returncode: int | None = None
        try:
            self._fd: int | None = os.pidfd_open(pid)  # readable once it exits
        except ProcessLookupError:
            self._fd = None

    def poll(self) -> int | None:
        if self.returncode is None and self._exited(0.0):
            self.returncode = self._code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout or 0.0)
            self.returncode = self._code()
        return self.returncode

    def _exited(self, timeout: float | None) -> bool:
        if self._fd is None:
            return True
        return bool(select.select([self._fd], [], [], timeout)[0])

    def _code(self) -> int:
        """Its exit code, once the fork server has collected it (within REAP_EVERY_S); -1 if
        that cannot be known (the fork server is gone: init collected it)."""
        deadline = time.monotonic() + 10 * REAP_EVERY_S
        while True:
            try:
                code = request(self.path, {"op": "exit", "pid": self.pid}).get("code")
            except (OSError, ValueError):
                code, deadline = None, 0.0
            if code is not None or time.monotonic() > deadline:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None
                return -1 if code is None else int(code)
            time.sleep(REAP_EVERY_S / 2)


def spawn(argv: list[str], env: dict[str, str], log: Path, append: bool) -> ForkedServer | None:
    """The server `argv` forked by the fork server FORKSERVER_ENV names, or None where that
    cannot be done as it would run (no fork server, another program, another import env)."""
    path = os.environ.get(FORKSERVER_ENV)
    parsed = server_args(argv)
    if not path or parsed is None:
        return None
    ns, args = parsed
    body = {"op": "spawn", "args": args, "env": env, "cwd": os.getcwd(), "log": str(log),
            "append": append, "netns": ns}  # fmt: skip
    try:
        answer = request(path, body, SPAWN_TIMEOUT_S)
    except (OSError, ValueError) as err:  # it is gone or never came up: start as before
        print(f"[pdd] fork server {path} unavailable ({err!r}); starting {args[:2]} directly",
              file=sys.stderr, flush=True)  # fmt: skip
        return None
    if "pid" not in answer:
        return None  # e.g. an environment that must be read at import: started as before
    return ForkedServer(path, int(answer["pid"]))


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    size = 0
    while chunk := sock.recv(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REQUEST:
            raise ValueError(f"a fork-server message over {MAX_REQUEST} bytes")
    return b"".join(chunks)


# --- the fork server ----------------------------------------------------------------------------


class ForkServer:
    def __init__(self, path: str, base: dict[str, str]) -> None:
        self.base = base  # the environment the imports read (before they changed it)
        self.codes: dict[int, int] = {}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)

    def serve(self) -> None:
        while True:
            readable = select.select([self.listener], [], [], REAP_EVERY_S)[0]
            self.reap()
            if readable:
                conn, _ = self.listener.accept()
                with conn:
                    conn.settimeout(REQUEST_TIMEOUT_S)
                    try:
                        answer = self.answer(json.loads(_read_all(conn)), conn)
                    except (ValueError, OSError, KeyError, TypeError) as err:
                        answer = {"error": f"{type(err).__name__}: {err}"}
                    try:
                        conn.sendall(json.dumps(answer).encode())
                    except OSError:
                        pass  # the client gave up; a forked server is still collected

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.codes[pid] = os.waitstatus_to_exitcode(status)

    def answer(self, req: dict[str, Any], conn: socket.socket) -> dict[str, Any]:
        if req.get("op") == "exit":
            self.reap()
            return {"code": self.codes.get(int(req["pid"]))}
        if req.get("op") != "spawn":
            return {"error": f"unknown op {req.get('op')!r}"}
        differs = env_difference(req["env"], self.base) - RUNTIME_ENV
        if differs:
            return {"error": f"environment read at import differs: {sorted(differs)}"}
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            conn.close()  # else the client waits on this copy for the end of the answer
            self.listener.close()
            _run_server(req)  # never returns
        return {"pid": pid}


def _run_server(req: dict[str, Any]) -> None:
    """In the forked child: become the server `req` describes, as its own command line would."""
    code = 1
    try:
        os.setsid()  # its own session and process group, as ManagedProcess starts one
        if req["netns"]:
            netns.enter(req["netns"])
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if req["append"] else os.O_TRUNC)
        log = os.open(req["log"], flags, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _reseed()  # else every forked server draws the same "random" ports and seeds
        command = [sys.executable, "-m", ENTRY, *req["args"]]
        setproctitle.setproctitle(shlex.join(command))  # what ps and pgrep show for it
        print(f"[pdd] forked from a process that imported SGLang ({ENTRY})", flush=True)
        spec = importlib.util.find_spec(ENTRY)
        sys.argv = [spec.origin if spec and spec.origin else ENTRY, *req["args"]]
        sys.orig_argv = command
        runpy.run_module(ENTRY, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at a normal exit
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reseed() -> None:
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser("pdd.launch.forkserver", description=__doc__)
    parser.add_argument("--socket", required=True, help="the Unix socket to serve on")
    args = parser.parse_args(argv)
    start = time.monotonic()
    # Before the imports change os.environ: setproctitle finds the memory it rewrites (argv and
    # the environment block after it) only while the environment is the one it started with.
    setproctitle.setproctitle(shlex.join(sys.orig_argv))
    server = ForkServer(args.socket, dict(os.environ))  # bound now, serving once imported
    for name in PRELOAD:
        importlib.import_module(name)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:  # a fork copies only this thread: locks another holds would stay held
        raise SystemExit(f"importing SGLang started threads {threads}: cannot fork servers")
    print(f"fork server ready on {args.socket}: SGLang imported in "
          f"{time.monotonic() - start:.1f}s", flush=True)  # fmt: skip
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
