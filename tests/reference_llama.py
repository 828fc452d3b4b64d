"""A plain Hugging Face-style llama forward: the test oracle for the paged model.

No KV cache, no batching, no fusion: every call recomputes the whole sequence in fp32 (or wider),
so a reader can check it line by line against transformers' modeling_llama.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from kvpark.pod.model.config import ModelConfig
from kvpark.pod.model.loader import LoadedModel, load_model_files


@functools.lru_cache(maxsize=1)
def builtin_model() -> LoadedModel:
    """The real SmolLM2 in fp32, loaded once per test session (about 5 s). Do not mutate it."""
    return load_model_files(None)


def reference_logits(loaded: LoadedModel, ids: Sequence[int]) -> torch.Tensor:
    """Logits for every position: [len(ids), vocab]."""
    hidden = _final_hidden(loaded, ids)
    return hidden @ _lm_head(loaded).T


def greedy_generate(
    loaded: LoadedModel, ids: Sequence[int], n: int, stop_at_eos: bool = True
) -> list[int]:
    """Up to n new ids by argmax, recomputing the whole sequence each step."""
    tokens, new = list(ids), []
    for _ in range(n):
        logits = _final_hidden(loaded, tokens)[-1] @ _lm_head(loaded).T
        token = int(torch.argmax(logits))
        new.append(token)
        tokens.append(token)
        if stop_at_eos and token in loaded.tokenizer.eos_token_ids:
            break
    return new


def _final_hidden(loaded: LoadedModel, ids: Sequence[int]) -> torch.Tensor:
    cfg, w = loaded.config, _as_float(loaded.weights)
    x = w["model.embed_tokens.weight"][torch.tensor(list(ids), dtype=torch.long)]  # [T, hidden]
    cos, sin = rope_cos_sin(cfg, len(ids))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        x = x + attention(cfg, w, p, rms_norm(x, w[p + "input_layernorm.weight"], cfg), cos, sin)
        x = x + mlp(w, p, rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg))
    return rms_norm(x, w["model.norm.weight"], cfg)


def _lm_head(loaded: LoadedModel) -> torch.Tensor:
    tied = loaded.config.tie_word_embeddings
    return _widen(loaded.weights["model.embed_tokens.weight" if tied else "lm_head.weight"])


def _as_float(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: _widen(t) for name, t in weights.items()}


def _widen(t: torch.Tensor) -> torch.Tensor:
    # bf16/fp16 weights are compared in fp32; fp64 stays fp64 (useful for tolerance checks).
    return t.cpu() if t.dtype == torch.float64 else t.cpu().float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + cfg.rms_norm_eps) * weight


def rope_cos_sin(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for positions 0..length-1: [T, head_dim], each frequency used twice (rotate-half)."""
    half = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta**half)
    freqs = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)  # [T, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, head_dim]; cos/sin: [T, head_dim] broadcast over heads
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


def attention(
    cfg: ModelConfig, w: dict[str, torch.Tensor], p: str, h: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:
    T, D = h.shape[0], cfg.head_dim
    q = _linear(h, w, p + "self_attn.q_proj").view(T, cfg.num_heads, D)
    k = _linear(h, w, p + "self_attn.k_proj").view(T, cfg.num_kv_heads, D)
    v = _linear(h, w, p + "self_attn.v_proj").view(T, cfg.num_kv_heads, D)
    if cfg.qk_norm:  # Qwen3 normalises each head before RoPE
        q = rms_norm(q, w[p + "self_attn.q_norm.weight"], cfg)
        k = rms_norm(k, w[p + "self_attn.k_norm.weight"], cfg)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # GQA: query head j reads KV head j // group, which is what repeat_interleave lays out.
    k = k.repeat_interleave(cfg.gqa_group, dim=1)  # [T, heads, D]
    v = v.repeat_interleave(cfg.gqa_group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)  # [heads, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(T, cfg.num_heads * D)
    return out @ w[p + "self_attn.o_proj.weight"].T


def mlp(w: dict[str, torch.Tensor], p: str, h: torch.Tensor) -> torch.Tensor:
    gate = h @ w[p + "mlp.gate_proj.weight"].T
    up = h @ w[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def _linear(h: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    out = h @ w[prefix + ".weight"].T
    bias = w.get(prefix + ".bias")
    return out if bias is None else out + bias
