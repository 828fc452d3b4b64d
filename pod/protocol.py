"""Request validation for the OpenAI and llama.cpp APIs: JSON in, a `GenerationRequest` out.

Every problem raises `ApiError` naming the field, which the API turns into an OpenAI-style
`{"error": {...}}` body with a 4xx status.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import Any

from . import tools
from .api_fields import (
    API_FIELDS,
    COMMON_MAX_TOKENS,
    NO_LIMIT,
    UNLIMITED_AT_NO_LIMIT,
    UNSUPPORTED,
)
from .generation_defaults import GenerationDefaults
from .grammar import Grammar
from .model.tokenizer import Tokenizer
from .request_errors import MAX_SHOWN, ApiError, clip, shown
from .request_errors import bad_field as _bad
from .sampling import SamplingParams
from .structured_fields import compiled, structured_output, tool_plan

log = logging.getLogger("kvpark.protocol")

MAX_N = 16
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 1024  # per stop string: up to this much text is held back while it may match
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
# No tokenizer packs more characters than this into a token on average, so a prompt longer than
# 32 x the context can never fit: it is refused before the chat template and the tokenizer run.
CHARS_PER_TOKEN = 32
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
MAX_N_PROBS = 100  # llama.cpp's n_probs
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range is -2..2
# multiplicative penalties: far outside this a logit divided by one overflows float32
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


@dataclass(frozen=True)
class InputLimits:
    max_context: int  # tokens one request can hold
    max_messages: int
    max_prompt_chars: int  # characters of prompt text (all messages' content together)

    @classmethod
    def of(cls, max_context: int, max_messages: int, max_prompt_chars: int = 0) -> InputLimits:
        """`max_prompt_chars` 0: what the context could ever hold."""
        return cls(max_context, max_messages, max_prompt_chars or CHARS_PER_TOKEN * max_context)


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
    grammar: Grammar | None = None  # the output must match it (compiled by the parser)
    tools: tools.ToolPlan | None = None  # set when the output may be a tool call
    echo: str | None = None  # completions' `echo`: the prompt as text, put before the output
    show_prompt_logprobs: bool = False  # vLLM's `prompt_logprobs` field asked for them
    return_progress: bool = False  # llama.cpp's: a stream reports the prompt's progress
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name token ids


# ---- the body -------------------------------------------------------------------------------

# Where a lone surrogate can come from: a \uD800-\uDFFF escape, or its UTF-8 bytes (json.loads
# decodes bytes with surrogatepass). Only a body that matches is walked.
_SURROGATE_HINT = re.compile(rb"\\[uU][dD][89a-fA-F]|\xed[\xa0-\xbf]")


def decode_body(raw: bytes) -> dict[str, Any]:
    """JSON bytes -> the request object, or a 400 naming what is wrong. CPU-bound on a large
    body: call it off the event loop."""
    if not raw.strip():
        raise ApiError(400, "the body is empty; expected a JSON object", param="body")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: it nests too deeply",
                       param="body") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", param="body") from None
    except ValueError:  # Python refuses integers past 4300 digits
        raise ApiError(400, "the body is not valid JSON: a number has too many digits",
                       param="body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", param="body")
    if _SURROGATE_HINT.search(raw):
        where = _lone_surrogate(body)
        if where is not None:
            raise _bad(where, "holds a lone UTF-16 surrogate (not valid Unicode text)")
    return body


def _lone_surrogate(value: Any) -> str | None:
    """The path of the first string (or key) that is not valid Unicode; None if all are."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:  # iterative: the nesting can be as deep as json allows
        item, where = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            return where or "body"
        if isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        elif isinstance(item, dict):
            for key, v in item.items():
                if not _is_text(key):
                    return where or "body"
                stack.append((v, f"{where}.{clip(key, 40)}" if where else clip(key, 40)))
    return None


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# ---- fields ---------------------------------------------------------------------------------

MAX_LOGGED_FIELDS = 1000  # bounds what a client inventing field names can make us remember
_logged_fields: set[str] = set()
_logged_lock = threading.Lock()


