"""The cluster simulator, the economics reproductions and the planner on small cases whose
answers are worked out by hand from the documented formulas (pure Python, no servers)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from pdd.eval.report import Record, percentile
from pdd.eval.sim import calibrate as calib  # its testbed_* are not tests
from pdd.eval.sim.calibrate import KINDS, Fit, as_record, calibrate
from pdd.eval.sim.cli import main as cli_main
from pdd.eval.sim.cli import parse_tier
from pdd.eval.sim.clock import Clock
from pdd.eval.sim.config import ClusterConfig, Sla, Tier, deployment
from pdd.eval.sim.costs import StepCosts, prediction_error
from pdd.eval.sim.economics import bcr, change, kv_gbit_s
from pdd.eval.sim.fit import PrefillFit, StepFit, WanFit, fit_step
from pdd.eval.sim.handoff_bench import handoff_microbench
from pdd.eval.sim.hardware import CHIP_A, CHIP_B, MOE_1T, WAN, Chip, Link, Model
from pdd.eval.sim.planner import PlanSpace, analytic_capacity, plan, sla_capacity, window
from pdd.eval.sim.requests import (
    SimRequest,
    agentic_requests,
    as_sim_request,
    fixed_requests,
    rescale,
)
from pdd.eval.sim.simulation import Simulation, simulate
from pdd.eval.sim.tiers import Decode, RequestState, Slot
from pdd.policy.handoff import HandoffPolicy
from pdd.policy.path import PathPolicy, Signals, auto_path, transfer_seconds

# A dense toy: 2e9 FLOPs per token, 1 GB of weights, 1 MB of KV per token, no attention FLOPs.
TOY = Model("toy", params_b=1.0, weight_bytes=1e9, kv_bytes_per_token=1e6)
# 2e12 FLOP/s: 1 ms per token of compute; 1e12 B/s: the weights take 1 ms per step;
# RDMA at 1e11 B/s: 10 ms per 1000 tokens of KV.
COSTS = StepCosts(TOY, flops_s=2e12, bytes_s=1e12, send_bytes_s=1e11)
LINK = Link(gbit_s=8, rtt_ms=20)  # 1e9 B/s, 10 ms one way, no jitter, no per-flow cap
RDMA = 0.002  # ClusterConfig.rdma_latency_s


def tier(n: int = 1, max_batch: int = 128) -> Tier:
    return Tier(CHIP_A, n, 1, max_batch, costs=COSTS)


# P's 1 s plus 1 s of KV for a fresh 1000-token prompt misses this SLA: such a prompt is low hit.
TOY_POLICY = PathPolicy(ttft_sla_s=1.5)


def toy(kind: str, **kw: object) -> ClusterConfig:
    base = ClusterConfig(kind, tier(), tier(), tier() if kind == "pdd" else None, TOY, LINK,
                         path_policy=TOY_POLICY)  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


def decode_s(context: int, steps: int) -> float:
    """Hand-summed decode of one request: step k reads the weights (1e9 B) and the KV of
    context + k tokens plus the new one (1e6 B each) at 1e12 B/s; compute (1 ms) is smaller."""
    return sum((1e9 + (context + k + 1) * 1e6) / 1e12 for k in range(steps))


# -- costs -----------------------------------------------------------------------------------


def test_roofline_prefill_decode_and_extend() -> None:
    # Prefill of 1000 tokens: compute 1000 x 1 ms = 1 s beats memory (1e9 + 1e9 B = 2 ms).
    assert COSTS.prefill_s(1000) == pytest.approx(1.0)
    # 100 cached tokens add no compute here (no attention FLOPs), only 0.1 ms of reads.
    assert COSTS.prefill_s(500, 100) == pytest.approx(0.5)
    # Decode of one request at 1000 tokens: memory (1e9 + 1001e6) / 1e12 = 2.001 ms.
    assert COSTS.decode_step_s(1, 1000) == pytest.approx(2.001e-3)
    # A batch of 4 at 1000 tokens each: weights once, 4004 tokens of KV: 5.004 ms.
    assert COSTS.decode_step_s(4, 4000) == pytest.approx(5.004e-3)
    # Extend of 3 tokens over 1000: compute 3 ms > memory (1e9 + 1003e6 B = 2.003 ms).
    assert COSTS.extend_s(3, 1000) == pytest.approx(3e-3)


def test_moe_weights_and_extend_is_nearly_free() -> None:
    # One token reads 32/1000 of the weights; 1 - (1 - 0.032)^2 of them for two tokens.
    assert MOE_1T.weights_read(1) == pytest.approx(0.55e12 * 0.032)
    assert MOE_1T.weights_read(2) == pytest.approx(0.55e12 * (1 - 0.968**2))
    md = StepCosts.of(CHIP_B, 8, MOE_1T)
    step = md.decode_step_s(64, 64 * 64_000)
    extend = md.extend_s(99, 64_000)
    # Memory-bound: recomputing 99 tokens takes one forward where decoding them took 99 steps,
    # but a forward of its own: it reads (almost all) the weights again, so next to a step of
    # 64 x 64K it is not free (only one context's KV instead of 64).
    assert 0.5 * step < extend < step
    assert extend == pytest.approx(md.forward_s(99, 99 * 64_000 + 99 * 100 / 2, 64_000))
    # Several handoffs in one forward: the weights once, each one's tokens and context.
    jobs = [(99, 64_000), (10, 30_000)]
    both = md.forward_s(109, 99 * 64_000 + 4950 + 10 * 30_000 + 55, 94_000)
    assert md.extend_batch_s(jobs) == pytest.approx(both)
    assert md.extend_batch_s(jobs) < md.extend_s(99, 64_000) + md.extend_s(10, 30_000)
    assert md.extend_batch_s([(0, 64_000)]) == 0.0  # nothing to recompute: no forward


def test_instance_memory_and_fit() -> None:
    a = StepCosts.of(CHIP_A, 8, MOE_1T, kv_mem_fraction=1.0)
    # 8 x 96 GB - 550 GB = 218 GB of KV at 4649 * 1024 / 100 bytes per token.
    assert a.kv_capacity_tokens == int(218e9 / (4649 * 1024 / 100))
    with pytest.raises(ValueError, match="does not fit"):
        StepCosts.of(CHIP_A, 4, MOE_1T)


def test_calibrate_reproduces_measurements_and_reports_error() -> None:
    c = StepCosts.calibrate(TOY, prefill_s_per_token=0.004, decode_step_s=0.02,
                            prefill_tokens=500, decode_batch=2, decode_context=300)  # fmt: skip
    assert c.prefill_s(500) / 500 == pytest.approx(0.004)
    assert c.decode_step_s(2, 600) == pytest.approx(0.02)
    err = prediction_error({"ttft_s": 1.1, "tpot_s": 0.05, "extra": 9.0},
                           {"ttft_s": 1.0, "tpot_s": 0.1, "e2e_s": 3.0})  # fmt: skip
    assert err == pytest.approx({"ttft_s": 0.1, "tpot_s": -0.5})


# -- links -----------------------------------------------------------------------------------


def test_link_rates_and_cold_transfer() -> None:
    # 4 MiB window over 25 ms: 167.8 MB/s per flow, below the 12.5 GB/s line.
    wan = Link(gbit_s=100, rtt_ms=25, tcp_window_mb=4.0)
    assert wan.flow_bytes_per_s == pytest.approx(4 * 2**20 / 0.025)
    assert wan.bytes_per_s == pytest.approx(12.5e9)
    # Slow start from 10 KB: 10 KB then 20 KB take one round trip each (20 ms), the last 40 KB
    # fit the 40 KB window: 40 us on the wire, then one way (5 ms).
    cold = Link(gbit_s=8, rtt_ms=10, init_window_kb=10)
    assert cold.cold_transfer_s(70_000, random.Random(0)) == pytest.approx(0.02504)
    jittery = Link(gbit_s=8, rtt_ms=10, jitter_ms=3.0)
    samples = [jittery.one_way_s(random.Random(i)) for i in range(4000)]
    assert min(samples) > 0.005
    assert sum(samples) / len(samples) == pytest.approx(0.008, rel=0.08)  # 5 ms + 3 ms mean


# -- the simulator ---------------------------------------------------------------------------


def test_same_dc_one_request_by_hand() -> None:
    res = simulate([SimRequest(0.0, 1000, 0, 11)], toy("same-dc")).results[0]
    # TTFT = prefill (1 s) + RDMA (2 ms + 1e9 B / 1e11 B/s = 10 ms).
    assert res.ttft_s == pytest.approx(1.0 + RDMA + 0.01)
    # Ten decode steps from context 1000.
    assert res.finish_s - res.first_token_s == pytest.approx(decode_s(1000, 10))
    assert res.tpot_s == pytest.approx(decode_s(1000, 10) / 10)
    assert res.tokens == {"P": 1, "RLD": 0, "MD": 10}
    assert res.wan_bytes == 0 and res.rdma_bytes == 1e9


def test_requests_queue_on_one_p() -> None:
    # P starts on the first at once; two more arrive at 0.5 s while it is busy.
    reqs = [SimRequest(0.0, 1000, 0, 2), SimRequest(0.5, 1000, 0, 2), SimRequest(0.5, 1000, 0, 2)]
    ttft = [r.ttft_s for r in simulate(reqs, toy("same-dc", prefill_batch_tokens=1000)).results]
    # One prompt per forward: they end at 1, 2 and 3 s, each + 12 ms of RDMA.
    assert ttft == pytest.approx([1.012, 2.012 - 0.5, 3.012 - 0.5])
    # Room for two in a forward: the waiting pair runs as one 2000-token forward, 1 -> 3 s.
    ttft = [r.ttft_s for r in simulate(reqs, toy("same-dc", prefill_batch_tokens=4096)).results]
    assert ttft == pytest.approx([1.012, 3.012 - 0.5, 3.012 - 0.5])


def test_wan_transfer_and_fair_sharing() -> None:
    # cache: 1000 uncached tokens = 1e9 B at 1e9 B/s = 1 s, + 10 ms one way for the KV and
    # + 10 ms for MD's stream back to the user in datacenter A.
    one = simulate([SimRequest(0.0, 1000, 0, 2)], toy("cache")).results[0]
    assert one.ttft_s == pytest.approx(1.0 + 1.0 + 0.01 + 0.01)
    assert one.wan_bytes == 1e9
    # 90% cached on MD too: only 100 tokens cross (0.1 s); P computes 100 tokens (0.1 s).
    hit = simulate([SimRequest(0.0, 1000, 900, 2)], toy("cache")).results[0]
    assert hit.ttft_s == pytest.approx(0.1 + 0.1 + 0.02)
    # Fair sharing: the first transfer (1e9 B) runs alone from 1 to 1.5 s (half done); the
    # second (5e8 B, prefilled 1 -> 1.5 s) joins; at 5e8 B/s each, both end at 2.5 s.
    reqs = [SimRequest(0.0, 1000, 0, 2), SimRequest(0.5, 500, 0, 2)]
    pair = simulate(reqs, toy("cache")).results
    assert [r.ttft_s for r in pair] == pytest.approx([2.52, 2.52 - 0.5])
    # Naive PD ships the whole prompt even when P had it cached.
    naive = simulate([SimRequest(0.0, 1000, 900, 2)], toy("naive")).results[0]
    assert naive.wan_bytes == 1e9 and naive.md_cached_tokens == 0


def test_per_flow_cap() -> None:
    capped = replace(LINK, tcp_window_mb=1.0)  # 2^20 B / 20 ms = 52.4 MB/s per flow
    res = simulate([SimRequest(0.0, 100, 0, 2)], toy("cache", link=capped)).results[0]
    assert res.ttft_s == pytest.approx(0.1 + 1e8 / (2**20 / 0.02) + 0.02)


def test_wan_ramp_after_idle() -> None:
    # One flow from idle over 20 ms: 14.6 KB in the first round trip (730 KB/s), one segment
    # more in the next (16.06 KB), so 30.66 KB take exactly two round trips.
    ramp = Link(gbit_s=8, rtt_ms=20, ramp_flows=1)
    assert ramp.ramp_bytes_per_s(0.0) == pytest.approx(14600 / 0.02)
    assert ramp.ramp_bytes_per_s(0.02) == pytest.approx(16060 / 0.02)
    assert ramp.alone_s(30660) == pytest.approx(0.04)
    # In the simulator: two such transfers at once each ramp on their own (the line is far
    # from full) and land one way later; MD's stream takes another 10 ms back.
    reqs = [SimRequest(0.0, 1, 0, 2), SimRequest(0.0, 1, 0, 2)]  # one token of KV each
    fast = Tier(CHIP_A, 1, 1, costs=replace(COSTS, flops_s=1e15, bytes_s=1e15))  # us forwards
    cfg = replace(toy("cache", link=ramp, model=replace(TOY, kv_bytes_per_token=30660)),
                  prefill=fast, main=fast)  # fmt: skip
    ttft = [r.ttft_s for r in simulate(reqs, cfg).results]
    assert ttft == pytest.approx([0.04 + 0.02] * 2, abs=1e-4)
    # A line that 10 flows' first windows already fill: shared fairly from the start.
    full = Link(gbit_s=0.008, rtt_ms=20, ramp_flows=10)
    assert full.ramp_bytes_per_s(0.0) == pytest.approx(1e6) and full.alone_s(1e5) == 0.1
    cfg = replace(cfg, link=full, model=replace(TOY, kv_bytes_per_token=1e5))
    ttft = [r.ttft_s for r in simulate(reqs, cfg).results]
    assert ttft == pytest.approx([0.2 + 0.02] * 2, abs=1e-4)


def test_paths_follow_auto_path() -> None:
    reqs = [
        SimRequest(0.0, 1000, 990, 50),  # high hit: 10 tokens cross in 10 ms
        SimRequest(30.0, 1000, 0, 1),  # long input, one output token: singular
        SimRequest(50.0, 1000, 0, 2000),  # low hit, long answer: RLD hides the transfer
    ]
    policy = TOY_POLICY
    results = simulate(reqs, toy("pdd")).results
    assert [r.path for r in results] == ["main", "relay", "pdd"]
    # As the router does, a WAN estimate no transfer taught for over a minute makes the
    # singular request feed MD too, to measure the link again.
    late = simulate([reqs[0], replace(reqs[1], arrival_s=100.0)], toy("pdd")).results[1]
    assert late.path == "pdd" and "stale" in late.reason and late.wan_bytes == 1e9
    # The same decisions from auto_path itself, with the signals worked out by hand: transfer
    # = suffix x 1e6 B / 1e9 B/s; P's compute 1 ms per uncached token; RLD's time = its
    # batch-1 step (1e9 B / 1e12 = 1 ms + 1 token's KV) x the output; RLD idle.
    step = COSTS.decode_step_s(1, 0)
    for r in reqs:
        t = transfer_seconds(r.prompt_tokens - r.cached_tokens, 1e6, 1e9, 0.0)
        s = Signals(r.prompt_tokens, r.output_tokens, r.cached_tokens, t,
                    step * r.output_tokens, 0, prefill_s=1e-3 * max(1, r.prompt_tokens -
                    r.cached_tokens))  # fmt: skip
        assert auto_path(s, policy).path == results[reqs.index(r)].path
    relay = results[1]
    assert relay.wan_bytes == 0 and relay.tokens == {"P": 1, "RLD": 0, "MD": 0}
    # The same request meets the default 3 s SLA on P->MD: MD decodes it from the start.
    assert simulate(reqs[2:], toy("pdd", path_policy=PathPolicy())).results[0].path == "main"
    # RLD full (one slot, as its server reports): the second low-hit request goes to MD.
    pair = [SimRequest(200.0, 1000, 0, 2000), SimRequest(200.0, 1000, 0, 2000)]
    small = replace(tier(), max_batch=1)
    busy = simulate(pair, toy("pdd", relay=small)).results
    assert [r.path for r in busy] == ["pdd", "main"], [r.reason for r in busy]


def test_without_the_guard_a_full_rld_queues_low_hit_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # RLD with one slot, two low-hit requests at once: guarded, the second goes P->MD; unguarded
    # it is relayed too and waits for the slot, so its first token comes after the first
    # request has left RLD (its KV on MD, 1 s at the line's 1e9 B/s).
    pair = [SimRequest(200.0, 1000, 0, 2000), SimRequest(200.0, 1000, 0, 2000)]
    small = replace(tier(), max_batch=1)
    off = toy("pdd", relay=small, path_policy=replace(TOY_POLICY, guard=False))
    out = simulate(pair, off).results
    assert [r.path for r in out] == ["pdd", "pdd"], [r.reason for r in out]
    assert out[1].ttft_s > out[0].ttft_s + 1.0, (out[0].ttft_s, out[1].ttft_s)
    # The simulator's command line turns it off the same way.
    args = ["sim", "--workload", "fixed", "--requests", "20", "--rate", "2", "--prompt", "63000",
            "--hit", "0.3", "--output", "300", "--kinds", "pdd", "--max-batch", "1"]  # fmt: skip
    assert cli_main([*args, "--json"]) == 0
    guarded = json.loads(capsys.readouterr().out)["runs"][0]["summary"]["paths"]
    assert cli_main([*args, "--json", "--no-relay-guard"]) == 0
    unguarded = json.loads(capsys.readouterr().out)["runs"][0]["summary"]["paths"]
    assert guarded.get("main", 0) > 0 and unguarded == {"pdd": 20}, (guarded, unguarded)


def test_rld_guard_reads_rlds_kv_room_as_the_router_does() -> None:
    # An RLD whose KV pool holds 2000 tokens: room for a 1000-token prompt beside SGLang's
    # 512-token reservation (2000 - 512 = 1488). The second of two low-hit requests arriving
    # together finds 2000 - (1000 + 512) sent - 512 = -24: it goes P->MD, as live.
    pool = replace(tier(), costs=replace(COSTS, kv_capacity_tokens=2000))
    pair = [SimRequest(200.0, 1000, 0, 2000), SimRequest(200.0, 1000, 0, 2000)]
    out = simulate(pair, toy("pdd", relay=pool)).results
    assert [r.path for r in out] == ["pdd", "main"], [r.reason for r in out]
    assert "RLD's KV full (room for 0 tokens)" in out[1].reason
    # Once the first has left RLD (handed off to MD), its KV is free again: a later low-hit
    # request is relayed.
    later = simulate([*pair, SimRequest(400.0, 1000, 0, 2000)], toy("pdd", relay=pool)).results
    assert later[2].path == "pdd", later[2].reason
    # RLD holds a prompt and the reservation, not the whole answer: a 1400-token prompt with a
    # 2000-token answer fits a pool of 2000 (1400 + 512 <= 2000).
    alone = simulate([SimRequest(0.0, 1400, 0, 2000)], toy("pdd", relay=pool)).results[0]
    assert alone.path == "pdd" and alone.tokens["RLD"] > 0, alone
    # Without SGLang's reservation, a pool of 1000 takes the 1000-token prompt.
    tight = replace(tier(), costs=replace(COSTS, kv_capacity_tokens=1000))
    bare = toy("pdd", relay=tight, decode_reserve_tokens=0)
    assert simulate(pair[:1], bare).results[0].path == "pdd"
    assert simulate(pair[:1], toy("pdd", relay=tight)).results[0].path == "main"


def test_router_sees_cached_prefixes_in_blocks() -> None:
    # MD holds 137 of 141 tokens, but the router's view (MD's cache sync) is whole 16-token
    # blocks: 128, so it predicts 13 tokens' KV crossing (13 ms), plus P's 4 ms: ~0.02 s
    # (exact hits would say 4 + 4 ms: ~0.01 s).
    req = SimRequest(0.0, 141, 137, 50, md_cached_tokens=137)
    res = simulate([req], toy("pdd")).results[0]
    assert res.path == "main" and "128/141 tokens cached on MD" in res.reason
    assert "first token in ~0.02s" in res.reason
    assert res.wan_bytes == 4 * 1e6  # what crosses is what MD lacks


def test_extend_handoff_and_rld_share_by_hand() -> None:
    req = SimRequest(0.0, 1000, 0, 2000)
    out = simulate([req], toy("pdd", handoff=HandoffPolicy(mode="extend")))
    res = out.results[0]
    assert res.path == "pdd" and res.handoff_mode == "extend"
    # RLD starts after prefill + RDMA and streams until READY reaches the router. MD is fed
    # by a second request to P once P answered (its last token recomputed over 999 cached:
    # 2 ms), then the KV takes 1 + 0.01 s, MD parks it, READY takes 10 ms back.
    start, ready = 1.0 + RDMA + 0.01, 1.0 + COSTS.prefill_s(1, 999) + 1.02
    assert COSTS.prefill_s(1, 999) == pytest.approx(2e-3)
    t, steps = start, 0
    while t + (1e9 + (1000 + steps + 1) * 1e6) / 1e12 <= ready + 1e-12:
        t += (1e9 + (1000 + steps + 1) * 1e6) / 1e12
        steps += 1
    assert res.ttft_s == pytest.approx(start)
    assert res.tokens == {"P": 1, "RLD": steps, "MD": 2000 - 1 - steps}
    total = sum(res.tokens.values())
    assert out.summary.rld_token_share == pytest.approx(steps / total)
    # The HANDOFF reaches MD 10 ms after READY; MD recomputes the `steps` tokens RLD made but
    # the last (P's token 0 included) in a forward of its own, then decodes from the last one:
    # 2000 - 1 - steps steps, and MD's stream takes 10 ms back to the user.
    extend = COSTS.extend_s(steps, 1000)
    end = ready + 0.01 + extend + decode_s(1000 + steps, 2000 - 1 - steps) + 0.01
    assert res.finish_s == pytest.approx(end)


def test_catchup_handoff_sends_chunks() -> None:
    policy = HandoffPolicy(mode="catchup", chunk=64, threshold=16)
    sim = Simulation(toy("pdd", handoff=policy), [SimRequest(0.0, 1000, 0, 2000)])
    res = sim.run().results[0]
    assert res.handoff_mode == "catchup" and res.chunks >= 2
    # One extend forward per chunk, and one for the final handoff unless it hands over a
    # single token (that one is the next decode step's input: nothing to recompute).
    assert sim.md[0].extend_forwards in (res.chunks, res.chunks + 1)
    assert res.tokens["P"] == 1 and sum(res.tokens.values()) == 2000
    assert res.tokens["RLD"] > 0 and res.tokens["MD"] > 0


def _md_slot(md: Decode, prompt: int, target: int, finished: list[float]) -> Slot:
    """A request admitted on `md` (parked: it runs once `md.run` says so)."""
    st = RequestState(0, SimRequest(0.0, prompt, 0, target))
    slot = Slot(st, prompt + target, target, lambda s: None,
                lambda s: finished.append(md.clock.now))  # fmt: skip
    md.request(slot)
    return slot


def test_md_runs_the_handoff_extend_as_its_own_forward() -> None:
    clock = Clock()
    md = Decode(clock, COSTS, 8)
    finished: list[float] = []
    running = _md_slot(md, 1000, 10, finished)
    md.run(running, 1, 1000)
    handed = _md_slot(md, 1000, 7, finished)
    joined: list[tuple[float, int]] = []

    def extended() -> None:
        joined.append((clock.now, md.batch))
        md.run(handed, 4, 1003)  # 3 tokens recomputed, the 4th is the next step's input

    # The HANDOFF arrives during MD's first decode step (batch 1 at 1000: 2.001 ms).
    clock.at(0.001, md.extend, 3, 1000, extended)
    clock.run()
    first = decode_s(1000, 1)
    # The extend waits for that step, runs alone (3 tokens: 3 ms of compute), and only then
    # does the running request get its next token: the step is not extend + decode folded
    # into one forward (4 tokens over 2000 of KV: 4 ms in all).
    assert joined == [(pytest.approx(first + COSTS.extend_s(3, 1000)), 1)]
    assert COSTS.extend_s(3, 1000) == pytest.approx(3e-3)
    # Then both decode together: 3 more steps for the handed-off request (4 -> 7 tokens), the
    # running one's KV at 1001 and 1002 ... (weights once, both contexts, 2 new tokens each).
    t = joined[0][0]
    both = [(1e9 + (1001 + k + 1003 + k + 2) * 1e6) / 1e12 for k in range(3)]
    assert finished[0] == pytest.approx(t + sum(both))
    # The running request's last 5 steps (10 tokens in all) run alone from 1004 tokens of KV.
    assert finished[1] == pytest.approx(t + sum(both) + decode_s(1004, 5))
    assert md.extend_forwards == 1
    assert md.busy_s == pytest.approx(finished[1])  # never idle from t = 0 on


def test_decode_admits_between_forwards() -> None:
    # KV that lands during a step is taken in (MD's READY sent) when the step ends, as
    # SGLang's loop polls transfers between forwards; an idle decoder takes it at once.
    clock = Clock()
    md = Decode(clock, COSTS, 8)
    running = _md_slot(md, 1000, 10, [])
    md.run(running, 1, 1000)
    admitted: list[float] = []
    st = RequestState(1, SimRequest(0.0, 1000, 0, 5))
    late = Slot(st, 1005, 5, lambda s: admitted.append(clock.now), lambda s: None)
    clock.at(0.001, md.request, late)
    clock.run()
    assert admitted == [pytest.approx(decode_s(1000, 1))]
    idle = Decode(Clock(), COSTS, 8)
    idle.request(Slot(st, 1005, 5, lambda s: admitted.append(-1.0), lambda s: None))
    assert admitted[-1] == -1.0


def test_handoffs_of_one_step_share_one_extend_forward() -> None:
    clock = Clock()
    md = Decode(clock, COSTS, 8)
    done: list[tuple[str, float]] = []
    # Three HANDOFFs and a CHUNK arrive while MD is idle, at the same instant: one extend
    # forward for all four (as pdd.srt.main_decode.poll batches them), not four.
    for _ in range(3):
        md.extend(1, 1000, lambda: done.append(("handoff", clock.now)))
    md.extend(2, 500, lambda: done.append(("chunk", clock.now)), False)
    clock.run()
    assert md.extend_forwards == 1
    # Three 1-token extends in one forward: the weights once (1 GB) + 3003 tokens of KV =
    # 4.003 ms, where three forwards would take 3 x 2.001 ms. With the chunk's 2 tokens the
    # compute (5 tokens, 1 ms each) outweighs the memory traffic (4.505 ms).
    assert COSTS.extend_batch_s([(1, 1000)] * 3) == pytest.approx(4.003e-3)
    together = COSTS.extend_batch_s([(1, 1000)] * 3 + [(2, 500)])
    assert together == pytest.approx(5e-3)
    assert (
        sorted(done)
        == [("chunk", pytest.approx(together))] + [("handoff", pytest.approx(together))] * 3
    )
    # A handoff with nothing to recompute (RLD gave MD only token 0) costs no forward.
    md.extend(0, 1000, lambda: done.append(("empty", clock.now)))
    clock.run()
    assert md.extend_forwards == 1 and done[-1] == ("empty", pytest.approx(together))


def test_relay_finishes_before_md() -> None:
    # Forced P->RLD->MD with a 5-token answer: RLD is done long before the KV crosses.
    res = simulate([SimRequest(0.0, 1000, 0, 5)], toy("pdd", path="pdd")).results[0]
    assert res.path == "pdd" and res.tokens == {"P": 1, "RLD": 4, "MD": 0}
    assert res.finish_s < 2.0 and res.wan_bytes == 1e9


def test_md_cache_pressure() -> None:
    small = replace(COSTS, kv_capacity_tokens=1000)
    cfg = replace(toy("cache"), main=Tier(CHIP_A, 1, 1, costs=small), hot_set_tokens=4000)
    sim = Simulation(cfg, [])
    # 1000 free tokens x 1 MD / a 4000-token hot set: MD remembers a quarter of P's hit.
    assert sim.md_cached(SimRequest(0.0, 1000, 800, 2), 0) == 200


def test_determinism_and_summary() -> None:
    reqs = agentic_requests(120, 3.0, seed=3)
    a = simulate(reqs, deployment("pdd"), Sla())
    b = simulate(reqs, deployment("pdd"), Sla())
    assert [r.to_dict() for r in a.results] == [r.to_dict() for r in b.results]
    c = simulate(reqs, deployment("pdd", seed=1), Sla())
    assert [r.first_token_s for r in a.results] != [r.first_token_s for r in c.results]
    s = a.summary
    assert s.requests == 120 and sum(s.paths.values()) == 120
    assert s.tokens["P"] == 120 and sum(s.tokens.values()) == sum(r.output_tokens for r in reqs)
    assert s.ttft_s["p50"] <= s.ttft_s["p90"] <= s.ttft_s["p99"] <= s.ttft_s["max"]
    # Percentiles are the live report's (nearest rank): a simulated request's own TTFT.
    ttfts = [r.ttft_s for r in a.results]
    assert s.ttft_s["p99"] == percentile(ttfts, 99) and s.ttft_s["p99"] in ttfts
    good = sum(r.ttft_s <= 10 and r.tpot_s <= 0.06 for r in a.results)
    assert s.sla_met == pytest.approx(good / 120)


def test_request_helpers() -> None:
    got = as_sim_request({"arrival": 1.5, "input_tokens": 10, "prefix_hit_tokens": 4,
                          "max_new_tokens": 3})  # fmt: skip
    assert got == SimRequest(1.5, 10, 4, 3)
    reqs = fixed_requests(11, 2.0, 100, 0.25, 5)
    assert {(r.prompt_tokens, r.cached_tokens) for r in reqs} == {(100, 25)}
    fast = rescale(reqs, 4.0)  # ten gaps over 10 / 4 s
    assert fast[-1].arrival_s == pytest.approx(2.5)


# -- economics -------------------------------------------------------------------------------


def test_economics_arithmetic() -> None:
    # 100K tokens/s x 50 KB x 8 bit = 40 Gbit/s; a 90% decode-side hit leaves 4.
    assert kv_gbit_s(1e5, 5e4) == pytest.approx(40.0)
    assert kv_gbit_s(1e5, 5e4, 0.9) == pytest.approx(4.0)
    assert bcr(10.0, 80.0) == pytest.approx(0.125)
    assert change(12.78, 10.0) == pytest.approx(27.8)
    # PDD: 35 + 8 chips A, 32 chips B at 1.25, the WAN line 0.33; baseline: 88 chips A.
    assert deployment("pdd").cost == pytest.approx(35 + 8 + 32 * 1.25 + 0.33)
    assert deployment("same-dc").cost == 88
    assert deployment("pdd").chips() == {"A": 43, "B": 32}


def test_handoff_microbench_shape() -> None:
    rep = handoff_microbench(samples=300)
    d = rep.data
    assert d["ship_bytes"] == pytest.approx(100 * 4649 * 1024 / 100)
    assert d["handoff_bytes"] < 2048  # token ids, not KV
    # Jitter adds up over ship's round trips: a wider spread than recompute's.
    assert d["ship"]["std"] > d["recompute"]["std"]
    # Recompute: one way, half of MD's step in flight on average, then the extend of 99 tokens
    # as its own forward and the decode step the request joins (65 x 64K), one after the other.
    assert d["extend_s"] == pytest.approx(StepCosts.of(CHIP_B, 8, MOE_1T).extend_s(99, 64_000))
    expected = WAN.mean_one_way_s() + d["md_step_s"] / 2 + d["extend_s"] + d["md_step_joined_s"]
    assert d["recompute"]["mean"] == pytest.approx(expected, rel=0.03)
    assert d["md_step_s"] < d["md_step_joined_s"]
    assert "Instances: MD 1 x TP8 B decoding 64 x 64K." in rep.markdown()


# -- capacity and planning -------------------------------------------------------------------


def test_analytic_and_simulated_capacity() -> None:
    cfg = toy("same-dc")
    sample = fixed_requests(50, 1.0, 500, 0.0, 2)
    sla = Sla(ttft_s=3.0, tpot_s=1.0)
    # One P at 0.5 s per request: 2 req/s.
    assert analytic_capacity(cfg, sample, sla)["P"] == pytest.approx(2.0)
    make = window(lambda n, rate: fixed_requests(n, rate, 500, 0.0, 2), 150)
    cap = sla_capacity(cfg, make, sla, guess=1.0)
    assert 0.8 <= cap.rate <= 2.05
    assert any(not ok for _, ok in cap.tried)  # it found the limit, not just a lower bound


def test_planner_picks_the_obvious_best() -> None:
    cheap = Chip("cheap", tflops=5, mem_gb=100, mem_bw_gbs=1000, interconnect_gbs=100, price=1)
    dear = replace(cheap, name="dear", price=10)
    base = ClusterConfig("cache", Tier(cheap, 1, 1), Tier(dear, 1, 1), None, TOY, LINK,
                         mfu=0.4, overhead_s=0.0, wan_cost=0.0)  # fmt: skip
    space = PlanSpace(p_counts=(1, 2), rld_counts=(0,), md_counts=(1,), chips_per_instance=1)
    make = window(lambda n, rate: fixed_requests(n, rate, 100, 0.0, 2), 60)
    ranked = plan(base, space, make, Sla(ttft_s=2.0, tpot_s=1.0), top=2)
    # P-bound: a second P doubles the throughput for 1/11 more cost.
    assert [c.config.prefill.instances for c in ranked] == [2, 1]
    assert ranked[0].bcr is not None and ranked[1].bcr is not None
    assert ranked[0].bcr > ranked[1].bcr
    assert ranked[0].cost == 12 and ranked[1].cost == 11


# -- the command line ------------------------------------------------------------------------


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_tier("5x7A") == Tier(CHIP_A, 5, 7)
    args = ["sim", "--workload", "fixed", "--requests", "30", "--rate", "2", "--prompt", "4000",
            "--output", "20", "--kinds", "same-dc,pdd"]  # fmt: skip
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "| same-dc: P 5 x TP8 A, D 6 x TP8 A |" in out
    assert "| pdd: P 5 x TP7 A, RLD 1 x TP8 A, MD 4 x TP8 B |" in out
    assert cli_main(["repro", "--only", "ad", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "> 180 Gbit/s" in out and "4649 KB" in out
    # Which instances each table assumes (the paper gives only chip counts).
    assert "Instances: P 5 x TP7 A, RLD 1 x TP8 A, MD 4 x TP8 B." in out
    assert "Instances: MD 1 x TP8 B decoding 64 x 64K." in out
    args = ["plan", "--workload", "fixed", "--requests", "40", "--prompt", "4000", "--output",
            "20", "--p-counts", "5", "--rld-counts", "1", "--md-counts", "3", "--top", "1",
            "--window", "10", "--chips-per-instance", "16"]  # fmt: skip
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert "| pdd: P 5 x TP16 A, RLD 1 x TP16 A, MD 3 x TP16 B |" in out
    assert "Instances: P 5 x TP16 A, RLD 1 x TP16 A, MD 3 x TP16 B" in out
    assert cli_main(["nope"]) == 2


# -- calibration against a live run -----------------------------------------------------------


def _live_record(i: int, prompt: int, cached: int, ttft: float, path: str) -> dict[str, object]:
    out = 11
    return {"prompt_tokens": prompt, "cached_tokens": cached, "start_s": 3.0 * i,
            "output_tokens": out, "ttft_s": ttft, "e2e_s": ttft + 0.02 * (out - 1),
            "path": path, "relay_tokens": out if path == "P->RLD" else 0,
            "wan_kv_bytes": 0 if path == "P->RLD" else 1000 * prompt, "error": None}  # fmt: skip


def _live_doc() -> dict[str, object]:
    """Hand-made live.json: same-DC TTFT = 0.1 s + 1 ms per uncached token, TPOT 20 ms; naive
    adds the whole prompt's KV at 1000 B/token over 8 Mbit/s (1 ms per token) and one RTT."""
    shapes = [(200 + 37 * i, (i * 53) % 150) for i in range(12)]
    same = [
        _live_record(i, p, c, 0.1 + 0.001 * (p - c), "P->RLD") for i, (p, c) in enumerate(shapes)
    ]
    naive = [_live_record(i, p, c, 0.1 + 0.001 * (p - c) + 0.001 * p + 0.04, "P->MD")
             for i, (p, c) in enumerate(shapes)]  # fmt: skip
    wan_mb = sum(p for p, _ in shapes) / len(shapes) * 1000 / 1e6  # the link's counter
    return {
        "link": {"rate_mbit": 8.0, "delay_ms": 20.0},
        "model": {"name": "toy", "kv_bytes_per_token": 1000},
        "args": {"concurrency": "1", "rate": "None", "ttft_sla": "3.0", "tpot_sla": "0.5"},
        "summaries": {"naive cross-DC PD": {"wan_mb_per_request": wan_mb}},
        "runs": {"same-DC PD": same, "naive cross-DC PD": naive},
    }


