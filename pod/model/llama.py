"""The llama-family decoder (Llama, SmolLM2, Qwen2/3) over a paged KV pool.

The model only knows tokens, positions and an attention backend that was planned for the step;
which sequence owns which page is the runner's business.

On the CPU a decode step is bound by reading the weights, so the linears are what this file is
careful about: each weight is packed once for oneDNN (see `Linear`), and with `batch_invariant`
every GEMM sees at least `MIN_INVARIANT_ROWS` rows, so a row's result never depends on which
other rows share the step. Rows that read a GGUF's blocks (`BlockRows`) take two C calls a layer
around the attention (`kernels/layer_ops.py`) instead of ~25 torch ops: at batch 1 the step is
bound by per-op dispatch as much as by the weights.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvpark.kernels import cpu_features, layer_ops
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.quant_linear import QuantizedWeight, quant_linear

from .config import ModelConfig

# A GEMM of very few rows takes a different kernel whose sums round differently: oneDNN (the CPU
# path here) for 1 row, MKL's sgemm (F.linear) for 1-3 rows on one thread and up to 11 on two.
# From 4 rows on, oneDNN gives every row the same bits whatever the row count, on any number of
# threads; padding to it makes each row's result independent of the batch it rides in.
MIN_INVARIANT_ROWS = 4
# oneDNN JIT-compiles a primitive for every GEMM shape it meets and keeps it in two caches of
# 1024 entries each (its own primitive cache and ideep's LRU in torch), ~0.6 MB of code and
# buffers apiece whatever the row count (measured: 512 row counts through one linear, +300 MiB).
# Row counts are a prompt chunk's length, so distinct prompt lengths filled both caches: RSS
# grew ~700 MiB on synthetic:tiny, then kept creeping with the caches' evict-and-rebuild churn
# (issue 23). The packed GEMMs therefore run a bounded set of row counts: exact up to
# EXACT_GEMM_ROWS (decode steps), above that rounded up to one of GEMM_ROWS_PER_OCTAVE steps per
# power of two (<= 25% padding rows, ~8% on average): 33 shapes a linear up to 512 rows. The
# padding rows are zeros sliced off the result; from MIN_INVARIANT_ROWS on oneDNN gives a row
# the same bits at any row count, so they never change a real row.
EXACT_GEMM_ROWS = 16
GEMM_ROWS_PER_OCTAVE = 4


class WeightFormat(str, enum.Enum):
    """How the big linears (attention, MLP, lm_head) hold their weights."""

    FP32 = "fp32"  # the checkpoint's values; fp32 products and sums (exact, the default)
    BF16 = "bf16"  # half the bytes to read; weights, inputs and outputs rounded to bf16 (opt-in)


def can_prepack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:  # torch raises on CPUs without AVX-512 or AVX-NE-CONVERT
        return cpu_features.detect().can_bf16_gemm
    return weight.dtype == torch.float32


@dataclass(frozen=True)
class BlockRows:
    """Which rows of a step read a linear's quantised blocks, and which the dense weight.

    The runner marks the rows of generated tokens (positions past the prompt), first fed or
    replayed: a property of the sequence alone, so a row takes the same kernels whatever its
    neighbours, however its prompt was chunked, and a recompute replay reproduces its bits.
    """

    blocks: torch.Tensor  # row indices, int64
    dense: torch.Tensor

    @classmethod
    def from_mask(cls, from_blocks: list[bool]) -> BlockRows:
        mask = torch.tensor(from_blocks, dtype=torch.bool)
        return cls(mask.nonzero()[:, 0], (~mask).nonzero()[:, 0])

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def num_dense(self) -> int:
        return self.dense.shape[0]

    @classmethod
    def all_dense(cls, num_rows: int) -> BlockRows:
        return cls(torch.empty(0, dtype=torch.long), torch.arange(num_rows))


class Linear:
    """y = x W^T (+ b); on the CPU the weight is reordered once into oneDNN's blocked layout.

    A decode step's GEMMs have a handful of rows, so they stream the weight: oneDNN with a
    prepacked weight streams it faster than MKL's sgemm and is faster at prefill too (MKL takes
    its AVX2 path on AMD; measured in benchmarks/README.md). On CUDA: `F.linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 fmt: WeightFormat = WeightFormat.FP32,
                 blocks: QuantizedWeight | None = None) -> None:
        self.blocks = blocks  # the checkpoint's quantised blocks: decode rows read these
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = torch.bfloat16 if fmt is WeightFormat.BF16 else weight.dtype
        weight = weight.to(self.compute_dtype)
        self.bias = None if bias is None else bias.to(self.compute_dtype)
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, MIN_INVARIANT_ROWS)
                       if can_prepack(weight) else None)
        self.weight = None if self.packed is not None else weight  # no second copy in RAM

    def __call__(self, x: torch.Tensor, rows: BlockRows | None = None) -> torch.Tensor:
        """With `rows`, the rows it names read the quantised blocks (when there are any)."""
        if rows is None:  # the model padded x for the dense GEMM
            return self.dense(x)
        # the model does not pad when it hands `rows` down: the dense GEMM keeps its row
        # invariance only from MIN_INVARIANT_ROWS rows on, the block kernel at any count
        if self.blocks is None or rows.num_blocks == 0:
            return self.dense(pad_rows(x, MIN_INVARIANT_ROWS))[: x.shape[0]]
        if rows.num_dense == 0:
            return self.from_blocks(x)
        out = torch.empty(x.shape[0], self.blocks.out_features, dtype=x.dtype)
        dense_x = pad_rows(x.index_select(0, rows.dense), MIN_INVARIANT_ROWS)
        out.index_copy_(0, rows.dense, self.dense(dense_x)[: rows.num_dense])
        out.index_copy_(0, rows.blocks, self.from_blocks(x.index_select(0, rows.blocks)))
        return out

    def from_blocks(self, x: torch.Tensor) -> torch.Tensor:
        y = quant_linear(x, self.blocks)
        return y if self.bias is None else y + self.bias

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        if self.packed is not None:  # a bounded set of row counts (see EXACT_GEMM_ROWS)
            num_rows = x.shape[0]
            x = pad_rows(x, get_gemm_rows(num_rows))
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            y = y[:num_rows]
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if y.dtype == out_dtype else y.to(out_dtype)


def linear(x: torch.Tensor, layer: Linear, rows: BlockRows | None = None) -> torch.Tensor:
    """Every GEMM of the model goes through here (benchmarks/profile_step.py times it)."""
    return layer(x, rows)


def get_gemm_rows(num_rows: int) -> int:
    """The row count a packed GEMM of `num_rows` rows runs with: `num_rows` up to
    EXACT_GEMM_ROWS, else rounded up to a multiple of 1/GEMM_ROWS_PER_OCTAVE of the power of
    two below it (17 -> 20, 33 -> 40, 257 -> 320, 512 -> 512)."""
    if num_rows <= EXACT_GEMM_ROWS:
        return num_rows
    step = (1 << (num_rows - 1).bit_length()) // (2 * GEMM_ROWS_PER_OCTAVE)
    return -(-num_rows // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it has enough)."""
    return x if x.shape[0] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[0]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # one fused op, the same bits as the four-op form below
        return F.rms_norm(x, weight.shape, weight, eps)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin for `apply_rope`: [T, 1, D] each, the sin's first half negated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout) of x: [T, heads, D].

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) as x * cos + (x2, x1) * (-sin, sin): the same
    bits (a - b == a + -b), in four ops instead of nine.
    """
    t, heads, dim = x.shape
    swapped = x.view(t, heads, 2, dim // 2).flip(2).view(t, heads, dim)
    return x * cos + swapped * signed_sin


def fused_blocks(quantized: dict[str, QuantizedWeight] | None,
                 names: list[str]) -> QuantizedWeight | None:
    """The blocks of `names` stacked as one fused linear; None unless every part has them."""
    if not quantized or any(name not in quantized for name in names):
        return None
    return QuantizedWeight.cat([quantized[name] for name in names])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 fmt: WeightFormat = WeightFormat.FP32,
                 quantized: dict[str, QuantizedWeight] | None = None) -> None:
        super().__init__()
        self.config = config
        attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        qkv_names = [f"{attn}.{p}_proj.weight" for p in "qkv"]
        gate_up_names = [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"]
        self.qkv = Linear(
            torch.cat([weights[name] for name in qkv_names]),
            torch.cat([weights[f"{attn}.{p}_proj.bias"] for p in "qkv"])
            if config.attention_bias else None,
            fmt, fused_blocks(quantized, qkv_names),
        )
        self.o = Linear(weights[f"{attn}.o_proj.weight"], None, fmt,
                        fused_blocks(quantized, [f"{attn}.o_proj.weight"]))
        self.gate_up = Linear(torch.cat([weights[name] for name in gate_up_names]), None, fmt,
                              fused_blocks(quantized, gate_up_names))
        self.down = Linear(weights[f"{mlp}.down_proj.weight"], None, fmt,
                           fused_blocks(quantized, [f"{mlp}.down_proj.weight"]))
        # the dense weights under their old names (None once packed), for byte counts
        self.qkv_weight, self.qkv_bias = self.qkv.weight, self.qkv.bias
        self.o_weight, self.gate_up_weight = self.o.weight, self.gate_up.weight
        self.down_weight = self.down.weight
        self.input_norm = weights[f"{prefix}.input_layernorm.weight"]
        self.post_attn_norm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.q_norm = weights.get(f"{attn}.q_norm.weight") if config.qk_norm else None
        self.k_norm = weights.get(f"{attn}.k_norm.weight") if config.qk_norm else None
        self.fused = self.get_fused()

    def get_fused(self) -> layer_ops.FusedLayer | None:
        """The block rows' C ops (see `forward_fused`), where every linear has blocks and the
        layer has no q/k norms or attention bias (those keep the torch path)."""
        c, linears = self.config, (self.qkv, self.o, self.gate_up, self.down)
        if (any(lin.blocks is None for lin in linears) or self.q_norm is not None
                or self.qkv.bias is not None or self.input_norm.dtype != torch.float32
                or not layer_ops.is_available()):
            return None
        return layer_ops.FusedLayer(
            hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, eps=c.rms_norm_eps, input_norm=self.input_norm.contiguous(),
            post_norm=self.post_attn_norm.contiguous(), qkv=self.qkv.blocks, o=self.o.blocks,
            gate_up=self.gate_up.blocks, down=self.down.blocks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, kv_cache: torch.Tensor,
                num_tokens: int, rows: BlockRows | None = None) -> torch.Tensor:
        """x: [rows, hidden], of which the first `num_tokens` are real (the rest pad GEMMs);
        `rows`: which read quantised blocks (see `Linear`). On the fused path the block rows of
        x are updated in place."""
        if rows is not None and rows.num_blocks > 0 and self.fused is not None:
            assert num_tokens == x.shape[0], "no padding rows with `rows`"
            return self.forward_fused(x, cos, sin, backend, kv_cache, rows)
        c = self.config
        num_rows = x.shape[0]
        q, k, v = self.attention_inputs(x, cos, sin, rows)
        if num_tokens < num_rows:
            q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
        backend.append_kv(kv_cache, k, v)
        attn = backend.attend(q, kv_cache).reshape(num_tokens, c.num_heads * c.head_dim)
        return self.mlp_residual(x, pad_rows(attn, num_rows), rows)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         rows: BlockRows | None) -> tuple[torch.Tensor, ...]:
        """q [rows, heads, D], k and v [rows, kv heads, D]: norm, qkv, RoPE in torch ops."""
        c = self.config
        num_rows = x.shape[0]
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = linear(h, self.qkv, rows)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        v = qkv[:, q_size + kv_size :].view(num_rows, c.num_kv_heads, c.head_dim)
        if self.q_norm is None:  # RoPE on q and k heads in one go
            qk = qkv[:, : q_size + kv_size].view(num_rows, c.num_heads + c.num_kv_heads,
                                                 c.head_dim)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            if not q.is_cpu:  # FlashInfer wants q dense
                q = q.contiguous()
        else:
            q = qkv[:, :q_size].view(num_rows, c.num_heads, c.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(num_rows, c.num_kv_heads, c.head_dim)
            q = apply_rope(rms_norm(q, self.q_norm, c.rms_norm_eps), cos, sin)
            k = apply_rope(rms_norm(k, self.k_norm, c.rms_norm_eps), cos, sin)
        return q, k, v

    def mlp_residual(self, x: torch.Tensor, attn: torch.Tensor,
                     rows: BlockRows | None) -> torch.Tensor:
        """x + attn W_o^T, then plus the MLP of its norm, in torch ops; attn [rows, q_size]."""
        x = x + linear(attn, self.o, rows)
        h = rms_norm(x, self.post_attn_norm, self.config.rms_norm_eps)
        gate, up = linear(h, self.gate_up, rows).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down, rows)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      backend: AttentionBackend, kv_cache: torch.Tensor,
                      rows: BlockRows) -> torch.Tensor:
        """The block rows in two C calls (`layer_ops`), the dense rows (if any) in torch ops.

        A block row takes the same C arithmetic whether the step is all block rows (decode) or
        mixes them with dense rows (a recompute replay, a chunked prefill beside decodes): the
        C ops see only the block rows, each computed on its own."""
        c, fused = self.config, self.fused
        num_rows = x.shape[0]  # no padding: `LlamaModel.forward` pads nothing with `rows`
        heads = (c.num_heads, c.num_kv_heads, c.num_kv_heads)
        if rows.num_dense == 0:
            q, k, v = fused.attention_inputs(x, cos, sin).split(heads, dim=1)
        else:
            blocks, dense = rows.blocks, rows.dense
            parts = [
                (blocks, fused.attention_inputs(x.index_select(0, blocks),
                                                cos.index_select(0, blocks),
                                                sin.index_select(0, blocks)).split(heads, 1)),
                (dense, self.attention_inputs(x.index_select(0, dense),
                                              cos.index_select(0, dense),
                                              sin.index_select(0, dense),
                                              BlockRows.all_dense(rows.num_dense))),
            ]
            q, k, v = (torch.empty(num_rows, n, c.head_dim) for n in heads)
            for index, part in parts:
                for full, rows_part in zip((q, k, v), part):
                    full.index_copy_(0, index, rows_part)
        backend.append_kv(kv_cache, k, v)
        attn = backend.attend(q, kv_cache)  # [rows, heads, D]
        if not attn.is_contiguous():  # the torch reference's is a transposed view
            attn = attn.reshape(num_rows, -1)
        if rows.num_dense == 0:
            return fused.mlp_residual(x, attn)
        out = torch.empty_like(x)
        out.index_copy_(0, rows.blocks, fused.mlp_residual(x.index_select(0, rows.blocks),
                                                           attn.index_select(0, rows.blocks)))
        dense_attn = attn.index_select(0, rows.dense).reshape(rows.num_dense, -1)
        out.index_copy_(0, rows.dense,
                        self.mlp_residual(x.index_select(0, rows.dense), dense_attn,
                                          BlockRows.all_dense(rows.num_dense)))
        return out


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 batch_invariant: bool = True,
                 weight_format: WeightFormat = WeightFormat.FP32,
                 quantized: dict[str, QuantizedWeight] | None = None) -> None:
        """`quantized`: a GGUF's blocks by weight name; decode rows then read them (CPU only)."""
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        self.weight_format = weight_format
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        head_name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        self.head = Linear(weights[head_name], None, weight_format,
                           fused_blocks(quantized, [head_name]))
        self.lm_head = self.head.weight  # dense (None once packed), for byte counts
        self.layers = [
            DecoderLayer(config, weights, f"model.layers.{i}", weight_format, quantized)
            for i in range(config.num_layers)
        ]
        # generated-token rows read quantised blocks where the runner says so (`BlockRows`)
        self.has_blocks = self.head.blocks is not None or any(
            layer.qkv.blocks is not None for layer in self.layers)
        fused = [layer.fused for layer in self.layers]
        # a step whose rows all read blocks: every layer in one C call (same bits as the loop)
        self.stack = layer_ops.FusedStack(fused) if fused and all(fused) else None

    def drop_blocks(self) -> None:
        """Every row dense from now on (`--weights auto` measured float32 faster here)."""
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                lin.blocks = None
            layer.fused = None
        self.stack = None
        self.head.blocks = None
        self.has_blocks = False

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def min_rows(self) -> int:
        return MIN_INVARIANT_ROWS if self.batch_invariant else 1

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, kv_caches: list[torch.Tensor],
                rows: BlockRows | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden] (normed). `rows`: which
        rows read quantised blocks (with none, or no `rows`, every linear is dense)."""
        num_tokens = input_ids.shape[0]
        if not self.has_blocks:
            rows = None
        # pad once here rather than at every GEMM: padding rows ride along, never attend; with
        # `rows`, `Linear` pads only the dense rows (the block kernel needs none)
        min_rows = 1 if rows is not None else self.min_rows
        x = pad_rows(self.embed[input_ids], min_rows)
        cos, sin = rope_cos_sin(pad_rows(positions[:, None], min_rows)[:, 0],
                                self.config.head_dim, self.config.rope_theta, x.dtype)
        if self.can_stack(rows, backend, kv_caches):
            plan = backend.c_plan(self.config.head_dim)
            x = self.stack.decode(x, cos, sin, kv_caches, plan)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(x, cos, sin, backend, kv_cache, num_tokens, rows)
        return rms_norm(x[:num_tokens], self.final_norm, self.config.rms_norm_eps)

    def can_stack(self, rows: BlockRows | None, backend: AttentionBackend,
                  kv_caches: list[torch.Tensor]) -> bool:
        """All rows read blocks and the C attention runs: `FusedStack` takes the step."""
        return (self.stack is not None and rows is not None and rows.num_dense == 0
                and hasattr(backend, "c_plan")
                and all(c.dtype == torch.float32 and c.is_contiguous()
                        for c in kv_caches[:len(self.layers)]))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: BlockRows | None = None) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]; `rows` as in `forward`."""
        if self.has_blocks and rows is not None:
            return linear(hidden, self.head, rows).float()
        num_rows = hidden.shape[0]
        return linear(pad_rows(hidden, self.min_rows), self.head)[:num_rows].float()
