"""The llama-family decoder (Llama, SmolLM2, Qwen2/3) over a paged KV pool.

The model only knows tokens, positions and an attention backend that was planned for the step;
which sequence owns which page is the runner's business.

On the CPU a decode step is bound by reading the weights, so the linears are what this file is
careful about: each weight is packed once for oneDNN (see `Linear`), and with `batch_invariant`
every GEMM sees at least `MIN_INVARIANT_ROWS` rows, so a row's result never depends on which
other rows share the step. Rows that read a GGUF's blocks (`BlockRows`) take two C calls a layer
around the attention (`kernels/layer_ops.py`) instead of ~25 torch ops: at batch 1 the step is
bound by per-op dispatch as much as by the weights.
"""

from __future__ import annotations

import torch

from kvpark.kernels import layer_ops
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.cpu_paged import KV_DTYPES
from kvpark.kernels.prompt_stack import PromptPlan, PromptStack
from kvpark.kernels.quant_linear import QuantizedWeight

from .config import ModelConfig
from .decoder_base import DecoderBase
from .layers import DecoderLayer, all_dense, fused_blocks, rms_norm, rope_cos_sin
from .linear import BlockRows, Linear, WeightFormat, pad_rows


class LlamaModel(DecoderBase):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 batch_invariant: bool = True,
                 weight_format: WeightFormat = WeightFormat.FP32,
                 quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """`quantized`: a GGUF's blocks by weight name; decode rows then read them (CPU only)."""
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        self.weight_format = weight_format
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        head_name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        self.head = Linear(weights[head_name], None, weight_format,
                           fused_blocks(quantized, [head_name]))
        self.lm_head = self.head.weight  # dense (None once packed), for byte counts
        self.layers = [
            DecoderLayer(config, weights, f"model.layers.{i}", weight_format, quantized)
            for i in range(config.num_layers)
        ]
        # generated-token rows read quantised blocks where the runner says so (`BlockRows`)
        self.has_blocks = self.head.blocks is not None or any(
            layer.qkv.blocks is not None for layer in self.layers)
        fused = [layer.fused for layer in self.layers]
        # a step whose rows all read blocks: every layer in one C call (same bits as the loop)
        self.stack = layer_ops.FusedStack(fused) if fused and all(fused) else None
        # a step of prompt rows only on AMX: every layer in one C call (same bits as the loop)
        prompt = [layer.prompt_weights() for layer in self.layers]
        self.prompt_stack = PromptStack(prompt) if prompt and all(prompt) else None

    def drop_blocks(self) -> None:
        """Every row dense from now on (`--weights auto` measured float32 faster here)."""
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                lin.blocks = None
            layer.fused = None
        self.stack = None
        self.head.blocks = None
        self.has_blocks = False

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, kv_caches: list[torch.Tensor],
                rows: BlockRows | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed). `rows`: which
        rows read quantised blocks (with none, or no `rows`, every linear is dense)."""
        num_tokens = input_ids.shape[0]
        if not self.has_blocks:
            rows = None
        # pad once here rather than at every GEMM: padding rows ride along, never attend; with
        # `rows`, `Linear` pads only the dense rows (the block kernel needs none)
        min_rows = 1 if rows is not None else self.min_rows
        x = pad_rows(self.embed[input_ids], min_rows)
        cos, sin = rope_cos_sin(pad_rows(positions[:, None], min_rows)[:, 0],
                                self.config.head_dim, self.config.rope_theta, x.dtype)
        if self.can_stack(rows, backend, kv_caches):
            plan = backend.c_plan(self.config.head_dim, kv_caches[0].dtype)
            x = self.stack.decode(x, cos, sin, kv_caches, plan)
        elif (prompt_plan := self.prompt_plan(rows, backend, kv_caches)) is not None:
            x = self.prompt_stack.run(x, cos[:, 0], sin[:, 0], kv_caches, prompt_plan)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(x, cos, sin, backend, kv_cache, num_tokens, rows)
        return rms_norm(x[:num_tokens], self.final_norm, self.config.rms_norm_eps)

    def prompt_plan(self, rows: BlockRows | None, backend: AttentionBackend,
                    kv_caches: list[torch.Tensor]) -> PromptPlan | None:
        """Every row dense and a prompt row of the C attention's AMX kernel, every layer on the
        AMX path: `PromptStack` takes the step with this plan (else None)."""
        if (self.prompt_stack is None or not all_dense(rows)
                or not hasattr(backend, "c_prompt_plan") or not self.c_reads(kv_caches)):
            return None
        return backend.c_prompt_plan(self.config.head_dim, kv_caches[0].dtype)

    def can_stack(self, rows: BlockRows | None, backend: AttentionBackend,
                  kv_caches: list[torch.Tensor]) -> bool:
        """All rows read blocks and the C attention runs: `FusedStack` takes the step."""
        return (self.stack is not None and rows is not None and rows.num_dense == 0
                and hasattr(backend, "c_plan") and self.c_reads(kv_caches))

    def c_reads(self, kv_caches: list[torch.Tensor]) -> bool:
        """The layers' caches are what a one-call stack hands C: contiguous, of one type its
        kernels read."""
        caches = kv_caches[:len(self.layers)]
        return caches[0].dtype in KV_DTYPES and all(
            c.dtype == caches[0].dtype and c.is_contiguous() for c in caches)