def _four_passes() -> dict[str, object]:
    """_live_doc with the cache and PDD passes too (their numbers: naive's; only run here)."""
    doc = _live_doc()
    runs = doc["runs"]
    assert isinstance(runs, dict)
    runs["cross-DC PD + decode cache"] = runs["PDD"] = runs["naive cross-DC PD"]
    return doc


def test_calibration_recovers_the_fit_and_predicts_ttft() -> None:
    cal = calibrate(_live_doc())
    assert cal.fit.prefill.s_per_uncached == pytest.approx(0.001, rel=0.01)
    assert cal.fit.prefill.overhead_s == pytest.approx(0.1, rel=0.01)
    assert cal.fit.prefill.s_per_prompt == pytest.approx(0.0, abs=1e-6)
    # One request at a time, TPOT 20 ms whatever its context: a flat step.
    assert cal.fit.step.step_s(1, 200) == pytest.approx(0.02, rel=0.01)
    assert cal.fit.step.step_s(1, 600) == pytest.approx(0.02, rel=0.01)
    # Naive's extra first-token time is the prompt's KV at 1e6 B/s (the line) and one RTT:
    # the fitted ramp starts at the line (3 flows' first windows per RTT already fill it).
    assert cal.fit.wan is not None and cal.fit.wan.bootstrap_s == pytest.approx(0.0, abs=1e-6)
    link = calib.testbed_link(_live_doc(), cal.fit)
    assert link.ramp_bytes_per_s(0.0) == pytest.approx(1e6)
    rows = {(r.deployment, r.metric): r for r in cal.rows}
    same = rows[("same-DC PD", "ttft_p50")]
    assert same.predicted == pytest.approx(same.measured, rel=0.1)
    # The WAN transfer of the whole prompt's KV is in the naive prediction.
    naive = rows[("naive cross-DC PD", "ttft_p50")]
    assert naive.predicted == pytest.approx(naive.measured, rel=0.1)
    assert rows[("naive cross-DC PD", "wan_mb_per_request")].error == pytest.approx(0.0)
    assert ("PDD", "ttft_p50") not in rows and cal.median_abs_error < 0.1


