"""Request validation for the OpenAI and llama.cpp APIs: JSON in, a `GenerationRequest` out.

Every problem raises `ApiError` naming the field, which the API turns into an OpenAI-style
`{"error": {...}}` body with a 4xx status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .model.tokenizer import Tokenizer
from .sampling import SamplingParams

MAX_N = 16
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 1024  # per stop string: up to this much text is held back while it may match
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # "chat", "completion" (OpenAI) or "llama" (/completion)
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    return_tokens: bool = False  # llama.cpp's /completion option: generated token ids too
    priority: int = 0  # higher is more important: parked last, restored first


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"'{param}': {message}", param=param)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {value}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {value}")
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"expected true or false, got {value!r}")
    return value


def _stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _bad("stop", "expected a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if any(len(s) > MAX_STOP_CHARS for s in value):
        raise _bad("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters")
    return tuple(s for s in value if s)


def _max_tokens(body: dict, names: tuple[str, ...], max_context: int) -> int | None:
    for name in names:
        if body.get(name) is not None:
            value = body[name]
            # llama.cpp: -1 is unlimited. 0 is refused: llama.cpp still generates one token
            # for it (its limit is checked after a token), and its older servers none
            if name == "n_predict" and type(value) is int and value == -1:
                return None
            return _integer(body, name, None, 1, max_context)
    return None


def sampling_params(body: dict, max_context: int, max_tokens_names: tuple[str, ...]
                    ) -> SamplingParams:
    seed = _integer(body, "seed", None, -1, 2**63 - 1)
    top_k = _integer(body, "top_k", 0, -1, 1 << 20)
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),  # 0: greedy (is_greedy)
        top_k=0 if top_k in (None, -1) else top_k,  # llama.cpp's -1: off
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=None if seed == -1 else seed,  # llama.cpp's -1: random
        max_tokens=_max_tokens(body, max_tokens_names, max_context),
        stop=_stops(body),
        ignore_eos=_boolean(body, "ignore_eos", False),
        n=int(_integer(body, "n", 1, 1, MAX_N)),
    )


INT32 = (-(2**31), 2**31 - 1)


def _priority(body: dict) -> int:
    return int(_integer(body, "priority", 0, *INT32))


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options", "expected an object")
    return _boolean(options, "include_usage", False)


def _message_text(message: dict, index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise _bad(f"messages[{index}].content",
                           "only text parts ({'type': 'text', 'text': ...}) are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{index}].content", "expected a string or a list of text parts")


def chat_messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "expected an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"unknown role {role!r}")
        cleaned.append({"role": "system" if role == "developer" else role,
                        "content": _message_text(message, i)})
    return cleaned


def _prompt_ids(body: dict, tokenizer: Tokenizer, name: str = "prompt") -> list[int]:
    """A raw prompt's ids. Special-token texts in it become their ids, as llama.cpp parses them
    in /completion prompts: a raw prompt is the caller's whole model input, template included."""
    prompt = body.get(name)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise _bad(name, f"token ids must be in [0, {tokenizer.vocab_size})")
        ids = list(prompt)
    else:
        raise _bad(name, "expected a string, a one-element list of strings, or token ids")
    if not ids:
        raise _bad(name, "the prompt is empty")
    return ids


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "expected a string")
    return model


def parse_chat(body: dict, tokenizer: Tokenizer, max_context: int) -> GenerationRequest:
    messages = chat_messages(body)
    try:  # special-token texts in the messages stay text: only the template's markers are special
        prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    except Exception as exc:  # the model's own template rejected the conversation
        raise _bad("messages", f"the chat template rejected the messages: {exc}") from exc
    return GenerationRequest(
        kind="chat",
        prompt_ids=prompt_ids,
        params=sampling_params(body, max_context, ("max_completion_tokens", "max_tokens")),
        stream=_boolean(body, "stream", False),
        include_usage=_include_usage(body),
        model=_model(body),
        priority=_priority(body),
    )


def parse_completion(body: dict, tokenizer: Tokenizer, max_context: int) -> GenerationRequest:
    return GenerationRequest(
        kind="completion",
        prompt_ids=_prompt_ids(body, tokenizer),
        params=sampling_params(body, max_context, ("max_tokens",)),
        stream=_boolean(body, "stream", False),
        include_usage=_include_usage(body),
        model=_model(body),
        priority=_priority(body),
    )


def parse_llama_completion(body: dict, tokenizer: Tokenizer, max_context: int
                           ) -> GenerationRequest:
    params = sampling_params(body, max_context, ("n_predict", "max_tokens"))
    if params.n != 1:
        raise _bad("n", "/completion generates one sequence; use /v1/completions for n > 1")
    return GenerationRequest(
        kind="llama",
        prompt_ids=_prompt_ids(body, tokenizer),
        params=params,
        stream=_boolean(body, "stream", False),
        include_usage=False,
        model=_model(body),
        return_tokens=_boolean(body, "return_tokens", False),
        priority=_priority(body),
    )
