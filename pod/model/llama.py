"""The llama-family decoder (Llama, SmolLM2, Qwen2/3) over a paged KV pool.

The model only knows tokens, positions and an attention backend that was planned for the step;
which sequence owns which page is the runner's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpark.kernels.attention import AttentionBackend

from .config import ModelConfig

# On the CPU, a GEMM with fewer than this many rows takes a different kernel whose sums round
# differently; padding to it makes every row's result independent of the batch it rides in.
MIN_INVARIANT_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           batch_invariant: bool) -> torch.Tensor:
    rows = x.shape[0]
    if batch_invariant and rows < MIN_INVARIANT_ROWS:
        padded = x.new_zeros(MIN_INVARIANT_ROWS, x.shape[1])
        padded[:rows] = x
        return F.linear(padded, weight, bias)[:rows]
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D], rotate-half layout (Hugging Face)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 batch_invariant: bool) -> None:
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.qkv_weight = torch.cat([weights[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        self.qkv_bias = (
            torch.cat([weights[f"{attn}.{p}_proj.bias"] for p in "qkv"])
            if config.attention_bias else None
        )
        self.o_weight = weights[f"{attn}.o_proj.weight"]
        self.gate_up_weight = torch.cat(
            [weights[f"{mlp}.gate_proj.weight"], weights[f"{mlp}.up_proj.weight"]]
        )
        self.down_weight = weights[f"{mlp}.down_proj.weight"]
        self.input_norm = weights[f"{prefix}.input_layernorm.weight"]
        self.post_attn_norm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.q_norm = weights.get(f"{attn}.q_norm.weight") if config.qk_norm else None
        self.k_norm = weights.get(f"{attn}.k_norm.weight") if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, kv_cache: torch.Tensor) -> torch.Tensor:
        c = self.config
        tokens = x.shape[0]
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = linear(h, self.qkv_weight, self.qkv_bias, self.batch_invariant)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[:, :q_size].view(tokens, c.num_heads, c.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size :].view(tokens, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, c.rms_norm_eps)
            k = rms_norm(k, self.k_norm, c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.append_kv(kv_cache, k, v)
        attn = backend.attend(q, kv_cache).reshape(tokens, q_size)
        x = x + linear(attn, self.o_weight, None, self.batch_invariant)
        h = rms_norm(x, self.post_attn_norm, c.rms_norm_eps)
        gate, up = linear(h, self.gate_up_weight, None, self.batch_invariant).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down_weight, None, self.batch_invariant)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 batch_invariant: bool = True) -> None:
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed)
        self.layers = [
            DecoderLayer(config, weights, f"model.layers.{i}", batch_invariant)
            for i in range(config.num_layers)
        ]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        x = self.embed[input_ids]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, backend, kv_cache)
        return rms_norm(x, self.final_norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return linear(hidden, self.lm_head, None, self.batch_invariant).float()
