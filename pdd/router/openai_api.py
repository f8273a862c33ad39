"""The OpenAI-compatible front door, as pure translation: an OpenAI request becomes an
SGLang-native `GenerateRequest` (input ids the router tokenized itself, sampling_params), and
SGLang-native answers become OpenAI `chat.completion` / `text_completion` objects and stream
chunks. No I/O: the aiohttp handlers in app.py call these."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from pdd.router.body import (
    HOLD_FIELD,
    PATH_FIELD,
    BadRequest,
    GenerateRequest,
    Limits,
    is_token,
    parse_generate,
)
from pdd.router.chat_ids import ChatIds, ChatTokenizer
from pdd.router.tokenizer import TokenizerError

CHAT = "chat"
COMPLETION = "completion"
NO_TOKENIZER = "the OpenAI endpoints need a tokenizer: start the router with --tokenizer PATH"
# Half a UTF-8 character decodes to U+FFFD; the next chunk may complete it.
REPLACEMENT = "\ufffd"


class OpenAIError(Exception):
    """An answer in OpenAI's error shape, with the HTTP status it goes out with."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(
    status: int, message: str, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    code = status if code is None else code
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Tokenizer(ChatTokenizer, Protocol):
    def encode(self, text: str) -> list[int]: ...


# --- requests: OpenAI -> SGLang-native ---------------------------------------------------------


def _bad(message: str) -> OpenAIError:
    return OpenAIError(400, message)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _token_list(v: object) -> bool:
    return isinstance(v, list) and all(is_token(t) for t in v)


# OpenAI fields that would change the answer's shape or meaning and that the router does not
# implement: refused with a clear 400 rather than silently ignored.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "logprobs": lambda v: v is not None and v is not False,
    "top_logprobs": lambda v: v is not None,
    "tools": lambda v: bool(v),
    "functions": lambda v: bool(v),
    "echo": lambda v: bool(v),
    "suffix": lambda v: bool(v),
    "best_of": lambda v: v not in (None, 1),
    "audio": lambda v: v is not None,
    "prediction": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "response_format": lambda v: (
        v is not None and not (isinstance(v, dict) and v.get("type") == "text")
    ),
}
# OpenAI sampling fields and SGLang extensions -> (SGLang sampling_params name, type check).
_SAMPLING: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "temperature": ("temperature", _is_number, "a number"),
    "top_p": ("top_p", _is_number, "a number"),
    "frequency_penalty": ("frequency_penalty", _is_number, "a number"),
    "presence_penalty": ("presence_penalty", _is_number, "a number"),
    "seed": ("sampling_seed", _is_int, "an integer"),
    "logit_bias": ("logit_bias", lambda v: isinstance(v, dict), "an object"),
    # Extensions SGLang's own OpenAI server accepts too.
    "top_k": ("top_k", _is_int, "an integer"),
    "min_p": ("min_p", _is_number, "a number"),
    "repetition_penalty": ("repetition_penalty", _is_number, "a number"),
    "min_tokens": ("min_new_tokens", _is_int, "an integer"),
    "ignore_eos": ("ignore_eos", lambda v: isinstance(v, bool), "true or false"),
    "stop_token_ids": ("stop_token_ids", _token_list, "a list of token ids"),
    "skip_special_tokens": ("skip_special_tokens", lambda v: isinstance(v, bool), "true or false"),
}


_OPENAI_NAMES = {f"sampling_params.{native}": name for name, (native, _, _) in _SAMPLING.items()}


def _openai_field(native: str, body: dict[str, Any], prompt: str) -> str:
    """The OpenAI request's name for a field of the native body it became."""
    if native == "sampling_params.max_new_tokens":
        given = body.get("max_completion_tokens") is not None
        return "max_completion_tokens" if given else "max_tokens"
    if native == "input_ids":
        return prompt
    if native == "sampling_params.stop":
        return "stop"
    for key, name in _OPENAI_NAMES.items():  # logit_bias['5'] -> logit_bias['5']
        if native == key or native.startswith(f"{key}["):
            return name + native[len(key) :]
    return native


def _sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    for name, used in _UNSUPPORTED.items():
        if used(body.get(name)):
            raise _bad(f"{name} is not supported by the PDD router")
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("n must be 1: send n requests instead")
    # max_completion_tokens supersedes max_tokens (OpenAI); absent: up to the context length,
    # as SGLang's own OpenAI server does.
    max_tokens = body.get("max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body.get("max_tokens"), "max_tokens"
    if max_tokens is not None and not (_is_int(max_tokens) and max_tokens >= 1):
        raise _bad(f"{name} must be a positive integer, got {max_tokens!r}")
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    for field_name, (sglang_name, ok, what) in _SAMPLING.items():
        value = body.get(field_name)
        if value is None:
            continue
        if not ok(value):
            raise _bad(f"{field_name} must be {what}, got {value!r}")
        params[sglang_name] = value
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop] if stop else None
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop must be a string or a list of non-empty strings")
        if stop:
            params["stop"] = stop
    return params


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string role")
        content = msg.get("content")
        if isinstance(content, list):
            # Text parts flattened for the template, as SGLang does for string-content templates.
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}]: only text content parts are supported")
                texts.append(part["text"])
            content = " ".join(texts)
        elif content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts")
        clean = {k: v for k, v in msg.items() if v is not None}
        if content is not None:
            clean["content"] = content
        out.append(clean)
    return out


