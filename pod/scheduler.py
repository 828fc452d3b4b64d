"""Plans one step: admission, restores, forced parks, chunked prefill and decode, and parks
victims (via the pure policy in `preemption.py`) when the pool cannot give the step its pages.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpark.kernels.kv_copy import CopyEngine, Outcome, SyncCopyEngine, Ticket, TransferTracker

from . import preemption as policy
from .host_store import HostAllocationError, HostStore
from .kv_pool import KVPool
from .slot import Phase, PreemptMode, Sequence

log = logging.getLogger("kvpark.scheduler")

CONTEXT_EXCEEDED = "Context size has been exceeded."


@dataclass(frozen=True)
class SchedulerConfig:
    num_slots: int
    batch_size: int = 512  # tokens per step, prefill chunks included
    preempt: bool = True
    preempt_every: int = 0  # force a park + resume every N generated tokens (0: off)
    max_context: int = 1 << 30  # tokens one sequence may reach (finish_reason "length")
    preempt_high: float = 0.94  # park proactively when the next step would pass this share
    preempt_low: float = 0.80  # restore only while the pool stays below this share
    resume_order: str = "spec"  # or "fair" (head-of-line by park time)


@dataclass
class PreemptStats:
    n_preempt: int = 0
    n_resume: int = 0
    n_preempt_swap: int = 0
    n_preempt_recompute: int = 0
    n_recompute_tokens: int = 0
    n_swap_fallbacks: int = 0  # host allocation refused, parked by recompute instead
    n_watermark_parks: int = 0  # parked before the wall: the next step passed the high mark
    n_restore_refused_watermark: int = 0  # a restore that fit, held back by the low mark
    park_seconds: list[float] = field(default_factory=list)  # copy durations, drained by metrics
    resume_seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # fed this step: tokens[num_computed : num_computed + num_tokens]

    @property
    def samples(self) -> bool:
        return self.seq.num_computed + self.num_tokens == len(self.seq.tokens)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, host: HostStore,
                 copy: CopyEngine | None = None) -> None:
        self.config = config
        self.pool = pool
        self.host = host
        # swap copies; on CUDA they run on their own stream while other slots keep decoding,
        # and a sequence whose copy is in flight is neither scheduled nor chosen
        self.copy = copy or SyncCopyEngine(pool)
        self.transfers = TransferTracker()
        self.on_finish: Callable[[Sequence], None] = lambda seq: None  # metrics hook
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * config.num_slots
        self.stats = PreemptStats()

    def notify(self, seq: Sequence, kind: str) -> None:
        """Tell the sequence's owner: "parked", "resumed" or "finished"."""
        if kind == "finished":
            self.on_finish(seq)
        seq.on_event(seq, kind, None)

    # ---- views -------------------------------------------------------------------------------
    @property
    def active(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None and s.phase is Phase.RUNNING]

    @property
    def parked(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None and s.phase is Phase.PARKED]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots) or bool(
            len(self.transfers))

    @property
    def pages_in_flight(self) -> list[int]:
        """Pages held by swap copies still in flight (neither free nor in a page table)."""
        return self.transfers.pages()

    # ---- admission and endings ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str | None = None, error: str | None = None,
               status: int = 500) -> None:
        """End a sequence exactly once and give back everything it holds."""
        if seq.is_finished:
            return
        seq.end_park(time.monotonic())
        if self.transfers.cancel(seq):  # the copy owns pages and host buffer until it lands
            seq.page_table, seq.host_kv, seq.host_bytes = [], None, 0
        else:
            self._release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot_id is not None:
            self.slots[seq.slot_id] = None
        seq.phase = Phase.FINISHED
        seq.finish_reason = reason
        seq.error, seq.error_status = error, status
        seq.finished_at = time.monotonic()
        log.debug("seq %s finished: %s%s", seq.request_id, reason or "error",
                  f" ({error})" if error else "")
        self.notify(seq, "finished")

    def abort_all(self, error: str, status: int = 503) -> None:
        for seq in [*self.waiting, *self.active]:
            self.finish(seq, error=error, status=status)

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.page_table)
        seq.page_table = []
        if seq.host_kv is not None:
            self.host.release(seq.host_kv)
            seq.host_kv, seq.host_bytes = None, 0

    def _admit(self) -> None:
        for slot_id, occupant in enumerate(self.slots):
            if occupant is not None or not self.waiting:
                continue
            # highest priority first, first come first served within a priority
            seq = max(self.waiting, key=lambda s: (s.priority, -s.arrival, -s.seq_id))
            self.waiting.remove(seq)
            seq.slot_id, seq.phase = slot_id, Phase.RUNNING
            self.slots[slot_id] = seq
            if len(seq.tokens) + 1 > self.pool.capacity_tokens:
                self.finish(seq, error=CONTEXT_EXCEEDED, status=400)

    # ---- the step plan -----------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        self.reap_copies()
        self._admit()
        if self.config.preempt:
            self._restore_parked()
            self._force_parks()
        while True:
            plan, blocked = self._grant_pages(self._ordered_running())
            over_high = not blocked and self._passes_high(plan)
            if not blocked and not over_high:
                break
            victim = policy.choose_victim(self.running) if self.config.preempt else None
            if victim is not None:
                self.stats.n_watermark_parks += over_high
                # a blocked step needs the pages now; a park before the wall can overlap
                self.park(victim, wait=bool(blocked))
                continue
            if over_high:  # no one to park: run at the edge
                break
            # nobody can make room: the spec's (and llama.cpp's) failure, for one sequence at a
            # time, the latest arrival first; its pages may be what the others were missing
            latest = max(blocked, key=lambda s: (s.arrival, s.seq_id))
            self.finish(latest, error=CONTEXT_EXCEEDED)
        for item in plan:
            seq = item.seq
            missing = self.pool.pages_for(seq.num_computed + item.num_tokens) - len(seq.page_table)
            seq.page_table.extend(self.pool.allocate(missing))
        return plan

    @property
    def high_pages(self) -> int:
        return int(self.pool.num_pages * self.config.preempt_high)

    @property
    def low_pages(self) -> int:
        return int(self.pool.num_pages * self.config.preempt_low)

    def _step_pages(self, plan: list[ScheduledSeq]) -> int:
        return sum(self.pool.pages_for(i.seq.num_computed + i.num_tokens) - len(i.seq.page_table)
                   for i in plan)

    def _passes_high(self, plan: list[ScheduledSeq]) -> bool:
        """Would this step push the pool past the high watermark? (park before the wall)"""
        if not self.config.preempt or self.config.preempt_high >= 1.0:
            return False
        soon_free = len(self.pages_in_flight)  # parks in flight give their pages back
        return self.pool.num_used_pages - soon_free + self._step_pages(plan) > self.high_pages

    def _ordered_running(self) -> list[Sequence]:
        # decode rows first (cheap, latency-bound), then prefill and replay by arrival
        return sorted(self.running, key=lambda s: (s.num_pending > 1, s.arrival, s.seq_id))

    def _grant_pages(self, running: list[Sequence]) -> tuple[list[ScheduledSeq], list[Sequence]]:
        """Give each sequence its next step within the token budget and the free pages.

        A prefill chunk is shortened to the pages that are free; a sequence that cannot feed
        even one token is blocked.
        """
        budget, free, ps = self.config.batch_size, self.pool.num_free_pages, self.pool.page_size
        plan: list[ScheduledSeq] = []
        blocked: list[Sequence] = []
        for seq in running:
            if budget == 0:
                break
            room = (len(seq.page_table) + free) * ps - seq.num_computed
            num_tokens = min(seq.num_pending, budget, room)
            if num_tokens <= 0:
                blocked.append(seq)
                continue
            free -= self.pool.pages_for(seq.num_computed + num_tokens) - len(seq.page_table)
            budget -= num_tokens
            plan.append(ScheduledSeq(seq, num_tokens))
        return plan, blocked

    # ---- parking -----------------------------------------------------------------------------
    def park(self, seq: Sequence, wait: bool = True) -> PreemptMode:
        """Free a running sequence's pages: swap them to host RAM if the budget allows.

        With `wait=False` an asynchronous copy may still be in flight on return: its pages come
        back to the pool when it lands (see `reap_copies`).
        """
        assert seq.phase is Phase.RUNNING, f"cannot park a {seq.phase.value} sequence"
        started = time.perf_counter()
        num_bytes = self.pool.swap_bytes(len(seq.page_table))
        mode = policy.choose_mode(num_bytes, self._can_swap)
        ticket = None
        if mode is PreemptMode.SWAP:
            try:
                seq.host_kv = self.host.allocate(self.pool.swap_shape(len(seq.page_table)),
                                                 self.pool.dtype)
                ticket = self.copy.start_park(seq.page_table, seq.host_kv)
                seq.host_bytes, seq.swapped_tokens = num_bytes, seq.num_computed
            except HostAllocationError as exc:
                log.warning("seq %s: %s; parking by recompute", seq.request_id, exc)
                self.stats.n_swap_fallbacks += 1
                mode = PreemptMode.RECOMPUTE
        if mode is PreemptMode.RECOMPUTE:
            seq.replay_until = seq.num_computed
            seq.num_computed = 0
        if ticket is not None and wait:
            self.copy.wait(ticket)
        if ticket is not None and not self.copy.poll(ticket):
            self.transfers.start(seq, ticket)  # the pages stay allocated until it lands
        else:
            self.pool.free(seq.page_table)
        seq.page_table = []
        seq.phase, seq.preempt_mode = Phase.PARKED, mode
        seq.parked_at = time.monotonic()
        seq.n_preempt += 1
        seq.tokens_since_forced_park = 0
        self._count_park(seq, mode, time.perf_counter() - started)
        self.notify(seq, "parked")
        return mode

    def park_manually(self, seq: Sequence) -> None:
        """POST /slots/{id}?action=park: the normal mode decision; stays parked until unpark."""
        if seq.phase is Phase.RUNNING:
            self.park(seq)
        seq.preempt_manual = True

    def unpark(self, seq: Sequence) -> None:
        """POST /slots/{id}?action=unpark: resume now if it fits, else join the restore queue."""
        seq.preempt_manual = False
        if seq.phase is not Phase.PARKED or self.transfers.is_busy(seq):
            return
        need = self.pool.pages_for(policy.restore_need_tokens(seq, self.config.batch_size))
        if self.pool.can_allocate(need):
            self.resume(seq)

    def _can_swap(self, num_bytes: int) -> bool:
        if self.host.budget_bytes == 0:  # --preempt-ram 0: never copy, always recompute
            return False
        return self.host.can_hold(num_bytes)

    def _count_park(self, seq: Sequence, mode: PreemptMode, seconds: float) -> None:
        self.stats.n_preempt += 1
        if mode is PreemptMode.SWAP:
            self.stats.n_preempt_swap += 1
            if not self.transfers.is_busy(seq):  # an async copy is timed when it lands
                self.stats.park_seconds.append(seconds)
        else:
            self.stats.n_preempt_recompute += 1
            seq.n_recompute += 1
        log.info("seq %s (slot %s) parked by %s: %d tokens, %d host bytes, %.1f ms",
                 seq.request_id, seq.slot_id, mode.value, len(seq.tokens), seq.host_bytes,
                 seconds * 1e3)

    def _force_parks(self) -> None:
        every = self.config.preempt_every
        if every <= 0:
            return
        for seq in self.running:
            if seq.tokens_since_forced_park >= every and not seq.in_family:
                self.park(seq)

    # ---- restoring ---------------------------------------------------------------------------
    def _restore_parked(self) -> None:
        parked = [s for s in self.parked
                   if not s.preempt_manual and not self.transfers.is_busy(s)]
        if not parked:
            return
        running = self.running
        promised = policy.preempt_kv_reserve(running, self.pool.page_size) + sum(
            self.pool.pages_for(s.num_computed + policy.next_step_tokens(s, self.config.batch_size))
            - len(s.page_table)
            for s in running
            if not s.is_replaying
        )
        available = self.pool.num_free_pages - promised
        projected = self.pool.num_used_pages + promised
        head_of_line = self.config.resume_order == "fair"
        for seq in policy.restore_order(parked, self.config.resume_order):
            if policy.can_never_fit(seq, self.pool.capacity_tokens):
                self.finish(seq, error=CONTEXT_EXCEEDED)
                continue
            need = self.pool.pages_for(policy.restore_need_tokens(seq, self.config.batch_size))
            fits = need <= available
            # hysteresis: with anyone running, wake a sequence only if the pool stays below LOW
            below_low = not running or projected + need <= self.low_pages
            if fits and not below_low:
                self.stats.n_restore_refused_watermark += 1
            if fits and below_low:
                available -= need
                projected += need
                running = [*running, seq]
                self.resume(seq)
            elif head_of_line:
                break  # nobody passes a head that does not fit

    def resume(self, seq: Sequence) -> None:
        """Give a parked sequence its pages back; an asynchronous copy completes it later."""
        assert seq.phase is Phase.PARKED, f"cannot resume a {seq.phase.value} sequence"
        if seq.preempt_mode is PreemptMode.SWAP:
            pages = self.pool.allocate(self.pool.pages_for(seq.swapped_tokens))
            ticket = self.copy.start_resume(pages, seq.host_kv)
            if not self.copy.poll(ticket):
                self.transfers.start(seq, ticket)  # stays parked (and busy) until it lands
                return
            self._resumed_swap(seq, ticket)
        else:
            self.stats.n_recompute_tokens += seq.replay_until
        self._mark_resumed(seq)

    def _resumed_swap(self, seq: Sequence, ticket: Ticket) -> None:
        seq.page_table = list(ticket.pages)
        self.host.release(seq.host_kv)
        seq.host_kv, seq.host_bytes = None, 0
        self.stats.resume_seconds.append(time.perf_counter() - ticket.started_at)

    def reap_copies(self) -> None:
        """Settle swap copies that have landed: free parked pages, wake resumed sequences,
        and give back everything a sequence cancelled mid-copy held."""
        for seq, release, ticket in self.transfers.reap(self.copy.poll):
            if release.outcome is Outcome.RESUMED:
                self._resumed_swap(seq, ticket)
                self._mark_resumed(seq)
                continue
            self.pool.free(list(release.free_pages))
            if release.release_host:  # cancelled mid-copy
                self.host.release(ticket.host_buf)
            else:
                self.stats.park_seconds.append(time.perf_counter() - ticket.started_at)

    def wait_for_copies(self) -> None:
        """Block until every copy in flight has landed, then settle them (idle or shutdown)."""
        for _, ticket in self.transfers.tickets():
            self.copy.wait(ticket)
        self.reap_copies()

    def _mark_resumed(self, seq: Sequence) -> None:
        parked_for = seq.end_park(time.monotonic())
        seq.phase = Phase.RUNNING
        self.stats.n_resume += 1
        log.info("seq %s (slot %s) resumed after %.1f ms parked by %s", seq.request_id,
                 seq.slot_id, parked_for * 1e3, seq.preempt_mode.value)
        self.notify(seq, "resumed")

    # ---- after the step ----------------------------------------------------------------------
    def advance(self, item: ScheduledSeq, sampled: int | None) -> None:
        """Account the fed tokens; append the sampled one (the caller checks stop conditions)."""
        seq = item.seq
        seq.num_computed += item.num_tokens
        if seq.replay_until and seq.num_computed >= seq.replay_until:
            seq.replay_until = 0
            self.notify(seq, "recomputed")
        if sampled is not None:
            seq.tokens.append(sampled)
            seq.tokens_since_forced_park += 1
