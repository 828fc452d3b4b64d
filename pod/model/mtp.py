"""Qwen3.5's multi-token-prediction head (`mtp.*`; GGUF `nextn` blocks): a drafter inside the
checkpoint.

At position p it takes the target's final hidden state there (after the model's final norm: the
row whose logits gave token p + 1) and the embedding of token p + 1, each through its own RMSNorm,
joins them [embedding, hidden] through `fc` (2H -> H), runs one gated full-attention decoder block
(the target's layer kind, with its own K/V at position p) and a final RMSNorm; the target's LM
head then gives its guess of token p + 2. Chained, its own output hidden state stands in for the
target's at the next position. (vLLM's `Qwen3_5MultiTokenPredictor`, llama.cpp's `qwen35` MTP
graph: the embedding and the head are the model's.)
"""

from __future__ import annotations

import torch
from torch import nn

from kvpark.kernels.attention import AttentionBackend

from .config import ModelConfig
from .hybrid import GatedAttentionLayer, HybridModel, offset_norm
from .layers import rms_norm, rope_cos_sin
from .linear import Linear, linear, pad_rows

PREFIX = "mtp"


def has_mtp_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> bool:
    return config.num_mtp_layers > 0 and f"{PREFIX}.fc.weight" in weights


class MTPHead(nn.Module):
    def __init__(self, target: HybridModel, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        config = target.config
        self.config = config
        self.target = target  # its embedding, LM head and row padding
        self.fc = Linear(weights[f"{PREFIX}.fc.weight"], None, target.weight_format)
        self.embed_norm = offset_norm(weights, f"{PREFIX}.pre_fc_norm_embedding.weight",
                                      config.norm_offset)
        self.hidden_norm = offset_norm(weights, f"{PREFIX}.pre_fc_norm_hidden.weight",
                                       config.norm_offset)
        self.final_norm = offset_norm(weights, f"{PREFIX}.norm.weight", config.norm_offset)
        # Qwen3.5 has one block; a checkpoint with more uses the first (as llama.cpp does)
        self.block = GatedAttentionLayer(config, weights, f"{PREFIX}.layers.0",
                                         target.weight_format)

    @property
    def device(self) -> torch.device:
        return self.target.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                backend: AttentionBackend, kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] the tokens after each position; hidden: [T, H] the target's (or this
        head's) final hidden state at each position. Writes the block's K/V at `positions`;
        returns its normed output [T, H] (what the LM head reads, and the next link's input)."""
        c, eps = self.config, self.config.rms_norm_eps
        num_tokens, min_rows = input_ids.shape[0], self.target.min_rows
        embedded = rms_norm(self.target.embed[input_ids], self.embed_norm, eps)
        joined = torch.cat((embedded, rms_norm(hidden.to(embedded.dtype), self.hidden_norm, eps)),
                           dim=-1)
        x = linear(pad_rows(joined, min_rows), self.fc)
        cos, sin = rope_cos_sin(pad_rows(positions[:, None], min_rows)[:, 0], c.rotary_dim,
                                c.rope_theta, x.dtype)
        x = self.block(x, cos, sin, backend, kv_cache, num_tokens)
        return rms_norm(x[:num_tokens], self.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)