def _prompt_ids(prompt: object, tokenizer: Tokenizer) -> list[int]:
    batch = "batch requests are not supported: send one prompt per request"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one is one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt must not be empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise _bad("prompt must not be empty")
        if all(isinstance(p, (str, list)) for p in prompt):
            raise _bad(batch)
        if _token_list(prompt):
            return list(prompt)
    if prompt is None:
        raise _bad("prompt is required: a string or a list of token ids")
    raise _bad("prompt must be a string or a list of non-negative token ids")


@dataclass(frozen=True)
class OpenAIRequest:
    """One translated request: what goes to the servers, and how to shape the answer."""

    generate: GenerateRequest
    kind: str  # CHAT or COMPLETION
    model: str
    prompt_tokens: int
    include_usage: bool
    # Called with the answer's text (as the client got it) and its output ids, once served.
    on_answer: Callable[[str, object], None] | None = None

    def formatter(self) -> OpenAIFormatter:
        return OpenAIFormatter(
            self.kind, self.model, self.prompt_tokens, self.include_usage, on_answer=self.on_answer
        )


@dataclass(frozen=True)
class ServedModel:
    """The one model this router serves, by name, with its tokenizer and prompt limit."""

    name: str
    max_prompt_tokens: int
    tokenizer: Tokenizer
    limits: Limits = Limits()
    created: int = field(default_factory=lambda: int(time.time()))
    # Earlier chat answers' generated ids, reused when a conversation comes back (chat_ids.py).
    chat_ids: ChatIds = field(default_factory=ChatIds)

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdd",
            "root": self.name,
            "max_model_len": self.max_prompt_tokens,
        }
        return {"object": "list", "data": [card]}

    def chat(self, body: object) -> OpenAIRequest:
        body = self._check(body)
        params = _sampling_params(body)  # before tokenizing: cheap checks first
        messages = _messages(body.get("messages"))
        try:
            text, ids = self.chat_ids.encode(self.tokenizer, messages)
        except TokenizerError as err:
            raise _bad(str(err)) from err
        except Exception as err:  # the template is user-supplied Jinja: any error is the input's
            raise _bad(f"the chat template cannot render these messages: {err}") from err
        request = self._request(body, ids, params, CHAT)
        remember = self.chat_ids.remember
        return replace(request, on_answer=lambda answer, out: remember(text, ids, answer, out))

    def completion(self, body: object) -> OpenAIRequest:
        body = self._check(body)
        params = _sampling_params(body)
        ids = _prompt_ids(body.get("prompt"), self.tokenizer)
        return self._request(body, ids, params, COMPLETION)

    def _check(self, body: object) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model must be a string")
        if model is not None and model != self.name:
            message = f"model '{model}' does not exist; this router serves '{self.name}'"
            raise OpenAIError(404, message, "model_not_found")
        return body

    def _request(
        self, body: dict[str, Any], ids: list[int], params: dict[str, Any], kind: str
    ) -> OpenAIRequest:
        if not ids:
            raise _bad("the prompt is empty after tokenization")
        if len(ids) > self.max_prompt_tokens:
            raise OpenAIError(
                400,
                f"the prompt has {len(ids)} tokens, more than this router's limit of "
                f"{self.max_prompt_tokens} (--max-prompt-tokens)",
                "context_length_exceeded",
            )
        stream = body.get("stream") or False
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise _bad("stream_options must be an object")
        include_usage = bool((options or {}).get("include_usage")) and stream is True
        native: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": params,
            "stream": stream,
        }
        for name in (PATH_FIELD, HOLD_FIELD):  # the router's own fields pass through
            if body.get(name) is not None:
                native[name] = body[name]
        try:
            parsed = parse_generate(native, self.limits)
        except BadRequest as err:
            # The same checks as /generate; the message names the field as the client sent it.
            param = _openai_field(err.field, body, "messages" if kind == CHAT else "prompt")
            raise OpenAIError(400, f"{param} {err.problem}", param=param) from err
        return OpenAIRequest(parsed, kind, self.name, len(ids), include_usage)


# --- answers: SGLang-native -> OpenAI ----------------------------------------------------------


def finish_reason(value: object) -> str | None:
    """SGLang's finish_reason ({"type": "length"}, {"type": "stop", "matched": ...}) as OpenAI's
    string; None for an abort (the caller turns it into an error)."""
    kind = value.get("type") if isinstance(value, dict) else value
    if kind == "abort":
        return None
    if kind in (None, "stop"):
        return "stop"
    return str(kind)


