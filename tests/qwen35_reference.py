"""A tiny seeded-random Qwen3.5 written by transformers' own `Qwen3_5ForCausalLM` (the outside
reference: no download, built at test time), with SmolLM2's tokenizer so the server can load the
directory; and a small driver of kvpark's hybrid model over a paged pool and state slots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kvpark.kernels import cpu_paged
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.torch_paged import TorchPagedAttention
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.memory.state_pool import StatePool
from kvpark.pod.model.hybrid import HybridModel
from kvpark.pod.model.loader import builtin_tokenizer
from kvpark.pod.model.step_states import StateChunk

# the published Qwen3.5 layout (3 DeltaNet layers, then gated attention) at a tiny size; two
# value heads per key head, partial RoPE, tied embeddings as the small Qwen3.5s have
TINY_QWEN35 = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
    linear_num_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


REPO_ROOT = Path(__file__).resolve().parents[1]


def import_qwen35():
    """transformers' Qwen3.5 classes. The checkout's top-level `kernels/` folder (ours, shipped as
    `kvpark.kernels`) would shadow Hugging Face's `kernels` package, which transformers imports:
    the import runs with the checkout off the path."""
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    finally:
        sys.path[:] = saved
    return Qwen3_5ForCausalLM, Qwen3_5TextConfig


def build_reference(seed: int = 0):
    """transformers' Qwen3.5 with seeded weights; the norms, A_log and dt_bias moved off their
    initial values so that a misread offset or sign shows in the logits."""
    Qwen3_5ForCausalLM, Qwen3_5TextConfig = import_qwen35()  # noqa: N806
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY_QWEN35)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms (stored as scale - 1), A_log, dt_bias
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
            elif "conv1d" in name:
                param.mul_(4.0)  # a conv that matters
    return model


def write_reference_dir(model, root: Path) -> Path:
    """The model as a Hugging Face directory kvpark loads (SmolLM2's tokenizer beside it)."""
    model.save_pretrained(str(root))
    tokenizer = builtin_tokenizer()
    tokenizer.backend.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.token_text(tokenizer.bos_token_id),
        "eos_token": tokenizer.token_text(tokenizer.eos_token_id),
        "chat_template": tokenizer.chat_template,
    }))
    return root


class HybridDriver:
    """kvpark's hybrid model over a paged pool and one state slot per sequence, fed chunk by
    chunk as the runner feeds it (the C-free torch attention backend)."""

    def __init__(self, model: HybridModel, num_seqs: int = 1, page_size: int = 16,
                 num_pages: int = 64) -> None:
        c = model.config
        self.model = model
        self.pool = KVPool(len(c.attention_layers), num_pages, page_size, c.num_kv_heads,
                           c.head_dim)
        self.states = StatePool(num_seqs, len(c.delta_net_layers), c.delta_net)
        # the C kernel where it builds (what the server runs on the CPU: batch-invariant)
        self.backend = (cpu_paged.CpuPagedAttention() if cpu_paged.is_available()
                        else TorchPagedAttention("cpu"))
        self.tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.lens = [0] * num_seqs

    def feed(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """chunks: sequence -> its next tokens; returns every row's final hidden state."""
        ids, positions, tables, kv_lens, q_lens, state_chunks = [], [], [], [], [], []
        for seq, tokens in chunks.items():
            start, end = self.lens[seq], self.lens[seq] + len(tokens)
            need = self.pool.pages_for(end) - len(self.tables[seq])
            self.tables[seq] += self.pool.allocate(need)
            state_chunks.append(StateChunk(seq, len(ids), len(tokens), fresh=start == 0))
            ids += tokens
            positions += range(start, end)
            tables.append(self.tables[seq])
            kv_lens.append(end)
            q_lens.append(len(tokens))
            self.lens[seq] = end
        self.backend.plan(StepLayout(tables, kv_lens, q_lens, self.pool.page_size))
        return self.model(torch.tensor(ids), torch.tensor(positions), self.backend,
                          self.pool.caches, states=self.states.step_states(tuple(state_chunks)))

    def greedy(self, prompt: list[int], num_new: int, seq: int = 0) -> list[int]:
        hidden = self.feed({seq: prompt})
        out = [int(self.model.logits(hidden[-1:])[0].argmax())]
        while len(out) < num_new:
            out.append(int(self.model.logits(self.feed({seq: out[-1:]}))[0].argmax()))
        return out
