"""A tiny seeded-random Qwen3.5 written by transformers' own `Qwen3_5ForCausalLM` (the outside
reference: no download, built at test time), with SmolLM2's tokenizer so the server can load the
directory; and a small driver of kvpark's hybrid model over a paged pool and state slots."""

from __future__ import annotations

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2_hf_dir import write_tokenizer_files  # noqa: E402

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
    write_tokenizer_files(builtin_tokenizer(), root)
    return root


class HybridDriver:
    """kvpark's hybrid model over a paged pool and one state slot per sequence, fed chunk by
    chunk as the runner feeds it (the C attention backend the server runs, where it builds)."""

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


def write_reference_gguf(model, path: Path, half: bool = False) -> Path:
    """The model as llama.cpp's converter writes a Qwen3.5 (`qwen35`)."""
    return write_qwen35_gguf(model.state_dict(), model.config, path, half)


# an MTP head's own tensors as the converter renames them (`_QwenMtpMixin`: before its norm
# check, so enorm and hnorm are stored as scales too), then their GGUF names (llama.cpp's
# nextn names, newer than the gguf package's tensor map)
MTP_RENAMED = {"mtp.fc.weight": "eh_proj.weight",
               "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
               "mtp.pre_fc_norm_hidden.weight": "hnorm.weight",
               "mtp.norm.weight": "shared_head.norm.weight"}
NEXTN_NAMES = {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
               "hnorm.weight": "nextn.hnorm.weight",
               "shared_head.norm.weight": "nextn.shared_head_norm.weight"}


def write_qwen35_gguf(state: dict[str, torch.Tensor], c, path: Path, half: bool = False,
                      q8_0: bool = False) -> Path:
    """Hugging Face tensors as llama.cpp's converter writes a Qwen3.5 (`qwen35`): norms stored
    as their (1 + w) scale, ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, conv1d squeezed, and
    the value heads of every DeltaNet tensor in its tiled order (`conversion/qwen.py`,
    `_LinearAttentionVReorderBase`); an MTP head (`mtp.*`) as blocks after the decoder's with
    `nextn_predict_layers`; SmolLM2's tokenizer metadata. `c`: the config's fields. `half`:
    matrices as float16; `q8_0`: as Q8_0 blocks (llama.cpp's `quantize_row_q8_0`, gguf-py)."""
    import gguf

    from kvpark.pod.model.gguf_file import read_gguf
    from kvpark.pod.model.loader import builtin_gguf_path

    num_mtp = len({n.split(".")[2] for n in state if n.startswith("mtp.layers.")})
    writer = gguf.GGUFWriter(str(path), arch="qwen35")
    writer.add_block_count(c.num_hidden_layers + num_mtp)
    if num_mtp:
        writer.add_uint32("qwen35.nextn_predict_layers", num_mtp)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    # add_recurrent_layers is newer than some gguf releases: the key as it writes it
    writer.add_array("qwen35.attention.recurrent_layers",
                     [t == "linear_attention" for t in c.layer_types] + [False] * num_mtp)
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    meta = read_gguf(builtin_gguf_path()).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.add_chat_template(meta["tokenizer.chat_template"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, c.num_hidden_layers + num_mtp)
    for name, w in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = MTP_RENAMED.get(name, name)
        if name.startswith("mtp.layers."):
            _, _, index, rest = name.split(".", 3)
            name = f"model.layers.{c.num_hidden_layers + int(index)}.{rest}"
        name, w = as_converted(name, w.detach().float(), c)
        # the converter keeps vectors and the conv kernel in float32 (ggml's ssm_conv needs it)
        matrix = w.ndim == 2 and ".conv1d." not in name
        array = w.numpy().astype("float16" if half and matrix else "float32")
        raw_dtype = None
        if q8_0 and matrix and w.shape[1] % 32 == 0:
            raw_dtype = gguf.GGMLQuantizationType.Q8_0
            array = gguf.quants.quantize(w.numpy(), raw_dtype)
        gguf_name = (f"blk.{c.num_hidden_layers}.{NEXTN_NAMES[name]}" if name in NEXTN_NAMES
                     else names.get_name(name, try_suffixes=(".weight", ".bias")))
        writer.add_tensor(gguf_name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def as_converted(name: str, w: torch.Tensor, c) -> tuple[str, torch.Tensor]:
    """One tensor as the converter turns it (its Hugging Face name, possibly renamed)."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + 1
    if ".linear_attn." not in name:
        return name, w
    k_heads, v_heads = c.linear_num_key_heads, c.linear_num_value_heads
    qk = 2 * k_heads * c.linear_key_head_dim

    def tiled(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        shape = list(t.shape)
        grouped = t.reshape(*shape[:dim], k_heads, v_heads // k_heads, head_dim,
                            *shape[dim + 1:])
        return grouped.transpose(dim, dim + 1).contiguous().reshape(shape)

    if name.endswith(".A_log"):
        w = -torch.exp(tiled(w, 0, 1))
    elif name.endswith(".dt_bias"):
        name, w = name.replace(".dt_bias", ".dt_proj.bias"), tiled(w, 0, 1)
    elif ".conv1d." in name:
        w = w.squeeze(1)
        w = torch.cat((w[:qk], tiled(w[qk:], 0, c.linear_value_head_dim)))
    elif ".in_proj_qkv." in name:
        w = torch.cat((w[:qk], tiled(w[qk:], 0, c.linear_value_head_dim)))
    elif ".in_proj_z." in name:
        w = tiled(w, 0, c.linear_value_head_dim)
    elif ".in_proj_a." in name or ".in_proj_b." in name:
        w = tiled(w, 0, 1)
    elif ".out_proj." in name:
        w = tiled(w, 1, c.linear_value_head_dim)
    return name, w
