"""Qwen3.5's hybrid decoder: Gated DeltaNet layers (a recurrent state per sequence) and, every
few layers, gated full attention over the paged pool.

Differences from the llama family, all from transformers' `Qwen3_5ForCausalLM`: RMSNorm scales
by (1 + weight); attention's q_proj yields a per-head sigmoid gate on its output beside q; RoPE
turns only the first `rotary_dim` dims of a head; q/k norms. A DeltaNet layer projects q, k, v
(through a causal depthwise conv), z (the output gate), b (beta) and a (the decay step), runs the
gated delta rule (`kernels/delta_rule.py`) and a gated RMSNorm, then projects out.

Linears are the llama model's `Linear` (padded to `MIN_INVARIANT_ROWS` for batch invariance;
generated-token rows read Q8_0 blocks where the model has them, as the llama model's do); the
recurrences go one sequence and one token at a time, so no row depends on its neighbours.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvpark.kernels import delta_rule, layer_ops
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.quant_linear import QuantizedWeight

from .config import FULL_ATTENTION, DeltaNetConfig, ModelConfig
from .decoder_base import DecoderBase
from .layers import apply_rope, fused_blocks, plus_linear, rms_norm, rope_cos_sin
from .linear import BlockRows, Linear, WeightFormat, linear, pad_rows
from .step_states import StepStates

log = logging.getLogger("kvpark.model")

DeltaRule = Callable[..., torch.Tensor]  # the signature of delta_rule.gated_delta_rule


def pick_delta_rule(device: torch.device) -> DeltaRule:
    """The C kernel on the CPU where it builds, else the torch recurrence (one log line)."""
    if device.type != "cpu":
        log.info("delta rule: torch, one token at a time (no CUDA kernel wired yet)")
        return delta_rule.gated_delta_rule
    if not delta_rule.is_available():
        log.warning("delta rule: the C kernel did not build; torch, one token at a time")
        return delta_rule.gated_delta_rule
    return delta_rule.gated_delta_rule_c


def offset_norm(weights: dict[str, torch.Tensor], name: str, offset: float) -> torch.Tensor:
    """A norm weight as the scale it applies: Qwen3.5 stores (scale - 1)."""
    return weights[name] + offset if offset else weights[name]


Blocks = dict[str, QuantizedWeight] | None  # a linear's quantised blocks by weight name


def c_row_ops(weight: torch.Tensor) -> bool:
    """Whether a layer's float32 rows take `layer_ops`' C norms and SwiGLU (one pass each, each
    row on its own in a fixed order, prompt rows and decode rows alike): float32 norm weights on
    the CPU where the C kernels build. torch's rms_norm is several ops over memory a call, made
    several times a layer."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and layer_ops.is_available())


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, c_ops: bool) -> torch.Tensor:
    """RMSNorm over x's last dim: in C where `c_ops` and x is float32, else torch's. (torch's
    also wakes its own thread pool for a handful of rows, beside the C kernels' pool.)"""
    if c_ops and x.dtype == torch.float32:
        rows = x.reshape(-1, x.shape[-1])  # a copy only where heads are views of a projection
        return layer_ops.rms_norm(rows, weight, eps).view(x.shape)
    return rms_norm(x, weight, eps)


def make_linear(weights: dict[str, torch.Tensor], names: list[str], fmt: WeightFormat,
                quantized: Blocks) -> Linear:
    """One linear over these weights stacked (and their blocks, where each has them)."""
    return Linear(torch.cat([weights[n] for n in names]) if len(names) > 1 else weights[names[0]],
                  None, fmt, fused_blocks(quantized, names))


