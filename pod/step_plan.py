"""One step's plan as pure functions: which sequences feed how many tokens, within the token
budget and the pages the pool can give (the scheduler decides who is running at all)."""

from __future__ import annotations

from dataclasses import dataclass

from .paging import pages_for
from .slot import Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # fed this step: tokens[num_computed : num_computed + num_tokens]

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens)

    def new_pages(self, page_size: int) -> int:
        """Pages the step adds to the sequence's page table."""
        return pages_for(self.seq.num_computed + self.num_tokens, page_size) - len(
            self.seq.page_table)


def step_order(running: list[Sequence]) -> list[Sequence]:
    """Decode rows first (cheap, latency-bound), then prefill and replay by arrival."""
    return sorted(running, key=lambda s: (s.num_pending > 1, s.arrival, s.seq_id))


def grant_pages(running: list[Sequence], batch_size: int, free_pages: int,
                page_size: int) -> tuple[list[ScheduledSeq], list[Sequence]]:
    """Give each sequence, in order, its next step within the token budget and the free pages.

    A prefill chunk is shortened to the pages that are free; a sequence that cannot feed even
    one token is blocked. Returns (plan, blocked).
    """
    budget, free = batch_size, free_pages
    plan: list[ScheduledSeq] = []
    blocked: list[Sequence] = []
    for seq in running:
        if budget == 0:
            break
        room = (len(seq.page_table) + free) * page_size - seq.num_computed
        num_tokens = min(seq.num_pending, budget, room)
        if num_tokens <= 0:
            blocked.append(seq)
            continue
        item = ScheduledSeq(seq, num_tokens)
        free -= item.new_pages(page_size)
        budget -= num_tokens
        plan.append(item)
    return plan, blocked


def step_pages(plan: list[ScheduledSeq], page_size: int) -> int:
    return sum(item.new_pages(page_size) for item in plan)
