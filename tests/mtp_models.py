"""Qwen3.5 directories with an MTP head, written from kvpark's synthetic `tiny-hybrid-mtp`
weights: as they are (a random head, whose guesses fail), or rebuilt so that the head predicts
what the model will say (`predicting_weights`), to show the drafts it makes are accepted."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from kvpark.pod.model.loader import builtin_tokenizer
from kvpark.pod.model.synthetic import synthetic_config, synthetic_weights

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen35_reference import write_qwen35_gguf  # noqa: E402
from smollm2_hf_dir import write_tokenizer_files  # noqa: E402

CONFIG = synthetic_config("tiny-hybrid-mtp")


def predicting_weights(attention_scale: float) -> dict[str, torch.Tensor]:
    """A model whose next token depends on its last token only (every layer's output
    projection is zero, so the final hidden state is the token's normed embedding; its head is
    the embedding with rows permuted, so token t is followed by the one the permutation puts on
    t's row, and greedy text runs through long cycles of distinct tokens), and an MTP
    head that maps the embedding of token p + 1 straight through (`fc` = [I, 0]) to the same
    norm and head: it guesses token p + 2 exactly as the model will compute it, up to its own
    attention block, whose output is scaled by `attention_scale` (0: every guess right; larger:
    some guesses wrong, which ones depending on the head's K/V of the earlier positions)."""
    weights = synthetic_weights(CONFIG)
    for name in list(weights):
        if name.startswith("model.layers.") and name.endswith(
                ("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    perm = torch.randperm(CONFIG.vocab_size, generator=torch.Generator().manual_seed(7))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"][perm].clone()
    hidden = CONFIG.hidden_size
    weights["mtp.fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    weights["mtp.layers.0.mlp.down_proj.weight"].zero_()
    weights["mtp.layers.0.self_attn.o_proj.weight"].mul_(attention_scale)
    return weights


def hf_config(weights: dict[str, torch.Tensor]) -> dict:
    """`config.json` of the weights (a `qwen3_5_text` with one MTP block)."""
    c, s = CONFIG, CONFIG.delta_net
    return {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "layer_types": list(c.layer_types),
        "linear_num_key_heads": s.num_k_heads, "linear_num_value_heads": s.num_v_heads,
        "linear_key_head_dim": s.k_head_dim, "linear_value_head_dim": s.v_head_dim,
        "linear_conv_kernel_dim": s.conv_kernel, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                            "partial_rotary_factor": c.partial_rotary_factor},
        "mtp_num_hidden_layers": 1, "hidden_act": "silu",
    }


def write_dir(weights: dict[str, torch.Tensor], root: Path) -> Path:
    """A Hugging Face `qwen3_5_text` directory (config, safetensors, SmolLM2's tokenizer)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config(weights)))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(root / "model.safetensors"))
    write_tokenizer_files(builtin_tokenizer(), root)
    return root


def write_gguf(weights: dict[str, torch.Tensor], path: Path) -> Path:
    """The same weights as llama.cpp's converter writes them, MTP head as `nextn` blocks."""
    return write_qwen35_gguf(weights, SimpleNamespace(**hf_config(weights)), path)
