"""The CPU decode path: packed linears, fused RoPE/norm, per-sequence attention, and the
batch-invariance they promise (a row's bits never depend on which other rows share the step)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvpark.kernels import cpu_features, layer_ops, onednn_isa
from kvpark.kernels.attention import StepLayout
from kvpark.kernels.torch_paged import TorchPagedAttention
from kvpark.pod.memory.kv_pool import KVPool
from kvpark.pod.model import layers as layers_module
from kvpark.pod.model.config import ModelConfig
from kvpark.pod.model.layers import apply_rope, rms_norm, rope_cos_sin
from kvpark.pod.model.linear import Linear, WeightFormat, gemm_engine
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.loader import LoadedModel
from kvpark.pod.model.synthetic import synthetic_config, synthetic_weights
from kvpark.pod.worker.batch_invariance import probe_gemm_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_isa import requires_amx, requires_bf16_gemm  # noqa: E402
from reference_llama import reference_logits  # noqa: E402

PAGE = 16
# SmolLM2's attention and MLP shapes (the oneDNN kernels the real model hits), two layers and a
# small vocabulary so that the model builds in a blink
SMALL = replace(synthetic_config("smollm2-135m"), num_layers=2, vocab_size=512)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def small_weights() -> dict[str, torch.Tensor]:
    return synthetic_weights(SMALL)


# ---- linears ------------------------------------------------------------------------------------
ROW_COUNTS = [*range(2, 20), 31, 64, 100, 257, 512]
# bf16 row invariance is a property of oneDNN's prepacked bf16 GEMMs, which need AVX-512
FORMATS = [WeightFormat.FP32, pytest.param(WeightFormat.BF16, marks=requires_bf16_gemm),
           pytest.param(WeightFormat.AMX_BF16, marks=requires_amx)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (3072, 576), (576, 1536)])
def test_linear_rows_do_not_depend_on_the_row_count(fmt, threads, out_features, in_features):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(out_features)
    layer = Linear(torch.randn(out_features, in_features, generator=gen) * 0.05, None, fmt)
    x = torch.randn(600, in_features, generator=gen)
    full = layer(x)
    for rows in ROW_COUNTS:
        for start in (0, 3):
            assert torch.equal(layer(x[start : start + rows]), full[start : start + rows]), (
                f"{rows} rows from row {start} differ from the same rows in a batch of 600"
            )


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(bias):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(960, 576, generator=gen) * 0.05
    b = torch.randn(960, generator=gen) if bias else None
    layer = Linear(weight, b)
    assert layer.packed is not None and layer.weight is None  # one copy of the weights in RAM
    x = torch.randn(7, 576, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_bf16_linear_keeps_fp32_activations():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(256, 576, generator=gen) * 0.05
    x = torch.randn(5, 576, generator=gen)
    y = Linear(weight, None, WeightFormat.BF16)(x)
    assert y.dtype == torch.float32
    exact = F.linear(x.double(), weight.double())
    assert ((y.double() - exact).norm() / exact.norm()).item() < 1e-2


# ---- elementwise pieces: the same bits as the plain formulas they replace ------------------------
def test_rope_equals_rotate_half_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 12, 64, generator=gen)
    positions = torch.arange(100, 111)
    cos, signed_sin = rope_cos_sin(positions, 64, 100000.0, torch.float32)
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    angles = positions.float()[:, None] * inv_freq[None, :]
    c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :32], x[..., 32:]
    rotate_half = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert torch.equal(apply_rope(x, cos, signed_sin), rotate_half)


def test_rms_norm_equals_the_four_op_form_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(9, 576, generator=gen) * 3, torch.rand(576, generator=gen) + 0.5
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.equal(rms_norm(x, w, 1e-5), plain)


# ---- attention ----------------------------------------------------------------------------------
def fill_pool(lens: list[int], hkv: int = 3, dim: int = 64, seed: int = 0):
    """A pool whose sequences hold random K/V, pages interleaved as concurrent decoding leaves
    them; the unused slots of each last page hold NaN, as a former owner could have left them:
    reading them would poison the result."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PAGE) for n in lens)
    cache = torch.randn(num_pages, 2, PAGE, hkv, dim, generator=gen)
    order = list(range(num_pages))
    tables: list[list[int]] = [[] for _ in lens]
    while any(len(t) * PAGE < n for t, n in zip(tables, lens)):
        for t, n in zip(tables, lens):
            if len(t) * PAGE < n:
                t.append(order.pop(0))
    for table, n in zip(tables, lens):
        cache[table[-1], :, (n - 1) % PAGE + 1 :] = float("nan")
    return cache, tables


