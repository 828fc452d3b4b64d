"""A draft model's side of speculative decoding (`--model-draft`): its K/V beside the target's,
and its greedy drafts, made when a step runs.

The draft model's layers are the pool's last layers, so every page holds the target's K/V and
the draft's for the same positions: allocation, the prefix cache, swap and recompute, the
`--preempt-ram` budget and slot files carry both without knowing there are two models. (Hence a
draft must have the target's K/V head count and head size: `check_draft`.)

Each step, before the target runs, one pass of the draft model feeds the planned rows of every
sequence (prompt chunks, replays, decode rows), after the tokens it lags behind
(`Sequence.draft_lag`): its K/V stay level with the target's. A sequence whose drafting is
paused (its drafts kept failing) is left out, so free text costs little: the draft catches up
in one pass when it drafts again, those rows through dense GEMMs (many rows) rather than the
decode rows' blocks. For a sequence granted a draft of k tokens that pass's last row gives d1
(argmax), and k - 1 one-row passes give d2..dk. A draft is a guess: verification
(`sampling/verification.py`) samples target logits only, so the draft model, its precision and its
K/V never change the output, only how much of a draft is accepted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvpark.kernels.argmax import row_argmax
from kvpark.kernels.attention import AttentionBackend, StepLayout

from ..model.config import ModelConfig
from ..model.linear import BlockRows
from ..sampling.sampler import DraftSeed, Sampled
from .step_input import PlannedChunk

if TYPE_CHECKING:  # the runner imports this file on a GPU machine without the tokenizer's deps
    from ..model.tokenizer import Tokenizer

# a catch-up (the tokens a paused sequence's draft skipped) longer than this goes through one
# dense GEMM: the block kernel streams the weights once per tile of a few rows
BLOCK_ROWS_MAX = 4


class DraftModel(Protocol):
    """What the drafter needs of a model (`LlamaModel`)."""

    has_blocks: bool
    device: torch.device

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 backend: AttentionBackend, kv_caches: list[torch.Tensor],
                 rows: BlockRows | None = None) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor, rows: BlockRows | None = None) -> torch.Tensor: ...


@dataclass
class Rows:
    """One pass's rows: token ids, positions, whether each reads blocks, and the layout."""

    ids: list[int]
    positions: list[int]
    from_blocks: list[bool]
    page_tables: list[list[int]]
    kv_lens: list[int]
    q_lens: list[int]
    prompt_rows: list[int]  # of each sequence's rows, those at prompt positions (they come first)

    @classmethod
    def empty(cls) -> Rows:
        return cls([], [], [], [], [], [], [])

    def add(self, ids: list[int], start: int, num_prompt: int, page_table: list[int],
            dense_before: int = 0) -> None:
        """One sequence's rows from position `start`: generated tokens' rows read blocks, as
        the target's do (a draft that is the target writes the target's K/V bits), except a
        catch-up's rows before `dense_before`."""
        end = start + len(ids)
        self.ids.extend(ids)
        self.positions.extend(range(start, end))
        self.from_blocks.extend(dense_before <= p and p >= num_prompt for p in range(start, end))
        self.page_tables.append(page_table)
        self.kv_lens.append(end)
        self.q_lens.append(len(ids))
        self.prompt_rows.append(max(0, min(end, num_prompt) - start))


