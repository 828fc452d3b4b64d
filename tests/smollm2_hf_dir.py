"""The builtin SmolLM2 written out as a Hugging Face directory (bf16 safetensors, tokenizer.json,
tokenizer_config.json with its chat template, config.json): what a GPU pod loads, made from the
GGUF the tests already have, so nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvpark.pod.model.loader import LoadedModel
from kvpark.pod.model.tokenizer import Tokenizer


def write_smollm2_hf_dir(loaded: LoadedModel, root: Path) -> Path:
    config, tokenizer = loaded.config, loaded.tokenizer
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps, "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_word_embeddings, "torch_dtype": "bfloat16",
    }))
    save_file({name: w.to(torch.bfloat16).contiguous() for name, w in loaded.weights.items()},
              str(root / "model.safetensors"))
    write_tokenizer_files(tokenizer, root)
    return root


def write_tokenizer_files(tokenizer: Tokenizer, root: Path) -> None:
    """tokenizer.json and tokenizer_config.json (BOS, EOS, the chat template) into `root`."""
    tokenizer.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.token_text(tokenizer.bos_token_id),
        "eos_token": tokenizer.token_text(tokenizer.eos_token_id),
        "chat_template": tokenizer.chat_template,
    }))