def decode_step(cache, tables, lens, q):
    backend = TorchPagedAttention()
    backend.plan(StepLayout(tables, lens, [1] * len(lens), PAGE))
    return backend.attend(q, cache)


def test_a_decode_row_is_bitwise_independent_of_its_neighbours():
    lens = [300, 1000, 17, 1, 64, 2049]
    cache, tables = fill_pool(lens)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(5))
    together = decode_step(cache, tables, lens, q)
    assert torch.isfinite(together).all()
    for i in range(len(lens)):
        alone = decode_step(cache, [tables[i]], [lens[i]], q[i : i + 1])
        assert torch.equal(alone, together[i : i + 1]), f"sequence {i} changed with neighbours"


def test_attention_reads_a_strided_q_like_the_fused_qkv_view():
    lens = [40, 70]
    cache, tables = fill_pool(lens, seed=1)
    qk = torch.randn(2, 9 + 3, 64, generator=torch.Generator().manual_seed(6))
    strided = qk[:, :9]  # what the model hands over: q heads of the fused q|k rows
    assert not strided.is_contiguous()
    assert torch.equal(decode_step(cache, tables, lens, strided),
                       decode_step(cache, tables, lens, strided.contiguous()))


# ---- the whole model ----------------------------------------------------------------------------
def run_steps(model: LlamaModel, steps: list[list[tuple[int, list[int]]]], num_seqs: int,
              ) -> list[dict[int, torch.Tensor]]:
    """Feed `steps`: each a list of (sequence, token ids); return each step's last-row logits per
    sequence. Sequences get interleaved pages of one pool."""
    c = model.config
    pool = KVPool(c.num_layers, 64, PAGE, c.num_kv_heads, c.head_dim)
    tables: list[list[int]] = [[] for _ in range(num_seqs)]
    lens = [0] * num_seqs
    backend = TorchPagedAttention()
    out = []
    for step in steps:
        ids, positions = [], []
        for seq, tokens in step:
            lens[seq] += len(tokens)
            tables[seq] += pool.allocate(pool.pages_for(lens[seq]) - len(tables[seq]))
            ids += tokens
            positions += range(lens[seq] - len(tokens), lens[seq])
        backend.plan(StepLayout([tables[s] for s, _ in step], [lens[s] for s, _ in step],
                                [len(t) for _, t in step], PAGE))
        hidden = model(torch.tensor(ids), torch.tensor(positions), backend, pool.caches)
        ends = torch.tensor(cumulative([len(t) for _, t in step])) - 1
        logits = model.logits(hidden[ends])
        out.append({seq: logits[i] for i, (seq, _) in enumerate(step)})
    return out