class MLPBlock(nn.Module):
    """The gated MLP and the residual around it, shared by both layer kinds."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 fmt: WeightFormat, quantized: Blocks = None) -> None:
        super().__init__()
        mlp = f"{prefix}.mlp"
        self.gate_up = make_linear(weights, [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"],
                                   fmt, quantized)
        self.down = make_linear(weights, [f"{mlp}.down_proj.weight"], fmt, quantized)
        self.post_norm = offset_norm(weights, f"{prefix}.post_attention_layernorm.weight",
                                     config.norm_offset).contiguous()
        self.eps = config.rms_norm_eps
        self.c_ops = c_row_ops(self.post_norm)

    def forward(self, x: torch.Tensor, rows: BlockRows | None = None) -> torch.Tensor:
        gate_up = linear(norm(x, self.post_norm, self.eps, self.c_ops), self.gate_up, rows)
        if self.c_ops and gate_up.dtype == torch.float32:
            return plus_linear(x, layer_ops.silu_mul(gate_up), self.down, rows)
        gate, up = gate_up.chunk(2, dim=-1)
        return plus_linear(x, F.silu(gate) * up, self.down, rows)


class GatedAttentionLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 fmt: WeightFormat, quantized: Blocks = None) -> None:
        super().__init__()
        self.config = config
        attn = f"{prefix}.self_attn"
        self.qkv = make_linear(weights, [f"{attn}.{p}_proj.weight" for p in "qkv"], fmt,
                               quantized)
        self.o = make_linear(weights, [f"{attn}.o_proj.weight"], fmt, quantized)
        self.input_norm = offset_norm(weights, f"{prefix}.input_layernorm.weight",
                                      config.norm_offset).contiguous()
        self.c_ops = c_row_ops(self.input_norm)
        self.q_norm = offset_norm(weights, f"{attn}.q_norm.weight", config.norm_offset
                                  ).contiguous()
        self.k_norm = offset_norm(weights, f"{attn}.k_norm.weight", config.norm_offset
                                  ).contiguous()
        self.mlp = MLPBlock(config, weights, prefix, fmt, quantized)
        self.gate_up, self.down = self.mlp.gate_up, self.mlp.down

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend, kv_cache: torch.Tensor, num_tokens: int,
                rows: BlockRows | None = None) -> torch.Tensor:
        c = self.config
        num_rows, dim, heads = x.shape[0], c.head_dim, c.num_heads
        qkv = linear(norm(x, self.input_norm, c.rms_norm_eps, self.c_ops), self.qkv, rows)
        q_gate = qkv[:, :2 * heads * dim].view(num_rows, heads, 2 * dim)
        q, gate = q_gate[..., :dim], q_gate[..., dim:].reshape(num_rows, heads * dim)
        k_end = 2 * heads * dim + c.num_kv_heads * dim
        k = qkv[:, 2 * heads * dim:k_end].view(num_rows, c.num_kv_heads, dim)
        v = qkv[:, k_end:].view(num_rows, c.num_kv_heads, dim)
        eps = c.rms_norm_eps
        q = self.partial_rope(norm(q.contiguous(), self.q_norm, eps, self.c_ops), cos, sin)
        k = self.partial_rope(norm(k, self.k_norm, eps, self.c_ops), cos, sin)
        q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens].contiguous()
        backend.append_kv(kv_cache, k, v)
        attn = backend.attend(q, kv_cache).reshape(num_tokens, heads * dim)
        attn = pad_rows(attn, num_rows) * torch.sigmoid(gate)
        return self.mlp(plus_linear(x, attn, self.o, rows), rows)

    def partial_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> torch.Tensor:
        """RoPE on the first `rotary_dim` dims of each head; the rest pass as they are."""
        turned = self.config.rotary_dim
        if turned == x.shape[-1]:
            return apply_rope(x, cos, sin)
        return torch.cat((apply_rope(x[..., :turned].contiguous(), cos, sin),
                          x[..., turned:]), dim=-1)


class DeltaNetLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str,
                 fmt: WeightFormat, rule: DeltaRule = delta_rule.gated_delta_rule,
                 quantized: Blocks = None) -> None:
        super().__init__()
        self.config = config
        self.rule = rule
        self.shape: DeltaNetConfig = config.delta_net
        mixer = f"{prefix}.linear_attn"
        # q, k, v (the conv's channels), z, b, a: one GEMM
        self.qkv = make_linear(weights, [f"{mixer}.in_proj_{p}.weight"
                                         for p in ("qkv", "z", "b", "a")], fmt, quantized)
        self.o = make_linear(weights, [f"{mixer}.out_proj.weight"], fmt, quantized)
        self.conv_weight = weights[f"{mixer}.conv1d.weight"].reshape(self.shape.conv_dim, -1)
        self.neg_a = -weights[f"{mixer}.A_log"].float().exp()  # the decay rate, per value head
        self.dt_bias = weights[f"{mixer}.dt_bias"].float()
        self.out_norm = weights[f"{mixer}.norm.weight"].float().contiguous()  # no offset
        self.input_norm = offset_norm(weights, f"{prefix}.input_layernorm.weight",
                                      config.norm_offset).contiguous()
        self.c_ops = c_row_ops(self.input_norm)
        self.mlp = MLPBlock(config, weights, prefix, fmt, quantized)
        self.gate_up, self.down = self.mlp.gate_up, self.mlp.down
        # the C rule comes with the whole step's mixing in C (`delta_rule.delta_net_mix_c`):
        # in torch the conv and norms around it were ~25 small ops per sequence and layer
        self.c_mix = (rule is delta_rule.gated_delta_rule_c
                      and self.conv_weight.dtype == torch.float32
                      and self.conv_weight.device.type == "cpu")

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def forward(self, x: torch.Tensor, conv_states: torch.Tensor, states: torch.Tensor,
                step: StepStates, kept: tuple[torch.Tensor, torch.Tensor] | None = None,
                rows: BlockRows | None = None) -> torch.Tensor:
        """`kept`: this layer's [slots, draft rows, *state] conv and recurrent buffers, where a
        speculative chunk keeps the state after each of its rows but the last."""
        s, eps = self.shape, self.config.rms_norm_eps
        projected = linear(norm(x, self.input_norm, eps, self.c_ops), self.qkv, rows)
        mixed, z, b, a = projected.split(
            (s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads), dim=-1)
        core = torch.zeros(x.shape[0], s.num_v_heads, s.v_head_dim, dtype=torch.float32,
                           device=x.device)
        for chunk in step.chunks:
            if chunk.fresh:
                conv_states[chunk.slot].zero_()
                states[chunk.slot].zero_()
        self.mix_spans(mixed, a, b, conv_states, states, core, step.whole_spans)
        for chunk in step.row_chunks:  # speculative: the state after each row is kept
            for row in range(chunk.num_rows):
                self.mix_spans(mixed, a, b, conv_states, states, core, delta_rule.make_spans(
                    [(chunk.slot, chunk.start_row + row, 1)], step.num_slots))
                if row < chunk.num_rows - 1:
                    kept[0][chunk.slot, row].copy_(conv_states[chunk.slot])
                    kept[1][chunk.slot, row].copy_(states[chunk.slot])
        gated = norm(core.view(-1, s.v_head_dim), self.out_norm, eps, self.c_ops)
        gated = gated.view(x.shape[0], -1) * F.silu(z.float())
        return self.mlp(plus_linear(x, gated.to(x.dtype), self.o, rows), rows)

    def mix_spans(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  conv_states: torch.Tensor, states: torch.Tensor, core: torch.Tensor,
                  spans: delta_rule.Spans) -> None:
        """Each span's rows (one sequence's) through the conv and the delta rule into `core`:
        all in one C call where the rule is the C kernel and the step is float32, else a
        sequence at a time in torch around `self.rule`."""
        if self.c_mix and mixed.dtype == conv_states.dtype == torch.float32:
            delta_rule.delta_net_mix_c(mixed, a, b, self.conv_weight, self.neg_a, self.dt_bias,
                                       conv_states, states, spans, core, self.shape.num_k_heads)
            return
        for slot, start, num_rows in spans.spans:
            span = slice(start, start + num_rows)
            core[span] = self.mix(mixed[span], a[span], b[span], conv_states[slot], states[slot])

    def mix(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            conv_state: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """One sequence's rows through the conv and the delta rule: [T, value heads, v_dim]."""
        s = self.shape
        num_rows = mixed.shape[0]
        qkv = delta_rule.causal_conv(mixed, conv_state, self.conv_weight)
        q, k, v = qkv.split((s.key_dim, s.key_dim, s.value_dim), dim=-1)
        q = delta_rule.l2_normalize(q.reshape(num_rows, s.num_k_heads, s.k_head_dim).float())
        k = delta_rule.l2_normalize(k.reshape(num_rows, s.num_k_heads, s.k_head_dim).float())
        group = s.num_v_heads // s.num_k_heads  # consecutive value heads share a key head
        if group > 1:
            q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        q = q * (s.k_head_dim ** -0.5)
        v = v.reshape(num_rows, s.num_v_heads, s.v_head_dim)
        return self.rule(q, k, v, a, b, self.neg_a, self.dt_bias, state)


