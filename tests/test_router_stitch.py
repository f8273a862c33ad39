"""The router's stream stitcher and SSE parser, on synthetic SGLang chunks (pure)."""

from __future__ import annotations

import json

import pytest

from pdd.router.resume import resume_body
from pdd.router.sse import DONE, SSEError, SSEParser, encode_event
from pdd.router.stitch import Kind, Phase, Stitcher

TEXT = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 6: "f", 7: "g", 8: "h"}


def chunk(ids: list[int], finish: str | None = None, rid: str = "x-r", **meta: object) -> dict:
    reason: dict[str, object] | None = None if finish is None else {"type": finish}
    if finish == "abort":
        reason = {"type": "abort", "message": "Abort before prefill", "status_code": 503}
    text = "".join(TEXT[t] for t in ids)
    return {
        "text": text,
        "output_ids": list(ids),
        "meta_info": {"id": rid, "finish_reason": reason, "completion_tokens": len(ids), **meta},
    }


def client_tokens(outs: list) -> list[int]:
    """What a client of cumulative streaming ends with, checking each chunk extends the last."""
    seen: list[int] = []
    for fed in outs:
        ids = fed.chunk["output_ids"]
        assert ids[: len(seen)] == seen, "a chunk rewrote tokens the client already had"
        assert len(ids) > len(seen) or fed.final
        seen = ids
        assert fed.chunk["text"] == "".join(TEXT[t] for t in ids)
        assert fed.chunk["meta_info"]["id"] == "x"
    return seen


def test_relay_then_handoff_to_main_each_token_once() -> None:
    s = Stitcher("x")
    outs = [s.feed_relay(chunk([1])), s.feed_relay(chunk([1, 2, 3]))]  # coalesced chunk
    assert [o.new_tokens for o in outs] == [1, 2]
    assert s.handoff() == (1, 2, 3)
    # RLD made more tokens after the snapshot: they are discarded, so is its abort chunk.
    assert s.feed_relay(chunk([1, 2, 3, 4])).kind is Kind.IGNORED
    assert s.feed_relay(chunk([1, 2, 3, 4], "abort")).kind is Kind.IGNORED
    # MD's cumulative output starts with the handed-off tokens.
    main = [
        chunk([1, 2, 3], rid="x"),
        chunk([1, 2, 3, 5], rid="x"),
        chunk([1, 2, 3, 5, 6, 7], rid="x"),
    ]
    fed = [s.feed_main(c) for c in main]
    assert fed[0].kind is Kind.IGNORED  # nothing new
    assert [f.new_tokens for f in fed[1:]] == [1, 2]
    last = s.feed_main(chunk([1, 2, 3, 5, 6, 7, 8], "length", rid="x"))
    assert last.final and s.phase is Phase.DONE
    assert client_tokens(outs + fed[1:] + [last]) == [1, 2, 3, 5, 6, 7, 8]
    assert s.feed_main(chunk([1, 2, 3, 5, 6, 7, 8, 1], rid="x")).kind is Kind.IGNORED


def test_relay_finishes_naturally() -> None:
    s = Stitcher("x")
    a = s.feed_relay(chunk([1, 2]))
    b = s.feed_relay(chunk([1, 2, 3], "stop", matched_stop=3))
    assert b.final and b.chunk is not None
    assert b.chunk["meta_info"]["finish_reason"] == {"type": "stop"}
    assert b.chunk["meta_info"]["matched_stop"] == 3
    assert client_tokens([a, b]) == [1, 2, 3]
    assert s.phase is Phase.DONE


def test_finish_chunk_without_new_tokens_is_forwarded() -> None:
    s = Stitcher("x")
    s.feed_relay(chunk([1, 2]))
    s.handoff()
    fin = s.feed_main(chunk([1, 2], "length", rid="x"))
    assert fin.kind is Kind.FORWARD and fin.final and fin.new_tokens == 0


def test_relay_abort_before_handoff_is_a_failure_not_output() -> None:
    s = Stitcher("x")
    s.feed_relay(chunk([1]))
    fed = s.feed_relay(chunk([1, 2], "abort"))
    assert fed.kind is Kind.FAILED and "Abort before prefill" in fed.reason
    assert s.emitted == [1]  # the aborted chunk's token never reached the client
    err = s.feed_relay({"error": {"message": "boom", "code": 400}})
    assert err.kind is Kind.FAILED and "boom" in err.reason and err.status == 400
    assert s.feed_relay({"error": {"message": "x", "code": 500}}).status == 502
    assert s.feed_relay({"error": "plain"}).status == 502


def test_main_before_handoff() -> None:
    s = Stitcher("x")
    s.feed_relay(chunk([1]))
    # A parked MD says nothing; if it streams anyway that is not for the client.
    assert s.feed_main(chunk([1, 2], rid="x")).kind is Kind.IGNORED
    assert s.emitted == [1]
    ended = s.feed_main(chunk([1], "abort", rid="x"))
    assert ended.kind is Kind.FAILED and "before the handoff" in ended.reason
    unparked = s.feed_main(chunk([1, 2, 3], "length", rid="x"))
    assert unparked.kind is Kind.FAILED and "without parking" in unparked.reason


