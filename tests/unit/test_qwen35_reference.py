"""kvpark's Qwen3.5 against transformers' own `Qwen3_5ForCausalLM` (a tiny seeded-random model
built here, no download): the directory loads, prompt logprobs agree within 2e-3 in float32
(with the C step mixing and row ops, and with the torch ops that run where the C kernels do not
build), greedy ids agree, and a prompt row computes the same bits as a decode row at its
position."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from kvpark.kernels import delta_rule, layer_ops
from kvpark.pod.model import layers as layers_module
from kvpark.pod.model.hybrid import DeltaNetLayer, HybridModel
from kvpark.pod.model.linear import Linear, WeightFormat
from kvpark.pod.model.loader import load_model_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_isa import requires_amx  # noqa: E402
from qwen35_reference import (  # noqa: E402
    HybridDriver,
    build_reference,
    write_reference_dir,
    write_reference_gguf,
)

torch.set_num_threads(1)

PROMPT = "The delta rule keeps a state per sequence; attention keeps pages. Which parks faster?"


@pytest.fixture(scope="module")
def reference():
    return build_reference()


@pytest.fixture(scope="module")
def loaded(reference, tmp_path_factory):
    root = write_reference_dir(reference, tmp_path_factory.mktemp("qwen35"))
    return load_model_files(str(root))


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    return loaded.tokenizer.encode(PROMPT)


def kvpark_model(loaded, mixing: str = "default") -> HybridModel:
    """`mixing` "torch": the model as it is built where the C kernels do not build (the DeltaNet
    layers' torch ops around the torch rule, torch's norms and SiLU); "default": the C step
    mixing and row ops where they do."""
    if mixing == "torch":
        with mock.patch.object(delta_rule, "is_available", return_value=False), \
                mock.patch.object(layer_ops, "is_available", return_value=False):
            model = HybridModel(loaded.config, loaded.weights)
        assert not model.c_ops and not any(getattr(layer, "c_ops", True)
                                           or getattr(layer, "c_mix", False)
                                           for layer in model.layers)
        return model
    model = HybridModel(loaded.config, loaded.weights)
    delta_layers = [layer for layer in model.layers if isinstance(layer, DeltaNetLayer)]
    assert all(layer.c_mix for layer in delta_layers) == delta_rule.is_available()
    assert all(layer.c_ops and layer.mlp.c_ops for layer in model.layers) == model.c_ops == \
        layer_ops.is_available()
    return model


MIXINGS = pytest.mark.parametrize("mixing", ["default", "torch"])


def test_the_directory_loads_as_a_hybrid(loaded):
    c = loaded.config
    assert c.is_hybrid and c.attention_layers == [3, 7]
    assert c.delta_net_layers == [0, 1, 2, 4, 5, 6]
    assert c.rotary_dim == 8 and c.norm_offset == 1.0


@MIXINGS
def test_prompt_logprobs_agree_with_transformers(reference, loaded, prompt_ids, mixing):
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt_ids])).logits[0].float(), -1)
    model = kvpark_model(loaded, mixing)
    # two chunks, as chunked prefill feeds a long prompt: the state carries across
    driver = HybridDriver(model)
    cut = len(prompt_ids) // 2
    hidden = torch.cat([driver.feed({0: prompt_ids[:cut]}), driver.feed({0: prompt_ids[cut:]})])
    got = torch.log_softmax(model.logits(hidden), -1)
    picked = torch.tensor(prompt_ids[1:])[:, None]
    diff = (got[:-1].gather(1, picked) - expected[:-1].gather(1, picked)).abs().max().item()
    assert diff < 2e-3, diff
    assert (got - expected).abs().max().item() < 2e-3


def test_greedy_ids_agree_with_transformers_for_32_tokens(reference, loaded, prompt_ids):
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=32,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = expected[0, len(prompt_ids):].tolist()
    got = HybridDriver(kvpark_model(loaded)).greedy(prompt_ids, 32)
    assert got == expected


@MIXINGS
def test_a_prompt_row_computes_the_bits_of_a_decode_row(loaded, prompt_ids, mixing):
    """The recurrence is fed one token at a time in both cases, so a recompute replay (the
    prompt path) rebuilds the state the first pass (decode rows) built, bit for bit."""
    model = kvpark_model(loaded, mixing)
    as_prompt = HybridDriver(model).feed({0: prompt_ids})
    decode = HybridDriver(model)
    as_decode = torch.cat([decode.feed({0: [t]}) for t in prompt_ids])
    assert torch.equal(as_prompt, as_decode)


@MIXINGS
def test_a_row_does_not_depend_on_its_batch_neighbours(loaded, prompt_ids, mixing):
    model = kvpark_model(loaded, mixing)
    alone = HybridDriver(model).feed({0: prompt_ids})
    together = HybridDriver(model, num_seqs=2).feed({1: prompt_ids[::-1], 0: prompt_ids})
    assert torch.equal(alone, together[len(prompt_ids):])


@requires_amx
def test_the_residual_epilogue_changes_no_bit(loaded, prompt_ids, monkeypatch):
    """amx-bf16 linears add the residual in the GEMM's last pass (both layer kinds, both
    residuals): the hidden states of the GEMM then the add, to the bit."""
    model = HybridModel(loaded.config, loaded.weights, weight_format=WeightFormat.AMX_BF16)
    calls = []
    real = layers_module.linear_add
    monkeypatch.setattr(layers_module, "linear_add", lambda *a: calls.append(a) or real(*a))
    fused = HybridDriver(model).feed({0: prompt_ids})
    assert len(calls) == 2 * loaded.config.num_layers  # the mixer's output and the MLP's
    monkeypatch.setattr(Linear, "fuses_add", property(lambda self: False))
    assert torch.equal(HybridDriver(model).feed({0: prompt_ids}), fused)


def test_the_state_slot_is_what_carries_the_sequence(loaded, prompt_ids):
    """Without its state (zeroed between chunks) the continuation differs: the state matters."""
    model = kvpark_model(loaded)
    whole = HybridDriver(model).feed({0: prompt_ids})
    driver = HybridDriver(model)
    driver.feed({0: prompt_ids[:8]})
    driver.states.clear(0)
    rest = driver.feed({0: prompt_ids[8:]})
    assert not torch.equal(rest, whole[8:])


@pytest.fixture(scope="module")
def gguf_loaded(reference, tmp_path_factory):
    path = write_reference_gguf(reference, tmp_path_factory.mktemp("qwen35-gguf") / "q.gguf")
    return load_model_files(str(path))


def test_a_qwen35_gguf_gives_the_directory_s_logits(loaded, gguf_loaded, prompt_ids):
    """The same weights as llama.cpp's converter lays them out (tiled value heads, norms as
    scales, -exp(A_log)): the same config and logits as the safetensors directory."""
    a, b = loaded.config, gguf_loaded.config
    assert (b.layer_types, b.delta_net, b.rotary_dim) == (a.layer_types, a.delta_net,
                                                          a.rotary_dim)
    assert b.norm_offset == 0.0 and a.norm_offset == 1.0
    from_dir = kvpark_model(loaded)
    from_gguf = kvpark_model(gguf_loaded)
    expected = from_dir.logits(HybridDriver(from_dir).feed({0: prompt_ids}))
    got = from_gguf.logits(HybridDriver(from_gguf).feed({0: prompt_ids}))
    assert (got - expected).abs().max().item() < 1e-4
    assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_a_multimodal_checkpoint_serves_its_text_model(reference, loaded, prompt_ids, tmp_path):
    """`qwen3_5` (Qwen3_5ForConditionalGeneration's layout): the text config nested, the text
    weights under `model.language_model.`, a vision tower beside them (not served)."""
    import json

    from safetensors.torch import save_file

    root = write_reference_dir(reference, tmp_path / "text")
    text_config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": True, "text_config": text_config,
        "vision_config": {"depth": 1}}))
    weights = {name.replace("model.", "model.language_model.", 1): w.contiguous()
               for name, w in reference.state_dict().items() if name != "lm_head.weight"}
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    (root / "model.safetensors").unlink()
    save_file(weights, str(root / "model.safetensors"))
    multimodal = load_model_files(str(root))
    assert multimodal.config == loaded.config
    a, b = kvpark_model(loaded), kvpark_model(multimodal)
    assert torch.equal(a.logits(HybridDriver(a).feed({0: prompt_ids})),
                       b.logits(HybridDriver(b).feed({0: prompt_ids})))