def check_fields(body: dict, kind: str) -> None:
    """400 for a field this server does not implement; unknown fields are ignored, and each
    name is logged once (as vLLM does)."""
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == o and type(value) is type(o) for o in off):
            raise ApiError(400, f"'{name}' is not supported by this server (got "
                           f"{shown(value)}); leave it out", param=name)
    unknown = body.keys() - API_FIELDS[kind].known - UNSUPPORTED.keys()
    if not unknown:
        return
    with _logged_lock:
        new = {clip(name, 40) for name in unknown} - _logged_fields
        new = set(sorted(new)[:max(0, MAX_LOGGED_FIELDS - len(_logged_fields))])
        _logged_fields.update(new)
    if new:
        log.warning("The following fields were present in the request but ignored: {%s}",
                    ", ".join(ascii(name) for name in sorted(new)))


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"expected a number, got {shown(value)}")
    if not (isinstance(value, int) or math.isfinite(value)) or not lo <= value <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {shown(value)}")
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {shown(value)}")
    if not lo <= value <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {shown(value)}")
    return value


def boolean_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"expected true or false, got {shown(value)}")
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
            if name in UNLIMITED_AT_NO_LIMIT and type(value) is int and value == NO_LIMIT:
                return None
            return _integer(body, name, None, 1, max_context)
    return None


def sampling_params(body: dict, max_context: int, max_tokens_names: tuple[str, ...],
                    tokenizer: Tokenizer | None = None, kind: str = "completion"
                    ) -> SamplingParams:
    seed = _integer(body, "seed", None, -1, 2**63 - 1)
    top_k = _integer(body, "top_k", 0, -1, 1 << 20)
    max_tokens = _max_tokens(body, max_tokens_names, max_context)
    min_tokens = int(_integer(body, "min_tokens", 0, 0, max_tokens or max_context))
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),  # 0: greedy (is_greedy)
        top_k=0 if top_k in (None, -1) else top_k,  # llama.cpp's -1: off
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=None if seed == -1 else seed,  # llama.cpp's -1: random
        max_tokens=max_tokens,
        stop=_stops(body),
        ignore_eos=boolean_field(body, "ignore_eos", False),
        n=int(_integer(body, "n", 1, 1, MAX_N)),
        presence_penalty=_number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=_positive(body, "repetition_penalty"),
        repeat_penalty=_positive(body, "repeat_penalty"),
        repeat_last_n=int(_integer(body, "repeat_last_n", 64, -1, max_context)),
        logit_bias=_logit_bias(body, tokenizer),
        min_tokens=min_tokens,
        # vLLM: min_tokens holds back every end-of-generation id
        eos_ids=tokenizer.eos_token_ids if tokenizer is not None and min_tokens else frozenset(),
        logprobs=_logprobs(body, kind),
        prompt_logprobs=_prompt_logprobs(body, kind),
        post_sampling_probs=kind == "llama" and boolean_field(body, "post_sampling_probs", False),
    )


def _positive(body: dict, name: str) -> float:
    """A multiplicative penalty: 1 is off (vLLM takes any value above 0)."""
    return _number(body, name, 1.0, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)


def _logit_bias(body: dict, tokenizer: Tokenizer | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}, or llama.cpp's [[id, bias], ...]; bias -100..100, or
    false (llama.cpp: never this token). As llama.cpp, a key that is text, not an id, stands
    for each token the text is made of."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(p[0], p[1]) for p in value]
    else:
        raise _bad("logit_bias", "expected an object of token id -> bias, or a list of "
                   "[token id, bias] pairs")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
    entries = [(token, bias) for key, bias in pairs for token in _bias_tokens(key, tokenizer)]
    if len(entries) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"the texts make more than {MAX_LOGIT_BIAS} tokens")
    vocab_size = tokenizer.vocab_size if tokenizer is not None else 1 << 31
    return tuple(_bias_entry(token, bias, vocab_size) for token, bias in entries)


def _bias_tokens(key: Any, tokenizer: Tokenizer | None) -> list[Any]:
    """A key's token ids: itself, or the tokens of a text key (left as is when it is neither:
    `_bias_entry` names it)."""
    if (isinstance(key, str) and key and not re.fullmatch(r"-?[0-9]+", key)
            and tokenizer is not None and len(key) <= MAX_STOP_CHARS):
        return tokenizer.encode(key, False) or [key]
    return [key]


