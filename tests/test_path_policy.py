"""The path policy and instance choice as pure logic, over a table of situations."""

from __future__ import annotations

import random

import pytest

from pdd.policy.balance import pick_by_prefix, pick_least_loaded
from pdd.policy.path import PathPolicy, Signals, auto_path, choose_path, transfer_seconds
from pdd.router.estimates import (
    RESIDUAL_TTL_S,
    STALE_S,
    FirstTokenResidual,
    RelaySpeed,
    direct_wan_seconds,
    relayed_direct_ttft,
    wan_estimate,
)
from pdd.router.health import Health
from pdd.router.prefix_index import PrefixIndex

POLICY = PathPolicy(ttft_sla_s=3.0, relay_max_load=8, relay_only_share=0.5, margin=1.5)


def sig(**kw: object) -> Signals:
    base: dict = {"prompt_tokens": 4000, "max_new_tokens": 200, "md_cached_tokens": 0,
                  "transfer_s": 2.0, "relay_decode_s": 6.0, "relay_load": 1,
                  "prefill_s": 1.5}  # fmt: skip
    return Signals(**{**base, **kw})


@pytest.mark.parametrize(
    "signals, path, why",
    [
        # 95% cached on MD: P 0.2 s + the suffix 0.1 s meets the 3 s SLA, no relay needed.
        (sig(md_cached_tokens=3800, transfer_s=0.1, prefill_s=0.2), "main", "meets the SLA"),
        # Low hit, long answer: P 1.5 s + 2 s of KV misses the SLA; RLD hides it, hands off.
        (sig(), "pdd", "low hit"),
        # The same at 1.4 s of KV: 2.9 s meets the SLA, MD decodes from the first token.
        (sig(transfer_s=1.4), "main", "meets the SLA"),
        # ...but not when P->MD first tokens lately took 0.5 s more than compute + transfer.
        (sig(transfer_s=1.4, main_extra_s=0.5), "pdd", "first token on P->MD ~3.40s"),
        # ...and the reason says so: the hit is high, MD was slow lately (its queue, say).
        (
            sig(md_cached_tokens=3900, transfer_s=0.1, prefill_s=0.2, main_extra_s=3.0),
            "pdd",
            "P->MD slow lately (+3.00s): 3900/4000 tokens cached on MD",
        ),
        # Low hit, 4-token answer: RLD is done in 0.12 s, long before the KV (2 s): singular.
        (sig(max_new_tokens=4, relay_decode_s=0.12), "relay", "singular"),
        # ...also when P->MD would meet the SLA: no WAN for an answer RLD makes alone.
        (sig(max_new_tokens=4, relay_decode_s=0.12, transfer_s=0.5), "relay", "singular"),
        # ...unless relay-only traffic already fills its share (half of 8) of RLD.
        (sig(max_new_tokens=4, relay_decode_s=0.12, relay_load=4), "pdd", "low hit"),
        # A longer answer that RLD also finishes first is a session's turn: MD gets the prompt
        # too (RLD answers; MD caches it for the next turn), at most 16 tokens stay RLD's alone.
        (sig(max_new_tokens=100, relay_decode_s=0.5), "pdd", "low hit"),
        (sig(max_new_tokens=17, relay_decode_s=0.3), "pdd", "low hit"),
        (sig(max_new_tokens=16, relay_decode_s=0.3), "relay", "singular"),
        # ...and while the WAN estimate is stale, MD is fed too, to measure the link again.
        (sig(max_new_tokens=4, relay_decode_s=0.12, wan_stale=True), "pdd", "stale"),
        # RLD full (its own capacity when reported, else the policy's): P->MD above the SLA.
        (sig(relay_load=8), "main", "RLD full (8/8)"),
        (sig(relay_load=2, relay_capacity=2), "main", "RLD full (2/2)"),
        (sig(relay_load=8, relay_capacity=16), "pdd", "low hit"),
        (sig(relay_load=8, max_new_tokens=4, relay_decode_s=0.12), "main", "RLD full"),
        # RLD's KV pool cannot admit the prompt (it would wait there, and MD with it): P->MD,
        # also for a singular request; a prompt that fits goes to RLD as before.
        (sig(relay_kv_room=3999), "main", "RLD's KV full (room for 3999 tokens)"),
        (sig(relay_kv_room=-200), "main", "room for 0 tokens"),
        (sig(relay_kv_room=3999, max_new_tokens=4, relay_decode_s=0.12), "main", "KV full"),
        (sig(relay_kv_room=4000), "pdd", "low hit"),
        (sig(relay_kv_room=4000, max_new_tokens=4, relay_decode_s=0.12), "relay", "singular"),
        # Meeting the SLA beats RLD's load: it never needed RLD.
        (sig(relay_load=8, transfer_s=0.05), "main", "meets the SLA"),
        # Nothing measured yet (first requests): the safe path.
        (sig(transfer_s=None, relay_decode_s=None), "pdd", "unknown"),
        (sig(relay_decode_s=None, max_new_tokens=2), "pdd", "low hit"),
        # P's compute unknown: the transfer alone is the prediction.
        (sig(prefill_s=None), "main", "first token in ~2.00s"),
        # Close call: RLD 1.5 s x margin 1.5 > 2 s transfer: not surely first, keep MD.
        (sig(relay_decode_s=1.5), "pdd", "low hit"),
        # A tier missing.
        (sig(md_available=False), "relay", "no MD"),
        (sig(relay_load=None), "main", "no RLD"),
    ],
)
def test_auto_path(signals: Signals, path: str, why: str) -> None:
    choice = auto_path(signals, POLICY)
    assert choice.path == path and why in choice.reason, choice


