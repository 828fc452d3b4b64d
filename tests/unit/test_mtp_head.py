"""Qwen3.5's MTP head read from a Hugging Face directory (`mtp.*`) and from a GGUF of the same
weights as llama.cpp's converter writes it (`nextn` blocks after the decoder's): the same head,
the same guesses; and the head's row as `model/mtp.py` says: normed embedding of the next token
and normed hidden state, joined in that order."""

import sys
from pathlib import Path

import pytest
import torch

from kvpark.kernels.attention import StepLayout
from kvpark.kernels.torch_paged import TorchPagedAttention
from kvpark.pod.model.hybrid import HybridModel
from kvpark.pod.model.loader import load_model_files
from kvpark.pod.model.mtp import MTPHead, has_mtp_weights
from kvpark.pod.model.synthetic import synthetic_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtp_models import CONFIG, write_dir, write_gguf  # noqa: E402

PS = 16


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-files")
    weights = synthetic_weights(CONFIG)
    gen = torch.Generator().manual_seed(3)
    for name in weights:  # norms off their initial ones: a misread offset shows
        if name.endswith("norm.weight"):
            weights[name] = torch.randn(weights[name].shape, generator=gen) * 0.3
    return write_dir(weights, root / "dir"), write_gguf(weights, root / "model.gguf")


def head_of(path: Path) -> tuple[HybridModel, MTPHead, torch.Tensor]:
    """The model, its head and the head's `fc` weight as read."""
    loaded = load_model_files(str(path), device="cpu", dtype=torch.float32)
    assert loaded.config.num_mtp_layers == 1 and has_mtp_weights(loaded.config, loaded.weights)
    model = HybridModel(loaded.config, loaded.weights)
    return model, MTPHead(model, loaded.weights), loaded.weights["mtp.fc.weight"]


def guesses(head: MTPHead, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The head over positions 0..len(ids) - 1 of one sequence (its K/V in two pages)."""
    c = head.config
    cache = torch.zeros(2, 2, PS, c.num_kv_heads, c.head_dim)
    backend = TorchPagedAttention("cpu")
    backend.plan(StepLayout([[0, 1]], [len(ids)], [len(ids)], PS))
    out = head(torch.tensor(ids), torch.arange(len(ids)), hidden, backend, cache)
    return head.logits(out)


def test_the_gguf_nextn_blocks_are_the_directorys_mtp_head(files):
    directory, gguf_file = files
    (_, from_dir, _), (_, from_gguf, _) = head_of(directory), head_of(gguf_file)
    hidden = torch.randn(20, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = list(range(500, 520))
    assert torch.allclose(guesses(from_dir, hidden, ids), guesses(from_gguf, hidden, ids),
                          atol=1e-4)


def test_the_head_joins_the_normed_embedding_then_the_normed_hidden_state(files):
    model, head, fc = head_of(files[0])
    hidden = torch.randn(3, CONFIG.hidden_size, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([7, 8, 9])
    eps = CONFIG.rms_norm_eps
    joined = torch.cat((torch.nn.functional.rms_norm(model.embed[ids], (CONFIG.hidden_size,),
                                                     head.embed_norm, eps),
                        torch.nn.functional.rms_norm(hidden, (CONFIG.hidden_size,),
                                                     head.hidden_norm, eps)), dim=-1)
    captured = []
    head.block.register_forward_pre_hook(lambda _, args: captured.append(args[0]))
    guesses(head, hidden, ids.tolist())
    assert torch.allclose(captured[0][:3], joined @ fc.T, atol=1e-5)