def cumulative(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_count_runs_the_same_onednn_kernel(small_weights, fmt, threads):
    """The mechanism under the row-invariance tests: a row's bits can only be independent of the
    row count while oneDNN dispatches every count to the same kernel. On a CPU with AMX that
    holds for bf16 only with AMX kept out (`onednn_isa`; conftest caps as the server does), so
    no AMX kernel may show up; on AVX2 and AVX-512 CPUs there is none to begin with."""
    torch.set_num_threads(threads)
    model = LlamaModel(SMALL, small_weights, batch_invariant=True, weight_format=fmt)
    found = probe_gemm_kernels(model, ROW_COUNTS[2:])  # from MIN_INVARIANT_ROWS on
    if gemm_engine(fmt, model.device) == "amx":  # kvpark's tile kernel: test_amx_gemm.py
        assert not found.kernels, found.kernels
        return
    assert found.kernels, "the packed linears ran no oneDNN kernel"
    assert found.is_uniform, f"oneDNN's kernel depends on the row count: {found.by_rows}"
    assert not any("amx" in name for name in found.kernels), found.kernels
    if fmt is WeightFormat.BF16 and onednn_isa.AMX_FLAG in cpu_features.read_cpuinfo_flags():
        assert os.environ.get(onednn_isa.ENV) in onednn_isa.WITHOUT_AMX


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_model_logits_are_independent_of_batch_neighbours(small_weights, fmt, threads):
    torch.set_num_threads(threads)
    model = LlamaModel(SMALL, small_weights, batch_invariant=True, weight_format=fmt)
    prompt = [5, 9, 2, 77, 31, 8, 100]
    decode = [[11], [12], [13], [14]]
    alone = run_steps(model, [[(0, prompt)], *[[(0, t)] for t in decode]], 1)
    # the same sequence, prefilled next to a long prompt and decoded next to two others, one of
    # them still in its prefill
    neighbours = run_steps(model, [
        [(1, list(range(40, 90))), (0, prompt)],
        [(0, decode[0]), (2, [3, 4])],
        [(2, [6]), (0, decode[1]), (1, [7])],
        [(1, [8]), (0, decode[2]), (3, list(range(200, 237)))],
        [(0, decode[3])],
    ], 4)
    for step, (a, b) in enumerate(zip(alone, neighbours)):
        assert torch.equal(a[0], b[0]), f"step {step}: logits changed with batch neighbours"


@requires_amx
def test_the_amx_epilogues_change_no_logit(small_weights, monkeypatch):
    """amx-bf16 dense rows: the norms write the next GEMM's A tiles, SwiGLU runs in the gate/up
    GEMM's epilogue (into the down GEMM's A tiles), both residual adds in the o and down GEMMs':
    the logits of float32 rows, the GEMMs, then the C ops and torch's adds, to the bit, for a
    prefill and a decode step."""
    model = LlamaModel(SMALL, small_weights, batch_invariant=True,
                       weight_format=WeightFormat.AMX_BF16)
    steps = [[(0, list(range(3, 60)))], [(0, [7])]]
    calls = {"linear_silu": [], "linear_add": [], "rms_norm_tiles": []}
    for name, seen in calls.items():
        module = layer_ops if name == "rms_norm_tiles" else layers_module
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, seen=seen, **kw:
                            seen.append(a) or real(*a, **kw))
    fused = run_steps(model, steps, 1)
    layer_steps = len(steps) * SMALL.num_layers
    assert len(calls["linear_silu"]) == layer_steps
    assert len(calls["linear_add"]) == 2 * layer_steps
    assert len(calls["rms_norm_tiles"]) == 2 * layer_steps
    for flag in ("fuses_add", "fuses_silu", "reads_tiles"):
        monkeypatch.setattr(Linear, flag, property(lambda self: False))
    for a, b in zip(fused, run_steps(model, steps, 1), strict=True):
        assert torch.equal(a[0], b[0])


@requires_amx
def test_the_attention_into_the_o_projections_tiles_changes_no_bit(small_weights, monkeypatch):
    """A step of prompt rows only, AMX attention and amx-bf16 linears: the attention writes
    the o GEMM's A tiles itself (`attend_tiles`, every layer), and the hidden states are those
    of its float32 rows converted by the GEMM, to the bit; a step with a generated row takes
    the float32 rows."""
    from kvpark.kernels.cpu_paged import CpuPagedAttention

    model = LlamaModel(SMALL, small_weights, batch_invariant=True,
                       weight_format=WeightFormat.AMX_BF16)
    model.prompt_stack = None  # the layer loop's calls (the stack's are the next test's)
    pool = KVPool(SMALL.num_layers, 16, PAGE, SMALL.num_kv_heads, SMALL.head_dim)
    tables = [pool.allocate(5), pool.allocate(3)]
    backend = CpuPagedAttention(amx_prompt_rows=True)
    ids = torch.arange(3, 3 + 70 + 37) % SMALL.vocab_size
    positions = torch.cat([torch.arange(70), torch.arange(37)])
    real = CpuPagedAttention.attend_tiles
    written: list[object] = []
    monkeypatch.setattr(CpuPagedAttention, "attend_tiles", lambda *a: written.append(
        real(*a)) or written[-1])

    def hidden(prompt_rows: list[int]) -> torch.Tensor:
        backend.plan(StepLayout(tables, [70, 37], [70, 37], PAGE, prompt_rows))
        return model(ids, positions, backend, pool.caches)

    tiled = hidden([70, 37])
    assert len(written) == SMALL.num_layers and all(t is not None for t in written)
    monkeypatch.setattr(CpuPagedAttention, "attend_tiles", lambda *a: None)
    assert torch.equal(tiled.view(torch.int32), hidden([70, 37]).view(torch.int32))
    written.clear()
    monkeypatch.setattr(CpuPagedAttention, "attend_tiles", lambda *a: written.append(
        real(*a)) or written[-1])
    hidden([70, 36])  # the second sequence's last row is a generated token's
    assert written == [None] * SMALL.num_layers


