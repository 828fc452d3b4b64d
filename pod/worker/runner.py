"""Turns a step plan into tensors, runs the model over the paged pool and samples."""

from __future__ import annotations

import torch

from kvpark.kernels.attention import AttentionBackend, StepLayout

from ..memory.kv_pool import KVPool
from ..model.linear import BlockRows
from ..model.llama import LlamaModel
from ..model.step_states import StateChunk, StepStates
from ..sampling.sampler import (
    ChunkOutput,
    DraftSeed,
    Sampled,
    SamplingParams,
    TokenLogprob,
    get_logprob,
    get_prompt_logprob,
    post_sampling_logprobs,
    process_logits,
    sample,
)
from ..sampling.verification import verify
from .cuda_graphs import DecodeGraphRunner
from .draft_model import Drafter
from .mtp_drafter import MTPDrafter
from .step_input import PlannedChunk


class InjectedFault(RuntimeError):
    pass


class StateLost(RuntimeError):
    """A hybrid model's step failed after its delta-net layers may have advanced some state
    slots in place: rerunning the step would feed those tokens twice."""


def get_chunk_output(emitted: tuple[Sampled, ...], prompt_logprobs: tuple[TokenLogprob, ...],
                     seed: DraftSeed | None = None) -> ChunkOutput:
    """`emitted`: the chunk's sampled token, then its verified draft rows' tokens; empty when
    the chunk does not reach the end of what its sequence has fed."""
    return ChunkOutput(emitted[0] if emitted else None, prompt_logprobs, emitted[1:], seed)


