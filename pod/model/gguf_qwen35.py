"""llama.cpp's `qwen35` GGUF layout read back into the Hugging Face names and conventions the
hybrid model takes.

What llama.cpp's converter (`conversion/qwen.py`: `Qwen3NextModel`, `_LinearAttentionVReorderBase`)
does to a Qwen3.5 checkpoint, undone here:
- the (1 + w) norms are stored as their scale (w + 1): the config gets `norm_offset` 0 instead;
- `A_log` is stored as `ssm_a` = -exp(A_log); `dt_bias` as `ssm_dt.bias`; conv1d squeezed;
- where value heads outnumber key heads, the value-head axis of every DeltaNet tensor is stored
  *tiled* by key head (v0 of each group, then v1 of each, ...) instead of *grouped* (all of a key
  head's value heads together), so that ggml can broadcast by repeating: undone per tensor;
- an MTP head adds `nextn_predict_layers` blocks after the decoder's: a full-attention block
  plus `nextn.eh_proj` (`mtp.fc`), `nextn.enorm` / `hnorm` (the pre-fc norms) and
  `nextn.shared_head_norm` (`mtp.norm`), read back into the `mtp.*` names.
Metadata: `ssm.state_size` is the key head dim, `ssm.group_count` the key heads,
`ssm.time_step_rank` the value heads, `ssm.inner_size` value heads x value head dim,
`rope.dimension_count` the rotary dims, `attention.recurrent_layers` (or
`full_attention_interval`) which layers are DeltaNet layers.
"""

from __future__ import annotations

from typing import Any

import torch

from .config import FULL_ATTENTION, LINEAR_ATTENTION, DeltaNetConfig, ModelConfig

ARCH = "qwen35"

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# both layer kinds
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ATTENTION_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
DELTA_NET_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
}


def qwen35_config(field: Any, vocab_size: int, tensor_names: set[str]) -> ModelConfig:
    """The hybrid config of a `qwen35` GGUF; `field(key, default)` reads its metadata."""
    a = ARCH
    num_mtp = field(f"{a}.nextn_predict_layers", 0)
    num_layers = field(f"{a}.block_count") - num_mtp
    recurrent = field(f"{a}.attention.recurrent_layers", [])
    if recurrent:
        kinds = tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:num_layers])
    else:
        interval = field(f"{a}.full_attention_interval", 4)
        kinds = tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION
                      for i in range(num_layers))
    num_heads = field(f"{a}.attention.head_count")
    head_dim = field(f"{a}.attention.key_length")
    num_v_heads = field(f"{a}.ssm.time_step_rank")
    delta_net = DeltaNetConfig(
        num_k_heads=field(f"{a}.ssm.group_count"), num_v_heads=num_v_heads,
        k_head_dim=field(f"{a}.ssm.state_size"),
        v_head_dim=field(f"{a}.ssm.inner_size") // num_v_heads,
        conv_kernel=field(f"{a}.ssm.conv_kernel"))
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=field(f"{a}.embedding_length"),
        intermediate_size=field(f"{a}.feed_forward_length"), num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=field(f"{a}.attention.head_count_kv", num_heads),
        head_dim=head_dim, rope_theta=float(field(f"{a}.rope.freq_base", 10000000.0)),
        rms_norm_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position=field(f"{a}.context_length", 32768),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=True, architecture="qwen3_5_text", layer_types=kinds,
        delta_net=delta_net if LINEAR_ATTENTION in kinds else None,
        partial_rotary_factor=field(f"{a}.rope.dimension_count", head_dim) / head_dim,
        attention_output_gate=True, norm_offset=0.0,  # the file stores the norms' scales
        num_mtp_layers=num_mtp)


MTP_NAMES = {
    "nextn.eh_proj.weight": "fc.weight",
    "nextn.enorm.weight": "pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
}


def hf_name(gguf_name: str, config: ModelConfig) -> str | None:
    """The Hugging Face name of a `qwen35` tensor (an MTP block's under `mtp.`); None for one
    not used (an MTP block's own copy of the embedding or head: Qwen3.5 shares the model's)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a qwen35 model")
    layer, rest = int(parts[1]), parts[2]
    if layer >= config.num_layers:  # the MTP head's blocks come after the decoder's
        return mtp_name(gguf_name, layer - config.num_layers, rest)
    table = {**LAYER_NAMES, **(DELTA_NET_NAMES if config.kinds[layer] == LINEAR_ATTENTION
                               else ATTENTION_NAMES)}
    if rest not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a qwen35 model")
    return f"model.layers.{layer}.{table[rest]}"


def mtp_name(gguf_name: str, index: int, rest: str) -> str | None:
    if rest in MTP_NAMES:
        return f"mtp.{MTP_NAMES[rest]}" if index == 0 else None
    if rest in ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight"):
        return None
    table = {**LAYER_NAMES, **ATTENTION_NAMES}
    if rest not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a qwen35 MTP block")
    return f"mtp.layers.{index}.{table[rest]}"


def to_hf(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A tensor as Hugging Face stores it (`name` is its Hugging Face name)."""
    if ".linear_attn." not in name:
        return weight
    s = config.delta_net
    if name.endswith(".A_log"):
        weight = torch.log(-weight)  # ssm_a = -exp(A_log)
    elif name.endswith(".conv1d.weight"):
        weight = weight.reshape(s.conv_dim, 1, s.conv_kernel)
    group = s.num_v_heads // s.num_k_heads
    if group == 1:
        return weight
    if name.endswith(".in_proj_qkv.weight"):
        qk = 2 * s.key_dim
        return torch.cat((weight[:qk], untile(weight[qk:], 0, s, s.v_head_dim)))
    if name.endswith(".conv1d.weight"):
        qk = 2 * s.key_dim
        return torch.cat((weight[:qk], untile(weight[qk:], 0, s, s.v_head_dim)))
    if name.endswith(".in_proj_z.weight"):
        return untile(weight, 0, s, s.v_head_dim)
    if name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return untile(weight, 0, s, 1)
    if name.endswith(".out_proj.weight"):
        return untile(weight, 1, s, s.v_head_dim)
    return weight  # the gated norm: one scale shared by every head


def untile(t: torch.Tensor, dim: int, s: DeltaNetConfig, head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from the converter's tiled order ([group, key heads, head_dim])
    back to Hugging Face's grouped order ([key heads, group, head_dim])."""
    shape = list(t.shape)
    group = s.num_v_heads // s.num_k_heads
    tiled = t.reshape(*shape[:dim], group, s.num_k_heads, head_dim, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).contiguous().reshape(shape)