def test_without_the_guard_a_full_rld_still_takes_low_hit_requests() -> None:
    unguarded = PathPolicy(ttft_sla_s=3.0, relay_max_load=8, guard=False)
    assert auto_path(sig(relay_load=8), unguarded).path == "pdd"
    assert auto_path(sig(relay_load=30), unguarded).path == "pdd"
    assert auto_path(sig(relay_load=8), POLICY).path == "main"
    assert auto_path(sig(relay_kv_room=10), unguarded).path == "pdd"


def test_no_tier_at_all_is_an_error() -> None:
    with pytest.raises(ValueError, match="no RLD and no MD"):
        auto_path(sig(relay_load=None, md_available=False), POLICY)


def test_requested_paths_win_and_blockers_keep_handoffs_away() -> None:
    assert choose_path("main", "auto", [], sig()).reason == "requested"
    assert choose_path(None, "pdd", []).reason == "default"
    assert choose_path(None, "auto", ["return_logprob"], sig()).path == "relay"
    assert choose_path(None, "auto", ["n"], sig(transfer_s=0.1, prefill_s=0.1)).path == "main"
    with pytest.raises(ValueError, match="needs the request's signals"):
        choose_path(None, "auto", [])
    with pytest.raises(ValueError, match="must be one of"):
        choose_path("sideways", "auto", [], sig())


def test_policy_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        PathPolicy(relay_only_share=1.5)
    with pytest.raises(ValueError):
        PathPolicy(ttft_sla_s=0)
    with pytest.raises(ValueError):
        PathPolicy(margin=0.5)
    with pytest.raises(ValueError):
        PathPolicy(singular_max_new=-1)


def test_transfer_seconds() -> None:
    assert transfer_seconds(1000, 50_000, 12.5e6, 0.04) == pytest.approx(4.04)
    assert transfer_seconds(0, None, None, 0.04) == 0.04  # all cached: only the latency
    assert transfer_seconds(10, None, 1e6, 0.0) is None  # KV size unknown yet


def test_wan_estimate_learns_latency_and_bandwidth() -> None:
    est = wan_estimate(None)
    assert est.transfer_s(100) is None
    est.observe(16_000, 500, 0.05)  # small: the fixed latency
    for _ in range(20):
        est.observe(32_000 * 1000, 1000, 0.05 + 32e6 / 12.5e6)  # 100 Mbit/s
    assert est.kv_bytes_per_token == 32_000
    assert est.to_dict()["mbit_per_s"] == pytest.approx(100, rel=0.05)
    assert est.transfer_s(100) == pytest.approx(0.05 + 3.2e6 / 12.5e6, rel=0.05)
    assert wan_estimate(400).to_dict()["mbit_per_s"] == pytest.approx(400)


