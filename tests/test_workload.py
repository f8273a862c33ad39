"""The trace workload: hit-rate distribution, token recipes, trace files, import, replay, CLI."""

from __future__ import annotations

import bisect
import json
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdd.eval.__main__ import main
from pdd.eval.prompts import FIRST_ID
from pdd.eval.replay import NOT_SENT, replay
from pdd.eval.trace import TraceError, import_trace, read_header, read_trace, write_trace
from pdd.eval.workload import (
    TraceRequest,
    WorkloadConfig,
    generate,
    hit_rate_summary,
    materialize,
    segment_ids,
    system_prompts,
)

VOCAB = 32000


@pytest.fixture(scope="module")
def default_trace() -> list[TraceRequest]:
    return generate(WorkloadConfig())


def segment_lcp(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> int:
    """Shared tokens of two recipes, by segment semantics (a stream's prefixes agree)."""
    total = 0
    for (seed_a, n_a), (seed_b, n_b) in zip(a, b, strict=False):
        if seed_a != seed_b:
            break
        total += min(n_a, n_b)
        if n_a != n_b:
            break
    return total


def token_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_default_distribution_matches_the_paper(default_trace: list[TraceRequest]) -> None:
    s = hit_rate_summary(default_trace)
    assert s["requests"] == 2000
    assert 0.88 <= s["mean_hit"] <= 0.92
    assert abs(s["mean_hit"] - 0.90) <= 0.005  # calibrated, not just near
    assert 0.70 <= s["share_above_95"] <= 0.80
    assert 0.03 <= s["singular_share"] <= 0.04
    assert 0.02 <= s["share_below_50"] <= 0.12  # a small low-hit tail
    assert s["p50_hit"] > 0.95 and s["p5_hit"] < 0.5  # skewed: high head, long low tail
    singular = [r for r in default_trace if r.singular]
    assert all(r.output_tokens <= 4 and r.hit < 0.5 and r.prompt_tokens >= 16000 for r in singular)
    assert all(
        r.output_tokens >= 8 and r.prompt_tokens <= 128_000 for r in default_trace if not r.singular
    )
    assert s["turns_per_session"] >= 8  # sessions of many turns


def test_cached_tokens_are_the_prefix_shared_with_earlier_requests(
    default_trace: list[TraceRequest],
) -> None:
    # Independent of the generator's trie: pairwise against every earlier recipe, for a sample.
    for req in default_trace[::20]:
        assert req.segments is not None
        assert sum(n for _, n in req.segments) == req.prompt_tokens
        best = max(
            (segment_lcp(req.segments, e.segments or ()) for e in default_trace[: req.id]),
            default=0,
        )
        assert req.cached_tokens == best, req


def test_materialized_ids_share_exactly_the_cached_prefix() -> None:
    # Scaled down so every prompt fits in memory; the shape survives scaling.
    trace = generate(WorkloadConfig(seed=3).scaled(0.05))
    s = hit_rate_summary(trace)
    assert 0.88 <= s["mean_hit"] <= 0.92 and 0.70 <= s["share_above_95"] <= 0.80
    cache: dict[tuple[int, int], list[int]] = {}
    earlier: list[list[int]] = []  # sorted: the longest common prefix is with a neighbour
    exact = 0
    for req in trace:
        ids = materialize(req, VOCAB, cache)
        assert len(ids) == req.prompt_tokens
        at = bisect.bisect_left(earlier, ids)
        lcp = max(
            (token_lcp(ids, earlier[j]) for j in (at - 1, at) if 0 <= j < len(earlier)), default=0
        )
        assert 0 <= lcp - req.cached_tokens <= 3, req  # random ids may agree by chance
        exact += lcp == req.cached_tokens
        bisect.insort(earlier, ids)
    assert exact >= 0.99 * len(trace)


def test_segment_ids_are_prefix_consistent_and_in_range() -> None:
    long = segment_ids(7, 1000, VOCAB)
    assert segment_ids(7, 100, VOCAB) == long[:100]
    assert segment_ids(8, 100, VOCAB) != long[:100]
    assert min(long) >= FIRST_ID and max(long) < VOCAB
    req = TraceRequest(0, 0, 0, 0.0, 150, 0, 1, segments=((7, 100), (9, 50)))
    assert materialize(req, VOCAB) == long[:100] + segment_ids(9, 50, VOCAB)
    assert materialize(req, VOCAB, {}) == materialize(req, VOCAB)
    with pytest.raises(ValueError, match="no token recipe"):
        materialize(TraceRequest(1, 1, 0, 0.0, 10, 5, 1), VOCAB)


def answer_segments(trace: list[TraceRequest]) -> list[tuple[TraceRequest, int]]:
    """(turn, the length its answer takes in the session's next prompt) for continuing turns."""
    last: dict[int, TraceRequest] = {}
    out = []
    for req in trace:
        before = last.get(req.session)
        if before is not None:
            assert req.segments is not None and before.segments is not None
            out.append((before, req.segments[len(before.segments)][1]))
        last[req.session] = req
    return out


def test_turns_extend_their_session(default_trace: list[TraceRequest]) -> None:
    last: dict[int, TraceRequest] = {}
    extended = 0
    for req in default_trace:
        before = last.get(req.session)
        if before is not None:
            assert req.turn == before.turn + 1 and req.arrival_s >= before.arrival_s + 5.0
            assert req.segments is not None and before.segments is not None
            n = len(before.segments)
            assert req.segments[:n] == before.segments  # the whole previous prompt
            assert 1 <= req.segments[n][1] <= before.output_tokens  # the answer, then a tool
            assert req.cached_tokens == before.prompt_tokens
            extended += 1
        last[req.session] = req
    assert extended > 1500
    # Unscaled, the answer enters the next prompt whole unless that turn's hit target needs less.
    answers = answer_segments(default_trace)
    assert sum(seg == turn.output_tokens for turn, seg in answers) >= 0.75 * len(answers)


def test_default_outputs_are_agentic_and_continuing_turns_are_not_trimmed(
    default_trace: list[TraceRequest],
) -> None:
    outputs = [r.output_tokens for r in default_trace if not r.singular]
    assert statistics.fmean(outputs) >= 150 and max(outputs) <= 512 and min(outputs) >= 8
    assert 150 <= statistics.median(outputs) <= 210
    assert all(1 <= r.output_tokens <= 4 for r in default_trace if r.singular)
    # A turn that the session continues decodes as long as one that ends it: the prompt-side
    # cap that keeps > 95% turns above 95% applies to the answer's segment, not to the output.
    continuing = [turn.output_tokens for turn, _ in answer_segments(default_trace)]
    assert statistics.fmean(continuing) >= 0.95 * statistics.fmean(outputs)
    assert sum(n > 400 for n in continuing) >= 0.02 * len(continuing)  # the long tail is there


def test_scaling_shrinks_prompts_not_decoded_lengths() -> None:
    cfg = WorkloadConfig(seed=1)
    small = cfg.scaled(0.015)
    assert small.system_tokens == (30, 180) and small.max_context == 1920
    assert small.singular_tokens == (240, 960) and small.answer_prompt_scale == 0.015
    decode = ("output_median", "output_sigma", "output_range", "singular_output")
    assert all(getattr(small, k) == getattr(cfg, k) for k in decode)
    assert small.scaled(2.0).answer_prompt_scale == 0.03  # scales compose
    trace = generate(small)
    s = hit_rate_summary(trace)
    assert abs(s["mean_hit"] - 0.90) <= 0.02  # the production shape survives
    assert s["share_above_95"] >= 0.65 and 0.03 <= s["singular_share"] <= 0.04
    assert s["max_prompt_tokens"] <= 1920
    outputs = [r.output_tokens for r in trace if not r.singular]
    assert statistics.fmean(outputs) >= 150 and max(outputs) <= 512  # production answers
    # In the next prompt an answer takes 1.5% of its decoded length (or less, for the target).
    answers = answer_segments(trace)
    assert all(1 <= seg <= max(1, round(0.015 * t.output_tokens)) for t, seg in answers)
    scaled = sum(seg == max(1, round(0.015 * t.output_tokens)) for t, seg in answers)
    assert scaled >= 0.75 * len(answers)
    with pytest.raises(ValueError, match="answer_prompt_scale"):
        WorkloadConfig(answer_prompt_scale=0)


def test_a_warm_start_caches_the_system_prompts_first() -> None:
    cfg = WorkloadConfig(seed=2, requests=40, sessions=6, rate=0.15, turn_gap_s=20).scaled(0.015)
    cold, warm = generate(cfg), generate(replace(cfg, warm=True))
    systems = system_prompts(replace(cfg, warm=True))
    assert len(systems) == cfg.system_prompts and all(r.output_tokens == 1 for r in systems)
    heads = {r.segments[0] for r in warm if r.segments and not r.singular}
    assert heads <= {s.segments[0] for s in systems if s.segments}  # every session opens so
    assert hit_rate_summary(warm)["mean_hit"] > hit_rate_summary(cold)["mean_hit"]
    assert abs(hit_rate_summary(warm)["mean_hit"] - 0.90) <= 0.03  # short, yet warm: the shape


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    cfg = WorkloadConfig(requests=400, seed=5)
    assert generate(cfg) == generate(cfg)
    assert generate(cfg) != generate(WorkloadConfig(requests=400, seed=6))


def test_knobs_move_the_distribution() -> None:
    cfg = WorkloadConfig(seed=2, mean_hit=0.8, above_95=0.55, low_share=0.1, singular_share=0.06)
    s = hit_rate_summary(generate(cfg))
    assert abs(s["mean_hit"] - 0.8) <= 0.005
    assert abs(s["share_above_95"] - 0.55) <= 0.02
    assert abs(s["singular_share"] - 0.06) <= 0.005
    assert abs(s["share_below_50"] - 0.16) <= 0.02
    with pytest.raises(ValueError, match="out of reach"):
        WorkloadConfig(mean_hit=0.99)


def test_trace_round_trip(tmp_path: Path) -> None:
    trace = generate(WorkloadConfig(requests=300, seed=1))
    trace.append(TraceRequest(300, 999, 0, trace[-1].arrival_s, 10, 3, 2))  # no recipe
    path = tmp_path / "t.jsonl"
    write_trace(path, trace, {"note": "x"})
    assert read_trace(path) == trace
    assert read_header(path)["meta"] == {"note": "x"}
    assert import_trace(path) == trace  # "auto" recognises our own format


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r":3: not JSON"),
        ('{"id": 1}', r":3: missing field 'session'"),
        ("[1, 2]", r":3: expected a JSON object"),
    ],
)
def test_malformed_line_names_its_line(tmp_path: Path, line: str, message: str) -> None:
    trace = generate(WorkloadConfig(requests=3, seed=1))
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    lines = path.read_text().splitlines()
    lines[2] = line  # the second request
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=message):
        read_trace(path)


