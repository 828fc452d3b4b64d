"""Plans one step and takes in what it produced; the one writer of a sequence's pages and counts.

Before a step: admission, restores, forced parks, chunked prefill, decode and its drafts; it
parks victims (the pure policy in `preemption.py`, carried out by the `Swapper`) when the pool
cannot give a step pages. After it (`update_from_output`): the tokens computed, each sampled
token through the stop rules (`stopping.py`), a draft's verified tokens, and the pages only
rejected drafts reached given back. The pool, the swapper and the runner report pages and counts
back as values; this module writes them onto the sequence."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from ..memory.kv_pool import KVPool
from ..sampling.sampler import ChunkOutput, Sampled
from . import checkpointing, step_failure, step_plan
from . import preemption as policy
from .messages import CONTEXT_EXCEEDED, FinishReason, SeqEvent
from .reporting import report
from .scheduler_config import SchedulerConfig
from .sequence import Phase, PreemptMode, Sequence
from .speculation import Speculator, pages_past
from .step_plan import ScheduledSeq, StepCandidates, add_drafts, grant_pages, step_pages
from .stopping import stop_reason
from .swap import Resumed, Swapper

log = logging.getLogger("kvpark.scheduler")


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, swapper: Swapper,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.pool = pool
        self.eos_token_ids = eos_token_ids
        # parks' copies (on CUDA in flight while others decode: a busy sequence is not chosen)
        self.swapper = swapper
        self.stats = policy.PreemptStats()  # counted here, where the decisions are
        self.on_finish: Callable[[Sequence], None] = lambda seq: None  # metrics hook
        # engine-thread observers (tests, benchmarks) of every event, before it is reported
        self.on_event: Callable[[Sequence, SeqEvent], None] = lambda seq, event: None
        self.waiting: deque[Sequence] = deque()
        self.arrived: list[Sequence] = []  # since the last admission: told if they must wait
        self.slots: list[Sequence | None] = [None] * config.num_slots
        # the watermarks in pages: park before a step passes HIGH, restore only below LOW
        self.high_pages = int(self.pool.num_pages * config.preempt_high)
        self.low_pages = int(self.pool.num_pages * config.preempt_low)
        self.speculator = Speculator(config.spec, config.max_context)  # drafts, after the grant
        self.candidates = StepCandidates(config.prefill_first, config.batch_size)

    def notify(self, seq: Sequence, event: SeqEvent, text: str = "") -> None:
        if event is SeqEvent.FINISHED:
            self.on_finish(seq)
        self.on_event(seq, event)
        report(seq, event, text)

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
        self._offer_checkpoint(seq)
        self.swapper.cancel(seq)
        seq.page_table = []
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot_id is not None:
            self.slots[seq.slot_id] = None
        seq.mark_finished(FinishReason(reason), error, time.monotonic())
        log.debug("seq %s finished: %s %s", seq.request_id, seq.finish_reason.value, error or "")
        visible = seq.output.visible  # what was held back as a possible stop string
        self.notify(seq, SeqEvent.FINISHED,
                    visible.finish() if visible is not None and not seq.failed else "")

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
                self._take_cached_prefix(seq)
        # once, to each newcomer left without a slot: its stream says so and keeps alive
        for seq in [s for s in self.arrived if s.phase is Phase.WAITING]:
            self.notify(seq, SeqEvent.QUEUED)
        self.arrived = []

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Share the longest cached whole-page prefix of a new sequence's prompt, keeping at
        least one token to compute (its logits give the first sample)."""
        if self.pool.cache is None:
            return
        self._hash_pages(seq, (seq.num_prompt - 1) // self.pool.page_size)
        found = self.pool.take_cached_prefix(seq.page_hashes, seq.num_prompt)
        seq.page_table, ps = found.pages, self.pool.page_size
        if self.pool.checkpoints is not None:  # a hybrid: only up to a state checkpoint
            seq.page_table = checkpointing.cut_to_checkpoint(
                self.pool, self.pool.checkpoints, seq.slot_id, seq.page_hashes, found.pages)
        seq.cached_from = found.sources(len(seq.page_table))
        seq.num_computed = seq.num_cached = seq.checkpoint_at = len(seq.page_table) * ps

    def _hash_pages(self, seq: Sequence, num_full_pages: int) -> None:
        """The prefix cache's hashes of the sequence's first `num_full_pages` pages."""
        seq.page_hashes = self.pool.cache.grow_hashes(seq.page_hashes, seq.tokens,
                                                      seq.num_prompt, num_full_pages)

    # ---- the step plan -----------------------------------------------------------------------
    def schedule(self) -> list[ScheduledSeq]:
        self.reap_copies()
        self._admit()
        if self.config.preempt:
            self._restore_parked()
            self._force_parks()
        ps = self.pool.page_size
        while True:
            plan, blocked = grant_pages(self.candidates.pick(self.running),
                                        self.config.batch_size, self.pool.num_free_pages, ps,
                                        prompt_checkpoints=self.pool.checkpoints is not None)
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
        plan = step_failure.isolate(plan)
        if self.config.spec.enabled:  # drafts take unused pages only: they evict nothing
            unused = self.pool.num_free_pages - self.pool.num_cached_pages
            plan = add_drafts(plan, self.speculator, self.config.batch_size, unused, ps)
        for item in plan:
            item.seq.page_table.extend(self.pool.allocate(item.new_pages(ps)))
        self.candidates.stepped(plan)
        return plan

    # ---- parking -----------------------------------------------------------------------------
    def park(self, seq: Sequence, wait: bool = True, recompute: bool = False) -> PreemptMode:
        """Park a running sequence: swap or recompute, by policy (`recompute`: a failed step's)."""
        assert seq.phase is Phase.RUNNING, f"cannot park a {seq.phase.value} sequence"
        self._offer_full_pages(seq)
        plan = self.swapper.plan_park(seq)
        mode = PreemptMode.RECOMPUTE if recompute else policy.choose_mode(
            plan.swap_bytes, plan.budget_bytes, plan.held_bytes)
        result = self.swapper.park(seq, plan, mode, wait)
        seq.page_table = []
        if result.mode is PreemptMode.RECOMPUTE:  # a draft model's K/V replay with the target's
            self._offer_checkpoint(seq)  # (a snapshot, untouched by the park) its replay's start
            seq.parking.replay_until, seq.num_computed = seq.num_computed, 0
            seq.spec.draft_lag = 0
        seq.parking.begin(result.mode, time.monotonic())
        self.stats.count_park(result.mode, result.fell_back)
        seq.phase = Phase.PARKED
        self.notify(seq, SeqEvent.PARKED)
        return result.mode

    def _offer_full_pages(self, seq: Sequence) -> None:
        """With a prefix cache: its full computed pages registered, so that they stay cached
        when a park lets go of them, and remembered for the resume."""
        if self.pool.cache is None:
            return
        kept = seq.num_complete // self.pool.page_size
        self._hash_pages(seq, kept)
        self.pool.register_complete(seq.page_table, seq.page_hashes[:kept], 0)
        seq.parking.cached_pages = seq.page_table[:kept]

    def _offer_checkpoint(self, seq: Sequence) -> None:
        """A hybrid with a prefix cache: its snapshot (the state at its latest page boundary)
        kept as a checkpoint, for a conversation that comes back or its own replay."""
        if self.pool.checkpoints is not None and seq.slot_id is not None:
            checkpointing.offer(self.pool, self.pool.checkpoints, seq.slot_id,
                                seq.checkpoint_at, seq.page_hashes)

    def park_manually(self, seq: Sequence) -> None:
        """POST /slots/{id}?action=park: the normal mode decision; stays parked until unpark."""
        if seq.phase is Phase.RUNNING:
            self.park(seq)
        seq.parking.manual = True

    def unpark(self, seq: Sequence) -> None:
        """POST /slots/{id}?action=unpark: resume now if it fits, else join the restore queue."""
        seq.parking.manual = False
        if seq.phase is not Phase.PARKED or seq.parking.waits or self.swapper.is_busy(seq):
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
        parked = [s for s in self.parked if not s.parking.waits and not self.swapper.is_busy(s)]
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
        resumed = self.swapper.resume(seq)
        if resumed is not None:  # else parked (and busy) until the copy lands: reap_copies
            self._mark_resumed(seq, resumed)

    def reap_copies(self) -> None:
        """Settle swap copies that have landed and wake the sequences whose resume did."""
        for seq, resumed in self.swapper.reap():
            self._mark_resumed(seq, resumed)

    def wait_for_copies(self) -> bool:
        """Block until every copy in flight has landed, then settle them; False when none was."""
        waited = bool(self.swapper.num_in_flight)
        for seq, resumed in self.swapper.wait_all():
            self._mark_resumed(seq, resumed)
        return waited

    def _mark_resumed(self, seq: Sequence, resumed: Resumed) -> None:
        """Take a landed resume's pages and counts; count it: every full page back from a
        cache tier and no replay is a cached resume."""
        seq.page_table, seq.num_computed = resumed.page_table, resumed.num_computed
        seq.parking.replay_until = resumed.replay_until
        if not resumed.copied_back and self.pool.checkpoints is not None and seq.num_computed:
            seq.page_table = checkpointing.cut_to_checkpoint(  # the state: from a checkpoint
                self.pool, self.pool.checkpoints, seq.slot_id, seq.page_hashes, seq.page_table)
            seq.num_computed = seq.checkpoint_at = len(seq.page_table) * self.pool.page_size
            if seq.num_computed < resumed.num_computed:  # it replays what it cut
                seq.parking.replay_until = max(resumed.replay_until, resumed.num_computed)
        if not resumed.copied_back:  # registered pages hold every layer's K/V
            seq.spec.draft_lag = 0
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
    def update_from_output(self, plan: list[ScheduledSeq], outputs: list[ChunkOutput],
                           seconds: float) -> None:
        """What a step computed and sampled, taken into each planned sequence."""
        for item, output in zip(plan, outputs):
            if not item.seq.is_finished:
                self._take_output(item, output, seconds)

    def _take_output(self, item: ScheduledSeq, output: ChunkOutput, seconds: float) -> None:
        seq, in_prompt = item.seq, item.seq.in_prompt
        if in_prompt:
            seq.output.prompt_seconds += seconds
        seq.output.prompt_logprobs.extend(output.prompt_logprobs)  # before any event: all there
        seq.failed_steps = 0  # a step of its own succeeded
        if output.mtp_seed is not None:  # draft-mtp: the head's guess for the next step
            seq.spec.mtp_seed = output.mtp_seed
        sampled = output.sampled
        echo_only = sampled is not None and seq.params.scores_only  # nothing generated
        since = seq.num_complete
        self.speculator.draft_model_fed(seq, item.feeds_draft_model, item.num_tokens)
        drafted = item.num_rows - item.num_tokens
        self.advance(item, None if sampled is None or echo_only else sampled.token, since,
                     state_row=0 if drafted else None)
        if in_prompt:  # before the first token's event
            self.notify(seq, SeqEvent.PROGRESS)
        if echo_only:
            self.finish(seq, FinishReason.LENGTH)
        if sampled is None or echo_only:
            return
        if seq.output.first_token_at is None:
            seq.output.first_token_at = time.monotonic()
        if drafted:
            self.speculator.settle(seq, drafted, len(output.verified))
        if self._emit(seq, sampled) and drafted:
            self._accept_verified(seq, output.verified, drafted)

    def _accept_verified(self, seq: Sequence, verified: tuple[Sampled, ...], drafted: int
                         ) -> None:
        """Speculation: each token sampled at a draft row is taken as a decode step of its own
        would take it (the row before it becomes computed, then the same stop checks); once the
        sequence ends the rest are dropped. Then the pages only rejected drafts reached go back:
        between steps a page table holds its computed tokens' pages only, as without drafts. A
        hybrid model's state goes back to the one after the last accepted row the same way."""
        for row, sampled in enumerate(verified, start=1):
            self.advance(ScheduledSeq(seq, 1), sampled.token, seq.num_complete,
                         state_row=None if row == drafted else row)
            if not self._emit(seq, sampled):
                return  # finished: every page went back
        if self.pool.states is not None and len(verified) < drafted:
            self.pool.states.take_back_to_row(seq.slot_id, len(verified))
        drafts_only = pages_past(seq.num_computed, seq.page_table, self.pool.page_size)
        if drafts_only:
            self.pool.free(drafts_only)
            del seq.page_table[-len(drafts_only):]

    def _emit(self, seq: Sequence, sampled: Sampled) -> bool:
        """Hand one sampled token to its sequence and run the stop rules; False when it ended
        the sequence."""
        if seq.constraint is not None:
            seq.constraint.accept(sampled.token)
        is_eos = sampled.token in self.eos_token_ids and not seq.params.ignore_eos
        if not is_eos:  # EOS ends the text; it is not part of it (nor of the logprobs)
            if sampled.logprob is not None:  # before the event: the stream counts them
                seq.output.logprobs.append(sampled.logprob)
            # vLLM: a stop string ends the output only after min_tokens
            can_stop = seq.num_generated > seq.params.min_tokens
            visible = seq.output.visible
            self.notify(seq, SeqEvent.TOKEN,
                        visible.push(sampled.token, can_stop) if visible is not None else "")
        reason = stop_reason(seq, is_eos, self.config.max_context)
        if reason is not None:
            self.finish(seq, reason)
        return reason is None

    def advance(self, item: ScheduledSeq, sampled: int | None, since: int,
                state_row: int | None = None) -> None:
        """Count the fed tokens (cache pages complete from token `since` on); add the sample.
        `state_row`: a hybrid's state after these tokens is not the slot's (a speculative step
        went further) but the one its chunk kept after that row."""
        seq = item.seq
        seq.num_computed += item.num_tokens
        ps, cache = self.pool.page_size, self.pool.cache
        first, full = since // ps, seq.num_complete // ps
        if cache is not None and full > first:
            self._hash_pages(seq, full)
            self.pool.register_complete(seq.page_table, seq.page_hashes[:full], first)
        if self.pool.checkpoints is not None and seq.num_computed % ps == 0:
            checkpointing.snapshot(self.pool, seq.slot_id, state_row)  # a checkpoint to be
            seq.checkpoint_at = seq.num_computed
            if seq.num_computed == step_plan.prompt_page_end(seq, ps):  # the next turn's
                self._offer_checkpoint(seq)
        if seq.parking.replay_until and seq.num_computed >= seq.parking.replay_until:
            seq.parking.replay_until = 0
            self.notify(seq, SeqEvent.RECOMPUTED)
        if sampled is not None:
            seq.tokens.append(sampled)
            seq.parking.tokens_since_forced += 1
