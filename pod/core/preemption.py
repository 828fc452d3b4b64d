"""The preemption policy as pure functions over sequence state (spec: "Policy").

Victim: never the leader (most tokens); the smallest of the rest; a sequence parked
PREEMPT_N_STARVED times, or part-way through a recompute replay, is passed over while another
candidate exists; prompt-phase sequences are candidates; `n > 1` families are not.
Restore (spec order): most-preempted first, then longest parked, fit-first.

Beyond the spec: victims come from the lowest `priority` tier first (the leader rule applies
inside a tier, and the leader of the highest tier is never parked); restores go by priority
first. The "fair" restore order is head-of-line by park time: nobody passes a head that does
not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..memory.budget import fits_budget
from ..memory.paging import pages_for
from .sequence import PreemptMode, Sequence

PREEMPT_N_STARVED = 3
# a parked sequence within this many tokens (+1) of the whole pool can never run again
PREEMPT_N_MARGIN = 8


@dataclass
class PreemptStats:
    """Counters the metrics read (the spec's `n_preempt_*`, beyond-spec ones after)."""

    n_preempt: int = 0
    n_resume: int = 0
    n_preempt_swap: int = 0
    n_preempt_recompute: int = 0
    n_recompute_tokens: int = 0
    n_preempt_cached: int = 0  # parks restored from the prefix cache with nothing replayed
    n_swap_fallbacks: int = 0  # host allocation refused, parked by recompute instead
    n_watermark_parks: int = 0  # parked before the wall: the next step passed the high mark
    n_restore_refused_watermark: int = 0  # a restore that fit, held back by the low mark
    n_reader_parks: int = 0  # parked because their client fell behind reading (reader_holds.py)

    def count_park(self, mode: PreemptMode, fell_back: bool) -> None:
        self.n_preempt += 1
        self.n_preempt_swap += mode is PreemptMode.SWAP
        self.n_preempt_recompute += mode is PreemptMode.RECOMPUTE
        self.n_swap_fallbacks += fell_back

    def count_resume(self, replay_tokens: int, cached: bool) -> None:
        self.n_resume += 1
        self.n_recompute_tokens += replay_tokens
        self.n_preempt_cached += cached


def held_tokens(seq: Sequence) -> int:
    return len(seq.tokens)


def get_leader(active: Iterable[Sequence]) -> Sequence | None:
    """The sequence with the most tokens; ties go to the earliest (it has waited longest)."""
    return min(active, key=lambda s: (-held_tokens(s), s.arrival, s.seq_id), default=None)


def _pass_over(candidates: list[Sequence], unwanted: Callable[[Sequence], bool]) -> list[Sequence]:
    preferred = [c for c in candidates if not unwanted(c)]
    return preferred or candidates


def choose_victim(active: list[Sequence]) -> Sequence | None:
    """Pick the running sequence to park, or None when no one may be parked."""
    if not active:
        return None
    top = max(s.priority for s in active)
    protected = get_leader([s for s in active if s.priority == top])  # someone always runs
    for tier in sorted({s.priority for s in active}):
        members = [s for s in active if s.priority == tier and s is not protected]
        candidates = [s for s in members if not s.in_family]
        if tier != top and len(candidates) > 1:  # the leader rule inside a lower tier
            tier_leader = get_leader(members)
            candidates = [s for s in candidates if s is not tier_leader]
        if candidates:
            return _smallest_fresh(candidates)
    return None


def _smallest_fresh(candidates: list[Sequence]) -> Sequence:
    candidates = _pass_over(candidates, lambda s: s.parking.n_preempt >= PREEMPT_N_STARVED)
    candidates = _pass_over(candidates, lambda s: s.is_replaying)
    # smallest first; among equals the youngest, which has the least invested
    return min(candidates, key=lambda s: (held_tokens(s), -s.arrival, -s.seq_id))


def sibling_prefilling(seq: Sequence, running: Iterable[Sequence], prefix_cache: bool) -> bool:
    """With a prefix cache, an `n > 1` sibling waits while another computes their shared
    prompt, then takes its full pages from the cache instead of computing them again."""
    return prefix_cache and seq.in_family and any(
        s.in_family and s.in_prompt and s.prompt_ids == seq.prompt_ids for s in running)


def choose_mode(swap_bytes: int, budget_bytes: int, held_bytes: int) -> PreemptMode:
    """Swap when the victim's pages fit what remains of the budget, else recompute."""
    fits = fits_budget(swap_bytes, budget_bytes, held_bytes)
    return PreemptMode.SWAP if fits else PreemptMode.RECOMPUTE


def came_back_cached(released_pages: int, restored_pages: int, replay_tokens: int) -> bool:
    """A resume that found every full page its park released in a cache tier, replaying
    nothing: counted (and shown) as cached."""
    return released_pages > 0 and restored_pages == released_pages and not replay_tokens


def passes_high(used_pages: int, soon_free: int, step_pages: int, high_pages: int) -> bool:
    """Would a step taking `step_pages` push the pool past the high watermark? Pages of parks
    still in flight (`soon_free`) count as given back."""
    return used_pages - soon_free + step_pages > high_pages


def may_restore(need_pages: int, available: int, projected: int, low_pages: int,
                anyone_running: bool) -> tuple[bool, bool]:
    """(fits, below_low) for waking a parked sequence that needs `need_pages`: it must fit the
    pages not promised to running sequences and, with anyone running, keep the pool below the
    low watermark (hysteresis)."""
    fits = need_pages <= available
    below_low = not anyone_running or projected + need_pages <= low_pages
    return fits, below_low


@dataclass(frozen=True)
class Restores:
    """One step's restore decisions."""

    resume: list[Sequence]
    never_fit: list[Sequence]  # grown to within the margin of the whole pool: they end
    refused_by_watermark: int  # restores that fit but the low watermark held back


@dataclass(frozen=True)
class PoolRoom:
    """The pool as a restore sees it."""

    available: int  # free pages not promised to running sequences
    projected: int  # used pages once the running ones have taken what they are promised
    low_pages: int  # the low watermark
    capacity_tokens: int
    page_size: int
    n_spec: int = 0  # draft tokens a step may feed (speculative decoding)


def plan_restores(ordered: list[Sequence], room: PoolRoom, batch_size: int, fair: bool,
                  anyone_running: bool) -> Restores:
    """Walk the parked sequences in restore order: each that fits the pages not promised to
    running ones, keeping the pool below the low watermark, is resumed; in the "fair" order
    nobody passes a head that does not fit."""
    resume, never_fit, refused = [], [], 0
    available, projected = room.available, room.projected
    for seq in ordered:
        if can_never_fit(seq, room.capacity_tokens, room.n_spec):
            never_fit.append(seq)
            continue
        need = pages_for(restore_need_tokens(seq, batch_size), room.page_size)
        fits, below_low = may_restore(need, available, projected, room.low_pages,
                                      anyone_running=anyone_running or bool(resume))
        refused += fits and not below_low
        if fits and below_low:
            available, projected = available - need, projected + need
            resume.append(seq)
        elif fair:
            break  # nobody passes a head that does not fit
    return Restores(resume, never_fit, refused)


def restore_order(parked: Iterable[Sequence], order: str = "spec") -> list[Sequence]:
    """Priority first; then the spec's most-preempted, longest-parked, or "fair": park time."""
    if order == "fair":
        return sorted(parked, key=lambda s: (-s.priority, s.parking.parked_at or 0.0, s.seq_id))
    return sorted(parked, key=lambda s: (-s.priority, -s.parking.n_preempt,
                                         s.parking.parked_at or 0.0, s.seq_id))


def next_step_tokens(seq: Sequence, batch_size: int) -> int:
    """Tokens the sequence feeds in its next step (a prefill chunk, or one decode token)."""
    return max(1, min(seq.num_pending, batch_size))


def restore_need_tokens(seq: Sequence, batch_size: int) -> int:
    """KV tokens a parked sequence must be given to resume.

    Swapped: its pages plus its next step. Recomputed: its whole replay plus its next step,
    so that it is never woken into a pool that cannot finish the replay.
    """
    if seq.parking.mode is PreemptMode.RECOMPUTE:
        return len(seq.tokens) + 1
    return seq.num_computed + next_step_tokens(seq, batch_size)


def preempt_kv_reserve(running: Iterable[Sequence], page_size: int) -> int:
    """Pages promised to resuming recomputes: their whole remaining replay plus one step.

    Charging the whole replay (not one chunk) keeps a step from waking a second parked sequence
    into pages the first has not claimed yet.
    """
    reserve = 0
    for seq in running:
        if seq.is_replaying:
            total = pages_for(len(seq.tokens) + 1, page_size)
            reserve += max(0, total - len(seq.page_table))
    return reserve


def promised_pages(running: Iterable[Sequence], page_size: int, batch_size: int) -> int:
    """Pages the running sequences will claim before a parked one may have any: each one's
    next step, and the whole remaining replay of resuming recomputes."""
    running = list(running)
    next_steps = sum(pages_for(s.num_computed + next_step_tokens(s, batch_size), page_size)
                     - len(s.page_table) for s in running if not s.is_replaying)
    return preempt_kv_reserve(running, page_size) + next_steps


def can_never_fit(seq: Sequence, capacity_tokens: int, n_spec: int = 0) -> bool:
    """A parked sequence that has grown to within the margin of the whole pool: the spec's
    PREEMPT_N_MARGIN + 1 + n_spec cells, `n_spec` the draft tokens a step may feed."""
    return len(seq.tokens) + PREEMPT_N_MARGIN + 1 + n_spec > capacity_tokens