def _bias_entry(key: Any, bias: Any, vocab_size: int) -> tuple[int, float]:
    token = key if isinstance(key, int) and not isinstance(key, bool) else None
    if isinstance(key, str) and re.fullmatch(r"[0-9]{1,10}", key):
        token = int(key)
    if token is None or not 0 <= token < vocab_size:
        raise _bad("logit_bias", f"token ids must be integers in [0, {vocab_size}), got "
                   f"{shown(key)}")
    if bias is False:
        return token, float("-inf")
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
            -100 <= bias <= 100):
        raise _bad("logit_bias", f"a bias must be a number in [-100, 100] (or false), got "
                   f"{shown(bias)} for token {token}")
    return token, float(bias)


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token (None: no logprobs). Chat: `logprobs` true plus
    `top_logprobs`; completions: `logprobs` k; llama.cpp: `n_probs` k (0: none)."""
    if kind == "chat":
        wanted = boolean_field(body, "logprobs", False)
        top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
        if top and not wanted:
            raise _bad("top_logprobs", "needs 'logprobs': true")
        return (top or 0) if wanted else None
    if kind == "completion":
        return _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    return _integer(body, "n_probs", 0, 0, MAX_N_PROBS) or None


def _prompt_logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per prompt token (None: no prompt logprobs): vLLM's
    `prompt_logprobs` k, or completions' `echo` with `logprobs` (the prompt's rows are part of
    the echoed logprobs), whichever asks for more."""
    if kind == "llama":
        return None
    asked = _integer(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if kind == "completion" and boolean_field(body, "echo", False):
        echoed = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
        if echoed is not None:
            return max(asked or 0, echoed)
    return asked


def _echo_max_tokens(body: dict) -> dict:
    """`echo` with `max_tokens: 0` scores a prompt and generates nothing (OpenAI's legacy
    completions, lm-evaluation-harness): the body without the 0, for the parser's checks."""
    name = API_FIELDS["completion"].quoted_max_tokens
    value = body.get(name)
    if boolean_field(body, "echo", False) and type(value) is int and value == 0:
        return {k: v for k, v in body.items() if k != name}
    return body


def _echo_text(body: dict, prompt: Any, prompt_ids: list[int], tokenizer: Tokenizer
               ) -> str | None:
    """The prompt as the echo shows it: a text prompt as sent, token ids decoded."""
    if not boolean_field(body, "echo", False):
        return None
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids, False)


INT32 = (-(2**31), 2**31 - 1)


def _priority(body: dict) -> int:
    return int(_integer(body, "priority", 0, *INT32))


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options", "expected an object")
    # OpenAI and vLLM refuse it, so a client that thinks it asked for a streamed usage chunk
    # learns it gets none; null or {} asks for nothing (vLLM's rule)
    if options and body.get("stream") is not True:
        raise _bad("stream_options", "stream options can only be defined when `stream=True`")
    return boolean_field(options, "include_usage", False)


def _continuous_usage(body: dict) -> bool:
    """vLLM's `stream_options.continuous_usage_stats`: usage in every chunk (with
    `include_usage`, as vLLM reads it)."""
    options = body.get("stream_options")
    if not isinstance(options, dict):
        return False
    return _include_usage(body) and boolean_field(options, "continuous_usage_stats", False)


def _return_progress(body: dict) -> bool:
    return boolean_field(body, "return_progress", False)


def _message_text(message: dict, index: int, role: str) -> str | None:
    if message.get("function_call"):  # the legacy form of tool_calls
        raise ApiError(400, f"'messages[{index}].function_call' is not supported by this "
                       "server; send tool_calls", param=f"messages[{index}].function_call")
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        return None  # OpenAI: only an assistant message with tool calls may omit it
    if content is None:
        raise _bad(f"messages[{index}].content",
                   f"required for a {role} message (a string or a list of text parts)")
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