class Drafter:
    """Runs the draft model over its layers of the pool (`caches`) with its own attention
    backend (a plan of its own: the target's is made after it)."""

    def __init__(self, model: DraftModel, backend: AttentionBackend,
                 caches: list[torch.Tensor], page_size: int) -> None:
        self.model = model
        self.backend = backend
        self.caches = caches
        self.page_size = page_size

    def fill(self, plan: list[PlannedChunk]) -> list[PlannedChunk]:
        """The plan with each granted draft length filled with the draft model's tokens; the
        draft's K/V written for every fed row (and the drafts but the last)."""
        if not plan:
            return plan
        fed = [item for item in plan if item.feeds_draft_model]
        if not fed:
            return plan
        first = Rows.empty()
        for item in fed:
            seq = item.seq
            start = seq.num_computed - seq.draft_lag
            catch_up = seq.num_computed if seq.draft_lag > BLOCK_ROWS_MAX else 0
            first.add(seq.tokens[start:seq.num_computed + item.num_tokens], start,
                      seq.num_prompt, seq.page_table, catch_up)
        drafting = [i for i, item in enumerate(plan) if item.draft_room]
        if not drafting:
            self.run(first, [])
            return plan
        last_row = {id(item): end - 1
                    for item, end in zip(fed, itertools.accumulate(first.q_lens))}
        ends = [last_row[id(plan[i])] for i in drafting]
        drafts = [[token] for token in self.run(first, ends)]
        for step in range(1, max(plan[i].draft_room for i in drafting)):
            going = [n for n, i in enumerate(drafting) if plan[i].draft_room > step]
            rows = Rows.empty()
            for n in going:
                seq = plan[drafting[n]].seq
                at = seq.num_computed + plan[drafting[n]].num_tokens + step - 1
                rows.add([drafts[n][-1]], at, seq.num_prompt, seq.page_table)
            for n, token in zip(going, self.run(rows, list(range(len(going))))):
                drafts[n].append(token)
        return with_drafts(plan, drafting, drafts)

    def after_step(self, plan: list[PlannedChunk], hidden: torch.Tensor,
                   emitted: dict[int, tuple[Sampled, ...]]) -> dict[int, DraftSeed]:
        """Nothing: a draft model drafts from tokens alone, when the next step runs."""
        return {}

    def run(self, rows: Rows, argmax_rows: list[int]) -> list[int]:
        """One pass over `rows`; the greedy next token at each of `argmax_rows`."""
        self.backend.plan(StepLayout(rows.page_tables, rows.kv_lens, rows.q_lens,
                                     self.page_size, rows.prompt_rows))
        device = self.model.device
        blocks = BlockRows.from_mask(rows.from_blocks) if self.model.has_blocks else None
        hidden = self.model(torch.tensor(rows.ids, dtype=torch.long, device=device),
                            torch.tensor(rows.positions, dtype=torch.long, device=device),
                            self.backend, self.caches, blocks)
        if not argmax_rows:
            return []
        picked = hidden[torch.tensor(argmax_rows, device=device)]
        head_rows = None if blocks is None else BlockRows.from_mask(
            [rows.from_blocks[r] for r in argmax_rows])
        return row_argmax(self.model.logits(picked, head_rows))


def with_drafts(plan: list[PlannedChunk], drafting: list[int], drafts: list[list[int]]
                ) -> list[PlannedChunk]:
    """The plan with item `drafting[n]` given `drafts[n]` (a drafter's guesses, in its room)."""
    filled = list(plan)
    for n, i in enumerate(drafting):
        filled[i] = plan[i].with_draft(tuple(drafts[n]))
    return filled


def check_draft(target: ModelConfig, draft: ModelConfig, target_tokens: Tokenizer,
                draft_tokens: Tokenizer) -> str | None:
    """Why this draft cannot serve this target, or None: the same vocabulary (every token's
    text, and the end-of-generation ids), and the same K/V head count and head size (its pages
    are the pool's pages); a dense draft (a hybrid one would need state slots of its own)."""
    if draft.is_hybrid:
        return ("it is a hybrid model (Gated DeltaNet layers): a draft model's recurrent state "
                "is not kept yet; draft for a hybrid target by lookup (--spec-type "
                "ngram-simple) or with a dense draft model")
    if draft.vocab_size != target.vocab_size:
        return (f"its vocabulary has {draft.vocab_size} tokens, the target's "
                f"{target.vocab_size}")
    if (draft.num_kv_heads, draft.head_dim) != (target.num_kv_heads, target.head_dim):
        return (f"its K/V heads are {draft.num_kv_heads} x {draft.head_dim}, the target's "
                f"{target.num_kv_heads} x {target.head_dim}; a draft's K/V share the target's "
                "pages, so they must match")
    if draft_tokens.eos_token_ids != target_tokens.eos_token_ids:
        return "its end-of-generation tokens differ from the target's"
    draft_vocab = draft_tokens.backend.get_vocab(with_added_tokens=True)
    target_vocab = target_tokens.backend.get_vocab(with_added_tokens=True)
    differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda t: t[1])
    if differ:
        text, token = differ[0]
        return (f"its tokenizer differs from the target's: {text!r} is token {token} in one "
                f"and not in the other ({len(differ)} differences)")
    return None