@requires_amx
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_the_prompt_stack_gives_the_layer_loops_bits(small_weights, monkeypatch, kv_dtype):
    """A step of prompt rows only on AMX runs every layer in one C call (`PromptStack`): the
    hidden states and every KV page the layer loop gives, to the bit, for two prompts from
    position 0 and a chunk after a cached prefix (3 tokens: its GEMMs' rows padded to 4); a
    step with a generated row keeps the loop."""
    from kvpark.kernels.cpu_paged import CpuPagedAttention
    from kvpark.kernels.prompt_stack import PromptStack

    g = torch.Generator().manual_seed(5)  # norms of their own (the synthetic ones are 1s)
    weights = {name: torch.rand(w.shape, generator=g) + 0.5 if "norm" in name else w
               for name, w in small_weights.items()}
    model = LlamaModel(SMALL, weights, batch_invariant=True, weight_format=WeightFormat.AMX_BF16)
    assert model.prompt_stack is not None
    stack = model.prompt_stack
    runs: list[int] = []
    real = PromptStack.run
    monkeypatch.setattr(PromptStack, "run", lambda self, x, *a: runs.append(x.shape[0])
                        or real(self, x, *a))

    def steps(with_stack: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model.prompt_stack = stack if with_stack else None
        pool = KVPool(SMALL.num_layers, 16, PAGE, SMALL.num_kv_heads, SMALL.head_dim,
                      dtype=kv_dtype)
        tables = [pool.allocate(6), pool.allocate(3)]
        backend = CpuPagedAttention(amx_prompt_rows=True)
        out = []
        # two prompts from 0 (70 and 37 tokens), then 3 more of the first after its 70
        for kv_lens, q_lens, start in (([70, 37], [70, 37], [0, 0]), ([73], [3], [70])):
            backend.plan(StepLayout(tables[:len(kv_lens)], kv_lens, q_lens, PAGE, q_lens))
            n = sum(q_lens)
            ids = (torch.arange(n) * 7 + kv_lens[0]) % SMALL.vocab_size
            positions = torch.cat([torch.arange(s, s + q) for s, q in zip(start, q_lens)])
            out.append(model(ids, positions, backend, pool.caches))
        return out, [c.clone() for c in pool.caches]

    stacked, stacked_pages = steps(True)
    assert runs == [107, 4]  # a padding row rides along in the second
    looped, looped_pages = steps(False)
    for a, b in zip(stacked + stacked_pages, looped + looped_pages, strict=True):
        assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))
    runs.clear()
    model.prompt_stack = stack
    pool = KVPool(SMALL.num_layers, 16, PAGE, SMALL.num_kv_heads, SMALL.head_dim)
    backend = CpuPagedAttention(amx_prompt_rows=True)
    backend.plan(StepLayout([pool.allocate(2)], [20], [20], PAGE, [19]))  # a generated row
    model(torch.arange(20), torch.arange(20), backend, pool.caches)
    assert runs == []


def test_model_matches_the_reference_oracle(small_weights):
    loaded = LoadedModel(SMALL, small_weights, tokenizer=None, name="small", source="small")
    ids = [7, 300, 12, 5, 99, 250, 3, 41, 8, 17, 2, 64]
    expected = reference_logits(loaded, ids)
    model = LlamaModel(SMALL, small_weights)
    # a chunked prefill of 5 + 4 tokens, then three decode steps
    got = run_steps(model, [[(0, ids[:5])], [(0, ids[5:9])], *[[(0, [t])] for t in ids[9:]]], 1)
    for step, end in enumerate([5, 9, 10, 11, 12]):
        torch.testing.assert_close(got[step][0], expected[end - 1], rtol=1e-4, atol=1e-4)


def test_qwen_shapes_with_bias_and_qk_norm_match_the_oracle():
    config = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True,
                         qk_norm=True, tie_word_embeddings=False)
    weights = synthetic_weights(config)
    loaded = LoadedModel(config, weights, tokenizer=None, name="qwen", source="qwen")
    ids = [1, 2, 3, 250, 17, 9]
    got = run_steps(LlamaModel(config, weights), [[(0, ids[:4])], [(0, ids[4:5])],
                                                  [(0, ids[5:])]], 1)
    expected = reference_logits(loaded, ids)
    for step, end in enumerate([4, 5, 6]):
        torch.testing.assert_close(got[step][0], expected[end - 1], rtol=1e-4, atol=1e-4)