def test_wan_estimate_separates_fixed_costs_from_bandwidth_without_small_transfers() -> None:
    # As live traffic teaches it: no transfer under 0.5 MB, each with ~1 s that does not grow
    # with its size (P's queue, MD's bootstrap), times jittered +-10%, 100 Mbit/s underneath.
    rng = random.Random(7)
    est = wan_estimate(None)
    for _ in range(40):
        nbytes = rng.randint(500_000, 5_000_000)
        est.observe(nbytes, nbytes // 32_000, (1.0 + nbytes / 12.5e6) * rng.uniform(0.9, 1.1))
    assert est.to_dict()["mbit_per_s"] == pytest.approx(100, rel=0.15)
    assert est.overhead_s == pytest.approx(1.0, rel=0.3)


def test_wan_estimate_of_one_transfer_size_predicts_that_size() -> None:
    est = wan_estimate(None)
    for _ in range(5):
        est.observe(3_200_000, 100, 0.5 + 3.2e6 / 12.5e6)  # fixed and per-byte parts inseparable
    assert est.overhead_s == 0.0
    assert est.transfer_s(100) == pytest.approx(0.5 + 3.2e6 / 12.5e6)
    cached = wan_estimate(None)
    for _ in range(3):
        cached.observe(0, 0, 0.2)  # fully cached prompts: only the fixed cost
    assert cached.overhead_s == pytest.approx(0.2)
    assert cached.bytes_per_s is None


def test_wan_estimate_leaves_out_a_stall_but_follows_a_link_that_changed() -> None:
    est = wan_estimate(None)
    for i in range(8):
        est.observe(3_200_000 * (1 + i % 3), 100 * (1 + i % 3), 0.05 + 3.2e6 * (1 + i % 3) / 12.5e6)
    before = est.to_dict()["mbit_per_s"]
    # One transfer 10x slower (a stall, a queue on P): left out, the estimate stands.
    assert not est.observe(3_200_000, 100, 3.0)
    assert est.to_dict()["mbit_per_s"] == before
    # Slow again and again: the link itself changed; the third in a row is learnt.
    assert not est.observe(3_200_000, 100, 3.0)
    assert est.observe(3_200_000, 100, 3.0)
    assert est.to_dict()["mbit_per_s"] < before


def test_a_stale_wan_estimate_asks_for_one_probe_per_interval() -> None:
    est = wan_estimate(None)
    assert not est.wants_probe(1000.0)  # nothing learnt yet: every path measures
    est.observe(3_200_000, 100, 0.3, now=10.0)
    assert not est.wants_probe(10.0 + STALE_S - 1)
    assert est.wants_probe(10.0 + STALE_S + 1)
    est.probed(10.0 + STALE_S + 1)
    assert not est.wants_probe(10.0 + STALE_S + 2)  # one probe in flight is enough
    assert est.wants_probe(10.0 + 2 * STALE_S + 2)


def test_p_to_md_teaches_the_wan_only_when_ps_compute_is_a_small_part() -> None:
    assert direct_wan_seconds(1.0, 0.2) == pytest.approx(0.8)
    assert direct_wan_seconds(1.0, None) == 0.0  # P's speed unknown: no time learnt
    assert direct_wan_seconds(0.6, 0.45) == 0.0  # an error there would double the bandwidth


def test_relay_speed_ignores_short_streams() -> None:
    speed = RelaySpeed()
    speed.observe(3, 1.0)
    assert speed.decode_s(100) is None
    speed.observe(11, 0.5)
    assert speed.decode_s(100) == pytest.approx(5.0)


def test_pickers_skip_down_instances_and_prefer_cached_prefixes() -> None:
    assert pick_least_loaded([None, 3, 1]) == 2
    assert pick_least_loaded([None, 0, 0], cursor=0) == 1
    with pytest.raises(ValueError):
        pick_least_loaded([None, None])
    # Instance 2 holds the prompt: chosen while within the slack of the least loaded.
    assert pick_by_prefix([0, 1, 2], [0, 0, 800], slack=2) == 2
    assert pick_by_prefix([0, 1, 3], [0, 0, 800], slack=2) == 0  # too busy: load wins
    assert pick_by_prefix([0, None, 0], [0, 900, 100], slack=2) == 2  # down: skipped
    assert pick_by_prefix([1, 0], [0, 0], slack=2) == 1  # no prefix anywhere: least loaded


def test_health_marks_down_after_repeated_failures_and_up_at_once() -> None:
    health = Health({"main": ["http://md0", "http://md1"]}, interval_s=1.0, failures=2)
    health.mark("main", 0, False, "refused")
    assert health.up("main", 0)  # one failure may be a blip
    health.mark("main", 0, False, "refused")
    assert not health.up("main", 0)
    health.mark("main", 0, True)
    assert health.up("main", 0)
    health.mark_down("main", 1, "unreachable")  # a request saw it: at once
    assert not health.up("main", 1)
    assert health.status()["main"][1]["last_error"] == "unreachable"


def test_a_dropped_connection_is_one_failure_and_a_refused_one_takes_the_instance_down() -> None:
    health = Health({"main": ["http://md0", "http://md1"]}, interval_s=1.0, failures=2)
    health.request_lost("main", 0, "dropped the connection", unreachable=False)
    assert health.up("main", 0)  # a reset on the way: still up
    health.mark("main", 0, True)  # the next check answers: the count starts again
    health.request_lost("main", 0, "dropped the connection", unreachable=False)
    assert health.up("main", 0)
    health.mark("main", 0, False, "/ping failed")  # ... and a failed check after it: down
    assert not health.up("main", 0)
    health.request_lost("main", 1, "unreachable", unreachable=True)  # nothing listens: at once
    assert not health.up("main", 1) and health.status()["main"][1]["downs"] == 1


def test_a_timed_out_check_counts_only_while_the_instance_is_not_heard_elsewhere() -> None:
    clock = [100.0]
    health = Health({"main": ["http://md0"]}, interval_s=1.0, failures=2, heard_window_s=15.0,
                    now=lambda: clock[0])  # fmt: skip
    health.heard("main", 0)  # MD answered cache sync: alive, whatever its /ping does
    for _ in range(5):
        clock[0] += 2.0  # 10 s of /ping stuck behind KV in the link's queue
        health.timed_out("main", 0, "/ping timed out")
    assert health.up("main", 0)
    assert health.status()["main"][0]["slow_checks"] == 5
    assert health.status()["main"][0]["downs"] == 0
    health.mark("main", 0, False, "refused")  # a refusal counts, heard or not
    health.mark("main", 0, False, "refused")
    assert not health.up("main", 0) and health.status()["main"][0]["downs"] == 1
    health.mark("main", 0, True)
    clock[0] += 16.0  # not heard for longer than the window: silence on every channel
    health.timed_out("main", 0, "/ping timed out")
    health.timed_out("main", 0, "/ping timed out")
    assert not health.up("main", 0) and health.status()["main"][0]["downs"] == 2


def test_prefix_index_remembers_recent_prompts() -> None:
    index = PrefixIndex(capacity_blocks=10)
    a, b = list(range(100, 180)), list(range(500, 580))  # 5 blocks each
    index.add(a)
    assert index.cached_prefix([*a[:40], 1, 2]) == 32
    index.add(b)
    index.add(list(range(900, 916)))  # an 11th block: a's first block is the oldest, dropped
    assert index.cached_prefix(a) == 0 and index.cached_prefix(b) == 80


def test_first_token_residual_is_a_high_quantile_of_recent_misses() -> None:
    r = FirstTokenResidual()
    r.observe(0.2, now=0.0)
    r.observe(0.3, now=1.0)
    assert r.value(now=2.0) == 0.0, "two samples are not enough to learn from"
    for i in range(8):
        r.observe(0.1 * i, now=2.0 + i)  # 0.0 ... 0.7
    # Ten residuals: 0.0, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.5, 0.6, 0.7; the 90th percentile is 0.6.
    assert r.value(now=10.0) == pytest.approx(0.6)
    # A first token faster than predicted does not make the prediction shorter than its base.
    early = FirstTokenResidual()
    for i in range(3):
        early.observe(-0.4, now=float(i))
    assert early.value(now=3.0) == 0.0


def test_first_token_residual_forgets_so_md_is_measured_again() -> None:
    r = FirstTokenResidual()
    for i in range(5):
        r.observe(2.0, now=float(i))
    assert r.value(now=5.0) == pytest.approx(2.0)
    # Long after: the residual that kept requests off P->MD is gone, so P->MD is tried again.
    assert r.value(now=5.0 + RESIDUAL_TTL_S) == 0.0


def test_a_relayed_request_tells_what_p_to_md_would_have_taken() -> None:
    # P answered RLD after 0.4 s (queue + compute); MD, fed at 0.5 s, was READY at 0.8 s.
    timings = {"prefill_done": 0.4, "prefill_md_sent": 0.5, "ready": 0.8, "first_token": 0.45}
    assert relayed_direct_ttft(timings) == pytest.approx(0.7)
    assert relayed_direct_ttft({"prefill_done": 0.4, "ready": 0.8}) is None, "MD never fed"
    assert relayed_direct_ttft({"prefill_md_sent": 0.5, "ready": 0.8}) is None, "no P answer"
