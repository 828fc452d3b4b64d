"""Named llama shapes with seeded random weights, for tests and benchmarks without a checkpoint.

Weights are generated directly on the target device in the target dtype: an 8B model in fp32
would not fit in this machine's RAM, and on a GPU host we want it in bf16 on the GPU only.
"""

from __future__ import annotations

import os
import zlib

import torch

from .config import ModelConfig

INIT_STD = 0.02
DEFAULT_SEED = 0

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
    """Every weight a llama-family checkpoint of this config has, in Hugging Face names/shapes."""
    hidden, inter, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * dim, config.num_kv_heads * dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (dim,), p + "self_attn.k_norm.weight": (dim,)}
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


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