def test_main_error_after_handoff() -> None:
    s = Stitcher("x")
    s.feed_relay(chunk([1, 2]))
    s.handoff()
    fed = s.feed_main({"error": {"message": "MD exploded"}})
    assert fed.kind is Kind.FAILED and "MD exploded" in fed.reason
    # MD output that does not extend the client's tokens is refused, never forwarded.
    bad = s.feed_main(chunk([1, 3, 4], rid="x"))
    assert bad.kind is Kind.FAILED and "does not extend" in bad.reason
    final = s.failure_chunk("MD failed")
    assert final["output_ids"] == [1, 2] and final["text"] == "ab"
    assert final["meta_info"]["finish_reason"] == {"type": "abort", "message": "MD failed"}


def test_handoff_with_nothing_emitted_and_main_only_path() -> None:
    s = Stitcher("x")
    assert s.handoff() == ()
    fed = s.feed_main(chunk([4, 5], rid="x"))
    assert fed.new_tokens == 2
    m = Stitcher("x", Phase.MAIN)  # P->MD: MD feeds the client from the start
    assert m.feed_relay(chunk([1])).kind is Kind.IGNORED
    assert m.feed_main(chunk([1], rid="x")).new_tokens == 1
    with pytest.raises(RuntimeError):
        m.handoff()


def test_malformed_chunks() -> None:
    s = Stitcher("x")
    assert s.feed_relay({"text": "a"}).kind is Kind.FAILED
    assert s.feed_relay({"output_ids": ["a"]}).kind is Kind.FAILED


def test_sse_parser_split_anywhere() -> None:
    events = [chunk([1]), chunk([1, 2], "length")]
    raw = b"".join(encode_event(e) for e in events) + encode_event(DONE)
    for cut in range(len(raw) + 1):
        p = SSEParser()
        got = p.feed(raw[:cut]) + p.feed(raw[cut:])
        assert got == [*events, DONE]
    p = SSEParser()
    got = p.feed(b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\ndata: [DONE]\n\n')
    assert got == [{"a": 1}, DONE]
    # A long cumulative chunk is one event, however big.
    big = {"output_ids": list(range(100_000))}
    assert SSEParser().feed(encode_event(big)) == [big]
    # Text a model produced may hold characters other line splitters break at; JSON writers
    # such as orjson (SGLang's) leave them raw inside strings.
    odd = {"text": "a\u2028b\u2029c\x85d\x1ce\x0bf", "output_ids": [1]}
    raw_odd = b"data: " + json.dumps(odd, ensure_ascii=False).encode() + b"\n\n"
    assert SSEParser().feed(raw_odd) == [odd]
    with pytest.raises(SSEError):
        SSEParser().feed(b"data: {nope\n\n")
    with pytest.raises(SSEError):
        SSEParser().feed(b"data: [1, 2]\n\n")


def test_resume_on_relay_after_main_failed() -> None:
    s = Stitcher("x")
    outs = [s.feed_relay(chunk([1, 2]))]
    s.handoff()
    outs.append(s.feed_main(chunk([1, 2, 3], rid="x")))
    assert s.feed_main({"error": {"message": "MD died"}}).kind is Kind.FAILED
    s.resume(Phase.RELAY)
    # The new RLD request's output is only the continuation; the client's grows from [1, 2, 3].
    outs += [s.feed_relay(chunk([4], rid="x-r2")), s.feed_relay(chunk([4, 5], "length"))]
    assert [o.new_tokens for o in outs] == [2, 1, 1, 1] and outs[-1].final
    assert client_tokens(outs) == [1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="resume in phase done"):
        s.resume(Phase.MAIN)


def test_resume_on_main_after_relay_failed() -> None:
    s = Stitcher("x")
    outs = [s.feed_relay(chunk([1, 2]))]
    assert s.feed_relay(chunk([1, 2], "abort")).kind is Kind.FAILED
    s.resume(Phase.MAIN)
    assert s.feed_relay(chunk([1, 2, 3])).kind is Kind.IGNORED  # the dead side is not heard
    outs += [s.feed_main(chunk([3], rid="x")), s.feed_main(chunk([3, 4], "length", rid="x"))]
    assert client_tokens(outs) == [1, 2, 3, 4] and outs[-1].final


def test_resume_body() -> None:
    body = {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    assert resume_body(body, [1, 2]) == {
        "input_ids": [7, 8, 1, 2],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    }
    assert body["input_ids"] == [7, 8]  # the client's body is left alone
    assert resume_body({"input_ids": [7]}, [1] * 3)["sampling_params"] == {"max_new_tokens": 125}
    assert resume_body({"text": "hi"}, [1]) is None  # no ids to extend
    assert resume_body(body, [1] * 5) is None  # nothing left to generate
    penalised = {**body, "sampling_params": {"max_new_tokens": 5, "frequency_penalty": 1.0}}
    assert resume_body(penalised, [1]) is None  # the new sampler would not see [1]
