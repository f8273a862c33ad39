"""MD's handoff extends through pdd's Triton kernel (`--pdd-extend-kernel triton`), with real P,
MD and colocated servers. On a CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1
in MD only); the interpreter's bf16 dots are wrong, so all three servers run in float32.

Forced `triton` fails the extend rather than fall back, so exact outputs mean every attention
layer of every handoff extend went through the kernel, which also wrote their K/V into the pool
that MD's later decode steps (SGLang's own attention) read. Every test runs on the tiny dense
model (pdd.kernels.extend_attention) and on the tiny DeepSeek-V3, whose latent-attention layers
run pdd.kernels.mla_extend_attention.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdd.control.messages import Ack, Chunk, Handoff
from pdd.launch.servers import SGLangServer
from tests.log_checks import tracebacks
from tests.marks import without_gpu
from tests.test_main_decode import Deployment, Parked, reference, started
from tests.test_pd_same_dc import random_ids

KERNEL_LOG = "handoff extends use the Triton extend kernel"
FALLBACK_LOG = "handoff extends use SGLang's attention"


# On a GPU MD runs the kernel natively (`auto`); tests/test_main_decode.py covers it there.
pytestmark = without_gpu("this checks the kernel in Triton's CPU interpreter")


@pytest.fixture(scope="module", params=["tiny", "mla"])
def deployment(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Deployment]:
    model: Path = request.getfixturevalue(f"{request.param}_model")
    colocated: SGLangServer = request.getfixturevalue(
        "colocated" if request.param == "tiny" else "mla_colocated"
    )
    with started(
        model,
        tmp_path_factory.mktemp("handoff_kernel"),
        colocated,
        args=["--dtype", "float32"],
        md_args=["--pdd-extend-kernel", "triton"],
        md_env={"TRITON_INTERPRET": "1"},
    ) as dep:
        yield dep


def md_log(dep: Deployment) -> str:
    return (dep.main.log_dir / "main.log").read_text()


@pytest.mark.parametrize("k", [1, 2, 33])
def test_extend_handoff_through_the_kernel(deployment: Deployment, k: int) -> None:
    ids = random_ids(200, seed=400 + k)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    deployment.send(Handoff(rid=parked.rid, start=0, tokens=tuple(ref[:k])))
    assert parked.output()["output_ids"] == ref
    if k > 1:  # k - 1 tokens to extend (the last one is the next decode step's input)
        log = md_log(deployment)
        assert KERNEL_LOG in log and FALLBACK_LOG not in log


def test_a_ragged_batch_in_one_kernel_extend(deployment: Deployment) -> None:
    prompts = [random_ids(n, seed=500 + n) for n in (17, 64, 150, 301)]
    refs = [reference(deployment, ids) for ids in prompts]
    parked = [Parked(deployment, ids) for ids in prompts]
    for i, (p, ref) in enumerate(zip(parked, refs, strict=True)):
        deployment.send(Handoff(rid=p.rid, start=0, tokens=tuple(ref[: 1 + 11 * i])))
    for p, ref in zip(parked, refs, strict=True):
        assert p.output()["output_ids"] == ref


def test_catch_up_chunks_through_the_kernel(deployment: Deployment) -> None:
    """Each chunk's prefix includes the tokens the previous chunks computed."""
    ids = random_ids(120, seed=600)
    ref = reference(deployment, ids)
    parked = Parked(deployment, ids)
    done = 0
    for end in (1, 9, 30):
        deployment.send(Chunk(rid=parked.rid, start=done, tokens=tuple(ref[done:end])))
        assert deployment.recv(parked.rid) == Ack(rid=parked.rid, done=end)
        done = end
    deployment.send(Handoff(rid=parked.rid, start=done, tokens=tuple(ref[done:36])))
    assert parked.output()["output_ids"] == ref
    assert not tracebacks(md_log(deployment))