def _tool_calls(message: dict, index: int, role: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked: arguments must be a JSON object's text."""
    calls = message.get("tool_calls")
    if not calls:
        return []
    where = f"messages[{index}].tool_calls"
    if role != "assistant" or not isinstance(calls, list):
        raise _bad(where, "only an assistant message has tool_calls (a list)")
    cleaned = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{where}[{i}]", "expected {'id', 'type': 'function', 'function': "
                       "{'name', 'arguments'}}")
        arguments = function.get("arguments", "{}")
        try:  # some clients send the object itself
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise _bad(f"{where}[{i}].function.arguments", "expected a JSON object's text")
        call_id = call.get("id")
        cleaned.append({"id": call_id if isinstance(call_id, str) else f"call_{index}_{i}",
                        "type": "function", "function": {"name": function["name"],
                                                         "arguments": json.dumps(parsed)}})
    return cleaned


def chat_messages(body: dict, limits: InputLimits) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty list of messages")
    if len(messages) > limits.max_messages:
        raise _bad("messages", f"{len(messages)} messages; at most {limits.max_messages} are "
                   "accepted (--max-messages)")
    cleaned, num_chars = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "expected an object with 'role' and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"messages[{i}].role", f"unknown role {shown(role)}")
        text = _message_text(message, i, role)
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": text}
        calls = _tool_calls(message, i, role)
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise _bad(f"messages[{i}].tool_call_id", "required for a tool message")
            entry["tool_call_id"] = call_id
        num_chars += len(text or "") + sum(len(c["function"]["arguments"]) for c in calls)
        _check_chars("messages", num_chars, limits)
        cleaned.append(entry)
    return cleaned


def _check_chars(param: str, num_chars: int, limits: InputLimits) -> None:
    """Refused before the template and the tokenizer see it: it could never fit anyway."""
    if num_chars > limits.max_prompt_chars:
        raise _bad(param, f"more than {limits.max_prompt_chars} characters of prompt text, "
                   f"more than a {limits.max_context}-token context can hold "
                   "(--max-prompt-chars)")


def _prompt_ids(body: dict, tokenizer: Tokenizer, limits: InputLimits,
                name: str = "prompt") -> list[int]:
    """A raw prompt's ids. Special-token texts in it become their ids, as llama.cpp parses them
    in /completion prompts: a raw prompt is the caller's whole model input, template included."""
    prompt = body.get(name)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_chars(name, len(prompt), limits)
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


@dataclass(frozen=True)
class ChatTurn:
    """How the conversation is rendered: the messages, whether the template opens the
    assistant's turn, and the start of that turn the output continues (assistant prefill)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    prefill: str = ""


def chat_turn(body: dict, messages: list[dict[str, Any]]) -> ChatTurn:
    """vLLM's `add_generation_prompt` / `continue_final_message`, and llama.cpp's prefill: a
    conversation ending in an assistant message, with neither field sent, continues it."""
    continues = boolean_field(body, "continue_final_message", False)
    asked = body.get("add_generation_prompt")
    generation_prompt = boolean_field(body, "add_generation_prompt", True)
    last = messages[-1]
    ends_in_reply = last["role"] == "assistant" and not last.get("tool_calls")
    if continues and asked is True:  # vLLM's rule and words
        raise _bad("continue_final_message", "Cannot set both `continue_final_message` and "
                   "`add_generation_prompt` to True.")
    if continues and not ends_in_reply:
        raise _bad("continue_final_message", "needs the last message to be an assistant "
                   "message (without tool calls) to continue")
    if not (continues or (asked is None and ends_in_reply)):
        return ChatTurn(messages, generation_prompt)
    if len(messages) > 1 and messages[-2]["role"] == "assistant":  # llama.cpp's rule and words
        raise _bad("messages", "Cannot have 2 or more assistant messages at the end of the list.")
    if body.get("tools"):
        raise _bad("messages", "an assistant prefill (a last assistant message to continue) "
                   "cannot be combined with tools")
    return ChatTurn(messages[:-1], True, last.get("content") or "")


def _template_input(turn: ChatTurn, plan: tools.ToolPlan | None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages the template sees (tool history in the generic format) and the tools."""
    messages = turn.messages
    if plan is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = tools.polyfill_messages(messages, plan)
    offered = [t.as_openai() for t in plan.callable_tools()] if plan and plan.can_call else None
    return messages, offered


def _chat_prompt(turn: ChatTurn, tokenizer: Tokenizer,
                 plan: tools.ToolPlan | None = None) -> list[int]:
    messages, offered = _template_input(turn, plan)
    try:  # special-token texts in the messages stay text: only the template's markers are special
        return tokenizer.encode_chat(messages, add_generation_prompt=turn.add_generation_prompt,
                                     tools=offered, prefill=turn.prefill)
    except Exception as exc:  # the model's own template rejected the conversation
        raise _template_rejected(exc) from exc


def _template_rejected(exc: Exception) -> ApiError:
    return _bad("messages", f"the chat template rejected the messages: "
                f"{clip(str(exc), 2 * MAX_SHOWN)}")


def _chat_input(body: dict, limits: InputLimits) -> tuple[ChatTurn, tools.ToolPlan | None]:
    return chat_turn(body, chat_messages(body, limits)), tool_plan(body, None)


def chat_prompt_ids(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> list[int]:
    """vLLM's /tokenize with `messages`: the ids a chat request with this body would run."""
    turn, plan = _chat_input(body, limits)
    return _chat_prompt(turn, tokenizer, plan)


def render_chat(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> str:
    """llama.cpp's /apply-template: the text a chat request with this body would run."""
    turn, plan = _chat_input(body, limits)
    messages, offered = _template_input(turn, plan)
    extra = {"tools": offered} if offered else {}
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=turn.add_generation_prompt, **extra)
    except Exception as exc:
        raise _template_rejected(exc) from exc
    return text + turn.prefill


# The parsers template and tokenise: CPU-bound on a long prompt, so they run off the event loop.
# Cheap checks come first, so a bad request costs no tokenising.

def parse_chat(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> GenerationRequest:
    check_fields(body, "chat")
    messages = chat_messages(body, limits)
    params = sampling_params(body, limits.max_context, API_FIELDS["chat"].max_tokens,
                             tokenizer, "chat")
    grammar = structured_output(body, tokenizer)
    plan = tool_plan(body, grammar)
    if plan is not None and plan.can_call:  # the output is a call or a wrapped answer
        grammar = compiled("tools", plan.grammar(), tokenizer)
    return GenerationRequest(
        kind="chat",
        params=params,
        stream=boolean_field(body, "stream", False),
        include_usage=_include_usage(body),
        continuous_usage=_continuous_usage(body),
        tokens_as_ids=boolean_field(body, "return_tokens_as_token_ids", False),
        return_progress=_return_progress(body),
        model=_model(body),
        priority=_priority(body),
        prompt_ids=_chat_prompt(chat_turn(body, messages), tokenizer, plan),
        grammar=grammar,
        tools=plan if plan is not None and plan.can_call else None,
        show_prompt_logprobs=body.get("prompt_logprobs") is not None,
    )


def _completion_params(body: dict, tokenizer: Tokenizer, limits: InputLimits
                       ) -> SamplingParams:
    checked = _echo_max_tokens(body)
    params = sampling_params(checked, limits.max_context, API_FIELDS["completion"].max_tokens,
                             tokenizer)
    return params if checked is body else dataclasses.replace(params, max_tokens=0)


def parse_completion(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> GenerationRequest:
    check_fields(body, "completion")
    params = _completion_params(body, tokenizer, limits)
    prompt_ids = _prompt_ids(body, tokenizer, limits)
    return GenerationRequest(
        kind="completion",
        params=params,
        stream=boolean_field(body, "stream", False),
        include_usage=_include_usage(body),
        continuous_usage=_continuous_usage(body),
        tokens_as_ids=boolean_field(body, "return_tokens_as_token_ids", False),
        return_progress=_return_progress(body),
        model=_model(body),
        priority=_priority(body),
        prompt_ids=prompt_ids,
        grammar=structured_output(body, tokenizer),
        echo=_echo_text(body, body.get("prompt"), prompt_ids, tokenizer),
        show_prompt_logprobs=body.get("prompt_logprobs") is not None,
    )


def parse_llama_completion(body: dict, tokenizer: Tokenizer, limits: InputLimits
                           ) -> GenerationRequest:
    check_fields(body, "llama")
    params = sampling_params(body, limits.max_context, API_FIELDS["llama"].max_tokens,
                             tokenizer, "llama")
    if params.n != 1:
        raise _bad("n", "/completion generates one sequence; use /v1/completions for n > 1")
    return GenerationRequest(
        kind="llama",
        params=params,
        stream=boolean_field(body, "stream", False),
        include_usage=False,
        return_progress=_return_progress(body),
        model=_model(body),
        return_tokens=boolean_field(body, "return_tokens", False),
        priority=_priority(body),
        prompt_ids=_prompt_ids(body, tokenizer, limits),
        grammar=structured_output(body, tokenizer),
    )


MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request (vLLM has no cap; a bound)
MAX_BATCH_CHOICES = 256  # prompts x n: what one request may put in the queue


def _batch_prompts(body: dict) -> list[Any] | None:
    """OpenAI's batched `prompt`: a list of strings or of token-id lists (None: one prompt)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt):
        return prompt if len(prompt) > 1 else None
    if not all(isinstance(p, list) for p in prompt):
        return None  # token ids, or a mix the single-prompt parser names
    return prompt


def parse_completions(body: dict, tokenizer: Tokenizer, limits: InputLimits
                      ) -> list[GenerationRequest]:
    """/v1/completions: one request per prompt; each is checked and sized like a lone prompt,
    and errors name `prompt[i]`."""
    prompts = _batch_prompts(body)
    if prompts is None:
        return [parse_completion(body, tokenizer, limits)]
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise _bad("prompt", f"{len(prompts)} prompts; at most {MAX_BATCH_PROMPTS} are accepted "
                   "in one request")
    check_fields(body, "completion")
    n = _integer(body, "n", 1, 1, MAX_N) or 1
    if len(prompts) * n > MAX_BATCH_CHOICES:
        raise _bad("n", f"{len(prompts)} prompts x n={n} choices; at most {MAX_BATCH_CHOICES} "
                   "in one request")
    common = dict(kind="completion", params=_completion_params(body, tokenizer, limits),
                  show_prompt_logprobs=body.get("prompt_logprobs") is not None,
                  stream=boolean_field(body, "stream", False), include_usage=_include_usage(body),
                  continuous_usage=_continuous_usage(body),
                  tokens_as_ids=boolean_field(body, "return_tokens_as_token_ids", False),
                  return_progress=_return_progress(body),
                  model=_model(body), priority=_priority(body),
                  grammar=structured_output(body, tokenizer))
    requests = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            raise _bad(f"prompt[{i}]", "expected a string or a list of token ids")
        name = f"prompt[{i}]"
        prompt_ids = _prompt_ids({name: prompt}, tokenizer, limits, name)
        requests.append(GenerationRequest(
            prompt_ids=prompt_ids, echo=_echo_text(body, prompt, prompt_ids, tokenizer),
            **common))
    return requests


PARSERS = {"chat": parse_chat, "completion": parse_completion, "llama": parse_llama_completion}
NO_DEFAULTS = GenerationDefaults()


def parse_request(kind: str, raw: bytes, tokenizer: Tokenizer, limits: InputLimits,
                  defaults: GenerationDefaults = NO_DEFAULTS) -> GenerationRequest:
    """Body bytes -> a `GenerationRequest` for route `kind`, or an `ApiError`."""
    body = defaults.under(decode_body(raw), limits.max_context)
    return PARSERS[kind](body, tokenizer, limits)


def parse_requests(kind: str, raw: bytes, tokenizer: Tokenizer, limits: InputLimits,
                   defaults: GenerationDefaults = NO_DEFAULTS) -> list[GenerationRequest]:
    """As `parse_request`; /v1/completions may carry several prompts: one request each."""
    if kind == "completion":
        body = defaults.under(decode_body(raw), limits.max_context)
        return parse_completions(body, tokenizer, limits)
    return [parse_request(kind, raw, tokenizer, limits, defaults)]


def check_defaults(defaults: GenerationDefaults) -> None:
    """The server-wide defaults through the request fields' own checks, before the model loads:
    a bad one is a start-up error naming where it came from, not a 400 on every request."""
    unbounded = 1 << 31  # max_tokens is clamped to the context per request
    try:
        sampling_params(defaults.under({}, unbounded), unbounded, (COMMON_MAX_TOKENS,))
    except ApiError as exc:
        source = defaults.sources.get(exc.param or "", "a default")
        raise ValueError(f"sampling default from {source}: {exc.message}") from None