def test_bad_fields_are_named(tmp_path: Path) -> None:
    good = {
        "id": 0,
        "session": 0,
        "turn": 0,
        "arrival_s": 0.0,
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "output_tokens": 1,
        "singular": False,
    }
    cases: list[tuple[dict[str, Any], str]] = [
        ({"cached_tokens": 11}, "'cached_tokens' 11 exceeds"),
        ({"prompt_tokens": "10"}, "'prompt_tokens' must be an integer"),
        ({"segments": [[1, 4]]}, "'segments' add up to 4"),
        ({"colour": "red"}, "unknown field 'colour'"),
    ]
    header = json.dumps({"format": "pdd-trace", "v": 1, "requests": 1})
    for change, message in cases:
        path = tmp_path / "t.jsonl"
        path.write_text(header + "\n" + json.dumps({**good, **change}) + "\n")
        with pytest.raises(TraceError, match=f":2: field {message}|:2: {message}"):
            read_trace(path)
    path.write_text(header.replace('"v": 1', '"v": 9') + "\n")
    with pytest.raises(TraceError, match="version 9"):
        read_trace(path)
    path.write_text(header + "\n")
    with pytest.raises(TraceError, match="header says 1 requests, found 0"):
        read_trace(path)


def test_mooncake_import_derives_cached_tokens_from_hash_ids(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1100, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 4]},
        {"timestamp": 1250, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = import_trace(path, "mooncake")
    # 1: nothing seen before. 2: blocks 1, 2 seen (2 x 512); its block 4 is new.
    # 3: blocks 1, 2, 3 all seen: 1024 + its last, partial block (76 tokens) = the whole prompt.
    assert [r.cached_tokens for r in trace] == [0, 1024, 1100]
    assert [r.arrival_s for r in trace] == [0.0, 0.1, 0.25]
    assert [r.prompt_tokens for r in trace] == [1200, 1500, 1100]
    assert not any(r.singular for r in trace)
    ids = [materialize(r, VOCAB) for r in trace]
    assert token_lcp(ids[1], ids[0]) == 1024 and ids[2] == ids[0][:1100]
    path.write_text(json.dumps({**rows[0], "hash_ids": [1, 2]}) + "\n")
    with pytest.raises(TraceError, match=r":1: field 'hash_ids' has 2 blocks, but 1200"):
        import_trace(path)


def test_simple_import_uses_sessions_or_given_cached_tokens(tmp_path: Path) -> None:
    path = tmp_path / "user.jsonl"
    rows = [
        {"arrival_s": 2.0, "prompt_tokens": 1000, "output_tokens": 50, "session_id": "a"},
        {"arrival_s": 1.0, "prompt_tokens": 800, "output_tokens": 3},
        {"arrival_s": 3.0, "prompt_tokens": 1300, "output_tokens": 40, "session_id": "a"},
        {"arrival_s": 4.0, "input_length": 900, "output_length": 9, "cached_tokens": 450},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = import_trace(path)
    assert [r.prompt_tokens for r in trace] == [800, 1000, 1300, 900]  # sorted by arrival
    assert [r.cached_tokens for r in trace] == [0, 0, 1000, 450]
    assert [r.arrival_s for r in trace] == [0.0, 1.0, 2.0, 3.0]
    assert trace[1].session == trace[2].session and trace[2].turn == 1
    assert trace[0].singular and not trace[1].singular  # 3 output tokens, no hit
    assert trace[3].segments is None
    path.write_text(json.dumps({"prompt_tokens": 5}) + "\n")
    with pytest.raises(TraceError, match=r":1: missing field 'output_tokens' or 'output_length'"):
        import_trace(path)


def small_requests(n: int) -> list[TraceRequest]:
    return [TraceRequest(i, i, 0, i * 0.01, 10, 0, 1) for i in range(n)]


def test_closed_loop_never_exceeds_its_concurrency() -> None:
    lock = threading.Lock()
    now = peak = 0

    def send(req: TraceRequest) -> int:
        nonlocal now, peak
        with lock:
            now += 1
            peak = max(peak, now)
        time.sleep(0.01)
        with lock:
            now -= 1
        return req.id

    results = replay(small_requests(40), send, concurrency=4, log=lambda _: None)
    assert peak == 4
    assert [r.value for r in results] == list(range(40)) and all(r.ok for r in results)


def test_open_loop_sends_on_schedule() -> None:
    results = replay(small_requests(15), lambda r: r.id, rate=50, log=lambda _: None)
    assert [r.scheduled_s for r in results] == [i / 50 for i in range(15)]
    for r in results:
        assert r.start_s is not None and r.scheduled_s is not None
        assert r.scheduled_s <= r.start_s <= r.scheduled_s + 0.5  # loose: a busy machine lags
    results = replay(small_requests(5), lambda r: r.id, speed=2.0, log=lambda _: None)
    assert [r.scheduled_s for r in results] == [i * 0.01 / 2 for i in range(5)]


def test_failures_and_timeouts_are_results_not_the_end() -> None:
    def send(req: TraceRequest) -> int:
        if req.id == 3:
            raise RuntimeError("boom")
        if req.id == 5:
            time.sleep(2)
        return req.id

    lines: list[str] = []
    start = time.monotonic()
    results = replay(small_requests(10), send, concurrency=3, timeout_s=0.3, log=lines.append)
    assert time.monotonic() - start < 1.5
    assert results[3].error == "RuntimeError: boom"
    assert results[5].error is not None and "timed out" in results[5].error
    assert [r.ok for r in results].count(True) == 8
    assert "10/10 done, 2 errors" in lines[-1]


def test_stop_ends_the_run_and_marks_what_was_not_sent() -> None:
    stop = threading.Event()

    def send(req: TraceRequest) -> int:
        if req.id == 4:
            stop.set()
        return req.id

    results = replay(small_requests(20), send, concurrency=1, stop=stop, log=lambda _: None)
    assert [r.ok for r in results[:5]] == [True] * 5
    assert all(r.error == NOT_SENT for r in results[5:])
    with pytest.raises(ValueError, match="exactly one"):
        replay(small_requests(2), send, rate=1, concurrency=1)


def test_cli_trace_writes_a_file_and_prints_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["trace", "--requests", "300", "--seed", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean hit" in printed and "hit > 95%" in printed and "wrote 300 requests" in printed
    trace = read_trace(out)
    assert trace == generate(WorkloadConfig(requests=300, seed=4))
    assert read_header(out)["meta"]["config"]["seed"] == 4
    assert main(["import", str(out)]) == 0
    assert "singular" in capsys.readouterr().out
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    assert all(f"  {c} " in listed for c in ("trace", "import", "sim", "plan", "repro", "live"))
    assert main(["nonsense"]) == 2
