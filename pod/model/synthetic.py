"""Named llama shapes with seeded random weights, for tests and benchmarks without a checkpoint.

Weights are generated directly on the target device in the target dtype: an 8B model in fp32
would not fit in this machine's RAM, and on a GPU host we want it in bf16 on the GPU only.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import torch

from .config import FULL_ATTENTION, LINEAR_ATTENTION, DeltaNetConfig, ModelConfig

INIT_STD = 0.02
DEFAULT_SEED = 0

TINY_HYBRID = ModelConfig(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=8,
    num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000000.0, rms_norm_eps=1e-6,
    architecture="qwen3_5_text", layer_types=((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * 2,
    delta_net=DeltaNetConfig(num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=16),
    partial_rotary_factor=0.25, attention_output_gate=True, norm_offset=1.0, qk_norm=True,
)

SYNTHETIC_CONFIGS: dict[str, ModelConfig] = {
    # Our fast test model: SmolLM2's vocabulary and GQA ratio (9 over 3), everything else tiny.
    "tiny": ModelConfig(
        vocab_size=49152, hidden_size=72, intermediate_size=192, num_layers=2,
        num_heads=9, num_kv_heads=3, head_dim=8, rope_theta=10000.0,
    ),
    # A draft for "tiny": its first layer, embedding, norm and head (weights are seeded by name)
    "tiny-draft": ModelConfig(
        vocab_size=49152, hidden_size=72, intermediate_size=192, num_layers=1,
        num_heads=9, num_kv_heads=3, head_dim=8, rope_theta=10000.0,
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
    ),
    # A draft for "smollm2-135m": its first 6 of 30 layers (benchmarks of a draft model)
    "smollm2-135m-draft": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=6,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
    ),
    # A tiny Qwen3.5 (three Gated DeltaNet layers, then gated attention; twice), SmolLM2's
    # vocabulary: hybrid parking and prefix tests without transformers
    "tiny-hybrid": TINY_HYBRID,
    # The same with a state slot of 1.5 MiB (16 value heads of 64 x 64): budgets that hold a
    # sequence's pages but not its pages and state
    "tiny-hybrid-wide": dataclasses.replace(TINY_HYBRID, delta_net=DeltaNetConfig(
        num_k_heads=4, num_v_heads=16, k_head_dim=64, v_head_dim=64)),
    # tiny-hybrid with an MTP head (one full-attention block after the decoder's): draft-mtp
    "tiny-hybrid-mtp": dataclasses.replace(TINY_HYBRID, num_mtp_layers=1),
    # A dense draft for the tiny hybrids: their K/V heads and vocabulary, two layers
    "tiny-hybrid-draft": ModelConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
    ),
    "llama-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}


def synthetic_config(name: str) -> ModelConfig:
    if name not in SYNTHETIC_CONFIGS:
        known = ", ".join(f"synthetic:{n}" for n in SYNTHETIC_CONFIGS)
        raise ValueError(f"unknown synthetic model 'synthetic:{name}' (known: {known})")
    return SYNTHETIC_CONFIGS[name]


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint of this config has, in Hugging Face names and shapes."""
    hidden = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i, kind in enumerate(config.kinds):
        p = f"model.layers.{i}."
        shapes |= _mlp_shapes(config, p)
        if kind == LINEAR_ATTENTION:
            shapes |= _delta_net_shapes(config, p + "linear_attn.")
        else:
            shapes |= _attention_shapes(config, p + "self_attn.")
    shapes["model.norm.weight"] = (hidden,)
    for i in range(config.num_mtp_layers):  # Qwen3.5's MTP head: full-attention blocks
        shapes |= _mlp_shapes(config, f"mtp.layers.{i}.")
        shapes |= _attention_shapes(config, f"mtp.layers.{i}.self_attn.")
    if config.num_mtp_layers:
        shapes |= {"mtp.fc.weight": (hidden, 2 * hidden), "mtp.norm.weight": (hidden,),
                   "mtp.pre_fc_norm_embedding.weight": (hidden,),
                   "mtp.pre_fc_norm_hidden.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def _mlp_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "mlp.gate_proj.weight": (inter, hidden),
        p + "mlp.up_proj.weight": (inter, hidden),
        p + "mlp.down_proj.weight": (hidden, inter),
    }


def _attention_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    hidden, dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * dim, config.num_kv_heads * dim
    gate = 2 if config.attention_output_gate else 1  # q_proj yields q and the gate
    shapes = {
        p + "q_proj.weight": (gate * q_out, hidden),
        p + "k_proj.weight": (kv_out, hidden),
        p + "v_proj.weight": (kv_out, hidden),
        p + "o_proj.weight": (hidden, q_out),
    }
    if config.attention_bias:
        shapes |= {p + "q_proj.bias": (q_out,), p + "k_proj.bias": (kv_out,),
                   p + "v_proj.bias": (kv_out,)}
    if config.qk_norm:
        shapes |= {p + "q_norm.weight": (dim,), p + "k_norm.weight": (dim,)}
    return shapes


def _delta_net_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    hidden, s = config.hidden_size, config.delta_net
    return {
        p + "in_proj_qkv.weight": (s.conv_dim, hidden),
        p + "in_proj_z.weight": (s.value_dim, hidden),
        p + "in_proj_b.weight": (s.num_v_heads, hidden),
        p + "in_proj_a.weight": (s.num_v_heads, hidden),
        p + "conv1d.weight": (s.conv_dim, 1, s.conv_kernel),
        p + "A_log": (s.num_v_heads,),
        p + "dt_bias": (s.num_v_heads,),
        p + "norm.weight": (s.v_head_dim,),
        p + "out_proj.weight": (hidden, s.value_dim),
    }


def synthetic_weights(
    config: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = DEFAULT_SEED,
) -> dict[str, torch.Tensor]:
    """normal(0, 0.02) matrices and biases, ones for norms; the same numbers on every run."""
    shapes = weight_shapes(config)
    _check_fits_in_ram(shapes, device, dtype)
    return {name: _init_tensor(name, shape, device, dtype, seed) for name, shape in shapes.items()}


def _init_tensor(
    name: str, shape: tuple[int, ...], device: str | torch.device, dtype: torch.dtype, seed: int
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device, dtype=dtype)
    # A seed per tensor name: a tensor's values do not depend on the order or number of others.
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    out = torch.empty(shape, device=device, dtype=dtype)
    return out.normal_(0.0, INIT_STD, generator=generator)


def _check_fits_in_ram(
    shapes: dict[str, tuple[int, ...]], device: str | torch.device, dtype: torch.dtype
) -> None:
    if torch.device(device).type != "cpu":
        return
    num_bytes = sum(_numel(s) for s in shapes.values()) * torch.finfo(dtype).bits // 8
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if num_bytes > ram // 2:
        raise ValueError(
            f"synthetic weights need {num_bytes / 2**30:.1f} GiB in {dtype} on the CPU, more than "
            f"half of this machine's {ram / 2**30:.1f} GiB; use a GPU or a smaller dtype"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
