"""The oracle itself: end to end on the real SmolLM2, and its parts against torch's own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvpark.pod.model.loader import load_model_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_llama import (  # noqa: E402
    apply_rope,
    attention,
    builtin_model,
    greedy_generate,
    reference_logits,
    rope_cos_sin,
)

torch.set_num_threads(1)

FRANCE = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def smollm2():
    return builtin_model()


@pytest.fixture(scope="module")
def tiny():
    return load_model_files("synthetic:tiny")


def test_smollm2_knows_the_capital_of_france(smollm2):
    """End to end: GGUF dequant + Q/K un-permute + tokenizer + chat template + forward."""
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": FRANCE}]))
    new = greedy_generate(smollm2, prompt, 24)
    answer = tok.decode(new)
    assert "Paris" in answer, answer
    assert new[-1] in tok.eos_token_ids  # it stops by itself with <|im_end|>


def test_logits_match_greedy_and_are_causal(tiny):
    ids = tiny.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    full = reference_logits(tiny, ids)
    assert full.shape == (len(ids), 49152)
    prefix = reference_logits(tiny, ids[:4])
    torch.testing.assert_close(full[:4], prefix, rtol=1e-5, atol=1e-6)
    assert greedy_generate(tiny, ids, 1, stop_at_eos=False) == [int(full[-1].argmax())]


def test_greedy_generate_is_deterministic(tiny):
    ids = tiny.tokenizer.encode("Hello")
    first = greedy_generate(tiny, ids, 5, stop_at_eos=False)
    assert len(first) == 5 and greedy_generate(tiny, ids, 5, stop_at_eos=False) == first


def test_attention_matches_torch_sdpa_with_gqa(tiny):
    """The oracle's hand-written GQA + causal mask against torch's fused attention."""
    cfg, w, p = tiny.config, tiny.weights, "model.layers.0."
    h = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(cfg, 11)
    q = apply_rope((h @ w[p + "self_attn.q_proj.weight"].T).view(11, 9, 8), cos, sin)
    k = apply_rope((h @ w[p + "self_attn.k_proj.weight"].T).view(11, 3, 8), cos, sin)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(11, 3, 8)
    fused = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1).reshape(11, 72) @ w[p + "self_attn.o_proj.weight"].T
    torch.testing.assert_close(attention(cfg, w, p, h, cos, sin), fused, rtol=1e-5, atol=1e-6)


def test_rope_is_rotate_half_of_complex_rotation(tiny):
    """Rotate-half RoPE == rotating (x_i, x_{i+d/2}) by pos * theta^(-2i/d)."""
    cfg = tiny.config
    x = torch.randn(5, 1, cfg.head_dim, dtype=torch.float64)
    cos, sin = rope_cos_sin(cfg, 5)
    half = cfg.head_dim // 2
    z = torch.complex(x[..., :half], x[..., half:])
    inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
    angle = torch.outer(torch.arange(5.0, dtype=torch.float64), inv_freq)
    z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    expected = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, rtol=1e-6, atol=1e-6)
