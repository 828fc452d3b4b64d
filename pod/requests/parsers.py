"""Parsing a generation request, one parser per endpoint (chat, /v1/completions with its
batched prompts, llama.cpp's /completion): body bytes in, a `GenerationRequest` out.

Each parser checks the body's fields against its API's row of `fields`, then reads the
sampling fields (`sampling_fields`), the prompt (`prompts`), the constrained output
(`structured_fields`) and how the answer is delivered (stream, usage, echo: here). Every problem
raises `ApiError` naming the field, which the API turns into an OpenAI-style `{"error": {...}}`
body with a 4xx status.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ..model.tokenizer import Tokenizer
from ..sampling.grammar import Grammar
from ..sampling.reasoning import ThinkingRule
from ..sampling.reasoning_gate import ThinkingGate
from ..sampling.sampler import SamplingParams
from . import reasoning_fields, responses_api, tools
from .anthropic import to_chat_body
from .chat_messages import chat_messages
from .errors import ApiError, clip, shown
from .errors import bad_field as _bad
from .field_values import boolean_field, ranged_field
from .fields import (
    API_FIELDS,
    COMMON_MAX_TOKENS,
    HARMLESS,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    UNSUPPORTED,
)
from .generation_defaults import GenerationDefaults
from .input_limits import InputLimits
from .json_body import decode_body
from .prompts import chat_prompt, chat_turn, raw_prompt_ids
from .sampling_fields import sampling_params
from .structured_fields import compiled, structured_output, tool_plan

log = logging.getLogger("kvpark.protocol")


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # chat, completion (OpenAI), llama (/completion), messages (Anthropic), responses
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
    # the Responses API: the conversation as chat messages (kept with the answer when `store`)
    # and the request's fields its response repeats
    conversation: tuple[dict[str, Any], ...] = ()
    store: bool = False
    echoed: tuple[tuple[str, Any], ...] = ()
    # a reasoning model's think block: how its text is returned, its budget and grammar's wait
    thinking: ThinkingRule | None = None
    thinking_gate: ThinkingGate | None = None


MAX_LOGGED_FIELDS = 1000  # bounds what a client inventing field names can make us remember
_logged_fields: set[str] = set()
_logged_lock = threading.Lock()


def check_fields(body: dict, kind: str) -> None:
    """400 for a field this server does not implement or a harmless one of the wrong type;
    unknown fields are ignored, and each name is logged once (as vLLM does)."""
    for name, off in UNSUPPORTED.items():
        value = body.get(name)
        if not any(value == o and type(value) is type(o) for o in off):
            raise ApiError(400, f"'{name}' is not supported by this server (got "
                           f"{shown(value)}); leave it out", param=name)
    for name, expected in HARMLESS.items():
        if body.get(name) is not None:
            check_harmless(name, body[name], expected)
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


def check_harmless(name: str, value: Any, expected: str) -> None:
    """A field without effect here, held to its type elsewhere (`fields.HARMLESS`)."""
    if expected == "metadata":
        check_metadata(value)
    elif expected == "object" and not isinstance(value, dict):
        raise _bad(name, f"expected an object, got {shown(value)}")
    elif expected == "boolean":
        boolean_field({name: value}, name, False)
    elif expected == "string" and not isinstance(value, str):
        raise _bad(name, f"expected a string, got {shown(value)}")


def check_metadata(value: Any) -> None:
    """OpenAI's `metadata`: a small object of string values."""
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _bad("metadata", "expected an object of string values")
    if len(value) > MAX_METADATA_PAIRS:
        raise _bad("metadata", f"at most {MAX_METADATA_PAIRS} pairs")
    if any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items()):
        raise _bad("metadata", f"keys of at most {MAX_METADATA_KEY} characters and values of "
                   f"at most {MAX_METADATA_VALUE}")


def _echo_max_tokens(body: dict) -> dict:
    """`echo` with `max_tokens: 0` scores a prompt and generates nothing (OpenAI's legacy
    completions, lm-evaluation-harness): the body without the 0, for the parser's checks."""
    name = API_FIELDS["completion"].quoted_limit
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


def _chat_echo(body: dict, messages: list[dict[str, Any]]) -> str | None:
    """vLLM's chat `echo`: a last assistant message's content comes back before the reply."""
    if not boolean_field(body, "echo", False) or messages[-1]["role"] != "assistant":
        return None
    return messages[-1].get("content") or ""


def _priority(body: dict) -> int:
    return int(ranged_field(body, "priority", 0))


def _stream_options(body: dict) -> dict | None:
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "expected an object")
    return options


def _include_usage(body: dict) -> bool:
    options = _stream_options(body)
    if options is None:
        return False
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


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", "expected a string")
    return model


