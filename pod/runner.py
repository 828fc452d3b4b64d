"""Turns a step plan into tensors, runs the model over the paged pool and samples."""

from __future__ import annotations

import torch

from kvpark.kernels.attention import AttentionBackend, StepLayout

from .cuda_graphs import DecodeGraphRunner
from .kv_pool import KVPool
from .model.llama import BlockRows, LlamaModel
from .sampling import Sampled, SamplingParams, get_logprob, process_logits, sample
from .step_plan import ScheduledSeq


class InjectedFault(RuntimeError):
    pass


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, backend: AttentionBackend,
                 graphs: DecodeGraphRunner | None = None, fault_token: int | None = None
                 ) -> None:
        self.model = model
        self.pool = pool
        self.backend = backend
        self.graphs = graphs  # CUDA graphs for decode-only steps
        # --inject-fault-token (tests of fault isolation): a step fails while a sequence whose
        # prompt holds this token id is in it
        self.fault_token = fault_token

    def get_layout(self, plan: list[ScheduledSeq]) -> StepLayout:
        return StepLayout(
            page_tables=[item.seq.page_table for item in plan],
            kv_lens=[item.seq.num_computed + item.num_tokens for item in plan],
            q_lens=[item.num_tokens for item in plan],
            page_size=self.pool.page_size,
        )

    def run(self, plan: list[ScheduledSeq]) -> list[Sampled | None]:
        """Feed every planned chunk; return a sampled token (and its logprobs, if asked for)
        for the rows that reach the end. Changes no sequence: a failed step is rerun."""
        if self.fault_token is not None:
            for item in plan:
                if self.fault_token in item.seq.prompt_ids:
                    raise InjectedFault(f"injected fault in {item.seq.request_id}")
        ids: list[int] = []
        positions: list[int] = []
        for item in plan:
            start = item.seq.num_computed
            ids.extend(item.seq.tokens[start : start + item.num_tokens])
            positions.extend(range(start, start + item.num_tokens))
        device = self.model.device
        layout = self.get_layout(plan)
        rows = None
        if self.model.has_blocks:  # generated-token rows read the GGUF's quantised blocks
            rows = BlockRows.from_mask([p >= item.seq.num_prompt for item in plan
                                        for p in range(item.seq.num_computed,
                                                       item.seq.num_computed + item.num_tokens)])
        if self.graphs is not None and self.graphs.can_run(layout) and rows is None:
            hidden = self.graphs.run(ids, positions, layout)  # a view the next replay rewrites
        else:
            self.backend.plan(layout)
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(positions, dtype=torch.long, device=device),
                self.backend,
                self.pool.caches,
                rows,
            )
        last_rows, sampling = [], []
        end = 0
        for item in plan:
            end += item.num_tokens
            if item.samples:
                last_rows.append(end - 1)
                sampling.append(item)
        sampled: dict[int, Sampled] = {}
        if sampling:
            if len(last_rows) < hidden.shape[0]:  # a decode-only step samples every row
                hidden = hidden[torch.tensor(last_rows, device=device)]
            head_rows = None if rows is None else BlockRows.from_mask(
                [item.seq.num_computed + item.num_tokens - 1 >= item.seq.num_prompt
                 for item in sampling])
            logits = self.model.logits(hidden, head_rows).cpu()
            sampled = self.sample(sampling, logits)
        return [sampled.get(id(item)) for item in plan]

    @staticmethod
    def sample(sampling: list[ScheduledSeq], logits: torch.Tensor) -> dict[int, Sampled]:
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
    def sample_processed(sampling: list[ScheduledSeq], logits: torch.Tensor,
                         params: list[SamplingParams], generators: list[torch.Generator]
                         ) -> dict[int, Sampled]:
        """Per row: logprobs of the raw logits, then penalties, bias and min_tokens, then the
        constraint's mask; then the same draw."""
        raw: dict[int, torch.Tensor] = {}
        for row, (item, p) in enumerate(zip(sampling, params)):
            if p.logprobs is not None:
                raw[row] = torch.log_softmax(logits[row], dim=-1)
            if p.needs_processing:
                logits[row] = process_logits(logits[row], p, item.seq.tokens,
                                             item.seq.num_prompt)
            if item.seq.constraint is not None:
                item.seq.constraint.mask(logits[row])
        tokens = sample(logits, params, generators)
        return {id(item): Sampled(token, get_logprob(raw[row], token, p.logprobs)
                                  if row in raw else None)
                for row, (item, p, token) in enumerate(zip(sampling, params, tokens))}
