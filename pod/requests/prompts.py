"""Prompt token ids: a raw prompt (text, with special-token texts parsed, or ids), and a
conversation through the model's chat template, with the offered tools, tool history in the
generic format and an assistant prefill. /tokenize and /apply-template render through here too,
so they show what a generation request would run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..model.tokenizer import RenderedTooLong, Tokenizer
from . import tools
from .chat_messages import chat_messages
from .errors import MAX_SHOWN, ApiError, clip
from .errors import bad_field as _bad
from .field_values import boolean_field
from .input_limits import InputLimits, check_chars
from .reasoning_fields import template_kwargs
from .structured_fields import tool_plan


def raw_prompt_ids(body: dict, tokenizer: Tokenizer, limits: InputLimits,
                   name: str = "prompt") -> list[int]:
    """A raw prompt's ids. Special-token texts in it become their ids, as llama.cpp parses them
    in /completion prompts: a raw prompt is the caller's whole model input, template included."""
    prompt = body.get(name)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_chars(name, len(prompt), limits)
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


@dataclass(frozen=True)
class ChatTurn:
    """How the conversation is rendered: the messages, whether the template opens the
    assistant's turn, and the start of that turn the output continues (assistant prefill)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    prefill: str = ""
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs ...


def chat_turn(body: dict, messages: list[dict[str, Any]]) -> ChatTurn:
    """The turn with the variables the body hands the template (`reasoning_fields`)."""
    return replace(_turn(body, messages), template_kwargs=template_kwargs(body))


def _turn(body: dict, messages: list[dict[str, Any]]) -> ChatTurn:
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


def chat_prompt(turn: ChatTurn, tokenizer: Tokenizer, plan: tools.ToolPlan | None = None,
                limits: InputLimits | None = None) -> list[int]:
    """The conversation's ids through the model's chat template, with the plan's tools. The
    rendered text (messages, tools, their schemas and the template together) is held to
    --max-prompt-chars before it is tokenised: message content alone is checked earlier, but
    tool schemas can make a short request render to megabytes."""
    messages, offered = _template_input(turn, plan)
    try:  # special-token texts in the messages stay text: only the template's markers are special
        return tokenizer.encode_chat(messages, add_generation_prompt=turn.add_generation_prompt,
                                     tools=offered, prefill=turn.prefill,
                                     max_chars=limits.max_prompt_chars if limits else None,
                                     template_kwargs=turn.template_kwargs)
    except RenderedTooLong as exc:
        raise _rendered_too_long(exc, limits) from None
    except Exception as exc:  # the model's own template rejected the conversation
        raise _template_rejected(exc) from exc


def _rendered_too_long(exc: RenderedTooLong, limits: InputLimits | None) -> ApiError:
    context = f", more than a {limits.max_context}-token context can hold" if limits else ""
    return _bad("messages", f"the prompt rendered from the messages, tools and chat template "
                f"is {exc.num_chars} characters; at most {exc.max_chars}{context} "
                "(--max-prompt-chars)")


def _template_rejected(exc: Exception) -> ApiError:
    return _bad("messages", f"the chat template rejected the messages: "
                f"{clip(str(exc), 2 * MAX_SHOWN)}")


def _chat_input(body: dict, limits: InputLimits) -> tuple[ChatTurn, tools.ToolPlan | None]:
    return chat_turn(body, chat_messages(body, limits)), tool_plan(body, None)


def chat_prompt_ids(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> list[int]:
    """vLLM's /tokenize with `messages`: the ids a chat request with this body would run."""
    turn, plan = _chat_input(body, limits)
    return chat_prompt(turn, tokenizer, plan, limits)


def render_chat(body: dict, tokenizer: Tokenizer, limits: InputLimits) -> str:
    """llama.cpp's /apply-template: the text a chat request with this body would run."""
    turn, plan = _chat_input(body, limits)
    messages, offered = _template_input(turn, plan)
    extra = {**turn.template_kwargs, **({"tools": offered} if offered else {})}
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=turn.add_generation_prompt, **extra)
    except Exception as exc:
        raise _template_rejected(exc) from exc
    text += turn.prefill
    if len(text) > limits.max_prompt_chars:
        raise _rendered_too_long(RenderedTooLong(len(text), limits.max_prompt_chars), limits)
    return text
