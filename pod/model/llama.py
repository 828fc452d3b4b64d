"""The llama-family decoder (Llama, SmolLM2, Qwen2/3) over a paged KV pool.

The model only knows tokens, positions and an attention backend that was planned for the step;
which sequence owns which page is the runner's business.

On the CPU a decode step is bound by reading the weights, so the linears are what this file is
careful about: each weight is packed once for oneDNN (see `Linear`), and with `batch_invariant`
every GEMM sees at least `MIN_INVARIANT_ROWS` rows, so a row's result never depends on which
other rows share the step.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

from kvpark.kernels.attention import AttentionBackend

from .config import ModelConfig

# A GEMM of very few rows takes a different kernel whose sums round differently: oneDNN (the CPU
# path here) for 1 row, MKL's sgemm (F.linear) for 1-3 rows on one thread and up to 11 on two.
# From 4 rows on, oneDNN gives every row the same bits whatever the row count, on any number of
# threads; padding to it makes each row's result independent of the batch it rides in.
MIN_INVARIANT_ROWS = 4


class WeightFormat(str, enum.Enum):
    """How the big linears (attention, MLP, lm_head) hold their weights."""

    FP32 = "fp32"  # the checkpoint's values; fp32 products and sums (exact, the default)
    BF16 = "bf16"  # half the bytes to read; weights, inputs and outputs rounded to bf16 (opt-in)


def can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and weight.dtype in (torch.float32, torch.bfloat16))


class Linear:
    """y = x W^T (+ b); on the CPU the weight is reordered once into oneDNN's blocked layout.

    A decode step's GEMMs have a handful of rows, so they stream the weight: on a 2-core EPYC
    (Zen 5) MKL's sgemm read it at 6-11 GB/s, oneDNN with a prepacked weight at ~23 GB/s, and
    oneDNN is also 3x faster at prefill (MKL takes its AVX2 path on AMD). On CUDA: `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 fmt: WeightFormat = WeightFormat.FP32) -> None:
        self.compute_dtype = torch.bfloat16 if fmt is WeightFormat.BF16 else weight.dtype
        weight = weight.to(self.compute_dtype)
        self.bias = None if bias is None else bias.to(self.compute_dtype)
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, MIN_INVARIANT_ROWS)
                       if can_prepack(weight) else None)
        self.weight = None if self.packed is not None else weight  # no second copy in RAM

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if y.dtype == out_dtype else y.to(out_dtype)


def linear(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    """Every GEMM of the model goes through here (benchmarks/profile_step.py times it)."""
    return layer(x)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it has enough)."""
    return x if x.shape[0] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, the same bits as the four-op form below
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for `apply_rope`: [T, 1, D] each, the sin's first half negated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout) of x: [T, heads, D].

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) as x * cos + (x2, x1) * (-sin, sin): the same
    bits (a - b == a + -b), in four ops instead of nine.
    """
    t, heads, dim = x.shape
    swapped = x.view(t, heads, 2, dim // 2).flip(2).view(t, heads, dim)
    return x * cos + swapped * signed_sin


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 fmt: WeightFormat = WeightFormat.FP32) -> None:
        super().__init__()
        self.config = config
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        self.qkv = Linear(
            torch.cat([weights[f"{attn}.{p}_proj.weight"] for p in "qkv"]),
            torch.cat([weights[f"{attn}.{p}_proj.bias"] for p in "qkv"])
            if config.attention_bias else None,
            fmt,
        )
        self.o = Linear(weights[f"{attn}.o_proj.weight"], None, fmt)
        self.gate_up = Linear(torch.cat([weights[f"{mlp}.gate_proj.weight"],
                                         weights[f"{mlp}.up_proj.weight"]]), None, fmt)
        self.down = Linear(weights[f"{mlp}.down_proj.weight"], None, fmt)
        # the dense weights under their old names (None once packed), for byte counts
        self.qkv_weight, self.qkv_bias = self.qkv.weight, self.qkv.bias
        self.o_weight, self.gate_up_weight = self.o.weight, self.gate_up.weight
        self.down_weight = self.down.weight
        self.input_norm = weights[f"{prefix}.input_layernorm.weight"]
        self.post_attn_norm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.q_norm = weights.get(f"{attn}.q_norm.weight") if config.qk_norm else None
        self.k_norm = weights.get(f"{attn}.k_norm.weight") if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, kv_cache: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
        """x: [rows, hidden], of which the first `num_tokens` are real (the rest pad GEMMs)."""
        c = self.config
        rows = x.shape[0]
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = linear(h, self.qkv)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        v = qkv[:, q_size + kv_size :].view(rows, c.num_kv_heads, c.head_dim)
        if self.q_norm is None:  # RoPE on q and k heads in one go
            qk = qkv[:, : q_size + kv_size].view(rows, c.num_heads + c.num_kv_heads, c.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            if not q.is_cpu:  # FlashInfer wants q dense
                q = q.contiguous()
        else:
            q = qkv[:, :q_size].view(rows, c.num_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(rows, c.num_kv_heads, c.head_dim)
            q = apply_rope(rms_norm(q, self.q_norm, c.rms_norm_eps), cos, sin)
            k = apply_rope(rms_norm(k, self.k_norm, c.rms_norm_eps), cos, sin)
        if num_tokens < rows:
            q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
        backend.append_kv(kv_cache, k, v)
        attn = backend.attend(q, kv_cache).reshape(num_tokens, q_size)
        x = x + linear(pad_rows(attn, rows), self.o)
        h = rms_norm(x, self.post_attn_norm, c.rms_norm_eps)
        gate, up = linear(h, self.gate_up).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 batch_invariant: bool = True,
                 weight_format: WeightFormat = WeightFormat.FP32) -> None:
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        self.weight_format = weight_format
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.head = Linear(weights.get("lm_head.weight", self.embed), None, weight_format)
        self.lm_head = self.head.weight  # dense (None once packed), for byte counts
        self.layers = [
            DecoderLayer(config, weights, f"model.layers.{i}", weight_format)
            for i in range(config.num_layers)
        ]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def min_rows(self) -> int:
        return MIN_INVARIANT_ROWS if self.batch_invariant else 1

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed)."""
        num_tokens = input_ids.shape[0]
        # pad once here rather than at every GEMM: padding rows ride along, never attend
        x = pad_rows(self.embed[input_ids], self.min_rows)
        cos, sin = rope_cos_sin(pad_rows(positions[:, None], self.min_rows)[:, 0],
                                self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, backend, kv_cache, num_tokens)
        return rms_norm(x[:num_tokens], self.final_norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        rows = hidden.shape[0]
        return linear(pad_rows(hidden, self.min_rows), self.head)[:rows].float()
