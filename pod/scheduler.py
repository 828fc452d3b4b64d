"""Plans one step: admission, restores, forced parks, chunked prefill, decode and its drafts;
parks victims (via the pure policy in `preemption.py`) when the pool cannot give a step pages."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from . import preemption as policy
from .kv_pool import KVPool
from .slot import CONTEXT_EXCEEDED, FinishReason, Phase, PreemptMode, SeqEvent, Sequence
from .speculation import SpecConfig, Speculator
from .step_plan import ScheduledSeq, add_drafts, grant_pages, step_order, step_pages
from .swap import Swapper

log = logging.getLogger("kvpark.scheduler")

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
    spec: SpecConfig = SpecConfig()  # speculative decoding (off by default)


class Scheduler:
    def __init__(self, config: SchedulerConfig, swapper: Swapper) -> None:
        self.config = config
        self.pool: KVPool = swapper.pool
        # parks' copies (on CUDA in flight while others decode: a busy sequence is not chosen)
        self.swapper = swapper
        self.stats = policy.PreemptStats()  # counted here, where the decisions are
        self.on_finish: Callable[[Sequence], None] = lambda seq: None  # metrics hook
        self.waiting: deque[Sequence] = deque()
        self.arrived: list[Sequence] = []  # since the last admission: told if they must wait
        self.slots: list[Sequence | None] = [None] * config.num_slots
        # the watermarks in pages: park before a step passes HIGH, restore only below LOW
        self.high_pages = int(self.pool.num_pages * config.preempt_high)
        self.low_pages = int(self.pool.num_pages * config.preempt_low)
        self.speculator = Speculator(config.spec, config.max_context)  # drafts, after the grant

    def notify(self, seq: Sequence, event: SeqEvent) -> None:
        if event is SeqEvent.FINISHED:
            self.on_finish(seq)
        seq.on_event(event)

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
        return bool(self.waiting or self.active or self.swapper.num_in_flight)

    # ---- admission and endings ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.arrived.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason | str,
               error: str | None = None) -> None:
        """End a sequence once, giving back all it holds; `error` says what went wrong."""
        if seq.is_finished:
            return
        seq.parking.end(time.monotonic())
        self.swapper.cancel(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot_id is not None:
            self.slots[seq.slot_id] = None
        seq.mark_finished(FinishReason(reason), error, time.monotonic())
        log.debug("seq %s finished: %s %s", seq.request_id, seq.finish_reason.value, error or "")
        self.notify(seq, SeqEvent.FINISHED)

    def abort_all(self, reason: FinishReason, error: str) -> None:
        for seq in [*self.waiting, *self.active]:
            self.finish(seq, reason, error)

    def _admit(self) -> None:
        for slot_id, occupant in enumerate(self.slots):
            eligible = [s for s in self.waiting if not policy.sibling_prefilling(
                s, self.running, self.pool.cache is not None)]
            if occupant is not None or not eligible:
                continue
            # highest priority first, first come first served within a priority
            seq = max(eligible, key=lambda s: (s.priority, -s.arrival, -s.seq_id))
            self.waiting.remove(seq)
            seq.slot_id, seq.phase = slot_id, Phase.RUNNING
            self.slots[slot_id] = seq
            if len(seq.tokens) + 1 > self.pool.capacity_tokens:
                self.finish(seq, FinishReason.PROMPT_TOO_LONG, CONTEXT_EXCEEDED)
            elif seq.params.prompt_logprobs is None:  # those need every prompt row computed
                self.pool.take_cached_prefix(seq)
        # once, to each newcomer left without a slot: its stream says so and keeps alive
        for seq in [s for s in self.arrived if s.phase is Phase.WAITING]:
            self.notify(seq, SeqEvent.QUEUED)
        self.arrived = []

    # ---- the step plan -----------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        self.reap_copies()
        self._admit()
        if self.config.preempt:
            self._restore_parked()
            self._force_parks()
        ps = self.pool.page_size
        while True:
            plan, blocked = grant_pages(step_order(self.running), self.config.batch_size,
                                        self.pool.num_free_pages, ps)
            # would the step pass the high watermark (a granted step never passes the pool)?
            over_high = not blocked and self.config.preempt and policy.passes_high(
                self.pool.num_used_pages, len(self.swapper.pages_in_flight),
                step_pages(plan, ps), self.high_pages)
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
            self.finish(latest, FinishReason.CONTEXT_EXCEEDED, CONTEXT_EXCEEDED)
        if self.config.spec.enabled:  # drafts take unused pages only: they evict nothing
            unused = self.pool.num_free_pages - self.pool.num_cached_pages
            plan = add_drafts(plan, self.speculator, self.config.batch_size, unused, ps)
        for item in plan:
            item.seq.page_table.extend(self.pool.allocate(item.new_pages(ps)))
        return plan

    # ---- parking -----------------------------------------------------------------------------
    def park(self, seq: Sequence, wait: bool = True) -> PreemptMode:
        """Park a running sequence: swap or recompute, the policy's choice on the swap's cost."""
        assert seq.phase is Phase.RUNNING, f"cannot park a {seq.phase.value} sequence"
        plan = self.swapper.plan_park(seq)
        mode = policy.choose_mode(plan.swap_bytes, plan.budget_bytes, plan.held_bytes)
        result = self.swapper.park(seq, plan, mode, wait)
        seq.parking.begin(result.mode, time.monotonic())
        self.stats.count_park(result.mode, result.fell_back)
        seq.phase = Phase.PARKED
        self.notify(seq, SeqEvent.PARKED)
        return result.mode

    def park_manually(self, seq: Sequence) -> None:
        """POST /slots/{id}?action=park: the normal mode decision; stays parked until unpark."""
        if seq.phase is Phase.RUNNING:
            self.park(seq)
        seq.parking.manual = True

    def unpark(self, seq: Sequence) -> None:
        """POST /slots/{id}?action=unpark: resume now if it fits, else join the restore queue."""
        seq.parking.manual = False
        if seq.phase is not Phase.PARKED or self.swapper.is_busy(seq):
            return
        need = self.pool.pages_for(policy.restore_need_tokens(seq, self.config.batch_size))
        if self.pool.can_allocate(need):
            self.resume(seq)

    def _force_parks(self) -> None:
        every = self.config.preempt_every  # 0: off
        for seq in self.running if every > 0 else ():
            if seq.parking.tokens_since_forced >= every and not seq.in_family:
                self.park(seq)

    # ---- restoring ---------------------------------------------------------------------------
    def _restore_parked(self) -> None:
        parked = [s for s in self.parked if not s.parking.manual and not self.swapper.is_busy(s)]
        running = self.running
        promised = policy.promised_pages(running, self.pool.page_size, self.config.batch_size)
        room = policy.PoolRoom(self.pool.num_free_pages - promised,
                               self.pool.num_used_pages + promised, self.low_pages,
                               self.pool.capacity_tokens, self.pool.page_size,
                               self.config.spec.n_spec)
        restores = policy.plan_restores(
            policy.restore_order(parked, self.config.resume_order), room,
            self.config.batch_size, self.config.resume_order == "fair", bool(running))
        self.stats.n_restore_refused_watermark += restores.refused_by_watermark
        for seq in restores.never_fit:
            self.finish(seq, FinishReason.CONTEXT_EXCEEDED, CONTEXT_EXCEEDED)
        for seq in restores.resume:
            self.resume(seq)

    def resume(self, seq: Sequence) -> None:
        """Give a parked sequence its pages back; an asynchronous copy completes it later."""
        assert seq.phase is Phase.PARKED, f"cannot resume a {seq.phase.value} sequence"
        if not self.swapper.resume(seq):
            return  # stays parked (and busy) until the copy lands: see reap_copies
        self._mark_resumed(seq)

    def reap_copies(self) -> None:
        """Settle swap copies that have landed and wake the sequences whose resume did."""
        for seq in self.swapper.reap():
            self._mark_resumed(seq)

    def wait_for_copies(self) -> bool:
        """Block until every copy in flight has landed, then settle them (idle or shutdown);
        False when none was in flight."""
        waited = bool(self.swapper.num_in_flight)
        for seq in self.swapper.wait_all():
            self._mark_resumed(seq)
        return waited

    def _mark_resumed(self, seq: Sequence) -> None:
        """Count a landed resume: every full page back from a cache tier, no replay: cached."""
        parked_for, parked_by = seq.parking.end(time.monotonic()), seq.parking.mode
        report = self.swapper.resume_report(seq)
        cached = policy.came_back_cached(report.released_pages, report.restored_pages,
                                         report.replay_tokens)
        seq.parking.resumed_from = report.sources
        seq.parking.mode = PreemptMode.CACHED if cached else parked_by
        self.stats.count_resume(report.replay_tokens, cached)
        log.info("seq %s (slot %s) resumed after %.1f ms parked by %s: %d tokens back in the pool "
                 "(from %s), %d to replay", seq.request_id, seq.slot_id, parked_for * 1e3,
                 parked_by.value, seq.num_computed, "+".join(report.sources), report.replay_tokens)
        seq.phase = Phase.RUNNING
        self.notify(seq, SeqEvent.RESUMED)

    # ---- after the step ----------------------------------------------------------------------
    def advance(self, item: ScheduledSeq, sampled: int | None, since: int) -> None:
        """Count the fed tokens (cache pages complete from token `since` on); add the sample."""
        seq = item.seq
        seq.num_computed += item.num_tokens
        self.pool.register_complete(seq, since)
        if seq.parking.replay_until and seq.num_computed >= seq.parking.replay_until:
            seq.parking.replay_until = 0
            self.notify(seq, SeqEvent.RECOMPUTED)
        if sampled is not None:
            seq.tokens.append(sampled)
            seq.parking.tokens_since_forced += 1