class HybridModel(DecoderBase):
    """The model interface of `LlamaModel` (forward, logits) plus the step's state slots."""

    stack = None

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 batch_invariant: bool = True,
                 weight_format: WeightFormat = WeightFormat.FP32,
                 rule: DeltaRule | None = None, quantized: Blocks = None) -> None:
        """`rule`: the delta rule's implementation (default: `pick_delta_rule`); `quantized`:
        blocks by weight name (Q8_0 made at load): generated-token rows then read them."""
        super().__init__()
        self.config = config
        self.batch_invariant = batch_invariant
        self.weight_format = weight_format
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = offset_norm(weights, "model.norm.weight", config.norm_offset
                                      ).contiguous()
        self.c_ops = c_row_ops(self.final_norm)
        head_name = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        self.head = make_linear(weights, [head_name], weight_format, quantized)
        self.lm_head = self.head.weight
        self.rule = rule or pick_delta_rule(self.embed.device)
        self.layers = [
            GatedAttentionLayer(config, weights, f"model.layers.{i}", weight_format, quantized)
            if kind == FULL_ATTENTION else
            DeltaNetLayer(config, weights, f"model.layers.{i}", weight_format, self.rule,
                          quantized)
            for i, kind in enumerate(config.kinds)
        ]
        # generated-token rows read quantised blocks where the runner says so (`BlockRows`)
        self.has_blocks = self.head.blocks is not None or any(
            lin.blocks is not None for layer in self.layers for lin in layer.linears)

    def drop_blocks(self) -> None:
        """Every row dense from now on (`--weights auto` measured float32 faster here)."""
        for lin in (self.head, *(lin for layer in self.layers for lin in layer.linears)):
            lin.blocks = None
        self.has_blocks = False

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend, kv_caches: list[torch.Tensor],
                rows: BlockRows | None = None, states: StepStates | None = None
                ) -> torch.Tensor:
        """As `LlamaModel.forward`; `kv_caches` holds the attention layers' caches only, and
        `states` says where each chunk's recurrent state lives."""
        assert states is not None, "a hybrid model's step needs its state slots"
        num_tokens = input_ids.shape[0]
        if not self.has_blocks:
            rows = None
        # pad once here for the dense GEMMs; with `rows`, `Linear` pads only the dense rows
        min_rows = 1 if rows is not None else self.min_rows
        x = pad_rows(self.embed[input_ids], min_rows)
        cos, sin = rope_cos_sin(pad_rows(positions[:, None], min_rows)[:, 0],
                                self.config.rotary_dim, self.config.rope_theta, x.dtype)
        caches, slots = iter(kv_caches), iter(zip(states.conv, states.recurrent))
        kept = iter(zip(states.row_conv, states.row_recurrent))
        for layer in self.layers:
            if isinstance(layer, GatedAttentionLayer):
                x = layer(x, cos, sin, backend, next(caches), num_tokens, rows)
            else:
                conv, recurrent = next(slots)
                x = layer(x, conv, recurrent, states, next(kept, None), rows)
        return norm(x[:num_tokens], self.final_norm, self.config.rms_norm_eps, self.c_ops)