def test_calibration_cli_writes_calib_md(tmp_path: Path) -> None:
    live = tmp_path / "live.json"
    live.write_text(json.dumps(_four_passes()))
    assert cli_main(["sim", "--calibrate", str(live), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "calib.md").read_text()
    assert "| same-DC PD | ttft_p50 |" in md and "Median absolute relative error" in md
    assert "| PDD | rld_share |" in md and "| cross-DC PD + decode cache | e2e_p99 |" in md
    assert json.loads((tmp_path / "out" / "calib.json").read_text())["rows"]
    assert cli_main(["sim", "--calibrate", str(tmp_path / "missing.json")]) == 1


def test_md_hits_and_the_live_path_policy() -> None:
    # Where KV crossed, MD lacked what was sent; a turn RLD answered alone sent MD nothing, so
    # MD holds what it held of the turn it continues (the request whose prompt is its P hit);
    # with no such turn, unknown (the simulator's model).
    def rec(start: float, prompt: int, cached: int, path: str, wan_tokens: int) -> Record:
        return Record(prompt, cached, start, 50, 0.1, 2.0, path, 0, wan_tokens * 1000)

    recs = [rec(0, 141, 137, "P->MD", 4), rec(10, 770, 141, "P->RLD", 0),
            rec(20, 806, 770, "P->RLD", 0), rec(30, 380, 96, "P->RLD", 0)]  # fmt: skip
    assert calib.md_hits(recs, 1000.0) == [137, 141, 141, None]
    reqs = calib.sim_requests(recs, 1000.0)
    assert [r.md_cached_tokens for r in reqs] == [137, 141, 141, None]
    # A live run that does not record --singular-max-new predates it: no limit.
    doc = _four_passes()
    f = calibrate(doc).fit
    model, link = calib.testbed_model(doc), calib.testbed_link(doc, f)
    cfg = calib.testbed_config("PDD", f, model, link, doc)
    assert cfg.path_policy.singular_max_new == calib.NO_SINGULAR_LIMIT
    doc["args"] = {**doc["args"], "singular_max_new": "16"}  # type: ignore[dict-item]
    cfg = calib.testbed_config("PDD", f, model, link, doc)
    assert cfg.path_policy.singular_max_new == 16
    # RLD's KV pool and reservation as the run recorded them (its router's view); a run that
    # predates them has an RLD without a KV bound.
    assert cfg.relay is not None and cfg.relay.costs is not None
    assert cfg.relay.costs.kv_capacity_tokens == StepCosts.kv_capacity_tokens
    doc["capacity"] = {"relay": 2, "main": 16, "relay_kv_pool": 4096, "relay_kv_reserve": 512}
    cfg = calib.testbed_config("PDD", f, model, link, doc)
    assert cfg.relay is not None and cfg.relay.costs is not None
    assert (cfg.relay.max_batch, cfg.relay.costs.kv_capacity_tokens) == (2, 4096)
    assert (cfg.main.max_batch, cfg.decode_reserve_tokens) == (16, 512)
    # The pass whose router ran with --no-relay-guard is simulated with the guard off.
    assert cfg.path_policy.guard
    assert not calib.testbed_config("PDD no RLD guard", f, model, link, doc).path_policy.guard


def _group(t0: float, k: int, prompt: int, out: int, tpot: float) -> list[dict[str, object]]:
    """`k` same-DC requests that decode side by side from t0 + 0.1 s, `out` tokens each."""
    e2e = 0.1 + tpot * (out - 1)
    return [{"prompt_tokens": prompt, "cached_tokens": prompt - 10, "start_s": t0,
             "output_tokens": out, "ttft_s": 0.1, "e2e_s": e2e, "path": "P->RLD",
             "error": None} for _ in range(k)]  # fmt: skip


def test_fitted_step_grows_with_batch_and_context() -> None:
    # A decode step of 4 ms + 5 ms per request + 10 us per token of context (its batch's new
    # tokens included): groups of 1, 2 and 4 requests decoding together, apart from each other,
    # at two prompt lengths. A group's context halfway is its prompts plus half the answers.
    def tpot(k: int, prompt: int, out: int) -> float:
        return 0.004 + 0.005 * k + 1e-5 * (k * (prompt + (out - 1) / 2) + k)

    records: list[dict[str, object]] = []
    t = 0.0
    for k in (1, 2, 4):
        for prompt in (100, 800):
            records += _group(t, k, prompt, 101, tpot(k, prompt, 101))
            t += 60.0
    step = fit_step([Record(**r) for r in records])  # type: ignore[arg-type]
    assert step.overhead_s == pytest.approx(0.004, rel=0.01)
    assert step.per_request_s == pytest.approx(0.005, rel=0.01)
    assert step.per_token_s == pytest.approx(1e-5, rel=0.01)
    assert step.step_s(4, 4 * 300) > 2 * step.step_s(1, 300)  # more running: a slower step
    # Through calibration: the simulated decoder's step is the fitted one.
    doc = {"link": {"rate_mbit": 8.0, "delay_ms": 20.0},
           "model": {"name": "toy", "kv_bytes_per_token": 1000},
           "runs": {"same-DC PD": records}}  # fmt: skip
    cal = calibrate(doc)
    costs = cal.fit.decode_costs(calib.testbed_model(doc))
    assert costs.decode_step_s(4, 1200) == pytest.approx(step.step_s(4, 1200), rel=1e-6)
    assert costs.decode_step_s(4, 1200) > costs.decode_step_s(1, 300)
    # A fit that ignored the batch would miss every group's TPOT by far more than this.
    tpots = {r.metric: r for r in cal.rows}
    assert abs(tpots["tpot_p50"].error) < 0.1 and abs(tpots["tpot_p99"].error) < 0.1


def _synthetic_live(seed: int) -> dict[str, object]:
    """A live.json made by the simulator itself from known costs: P 20 ms + 0.5 ms per uncached
    token + 0.2 ms per prompt token; a step of 3 ms + 4 ms per request + 20 us per context
    token; MD's bootstrap 150 ms; a request's KV ramping as 4 TCP flows from idle (1.46 MB/s,
    0.146 MB/s more each 40 ms round trip) over a 100 Mbit/s line."""
    model = Model("toy", 1.0, 1.0, 10_000.0)
    truth = Fit(
        PrefillFit(0.02, 5e-4, 2e-4, 0.0, 1.0, 0),
        StepFit(0.003, 0.004, 2e-5, 1.0, 0),
        WanFit(0.15, 4.0, 0, 1.0),
    )
    live: dict[str, object] = {"link": {"rate_mbit": 100.0, "delay_ms": 20.0},
                               "model": {"name": "toy", "kv_bytes_per_token": 10_000}}  # fmt: skip
    link = calib.testbed_link(live, truth)
    rng = random.Random(seed)
    reqs = []
    t = 0.0
    for _ in range(100):
        t += rng.expovariate(0.3)
        prompt = rng.choice((rng.randint(50, 150), rng.randint(800, 1200)))  # batch != context
        cached = prompt - (rng.randint(1, 20) if rng.random() < 0.8 else rng.randint(50, 400))
        reqs.append(SimRequest(t, prompt, max(cached, 0), rng.randint(20, 300)))
    runs = {}
    for name in ("same-DC PD", "cross-DC PD + decode cache"):
        res = simulate(reqs, calib.testbed_config(name, truth, model, link, live))
        runs[name] = [asdict(as_record(r, KINDS[name][0])) for r in res.results]
    live["runs"] = runs
    return live


def test_calibration_recovers_known_constants_from_synthetic_runs() -> None:
    # Noise-free, but a request's TPOT only averages the steps it shared, and a busy decoder
    # makes a first token wait for the running step (the fit puts that in the per-request
    # first-token term): the constants come back within the tolerances below.
    def true_step(n: int, context: int) -> float:
        return 0.003 + 0.004 * n + 2e-5 * (context + n)

    for seed in (1, 2):
        cal = calibrate(_synthetic_live(seed))
        step, pre, wan = cal.fit.step, cal.fit.prefill, cal.fit.wan
        for n, context in ((1, 200), (4, 2000), (8, 5000)):
            assert step.step_s(n, context) == pytest.approx(true_step(n, context), rel=0.05)
        assert step.per_token_s == pytest.approx(2e-5, rel=0.1)
        assert step.per_request_s == pytest.approx(0.004, rel=0.25)
        assert pre.s_per_prompt == pytest.approx(2e-4, rel=0.2)
        assert pre.s_per_uncached == pytest.approx(5e-4, rel=0.3)
        assert wan is not None
        assert wan.bootstrap_s == pytest.approx(0.15, rel=0.2)
        assert wan.flows == pytest.approx(4.0, rel=0.1)
        assert cal.median_abs_error < 0.05
