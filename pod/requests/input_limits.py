"""How much input one request may carry (--max-messages, --max-prompt-chars, the context), and
the character count refused before a template or the tokenizer runs on it."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import bad_field as _bad

# No tokenizer packs more characters than this into a token on average, so a prompt longer than
# 32 x the context can never fit: it is refused before the chat template and the tokenizer run.
CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class InputLimits:
    max_context: int  # tokens one request can hold
    max_messages: int
    max_prompt_chars: int  # characters of prompt text (all messages' content together)

    @classmethod
    def of(cls, max_context: int, max_messages: int, max_prompt_chars: int = 0) -> InputLimits:
        """`max_prompt_chars` 0: what the context could ever hold."""
        return cls(max_context, max_messages, max_prompt_chars or CHARS_PER_TOKEN * max_context)


def check_chars(param: str, num_chars: int, limits: InputLimits) -> None:
    """Refused before the template and the tokenizer see it: it could never fit anyway."""
    if num_chars > limits.max_prompt_chars:
        raise _bad(param, f"more than {limits.max_prompt_chars} characters of prompt text, "
                   f"more than a {limits.max_context}-token context can hold "
                   "(--max-prompt-chars)")
