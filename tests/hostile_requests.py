"""Hostile /generate requests, every field of SGLang's generate request and sampling parameters:
the pure checks (test_request_checks) and the live fuzz (test_hostile_input) share them.

`refused` are requests the router refuses, each with the field its 400 must name; `edges` are
the extremes it lets through, which every tier must serve or fail alone."""

from __future__ import annotations

import math
from typing import Any

NAN, INF = math.nan, math.inf
PROMPT = [5, 6, 7, 8]
GRAMMAR_CHARS = 32 * 1024

# SGLang 0.5.23's GenerateReqInput fields, each either forwarded or refused by the router.
SGLANG_GENERATE_FIELDS = (
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data",
    "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config",
    "sampling_params", "watermark", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "stream",
    "log_metrics", "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key", "conversation_id",
    "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens", "priority",
    "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
    "return_prompt_token_ids", "external_trace_header", "received_time",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt",
    "kv_hints",
)  # fmt: skip
# SamplingParams' fields that are not API parameters (normalize() fills them).
SAMPLING_INTERNAL = ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                     "is_normalized", "ebnf_full_assistant")  # fmt: skip
# A plausible value for each refused top-level field (what a client trying it would send).
UNSUPPORTED_VALUES: dict[str, Any] = {
    "input_embeds": [[0.0] * 8] * 4, "image_data": "https://example.com/a.png",
    "video_data": "a.mp4", "audio_data": "a.wav", "mm_hashes": ["0" * 64],
    "modalities": ["image"], "session_params": {"id": "s", "rid": "r"}, "session_id": "s",
    "lora_path": "adapter", "lora_id": "adapter", "custom_logit_processor": "{}",
    "return_hidden_states": True, "routed_dp_rank": 7, "data_parallel_rank": 7,
    "decode_tp_size": 64, "disagg_prefill_dp_rank": 9, "priority": 10**9, "extra_key": "k",
    "cache_salt": "s", "routing_key": "k", "max_thinking_tokens": -5, "custom_labels": {"a": "b"},
    "return_prompt_token_ids": True, "routed_experts_start_len": 10**9,
    "return_sampling_mask": True, "return_entropy": True, "return_routed_experts": True,
    "token_indices_to_pool": [10**9], "multi_item_delimiter_indices": [10**9],
    "positional_embed_overrides": {"embeds": [], "positions": [10**9]},
    "require_reasoning": True, "log_metrics": False, "background": True,
}  # fmt: skip


def refused_top(vocab: int, context: int) -> list[tuple[str, Any]]:
    """(field its 400 names, body) for hostile values of the top-level fields."""
    ids = {"input_ids": PROMPT}
    cases: list[tuple[str, Any]] = [
        ("sampling_params", [1]), ("sampling_params", "x"), ("sampling_params", 5),
        ("stream", "yes"), ("stream", 1), ("return_logprob", "true"), ("return_logprob", 0),
        ("return_text_in_logprobs", 1), ("return_text_in_logprobs", None),
        ("top_logprobs_num", -1), ("top_logprobs_num", 21), ("top_logprobs_num", 200),
        ("top_logprobs_num", vocab + 1), ("top_logprobs_num", 10**9),
        ("top_logprobs_num", 2.5), ("top_logprobs_num", "5"), ("top_logprobs_num", True),
        ("logprob_start_len", -2), ("logprob_start_len", -(10**9)),
        ("logprob_start_len", len(PROMPT) + 1), ("logprob_start_len", 10**9),
        ("logprob_start_len", 1.5), ("logprob_start_len", "0"), ("logprob_start_len", True),
        ("token_ids_logprob", [vocab]), ("token_ids_logprob", [-1]), ("token_ids_logprob", "x"),
        ("token_ids_logprob", [1] * 65), ("token_ids_logprob", [[1]]),
        ("pdd_path", "teleport"), ("pdd_path", 5),
        ("pdd_hold_relay", 0), ("pdd_hold_relay", -1), ("pdd_hold_relay", 1.5),
        ("pdd_hold_relay", "3"), ("pdd_hold_relay", True),
    ]  # fmt: skip
    out: list[tuple[str, Any]] = [
        (name, {**ids, "return_logprob": True, name: value}) for name, value in cases
           if name != "return_logprob"]  # fmt: skip
    out += [(name, {**ids, name: value}) for name, value in cases if name == "return_logprob"]
    for text in (5, "", ["a", "b"], {"a": 1}, True):
        out.append(("text", {"text": text}))
    for ids_value in ([], [-1], [1.5], [True], "abc", [[1], [2]], [vocab], [1] * context):
        out.append(("input_ids", {"input_ids": ids_value}))
    out += [("text or input_ids", {}), ("text or input_ids", {"text": "a", "input_ids": [1]}),
            ("the body", [1]), ("the body", "text")]  # fmt: skip
    for name in SGLANG_GENERATE_FIELDS:
        if name not in ("text", "input_ids", "sampling_params", "stream") and not any(
            name == n for n, _ in cases
        ):
            out.append((name, {**ids, name: UNSUPPORTED_VALUES.get(name, 1)}))
    return out


