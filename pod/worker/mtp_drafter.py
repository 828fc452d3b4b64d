"""Drafting with Qwen3.5's MTP head (`--spec-type draft-mtp`, `model/mtp.py`): its K/V beside the
target's, its guesses chained when a step runs.

The head's block is the pool's last layer, so every page holds the target's K/V and the head's
for the same positions, and allocation, the prefix cache, swap and recompute, the budget and
slot files carry both. Its row at position p reads the target's hidden state at p and token
p + 1, so it can run only once that token is known: at the end of each step, over the rows the
step made valid (a prompt chunk's rows; a decode chunk's row and its accepted draft rows, each
with the token sampled there), in one pass. That pass's last row of a sequence that sampled gives
the head's first guess for the next step and the hidden state to chain from (`DraftSeed`, kept by
the sequence). When the next step runs, a sequence granted k drafts takes that guess as d1 and
k - 1 one-row passes, each reading the previous link's output, give d2..dk; their K/V land at
the positions the target verifies this step and are written again by the end-of-step pass.

So a draft never waits on a lagging model: the head is always level with its target. Drafts are
guesses only: verification samples the target's logits, so the head never changes the output.
A cached page's K/V at its last position were computed with the token after it, which another
continuation may not share: the head then guesses from slightly other K/V there; still exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvpark.kernels.argmax import row_argmax
from kvpark.kernels.attention import AttentionBackend, StepLayout

from ..model.mtp import MTPHead
from ..sampling.sampler import DraftSeed, Sampled
from .draft_model import with_drafts
from .step_input import PlannedChunk


class HeadRows(NamedTuple):
    """One pass of the head: per row the token after its position, the position and the hidden
    state it reads; per sequence its pages and lengths."""

    ids: list[int]
    positions: list[int]
    hidden: list[torch.Tensor]  # [rows_i, H] pieces, in order
    page_tables: list[list[int]]
    kv_lens: list[int]
    q_lens: list[int]


class MTPDrafter:
    def __init__(self, head: MTPHead, backend: AttentionBackend, cache: torch.Tensor,
                 page_size: int) -> None:
        self.head = head
        self.backend = backend
        self.cache = cache  # the pool's layer for the head's K/V
        self.page_size = page_size

    # ---- when a step runs: the chained guesses --------------------------------------------
    def fill(self, plan: list[PlannedChunk]) -> list[PlannedChunk]:
        """The plan with each granted draft length filled: d1 from the sequence's seed, then one
        pass per further token over every sequence still drafting."""
        drafting = [i for i, item in enumerate(plan) if item.draft_room]
        if not drafting:
            return plan
        seeds = [plan[i].seq.mtp_seed for i in drafting]
        drafts = [[seed.token] for seed in seeds]
        hidden = [seed.hidden[None] for seed in seeds]
        for step in range(1, max(plan[i].draft_room for i in drafting)):
            going = [n for n, i in enumerate(drafting) if plan[i].draft_room > step]
            rows = HeadRows([], [], [], [], [], [])
            for n in going:
                seq = plan[drafting[n]].seq
                at = seq.num_computed + step - 1  # token d_step's row: after d_{step-1}'s
                add(rows, [drafts[n][-1]], at, hidden[n], seq.page_table)
            out = self.run(rows)
            tokens = row_argmax(self.head.logits(out))
            for k, n in enumerate(going):
                drafts[n].append(tokens[k])
                hidden[n] = out[k:k + 1]
        return with_drafts(plan, drafting, drafts)

    # ---- after the step: the head level with its target, and the next seeds ---------------
    def after_step(self, plan: list[PlannedChunk], hidden: torch.Tensor,
                   emitted: dict[int, tuple[Sampled, ...]]) -> dict[int, DraftSeed]:
        """Run the head over the rows this step made valid (`hidden`: the target's final
        hidden state of every fed row); the seed of each sequence that sampled and may draft
        next (`wants_seed`)."""
        rows = HeadRows([], [], [], [], [], [])
        seeded: list[tuple[int, int, int]] = []  # (item key, row in the pass, position)
        at_row = 0
        for item in plan:
            seq, start = item.seq, item.seq.num_computed
            sampled = emitted.get(id(item), ())
            known = list(seq.tokens[start + 1:start + item.num_tokens])
            nexts = known + [s.token for s in sampled]  # a sampling chunk: its emitted tokens
            if not item.samples:
                nexts = list(seq.tokens[start + 1:start + item.num_tokens + 1])
            count = min(len(nexts), item.num_rows)
            if count:
                add(rows, nexts[:count], start, hidden[at_row:at_row + count], seq.page_table)
                if sampled and item.wants_seed:
                    seeded.append((id(item), len(rows.ids) - 1, start + count - 1))
            at_row += item.num_rows
        if not rows.ids:
            return {}
        out = self.run(rows)
        if not seeded:
            return {}
        picked = out[torch.tensor([row for _, row, _ in seeded], device=out.device)]
        tokens = row_argmax(self.head.logits(picked))
        return {key: DraftSeed(position, token, picked[k].clone())
                for k, ((key, _, position), token) in enumerate(zip(seeded, tokens))}

    def run(self, rows: HeadRows) -> torch.Tensor:
        self.backend.plan(StepLayout(rows.page_tables, rows.kv_lens, rows.q_lens,
                                     self.page_size))
        device = self.head.device
        return self.head(torch.tensor(rows.ids, dtype=torch.long, device=device),
                         torch.tensor(rows.positions, dtype=torch.long, device=device),
                         torch.cat(rows.hidden), self.backend, self.cache)


def add(rows: HeadRows, ids: list[int], start: int, hidden: torch.Tensor,
        page_table: list[int]) -> None:
    """One sequence's rows from position `start` (its K/V land at those positions)."""
    rows.ids.extend(ids)
    rows.positions.extend(range(start, start + len(ids)))
    rows.hidden.append(hidden)
    rows.page_tables.append(page_table)
    rows.kv_lens.append(start + len(ids))
    rows.q_lens.append(len(ids))