def prompt_rows(item: PlannedChunk) -> int:
    """How many of the chunk's rows, from its first, are at prompt positions: the rest are
    generated tokens' (first fed or replayed), which read blocks and the float32 attention."""
    seq = item.seq
    return max(0, min(item.num_rows, seq.num_prompt - seq.num_computed))


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, backend: AttentionBackend,
                 graphs: DecodeGraphRunner | None = None, fault_token: int | None = None,
                 drafter: Drafter | MTPDrafter | None = None, fault_late: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.graphs = graphs  # CUDA graphs for decode-only steps
        self.drafter = drafter  # a draft model (--model-draft) or an MTP head: K/V and drafts
        # --inject-fault-token (tests of fault isolation): a step fails while a sequence whose
        # prompt holds this token id is in it
        self.fault_token = fault_token
        self.fault_late = fault_late  # ... after the forward (a hybrid's state written)

    def get_layout(self, plan: list[PlannedChunk]) -> StepLayout:
        return StepLayout(
            page_tables=[item.seq.page_table for item in plan],
            kv_lens=[item.seq.num_computed + item.num_rows for item in plan],
            q_lens=[item.num_rows for item in plan],
            page_size=self.pool.page_size,
            prompt_rows=[prompt_rows(item) for item in plan],
        )

    def run(self, plan: list[PlannedChunk]) -> list[ChunkOutput]:
        """Feed every planned chunk (and its draft rows); return a sampled token (and its
        logprobs, if asked for) for the rows that reach the end, the tokens its verified draft
        rows add, and the prompt rows' logprobs where asked for.
        Changes no sequence: a failed step is rerun."""
        if not self.fault_late:
            self.check_fault(plan)  # before anything is written: the step can be rerun
        if self.pool.states is not None:
            try:
                return self.run_checked(plan)
            except Exception as exc:
                raise StateLost(f"{type(exc).__name__}: {exc}") from exc
        return self.run_checked(plan)

    def run_checked(self, plan: list[PlannedChunk]) -> list[ChunkOutput]:
        if self.drafter is not None:  # first: the draft model's pass and its drafts
            plan = self.drafter.fill(plan)
        from_blocks = self.get_block_mask(plan)
        rows = None if from_blocks is None else BlockRows.from_mask(from_blocks)
        hidden = self.forward(plan, rows)
        if self.fault_late:
            self.check_fault(plan)
        prompt_logprobs = self.prompt_logprobs(plan, hidden, rows)
        sampled = self.sample_ends(plan, hidden, from_blocks)
        # an MTP head: level with the target over the rows this step made valid, and its seeds
        seeds = self.drafter.after_step(plan, hidden, sampled) if self.drafter else {}
        return [get_chunk_output(sampled.get(id(item), ()), prompt_logprobs.get(id(item), ()),
                                 seeds.get(id(item))) for item in plan]

    def get_block_mask(self, plan: list[PlannedChunk]) -> list[bool] | None:
        """Per fed row: does it read the GGUF's quantised blocks? Generated-token rows do, a
        property of each row alone (draft rows are generated-token rows: they get the bits
        their plain decode would). None: the model has no blocks."""
        if not self.model.has_blocks:
            return None
        mask: list[bool] = []
        for item in plan:
            dense = prompt_rows(item)
            mask.extend([False] * dense + [True] * (item.num_rows - dense))
        return mask

    def check_fault(self, plan: list[PlannedChunk]) -> None:
        if self.fault_token is not None:
            for item in plan:
                if self.fault_token in item.seq.prompt_ids:
                    raise InjectedFault(f"injected fault in {item.seq.request_id}")

    def forward(self, plan: list[PlannedChunk], rows: BlockRows | None) -> torch.Tensor:
        """The final hidden state of every fed row, by a captured graph where one fits."""
        ids: list[int] = []
        positions: list[int] = []
        for item in plan:
            start = item.seq.num_computed
            ids.extend(item.seq.tokens[start : start + item.num_tokens])
            ids.extend(item.draft)
            positions.extend(range(start, start + item.num_rows))
        layout = self.get_layout(plan)
        if self.graphs is not None and self.graphs.can_run(layout) and rows is None:
            return self.graphs.run(ids, positions, layout)  # a view the next replay rewrites
        self.backend.plan(layout)
        device = self.model.device
        states = {} if self.pool.states is None else {"states": self.step_states(plan)}
        return self.model(torch.tensor(ids, dtype=torch.long, device=device),
                          torch.tensor(positions, dtype=torch.long, device=device),
                          self.backend, self.pool.caches, rows, **states)

    def step_states(self, plan: list[PlannedChunk]) -> StepStates:
        """Each chunk's state slot (its sequence's slot) and rows; a chunk at position 0
        starts from the zero state; a chunk with drafts keeps the state after each row."""
        chunks, row = [], 0
        for item in plan:
            chunks.append(StateChunk(item.seq.slot_id, row, item.num_rows,
                                     fresh=item.seq.num_computed == 0,
                                     keep_rows=bool(item.draft)))
            row += item.num_rows
        return self.pool.states.step_states(tuple(chunks))

    def sample_ends(self, plan: list[PlannedChunk], hidden: torch.Tensor,
                    from_blocks: list[bool] | None) -> dict[int, tuple[Sampled, ...]]:
        """The tokens of each chunk that reaches the end of what its sequence has fed: from
        its last row, or from its last token's row and its draft rows, verified (the head
        reads the blocks where each row did)."""
        head, sampling = [], []  # rows the head reads; the items they belong to
        end = 0
        for item in plan:
            end += item.num_rows
            if item.samples:
                head.extend(range(end - 1 - len(item.draft), end))
                sampling.append(item)
        if not sampling:
            return {}
        if len(head) < hidden.shape[0]:  # a decode-only step samples every row
            hidden = hidden[torch.tensor(head, device=self.model.device)]
        head_rows = None if from_blocks is None else BlockRows.from_mask(
            [from_blocks[row] for row in head])
        return self.sample_verified(sampling, self.model.logits(hidden, head_rows).cpu())

    @staticmethod
    def sample_verified(sampling: list[PlannedChunk], logits: torch.Tensor
                        ) -> dict[int, tuple[Sampled, ...]]:
        """logits: [rows, vocab], 1 + len(draft) rows per item, in order. Items without a draft
        are sampled together as always; a drafted item's rows one at a time, in order, until a
        sample differs from the next draft token (`sampling/verification.py`)."""
        found: dict[int, tuple[Sampled, ...]] = {}
        plain, plain_rows = [], []
        at = 0
        for item in sampling:
            if item.draft:  # speculation: plain requests only (see Speculator.can_draft)
                found[id(item)] = ModelRunner.verify_draft(item, logits[at:at + 1 + len(
                    item.draft)])
            else:
                plain.append(item)
                plain_rows.append(at)
            at += 1 + len(item.draft)
        if plain:
            picked = logits if len(plain_rows) == logits.shape[0] else logits[plain_rows]
            found.update((key, (s,)) for key, s in ModelRunner.sample(plain, picked).items())
        return found

    def prompt_logprobs(self, plan: list[PlannedChunk], hidden: torch.Tensor,
                        rows: BlockRows | None) -> dict[int, tuple[TokenLogprob, ...]]:
        """For sequences that asked: each prompt token's logprob from the row before it, on
        the first pass over that row only (a recompute replay does not record them again).
        The rows' logits come from the same head a decode row of that position would use."""
        found: dict[int, tuple[TokenLogprob, ...]] = {}
        start_row = 0
        for item in plan:
            start_row += item.num_rows
            seq, k = item.seq, item.seq.params.prompt_logprobs
            if k is None:  # nearly every sequence: nothing to compute
                continue
            first = max(seq.num_computed, seq.num_prompt_logprobs)  # row p predicts p + 1
            last = min(seq.num_computed + item.num_tokens, seq.num_prompt - 1)
            if first < last:
                offset = start_row - item.num_rows - seq.num_computed
                picked = hidden[offset + first : offset + last]
                head_rows = None if rows is None else BlockRows.all_dense(len(picked))
                raw = torch.log_softmax(self.model.logits(picked, head_rows).float().cpu(), -1)
                found[id(item)] = tuple(
                    get_prompt_logprob(raw[i], seq.prompt_ids[p + 1], k)
                    for i, p in enumerate(range(first, last)))
        return found

    @staticmethod
    def verify_draft(item: PlannedChunk, logits: torch.Tensor) -> tuple[Sampled, ...]:
        """logits: [1 + len(draft), vocab]: each row drawn as plain decoding draws it, with
        the sequence's generator, one row at a time and only as far as the drafts match."""
        params, generator = [item.seq.params], [item.seq.generator]
        tokens = verify(item.draft, lambda row: sample(logits[row:row + 1], params, generator)[0])
        return tuple(Sampled(token) for token in tokens)

    @staticmethod
    def sample(sampling: list[PlannedChunk], logits: torch.Tensor) -> dict[int, Sampled]:
        """logits: [rows, vocab] float32, one row per item -> each item's sampled token."""
        params = [item.seq.params for item in sampling]
        generators = [item.seq.generator for item in sampling]
        if all(p.is_plain for p in params) and all(i.seq.constraint is None for i in sampling):
            # default requests: one batched draw, no per-row work (the common step)
            tokens = sample(logits, params, generators)
            return {id(item): Sampled(token) for item, token in zip(sampling, tokens)}
        return ModelRunner.sample_processed(sampling, logits, params, generators)

    @staticmethod
    @torch.inference_mode()  # the model's logits are inference tensors: rows change in place
    def sample_processed(sampling: list[PlannedChunk], logits: torch.Tensor,
                         params: list[SamplingParams], generators: list[torch.Generator]
                         ) -> dict[int, Sampled]:
        """Per row: logprobs of the raw logits, then penalties, bias and min_tokens, then the
        constraint's mask; then the same draw."""
        raw: dict[int, torch.Tensor] = {}
        for row, (item, p) in enumerate(zip(sampling, params)):
            if p.logprobs is not None and not p.post_sampling_probs:
                raw[row] = torch.log_softmax(logits[row], dim=-1)
            if p.needs_processing:
                logits[row] = process_logits(logits[row], p, item.seq.tokens,
                                             item.seq.num_prompt)
            if item.seq.constraint is not None:
                item.seq.constraint.mask(logits[row])
            if p.logprobs is not None and p.post_sampling_probs:
                raw[row] = post_sampling_logprobs(logits[row], p)
        tokens = sample(logits, params, generators)
        return {id(item): Sampled(token, get_logprob(raw[row], token, p.logprobs)
                                  if row in raw else None)
                for row, (item, p, token) in enumerate(zip(sampling, params, tokens))}
