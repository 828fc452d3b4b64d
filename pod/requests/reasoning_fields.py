"""A chat request's reasoning fields: what reaches the chat template (`chat_template_kwargs`,
vLLM's and llama-server's; OpenAI's `reasoning_effort`, where "none" turns thinking off), how
the output's think block is returned (llama-server's `reasoning_format`), and its budget
(`reasoning_budget_tokens` / `thinking_budget_tokens`, `reasoning_budget_message`).

The server's flags (`--reasoning`, `--reasoning-format`, `--reasoning-budget`,
`--chat-template-kwargs`) are the same fields laid under each chat body
(`generation_defaults.py`), so they are checked and read here alike.
"""

from __future__ import annotations

from typing import Any

from ..model.tokenizer import Tokenizer
from ..sampling.reasoning import THINK_END, THINK_START, ThinkingRule
from ..sampling.reasoning_gate import ThinkingGate
from .errors import bad_field, shown

FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")  # llama-server's --reasoning-format
# what the renderer itself passes: a client's kwargs may not replace them
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token",
                             "eos_token", "raise_exception", "strftime_now"})
MAX_KWARGS = 64
MAX_BUDGET = 2**31 - 1
MAX_BUDGET_MESSAGE = 1024  # characters: it is forced token by token
TAIL_TOKENS = 8  # the prompt's last tokens, read for a think block the template opened


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The variables a chat body hands the template beside the messages."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad_field("chat_template_kwargs", "expected an object")
    if len(kwargs) > MAX_KWARGS:
        raise bad_field("chat_template_kwargs", f"at most {MAX_KWARGS} variables")
    reserved = sorted(RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise bad_field("chat_template_kwargs", f"{', '.join(reserved)} cannot be set here "
                        "(the server renders them from the request)")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):  # llama-server's check
        raise bad_field("chat_template_kwargs", f"invalid type for 'enable_thinking' "
                        f"(expected boolean, got {shown(thinking)})")
    kwargs = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise bad_field("reasoning_effort", "expected a string")
        if effort == "none":  # OpenAI's value that turns reasoning off
            kwargs["enable_thinking"] = False
        else:
            kwargs["reasoning_effort"] = effort
    # always defined, as llama-server defines it: templates written for it test
    # `not enable_thinking`, which an undefined variable would turn off
    kwargs.setdefault("enable_thinking", True)
    return kwargs


def reasoning_format(body: dict[str, Any]) -> str:
    value = body.get("reasoning_format", "auto")
    if value is None:
        return "auto"
    if value not in FORMATS:
        raise bad_field("reasoning_format", f"one of {', '.join(FORMATS)} (got {shown(value)})")
    return value


def template_thinks(tokenizer: Tokenizer) -> bool:
    """Whether the chat template writes think blocks (llama-server's auto detection)."""
    return THINK_END in (tokenizer.chat_template or "")


def opened_block(prompt_ids: list[int], tokenizer: Tokenizer) -> bool:
    """Whether the prompt ends inside a think block: templates of models that always think
    (Qwen3.5, QwQ, DeepSeek-R1) open it in the generation prompt."""
    tail = tokenizer.decode(prompt_ids[-TAIL_TOKENS:], skip_special=False)
    return tail.rstrip().endswith(THINK_START)


def budget_tokens(body: dict[str, Any]) -> int | None:
    """The budget a body asks for, under either name (None: unlimited)."""
    for name in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if type(value) is not int or not -1 <= value <= MAX_BUDGET:
            raise bad_field(name, f"expected an integer in [-1, {MAX_BUDGET}] (-1: unlimited), "
                            f"got {shown(value)}")
        return None if value == -1 else value
    return None


def budget_message(body: dict[str, Any]) -> str:
    message = body.get("reasoning_budget_message", "")
    if message is None:
        return ""
    if not isinstance(message, str) or len(message) > MAX_BUDGET_MESSAGE:
        raise bad_field("reasoning_budget_message",
                        f"expected a string of at most {MAX_BUDGET_MESSAGE} characters")
    return message


def thinking(body: dict[str, Any], tokenizer: Tokenizer, prompt_ids: list[int]
             ) -> dict[str, ThinkingRule | ThinkingGate | None]:
    """A chat request's `thinking` (how the output's think block is returned; None: as
    content, untouched) and `thinking_gate` (its budget and the grammar's wait; None where the
    model has no think blocks)."""
    chosen = reasoning_format(body)
    budget, message = budget_tokens(body), budget_message(body)
    tags = template_thinks(tokenizer) or chosen.startswith("deepseek")
    if not tags:
        return {"thinking": None, "thinking_gate": None}
    opened = opened_block(prompt_ids, tokenizer)
    rule = None if chosen == "none" else ThinkingRule(opened,
                                                      keep_tags=chosen == "deepseek-legacy")
    forced = tokenizer.encode(message + THINK_END, add_bos=False)
    return {"thinking": rule, "thinking_gate": ThinkingGate(opened, budget, tuple(forced))}