def abort_message(value: object) -> str | None:
    """The reason, if this finish_reason is an abort."""
    if isinstance(value, dict) and value.get("type") == "abort":
        return str(value.get("message") or "the request was aborted")
    return "the request was aborted" if value == "abort" else None


def text_delta(sent: str, text: object, final: bool) -> str:
    """What a cumulative `text` adds to what the client already has. Nothing when it does not
    extend it (a source switch that re-decoded differently): never garbage. A trailing U+FFFD is
    held back until the final chunk, since the next chunk may complete that character."""
    if not isinstance(text, str) or not text.startswith(sent):
        return ""
    end = len(text)
    if not final:
        while end > len(sent) and text[end - 1] == REPLACEMENT:
            end -= 1
    return text[len(sent) : end]


@dataclass
class OpenAIFormatter:
    """Shapes one request's SGLang-native answer (whole or streamed) as OpenAI's."""

    kind: str
    model: str
    prompt_tokens: int
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    id: str | None = None
    sent: str = ""  # the text the client has been sent
    started: bool = False
    final: dict[str, Any] | None = None  # the final chunk, once seen without failure
    failed: bool = False
    on_answer: Callable[[str, object], None] | None = None

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == CHAT else "text_completion"

    @property
    def _chunk_object(self) -> str:
        # OpenAI's streamed completions keep "text_completion"; chat chunks have their own.
        return "chat.completion.chunk" if self.kind == CHAT else "text_completion"

    def error(self, status: int, message: str) -> dict[str, Any]:
        return error_body(status, message)

    def failure(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The body of a 502 for a request that failed after output had begun."""
        meta = chunk.get("meta_info") or {}
        message = abort_message(meta.get("finish_reason")) or "the request failed"
        body = error_body(502, message)
        if "pdd" in meta:
            body["pdd"] = meta["pdd"]
        return body

    def whole(self, final: dict[str, Any]) -> dict[str, Any]:
        meta = final.get("meta_info") or {}
        reason = finish_reason(meta.get("finish_reason"))
        if reason is None:
            raise OpenAIError(502, abort_message(meta.get("finish_reason")) or "aborted")
        text = final["text"] if isinstance(final.get("text"), str) else ""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=reason)
        out = self._head(meta, self.object)
        out.update(choices=[choice], usage=self._usage(final))
        if "pdd" in meta:
            out["pdd"] = meta["pdd"]  # the path taken, who decoded, the handoff
        if self.on_answer is not None:
            self.on_answer(text, final.get("output_ids"))
        return out

    def stream_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        meta = chunk.get("meta_info") or {}
        events = []
        if self.kind == CHAT and not self.started:
            events.append(self._event(meta, {"role": "assistant", "content": ""}, None))
        self.started = True
        finish = meta.get("finish_reason")
        delta = text_delta(self.sent, chunk.get("text"), final=finish is not None)
        if delta:
            self.sent += delta
            events.append(self._event(meta, self._delta(delta), None))
        if finish is None:
            return events
        reason = finish_reason(finish)
        if reason is None:  # failed after output began: OpenAI clients raise on an error event
            self.failed = True
            events.append(self.failure(chunk))
            return events
        last = self._event(meta, {} if self.kind == CHAT else "", reason)
        if "pdd" in meta:
            last["pdd"] = meta["pdd"]
        events.append(last)
        self.final = chunk
        if self.on_answer is not None:
            self.on_answer(self.sent, chunk.get("output_ids"))
        return events

    def stream_end(self) -> list[dict[str, Any]]:
        if not self.include_usage or self.final is None or self.failed:
            return []
        event = self._head(self.final.get("meta_info") or {}, self._chunk_object)
        event.update(choices=[], usage=self._usage(self.final))
        return [event]

    def _delta(self, text: str) -> dict[str, Any] | str:
        return {"content": text} if self.kind == CHAT else text

    def _event(
        self, meta: dict[str, Any], delta: dict[str, Any] | str, reason: str | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, ("delta" if self.kind == CHAT else "text"): delta}
        event = self._head(meta, self._chunk_object)
        choice.update(logprobs=None, finish_reason=reason)
        event["choices"] = [choice]
        if self.include_usage:
            event["usage"] = None  # OpenAI: null on every chunk but the usage one
        return event

    def _head(self, meta: dict[str, Any], obj: str) -> dict[str, Any]:
        if self.id is None:
            # The router's rid, so a client's id leads to the router's logs and meta_info.pdd.
            rid = meta.get("id")
            prefix = "chatcmpl" if self.kind == CHAT else "cmpl"
            self.id = f"{prefix}-{rid if isinstance(rid, str) else uuid.uuid4().hex}"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _usage(self, final: dict[str, Any]) -> dict[str, int]:
        # The stitched output_ids are exactly what the client got; after a handoff MD's own
        # meta_info counts would include RLD's tokens in its prompt.
        ids = final.get("output_ids")
        meta = final.get("meta_info") or {}
        completion = len(ids) if isinstance(ids, list) else int(meta.get("completion_tokens") or 0)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
