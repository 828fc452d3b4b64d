"""Q8_0 blocks made at load for the linears a checkpoint stores without blocks: a Hugging Face
directory's bf16 / fp16 / fp32 safetensors, or a GGUF's F16 or K-quant matrices. Decode rows on
the CPU then read one byte a weight (plus a scale per 32) instead of four, as they do for a Q4_1
or Q8_0 GGUF; `--weights auto` still measures them against float32 at start.

The blocks are those of llama.cpp's `quantize_row_q8_0` (gguf-py's bit-exact port): per block of
32 inputs, d = max|w| / 127 stored as fp16, q = round(w / d). They are a function of the weights
alone, so every server started with the same checkpoint and flags holds the same bits: slot
files, the prefix cache and recompute replays need nothing new.
"""

from __future__ import annotations

import gguf
import torch

from kvpark.kernels.quant_linear import BLOCK, QuantizedWeight

from .config import LINEAR_ATTENTION, ModelConfig

LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# a hybrid's Gated DeltaNet layer (the conv and the delta rule are not linears)
DELTA_NET_LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                     "linear_attn.in_proj_a", "linear_attn.out_proj", "mlp.gate_proj",
                     "mlp.up_proj", "mlp.down_proj")


def decode_linear_names(config: ModelConfig, weights: dict[str, torch.Tensor]) -> list[str]:
    """Every weight a decode row multiplies by: each layer's projections and the output head
    (the embedding where the head is tied to it)."""
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    return [f"model.layers.{i}.{linear}.weight" for i, kind in enumerate(config.kinds)
            for linear in (DELTA_NET_LINEARS if kind == LINEAR_ATTENTION else LAYER_LINEARS)
            ] + [head]


def q8_0_blocks(weight: torch.Tensor) -> QuantizedWeight:
    """W [out, in] (in a multiple of 32) as llama.cpp's Q8_0 blocks."""
    array = weight.detach().to(device="cpu", dtype=torch.float32).numpy()
    raw = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
    return QuantizedWeight.from_gguf("Q8_0", raw, weight.shape[0])


def make_missing_blocks(config: ModelConfig, weights: dict[str, torch.Tensor],
                        have: dict[str, QuantizedWeight]) -> dict[str, QuantizedWeight]:
    """Q8_0 blocks for each decode linear that `have` lacks and whose inputs split into blocks
    of 32; a linear left out keeps float32 for every row."""
    return {name: q8_0_blocks(weights[name]) for name in decode_linear_names(config, weights)
            if name not in have and weights[name].shape[1] % BLOCK == 0}


def blocks_nbytes(blocks: dict[str, QuantizedWeight]) -> int:
    return sum(b.nbytes for b in blocks.values())