def refused_sampling(vocab: int, context: int) -> list[tuple[str, dict[str, Any]]]:
    """(field its 400 names, body) for hostile values of every sampling parameter."""
    cases: list[tuple[str, Any]] = [
        ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", "10"),
        ("max_new_tokens", True), ("max_new_tokens", 10**12), ("max_new_tokens", context),
        ("min_new_tokens", -1), ("min_new_tokens", 1.5), ("min_new_tokens", 200),
        ("stop", 5), ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", ["x"] * 33),
        ("stop", "x" * 1001), ("stop", {"a": 1}),
        ("stop_token_ids", [vocab]), ("stop_token_ids", [-1]), ("stop_token_ids", "1"),
        ("stop_token_ids", [1] * 33), ("stop_token_ids", [2**70]), ("stop_token_ids", [1.0]),
        ("stop_regex", "("), ("stop_regex", "(a+)+$"), ("stop_regex", r"(a)\1"),
        ("stop_regex", "(x*y*)*z"), ("stop_regex", "a" * 257), ("stop_regex", ["a"] * 33),
        ("stop_regex", 5), ("stop_regex", ""),
        ("temperature", -1), ("temperature", NAN), ("temperature", INF), ("temperature", "hot"),
        ("temperature", True), ("temperature", 1e7), ("temperature", 10**400),
        ("top_p", 0), ("top_p", -0.1), ("top_p", 1.1), ("top_p", NAN), ("top_p", "1"),
        ("top_k", 0), ("top_k", -2), ("top_k", 2**31), ("top_k", 2**62), ("top_k", 1.5),
        ("top_k", True), ("top_k", "5"),
        ("min_p", -0.1), ("min_p", 1.5), ("min_p", NAN),
        ("frequency_penalty", 3), ("frequency_penalty", -3), ("frequency_penalty", NAN),
        ("presence_penalty", 2.01), ("presence_penalty", -INF),
        ("repetition_penalty", 0), ("repetition_penalty", 2.5), ("repetition_penalty", -1),
        ("repetition_penalty", NAN),
        ("n", 2), ("n", 0), ("n", 1.0), ("n", "1"), ("n", True), ("n", None),
        ("beam_width", 2), ("beam_width", 0), ("beam_width", True),
        ("json_schema", "{"), ("json_schema", "[1]"), ("json_schema", 5),
        ("json_schema", '"' + "x" * GRAMMAR_CHARS + '"'),
        ("regex", "("), ("regex", 5), ("regex", "x" * (GRAMMAR_CHARS + 1)),
        ("ebnf", 5), ("ebnf", "x" * (GRAMMAR_CHARS + 1)), ("ebnf", ["root ::= 'a'"]),
        ("structural_tag", "{"), ("structural_tag", 5),
        ("ignore_eos", "yes"), ("ignore_eos", 1), ("skip_special_tokens", "no"),
        ("spaces_between_special_tokens", 0), ("no_stop_trim", []),
        ("logit_bias", []), ("logit_bias", {"abc": 1}), ("logit_bias", {"-1": 1}),
        ("logit_bias", {" 5": 1}), ("logit_bias", {"\u0665": 1}), ("logit_bias", {str(vocab): 1}),
        ("logit_bias", {"5": NAN}), ("logit_bias", {"5": INF}), ("logit_bias", {"5": 101}),
        ("logit_bias", {"5": 1e30}), ("logit_bias", {"5": "x"}), ("logit_bias", {"5": True}),
        ("logit_bias", {str(i): 1 for i in range(vocab, vocab + 1025)}),
        ("sampling_seed", 2**63), ("sampling_seed", -(2**63) - 1), ("sampling_seed", 1.5),
        ("sampling_seed", "1"), ("sampling_seed", True),
        ("stream_interval", 1), ("stream_interval", 0), ("stream_interval", -5),
        ("stream_interval", "x"), ("custom_params", {"a": 1}),
        ("watermark", {"enabled": True}), ("choice", ["a"]),
        *[(name, 2) for name in SAMPLING_INTERNAL],
    ]  # fmt: skip
    out = [(name, {name: value}) for name, value in cases]
    out.append(("min_new_tokens", {"max_new_tokens": 5, "min_new_tokens": 6}))
    # A stop id beyond the vocabulary, where the min_new_tokens penalty indexes by stop ids.
    for ids in ([vocab + 5], [2**63 - 1]):
        out.append(("stop_token_ids", {"stop_token_ids": ids, "min_new_tokens": 2,
                                       "max_new_tokens": 4, "temperature": 1.0}))  # fmt: skip
    out.append(("regex", {"json_schema": "{}", "regex": "a"}))
    return [(f"sampling_params.{name}", {"input_ids": PROMPT, "sampling_params": params})
            for name, params in out]  # fmt: skip