# The parsers template and tokenise: CPU-bound on a long prompt, so they run off the event loop.
# Cheap checks come first, so a bad request costs no tokenising.

def _answer_options(body: dict) -> dict[str, Any]:
    """How an OpenAI route answers: streamed or not, with usage, token ids in the logprobs,
    the prompt's progress and logprobs; the model asked for; the request's priority. Read in
    this order, so the first bad field is the one named."""
    return dict(stream=boolean_field(body, "stream", False),
                include_usage=_include_usage(body),
                continuous_usage=_continuous_usage(body),
                tokens_as_ids=boolean_field(body, "return_tokens_as_token_ids", False),
                return_progress=_return_progress(body),
                model=_model(body),
                priority=_priority(body),
                show_prompt_logprobs=body.get("prompt_logprobs") is not None)


def parse_chat(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> GenerationRequest:
    check_fields(body, "chat")
    messages = chat_messages(body, limits)
    params = sampling_params(body, limits.max_context, API_FIELDS["chat"].limit_names,
                             tokenizer, "chat")
    grammar = structured_output(body, tokenizer)
    plan = tool_plan(body, grammar)
    if plan is not None and plan.can_call:  # the output is a call or a wrapped answer
        grammar = compiled("tools", plan.grammar(), tokenizer)
    prompt_ids = chat_prompt(chat_turn(body, messages), tokenizer, plan, limits)
    return GenerationRequest(
        kind="chat",
        params=params,
        **_answer_options(body),
        prompt_ids=prompt_ids,
        grammar=grammar,
        tools=plan if plan is not None and plan.can_call else None,
        echo=_chat_echo(body, messages),
        **reasoning_fields.thinking(body, tokenizer, prompt_ids),
    )


def _completion_params(body: dict, tokenizer: Tokenizer, limits: InputLimits
                       ) -> SamplingParams:
    checked = _echo_max_tokens(body)
    params = sampling_params(checked, limits.max_context, API_FIELDS["completion"].limit_names,
                             tokenizer)
    return params if checked is body else dataclasses.replace(params, max_tokens=0)


def parse_completion(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> GenerationRequest:
    check_fields(body, "completion")
    params = _completion_params(body, tokenizer, limits)
    prompt_ids = raw_prompt_ids(body, tokenizer, limits)
    return GenerationRequest(
        kind="completion",
        params=params,
        **_answer_options(body),
        prompt_ids=prompt_ids,
        grammar=structured_output(body, tokenizer),
        echo=_echo_text(body, body.get("prompt"), prompt_ids, tokenizer),
    )


def parse_llama_completion(body: dict, tokenizer: Tokenizer, limits: InputLimits,
                           prompt_ids: list[int] | None = None) -> GenerationRequest:
    """`prompt_ids`: one prompt of several, read already (`body`'s prompt is not read)."""
    check_fields(body, "llama")
    params = sampling_params(body, limits.max_context, API_FIELDS["llama"].limit_names,
                             tokenizer, "llama")
    if params.n != 1:
        raise _bad("n", "/completion generates one sequence; use /v1/completions for n > 1")
    _stream_options(body)  # read by no llama.cpp route, typed as the OpenAI routes read it
    return GenerationRequest(
        kind="llama",
        params=params,
        stream=boolean_field(body, "stream", False),
        include_usage=False,
        return_progress=_return_progress(body),
        model=_model(body),
        return_tokens=boolean_field(body, "return_tokens", False),
        priority=_priority(body),
        prompt_ids=raw_prompt_ids(body, tokenizer, limits) if prompt_ids is None else prompt_ids,
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
    n = ranged_field(body, "n", 1) or 1
    if len(prompts) * n > MAX_BATCH_CHOICES:
        raise _bad("n", f"{len(prompts)} prompts x n={n} choices; at most {MAX_BATCH_CHOICES} "
                   "in one request")
    common = dict(kind="completion", params=_completion_params(body, tokenizer, limits),
                  **_answer_options(body), grammar=structured_output(body, tokenizer))
    return [GenerationRequest(prompt_ids=ids, echo=_echo_text(body, prompt, ids, tokenizer),
                              **common)
            for prompt, ids in zip(prompts, each_prompt_ids(prompts, tokenizer, limits))]


def each_prompt_ids(prompts: list[Any], tokenizer: Tokenizer, limits: InputLimits
                    ) -> list[list[int]]:
    """A batch's prompts as ids, each checked like a lone prompt; errors name `prompt[i]`."""
    ids = []
    for i, prompt in enumerate(prompts):
        name = f"prompt[{i}]"
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            raise _bad(name, "expected a string or a list of token ids")
        ids.append(raw_prompt_ids({name: prompt}, tokenizer, limits, name))
    return ids


def parse_llama_completions(body: dict, tokenizer: Tokenizer, limits: InputLimits
                            ) -> list[GenerationRequest]:
    """llama.cpp's /completion with several prompts (a list of strings or of token-id lists):
    one request each, answered as a list (a stream's chunks carry their `index`). A list mixing
    strings and token-id lists is several prompts too, as llama-server reads it."""
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and len(prompt) > 1 and all(
        isinstance(p, str | list) for p in prompt) else None
    if prompts is None:
        return [parse_llama_completion(body, tokenizer, limits)]
    if len(prompts) > MAX_BATCH_PROMPTS:
        raise _bad("prompt", f"{len(prompts)} prompts; at most {MAX_BATCH_PROMPTS} are accepted "
                   "in one request")
    ids = each_prompt_ids(prompts, tokenizer, limits)
    first = parse_llama_completion(body, tokenizer, limits, ids[0])  # the fields, read once
    return [dataclasses.replace(first, prompt_ids=prompt_ids) for prompt_ids in ids]


def parse_messages(body: dict, tokenizer: Tokenizer, limits: InputLimits,
                   defaults: GenerationDefaults) -> GenerationRequest:
    """Anthropic's Messages API through the chat parser (`anthropic.py` maps the fields; the
    server's defaults go under chat's names)."""
    request = parse_chat(defaults.under_chat(to_chat_body(body), limits.max_context),
                         tokenizer, limits)
    return dataclasses.replace(request, kind="messages", include_usage=False)


def parse_responses(body: dict, tokenizer: Tokenizer, limits: InputLimits,
                    lookup: responses_api.Lookup, defaults: GenerationDefaults
                    ) -> GenerationRequest:
    """OpenAI's Responses API through the chat parser (`responses_api.py` maps the fields)."""
    chat, conversation = responses_api.to_chat_body(body, lookup)
    request = parse_chat(defaults.under_chat(chat, limits.max_context), tokenizer, limits)
    store = boolean_field(body, "store", True)
    return dataclasses.replace(request, kind="responses", include_usage=False,
                               conversation=tuple(conversation), store=store,
                               echoed=responses_api.echoed(body))


def count_message_tokens(body: dict, tokenizer: Tokenizer, limits: InputLimits
                         ) -> dict[str, int]:
    """/v1/messages/count_tokens: the prompt's tokens, as /v1/messages would template them."""
    chat = to_chat_body(body, needs_max_tokens=False)
    return {"input_tokens": len(parse_chat(chat, tokenizer, limits).prompt_ids)}


PARSERS = {"chat": parse_chat, "completion": parse_completion, "llama": parse_llama_completion}
NO_DEFAULTS = GenerationDefaults()


def parse_request(kind: str, raw: bytes, tokenizer: Tokenizer, limits: InputLimits,
                  defaults: GenerationDefaults = NO_DEFAULTS) -> GenerationRequest:
    """Body bytes -> a `GenerationRequest` for route `kind`, or an `ApiError`."""
    body = decode_body(raw)
    body = (defaults.under_chat(body, limits.max_context) if kind == "chat"
            else defaults.under(body, limits.max_context))
    return PARSERS[kind](body, tokenizer, limits)


def parse_requests(kind: str, raw: bytes, tokenizer: Tokenizer, limits: InputLimits,
                   defaults: GenerationDefaults = NO_DEFAULTS,
                   lookup: responses_api.Lookup = lambda response_id: None
                   ) -> list[GenerationRequest]:
    """As `parse_request`; /v1/completions may carry several prompts: one request each;
    Anthropic's messages and OpenAI's responses are mapped onto chat (the latter continuing a
    stored conversation: `lookup`)."""
    if kind == "messages":
        return [parse_messages(decode_body(raw), tokenizer, limits, defaults)]
    if kind == "responses":
        return [parse_responses(decode_body(raw), tokenizer, limits, lookup, defaults)]
    if kind == "completion":
        body = defaults.under(decode_body(raw), limits.max_context)
        return parse_completions(body, tokenizer, limits)
    if kind == "llama":
        body = defaults.under(decode_body(raw), limits.max_context)
        return parse_llama_completions(body, tokenizer, limits)
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
    try:  # the reasoning flags, read as a chat body's fields
        chat = dict(defaults.chat)
        reasoning_fields.template_kwargs(chat)
        reasoning_fields.reasoning_format(chat)
        reasoning_fields.budget_tokens(chat)
        reasoning_fields.budget_message(chat)
    except ApiError as exc:
        raise ValueError(f"reasoning flags: {exc.message}") from None
