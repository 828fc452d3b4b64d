"""A llama-family decoder layer and its parts: RMSNorm, rotary embeddings (Hugging Face's
rotate-half layout), attention over the paged pool through the step's backend, the gated MLP;
rows that read blocks run the layer in two C calls around the attention
(`kernels/layer_ops.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpark.kernels import layer_ops
from kvpark.kernels.amx_gemm import ATiles, Rows
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.prompt_stack import PromptLayerWeights
from kvpark.kernels.quant_linear import QuantizedWeight

from .config import ModelConfig
from .linear import BlockRows, Linear, WeightFormat, linear, linear_add, linear_silu, pad_rows


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


def all_dense(rows: BlockRows | None) -> bool:
    """No row of the step reads quantised blocks (None: the model padded the rows for a dense
    GEMM)."""
    return rows is None or rows.num_blocks == 0


def plus_linear(x: torch.Tensor, a: Rows, layer: Linear, rows: BlockRows | None) -> torch.Tensor:
    """x + a W^T (a residual connection): the sum in the AMX GEMM's last pass where every row
    is dense and float32, else the GEMM then torch's add; the same bits either way."""
    if (layer.fuses_add and all_dense(rows) and x.dtype == torch.float32  # AMX: on the CPU
            and (isinstance(a, ATiles) or a.dtype == torch.float32)):
        return linear_add(a, layer, x)
    return x + linear(a, layer, rows)


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
        # dense rows' norms, RoPE and SiLU in the C ops the block rows use (one pass each, not
        # torch's 2-5 ops over memory): a layer without q/k norms, float32 norms, C kernels
        self.row_ops = (self.q_norm is None and self.input_norm.dtype == torch.float32
                        and layer_ops.is_available())

    def prompt_weights(self) -> PromptLayerWeights | None:
        """What `PromptStack` needs of this layer, where its dense rows take the AMX path end to
        end (norms into tiles, every linear on AMX with fused epilogues, no q/k norms); None
        where they do not."""
        c, linears = self.config, (self.qkv, self.o, self.gate_up, self.down)
        # fuses_add: on AMX, float32 sums, no bias
        if not (self.row_ops and all(lin.fuses_add for lin in linears)
                and self.gate_up.fuses_silu):
            return None
        return PromptLayerWeights(
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            eps=c.rms_norm_eps, input_norm=self.input_norm.contiguous(),
            post_norm=self.post_attn_norm.contiguous(), qkv=self.qkv.amx, o=self.o.amx,
            gate_up=self.gate_up.amx, down=self.down.amx)

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
        num_rows = x.shape[0]
        q, k, v = self.attention_inputs(x, cos, sin, rows)
        if num_tokens < num_rows:
            q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
        backend.append_kv(kv_cache, k, v)
        return self.mlp_residual(x, self.attention(q, backend, kv_cache, num_rows, rows), rows)

    def attention(self, q: torch.Tensor, backend: AttentionBackend, kv_cache: torch.Tensor,
                  num_rows: int, rows: BlockRows | None) -> Rows:
        """q's attention as the o projection takes it: the A tiles the AMX attention writes
        where the o GEMM reads tiles and every row is dense, else float32 rows padded to
        `num_rows` (zeros); the same bits either way."""
        if self.o.reads_tiles and all_dense(rows):
            tiles = backend.attend_tiles(q, kv_cache, num_rows)
            if tiles is not None:
                return tiles
        attn = backend.attend(q, kv_cache).reshape(q.shape[0], q.shape[1] * q.shape[2])
        return pad_rows(attn, num_rows)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         rows: BlockRows | None) -> tuple[torch.Tensor, ...]:
        """q [rows, heads, D], k and v [rows, kv heads, D]: norm, qkv, RoPE (in C where
        `c_ops`, else torch ops)."""
        c = self.config
        num_rows = x.shape[0]
        c_ops = self.c_ops(x)
        h = (self.normed_for(self.qkv, x, self.input_norm, rows) if c_ops
             else rms_norm(x, self.input_norm, c.rms_norm_eps))
        qkv = linear(h, self.qkv, rows)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        v = qkv[:, q_size + kv_size :].view(num_rows, c.num_kv_heads, c.head_dim)
        if c_ops:  # RoPE on the q and k heads in place, in C
            qk = qkv[:, : q_size + kv_size].view(num_rows, c.num_heads + c.num_kv_heads,
                                                 c.head_dim)
            layer_ops.rope_(qk, cos[:, 0], sin[:, 0])
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        elif self.q_norm is None:  # RoPE on q and k heads in one go
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
        """x + attn W_o^T, then plus the MLP of its norm (norm and SiLU in C where `c_ops`);
        attn [rows, q_size]."""
        x = plus_linear(x, attn, self.o, rows)
        if self.c_ops(x):
            h = self.normed_for(self.gate_up, x, self.post_attn_norm, rows)
            return plus_linear(x, self.swiglu(h, rows), self.down, rows)
        h = rms_norm(x, self.post_attn_norm, self.config.rms_norm_eps)
        gate, up = linear(h, self.gate_up, rows).chunk(2, dim=-1)
        return plus_linear(x, F.silu(gate) * up, self.down, rows)

    def normed_for(self, consumer: Linear, x: torch.Tensor, weight: torch.Tensor,
                   rows: BlockRows | None) -> Rows:
        """RMSNorm of x (C ops) for the one linear that reads it: straight into its A tiles
        where it reads them and every row is dense, else float32 rows; the same bits."""
        eps = self.config.rms_norm_eps
        if consumer.reads_tiles and all_dense(rows):
            return layer_ops.rms_norm_tiles(x, weight, eps)
        return layer_ops.rms_norm(x, weight, eps)

    def swiglu(self, h: Rows, rows: BlockRows | None) -> Rows:
        """silu(g) * u of h's gate and up projections (float32 rows, the C ops' path): in the
        AMX GEMM's epilogue when every row is dense (as the down GEMM's A tiles where it reads
        them), else the GEMM then the C op; the same bits either way, without writing and
        rereading the GEMM's twice-as-wide output."""
        if self.gate_up.fuses_silu and all_dense(rows):
            return linear_silu(h, self.gate_up, tiles=self.down.reads_tiles)
        return layer_ops.silu_mul(linear(h, self.gate_up, rows))

    def c_ops(self, x: torch.Tensor) -> bool:
        """`row_ops` for float32 rows on the CPU. The C ops compute each row on its own, as the
        torch ops do."""
        return self.row_ops and x.is_cpu and x.dtype == torch.float32

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
            parts = [
                (False, fused.attention_inputs(*(rows.take(t, False) for t in (x, cos, sin)))
                 .split(heads, 1)),
                (True, self.attention_inputs(*(rows.take(t, True) for t in (x, cos, sin)),
                                             BlockRows.all_dense(rows.num_dense))),
            ]
            q, k, v = (torch.empty(num_rows, n, c.head_dim) for n in heads)
            for dense, part in parts:
                for full, rows_part in zip((q, k, v), part):
                    rows.put(full, dense, rows_part)
        backend.append_kv(kv_cache, k, v)
        attn = backend.attend(q, kv_cache)  # [rows, heads, D]
        if not attn.is_contiguous():  # the torch reference's is a transposed view
            attn = attn.reshape(num_rows, -1)
        if rows.num_dense == 0:
            return fused.mlp_residual(x, attn)
        out = torch.empty_like(x)
        rows.put(out, False, fused.mlp_residual(rows.take(x, False), rows.take(attn, False)))
        dense_attn = rows.take(attn, True).reshape(rows.num_dense, -1)
        rows.put(out, True, self.mlp_residual(rows.take(x, True), dense_attn,
                                              BlockRows.all_dense(rows.num_dense)))
        return out