def refused(vocab: int, context: int) -> list[tuple[str, Any]]:
    return [*refused_top(vocab, context), *refused_sampling(vocab, context)]


def edges(vocab: int, context: int) -> list[tuple[str, dict[str, Any]]]:
    """(what, body) at the edge of what the router accepts: each must be served, or fail alone."""
    last = vocab - 1
    sampling: list[tuple[str, dict[str, Any]]] = [
        ("max_new_tokens 0", {"max_new_tokens": 0}),
        # Allowed up to the context window; token 0 forced and a stop, so it ends at once.
        ("max_new_tokens to the context", {"max_new_tokens": context - len(PROMPT),
                                           "logit_bias": {"0": 100}, "stop_token_ids": [0]}),
        ("min_new_tokens = max", {"max_new_tokens": 6, "min_new_tokens": 6}),
        ("temperature 1e6", {"temperature": 1e6}), ("temperature 1e-9", {"temperature": 1e-9}),
        ("top_p 1e-9", {"top_p": 1e-9}), ("top_k 2^30", {"top_k": 2**30}),
        ("top_k 1", {"top_k": 1}), ("min_p 1", {"min_p": 1.0}),
        ("penalties at their bounds", {"frequency_penalty": 2, "presence_penalty": -2,
                                       "repetition_penalty": 2}),
        ("repetition_penalty near 0", {"repetition_penalty": 1e-9}),
        ("sampling_seed extremes", {"sampling_seed": -(2**63), "temperature": 1.0}),
        ("logit_bias +-100", {"logit_bias": {"0": 100, str(last): -100, "2": 100}}),
        ("logit_bias 1024 entries", {"logit_bias": {str(i % vocab): -1 for i in range(1024)}}),
        ("32 stop strings", {"stop": [chr(0x4E00 + i) * 3 for i in range(32)]}),
        ("32 stop token ids", {"stop_token_ids": [last - i for i in range(32)]}),
        ("stop_regex", {"stop_regex": [r"\d{3}$", "(foo|bar)!", "." * 200]}),
        ("regex grammar", {"regex": "(yes|no)[a-z]{0,5}"}),
        ("a regex grammar no token can start", {"regex": "\u2603{3}"}),
        ("json_schema grammar", {"json_schema": '{"type": "object", "properties": '
                                                '{"a": {"type": "integer"}}}'}),
        ("json_schema true", {"json_schema": "true"}),
        ("deep json_schema", {"json_schema": '{"items":' * 500 + "{}" + "}" * 500}),
        ("ebnf grammar", {"ebnf": 'root ::= "a" | "b" root'}),
        ("invalid ebnf", {"ebnf": "root ::= (((("}),
        ("invalid structural_tag", {"structural_tag": '{"type": "nonsense"}'}),
        ("huge counted regex", {"regex": "(a{1000}){1000}"}),
        ("ignore_eos etc.", {"ignore_eos": True, "skip_special_tokens": False,
                             "spaces_between_special_tokens": False, "no_stop_trim": True}),
        ("nulls", {k: None for k in (
            "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
            "beam_width", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
            "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
            "stream_interval", "logit_bias", "sampling_seed", "custom_params", "watermark")}),
    ]  # fmt: skip
    out: list[tuple[str, dict[str, Any]]] = [
        (what, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, **params}})
        for what, params in sampling
    ]
    logprobs: dict[str, Any] = {"input_ids": PROMPT, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 4}}  # fmt: skip
    out += [
        ("output logprobs", logprobs),
        ("top-level nulls", {"input_ids": PROMPT, **{k: None for k in (
            "sampling_params", "stream", "return_logprob", "top_logprobs_num",
            "logprob_start_len", "token_ids_logprob")}}),
        ("20 top logprobs", {**logprobs, "top_logprobs_num": 20}),
        ("input logprobs from 0", {**logprobs, "logprob_start_len": 0, "top_logprobs_num": 3}),
        ("input logprobs from the end", {**logprobs, "logprob_start_len": len(PROMPT)}),
        ("token_ids_logprob", {**logprobs, "token_ids_logprob": [0, last]}),
        ("return_text_in_logprobs", {**logprobs, "return_text_in_logprobs": True}),
        ("streamed logprobs", {**logprobs, "stream": True, "top_logprobs_num": 2}),
        ("the longest prompt", {"input_ids": [3] * (context - 2),
                                "sampling_params": {"max_new_tokens": 2}}),
        ("the highest token id", {"input_ids": [last] * 3}),
        ("a text prompt", {"text": "\u0000\ud7ff\U0010ffff" * 10}),
    ]  # fmt: skip
    return out
