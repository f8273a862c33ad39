"""The fork server the suite starts its SGLang servers from (pdd.launch.forkserver): a forked
server is an ordinary one (its own session and process group, its command line, the tokens a
server started the usual way makes), its exit is seen with its code, and a server whose
environment would change what SGLang imports is started the usual way."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdd.launch.forkserver import FORKSERVER_ENV, ForkedServer, env_difference, server_args, spawn
from pdd.launch.pd_local import generate
from pdd.launch.process import free_port
from pdd.launch.servers import SGLangServer
from tests.conftest import running
from tests.test_pd_same_dc import random_ids

MARKER = "[pdd] forked from a process that imported SGLang"


def test_what_it_forks_is_sglangs_server_alone_or_behind_ip_netns_exec() -> None:
    exe, entry = sys.executable, "sglang.launch_server"
    assert server_args([exe, "-m", entry, "--port", "1"]) == (None, ["--port", "1"])
    assert server_args(["ip", "netns", "exec", "pdd-a", exe, "-m", entry]) == ("pdd-a", [])
    assert server_args([exe, "-m", "pdd.router", "--port", "1"]) is None
    assert server_args(["/usr/bin/python3", "-m", entry]) is None  # another interpreter
    assert server_args(["ip", "netns", "exec"]) is None


def test_environment_difference_names_set_changed_and_unset_variables() -> None:
    base = {"A": "1", "B": "2", "C": "3"}
    assert env_difference({"A": "1", "B": "x", "D": "4"}, base) == {"B", "C", "D"}
    assert env_difference(dict(base), base) == set()


def test_without_a_fork_server_a_server_is_started_the_usual_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(FORKSERVER_ENV, str(tmp_path / "nobody-listens"))
    argv = [sys.executable, "-m", "sglang.launch_server", "--port", "1"]
    assert spawn(argv, dict(os.environ), tmp_path / "server.log", append=False) is None
    assert "unavailable" in capsys.readouterr().err
    monkeypatch.delenv(FORKSERVER_ENV)
    assert spawn(argv, dict(os.environ), tmp_path / "server.log", append=False) is None


def test_an_exit_code_nobody_can_tell_is_minus_one(tmp_path: Path) -> None:
    done = subprocess.Popen(["true"])
    done.wait()  # collected here: the fork server named below never had it, and is gone
    child = ForkedServer(str(tmp_path / "gone"), done.pid)
    assert child.poll() == -1 and child.wait(timeout=0) == -1


@pytest.fixture(scope="module")
def pair(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SGLangServer, SGLangServer]]:
    """One server forked, one started the usual way: a variable the fork server's imports did
    not see keeps it from forking that one."""
    run_dir = tmp_path_factory.mktemp("forkserver_pair")
    forked = SGLangServer("forked", tiny_model, free_port(), run_dir)
    usual = SGLangServer("usual", tiny_model, free_port(), run_dir,
                         env={"PDD_TEST_IMPORT_ENV": "1"})  # fmt: skip
    with running([forked, usual]):
        yield forked, usual


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_a_forked_server_has_its_own_group_and_command_line(
    pair: tuple[SGLangServer, SGLangServer],
) -> None:
    forked, usual = pair
    assert forked.process is not None and usual.process is not None
    assert isinstance(forked.process.popen, ForkedServer)
    assert isinstance(usual.process.popen, subprocess.Popen)
    pid = forked.process.pgid
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid
    assert parent(pid) != os.getpid() and parent(usual.process.pgid) == os.getpid()
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert f"-m sglang.launch_server --model-path {forked.model}" in cmdline, cmdline
    assert forked.process.log_path.read_text().startswith(MARKER)
    assert MARKER not in usual.process.log_path.read_text()


def test_forked_and_usual_servers_make_the_same_tokens(
    pair: tuple[SGLangServer, SGLangServer],
) -> None:
    forked, usual = pair
    sampling = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    for n in (9, 150, 700):
        body = {"input_ids": random_ids(n, seed=4000 + n), "sampling_params": sampling}
        assert generate(forked.url, body)["output_ids"] == generate(usual.url, body)["output_ids"]


def test_a_crashed_forked_server_exits_with_the_signal(
    pair: tuple[SGLangServer, SGLangServer],
) -> None:
    forked = pair[0]
    assert forked.process is not None and not forked.process.exited()
    forked.process.crash()
    assert forked.process.exited() and forked.process.popen is not None
    assert forked.process.popen.returncode == -9
