"""The reasoning budget (llama-server's `--reasoning-budget`, `thinking_budget_tokens`) and a
grammar that waits for the reasoning to end: one `TokenConstraint` over a sequence's output.

While the model reasons, a grammar (structured output, a tool call) does not apply: it starts
after the end tag, so a model that thinks first can still answer in JSON (vLLM and llama-server
alike). Once the block has used its budget of tokens, the end tag (after the budget message, if
any) is forced token by token, and the model answers. The tag is found in the sampled tokens'
text, so however the model spells it (one token or several) it counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.tokenizer import Tokenizer
from .constraint import TokenConstraint
from .reasoning import THINK_END, THINK_START, Phase


@dataclass(frozen=True)
class ThinkingGate:
    """A sequence's reasoning rules, as a value the request hands the engine."""

    opened: bool  # the output starts inside the block
    budget: int | None  # tokens the block may take (None: unlimited)
    forced_ids: tuple[int, ...]  # what ends the block when the budget is spent
    start: str = THINK_START
    end: str = THINK_END


class ReasoningGate:
    """`ThinkingGate` for one sequence, around the grammar's constraint (if any)."""

    def __init__(self, gate: ThinkingGate, tokenizer: Tokenizer,
                 inner: TokenConstraint | None) -> None:
        self.gate = gate
        self.tokenizer = tokenizer
        self.inner = inner
        # a grammar on a block the model may or may not open applies from the first token:
        # only a block the template opened is known to come first
        self.phase = (Phase.THINKING if gate.opened else
                      Phase.ANSWER if inner is not None else Phase.PENDING)
        self.num_thinking = 0
        self.forcing: list[int] = []  # the rest of the forced end, next first
        self._text = ""  # recent output text: where the tags are looked for
        self._check_budget()

    def mask(self, logits: torch.Tensor) -> None:
        if self.forcing:
            keep = logits[self.forcing[0]].clone()
            logits.fill_(float("-inf"))
            logits[self.forcing[0]] = keep if torch.isfinite(keep) else 0.0
        elif self.phase is Phase.ANSWER and self.inner is not None:
            self.inner.mask(logits)

    def accept(self, token: int) -> None:
        if self.phase is Phase.ANSWER:
            if self.inner is not None:
                self.inner.accept(token)
            return
        if self.forcing:
            self.forcing.pop(0)
        self._text += self.tokenizer.token_text(token)
        if self.phase is Phase.PENDING:
            self._pending()
        elif self.gate.end in self._text:
            self.phase, self.forcing = Phase.ANSWER, []
        else:
            self.num_thinking += 1
            self._keep_tail(self.gate.end)
            self._check_budget()

    def is_done(self) -> bool:
        return self.phase is Phase.ANSWER and self.inner is not None and self.inner.is_done()

    def _pending(self) -> None:
        text = self._text.lstrip()
        if text.startswith(self.gate.start):
            self.phase, self._text = Phase.THINKING, text[len(self.gate.start):]
            self._check_budget()
        elif not self.gate.start.startswith(text):
            self.phase = Phase.ANSWER  # no block: the answer began

    def _check_budget(self) -> None:
        budget = self.gate.budget
        if (self.phase is Phase.THINKING and budget is not None and not self.forcing
                and self.num_thinking >= budget and self.gate.end not in self._text):
            self.forcing = list(self.gate.forced_ids)

    def _keep_tail(self, tag: str) -> None:
        # the tag can only end in the last few tokens' text; a long block keeps no more
        limit = 4 * len(tag) + 64
        if len(self._text) > limit:
            self._text = self._text[-limit:]


def gated(gate: ThinkingGate | None, tokenizer: Tokenizer,
          inner: TokenConstraint | None) -> TokenConstraint | None:
    """A sequence's constraint: the gate around the grammar where there are reasoning rules
    that change anything (a budget, or a grammar behind an opened block)."""
    if gate is None or (gate.budget is None and not (gate.opened and inner is not None)):
        return inner
    return ReasoningGate(gate, tokenizer, inner)
