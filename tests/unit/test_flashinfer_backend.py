"""The FlashInfer backend on the CPU: selection errors, the arrays it hands FlashInfer, and its
whole plan/append/attend logic against the torch oracle through a faithful fake FlashInfer."""

import random
import sys
from pathlib import Path

import pytest
import torch

from kvpark.kernels import flashinfer_paged
from kvpark.kernels.attention import StepLayout, get_plan_arrays
from kvpark.kernels.flashinfer_paged import (
    AttentionShape,
    FlashInferPagedAttention,
    FlashInferUnavailable,
)
from kvpark.kernels.torch_paged import TorchPagedAttention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fake_flashinfer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUNDLE_CANDIDATES = [REPO / ".gpu" / "fi_site_aot.tar.xz",
                     REPO.parent / "shared" / "gpu" / "fi_site_aot.tar.xz"]


# ---- selection errors ----------------------------------------------------------------------------
def test_cpu_device_is_refused_with_a_clear_error():
    with pytest.raises(FlashInferUnavailable, match="needs a CUDA device, got cpu"):
        FlashInferPagedAttention("cpu")


def test_cuda_device_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FlashInferUnavailable, match="sees no CUDA device"):
        FlashInferPagedAttention("cuda")


def test_missing_package_is_an_import_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(ImportError, match="needs the flashinfer package"):
        flashinfer_paged.load_flashinfer("cuda")
    assert not flashinfer_paged.is_flashinfer_available("cuda")


def test_importing_the_module_does_not_import_flashinfer(monkeypatch):
    import importlib.util

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # any `import flashinfer` now fails
    # a fresh copy under another name, so the module the other tests use is left alone
    spec = importlib.util.spec_from_file_location("kvpark.kernels._flashinfer_probe",
                                                  flashinfer_paged.__file__)
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, probe)  # dataclasses look their module up
    spec.loader.exec_module(probe)


def test_server_picks_a_cpu_backend_on_cpu_and_refuses_flashinfer():
    from kvpark.kernels.cpu_paged import CpuPagedAttention, is_available
    from kvpark.pod.args import ServerArgs
    from kvpark.pod.model.synthetic import synthetic_config
    from kvpark.pod.serving.choices import pick_backend

    cpu, config = torch.device("cpu"), synthetic_config("tiny")
    auto = pick_backend(ServerArgs(attention_backend="auto"), cpu, config, torch.float32)
    assert isinstance(auto, CpuPagedAttention if is_available() else TorchPagedAttention)
    torch_backend = pick_backend(ServerArgs(attention_backend="torch"), cpu, config,
                                 torch.float32)
    assert type(torch_backend) is TorchPagedAttention
    bf16 = pick_backend(ServerArgs(attention_backend="auto"), cpu, config, torch.bfloat16)
    assert type(bf16) is TorchPagedAttention  # the C kernel is float32 only
    with pytest.raises(ValueError, match="float32 only"):
        pick_backend(ServerArgs(attention_backend="cpu"), cpu, config, torch.bfloat16)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pick_backend(ServerArgs(attention_backend="flashinfer"), cpu, config, torch.float32)


# ---- the arrays handed to FlashInfer, by hand --------------------------------------------------
# page_size 4. A: fresh prompt of 6 (two pages, last holds 2). B: decode filling a page exactly
# (kv 8, the new token at position 7). C: decode opening a new page (kv 9, position 8 is slot 0
# of page 3). D: prefill chunk continuing at a page boundary (positions 8..10).
MIXED = StepLayout(page_tables=[[5, 2], [0, 7, 9], [1, 3, 4], [6, 8, 10, 11]],
                   kv_lens=[6, 8, 9, 11], q_lens=[6, 1, 1, 3], page_size=4)
DECODE = StepLayout(page_tables=[[0, 7], [1, 3, 4]], kv_lens=[8, 9], q_lens=[1, 1], page_size=4)


def test_mixed_step_arrays_by_hand():
    arrays = get_plan_arrays(MIXED)
    assert arrays.qo_indptr.tolist() == [0, 6, 7, 8, 11]
    # B holds a third page it has not reached yet: only pages covering kv_len are passed
    assert arrays.kv_indptr.tolist() == [0, 2, 4, 7, 10]
    assert arrays.kv_indices.tolist() == [5, 2, 0, 7, 1, 3, 4, 6, 8, 10]
    assert arrays.kv_last_page_len.tolist() == [2, 4, 1, 3]
    assert arrays.batch_indices.tolist() == [0, 0, 0, 0, 0, 0, 1, 2, 3, 3, 3]
    assert arrays.positions.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 8, 9, 10]
    assert all(a.dtype == torch.int32 for a in vars(arrays).values())


def make_backend(monkeypatch, shape=None) -> FlashInferPagedAttention:
    fake_flashinfer.install(monkeypatch)
    return FlashInferPagedAttention("cpu", shape=shape, workspace_bytes=1024)


def calls_named(name):
    return [c for c in fake_flashinfer.CALLS if c[0] == name]


def test_mixed_step_plans_prefill_with_the_hand_arrays(monkeypatch):
    backend = make_backend(monkeypatch, AttentionShape(8, 2, 16, 4, torch.float32, torch.float32))
    backend.plan(MIXED)
    [(_, args, kwargs)] = calls_named("BatchPrefillWithPagedKVCacheWrapper.plan")
    qo, kv_indptr, kv_indices, last, hq, hkv, d, ps = args
    assert qo.tolist() == [0, 6, 7, 8, 11] and kv_indptr.tolist() == [0, 2, 4, 7, 10]
    assert kv_indices.tolist() == [5, 2, 0, 7, 1, 3, 4, 6, 8, 10]
    assert last.tolist() == [2, 4, 1, 3] and (hq, hkv, d, ps) == (8, 2, 16, 4)
    assert kwargs == {"causal": True, "q_data_type": torch.float32,
                      "kv_data_type": torch.float32}
    assert not calls_named("BatchDecodeWithPagedKVCacheWrapper.plan")


def test_decode_step_plans_decode_with_the_hand_arrays(monkeypatch):
    backend = make_backend(monkeypatch, AttentionShape(8, 2, 16, 4, torch.float32, torch.float32))
    backend.plan(DECODE)
    [(_, args, kwargs)] = calls_named("BatchDecodeWithPagedKVCacheWrapper.plan")
    indptr, indices, last = args[:3]
    assert indptr.tolist() == [0, 2, 5] and indices.tolist() == [0, 7, 1, 3, 4]
    assert last.tolist() == [4, 1] and args[3:] == (8, 2, 16, 4)
    assert kwargs == {"q_data_type": torch.float32, "kv_data_type": torch.float32}


@pytest.mark.parametrize("hq,hkv,tensor_cores", [(9, 3, False), (8, 2, True), (16, 4, True)])
def test_tensor_cores_from_a_group_of_four(monkeypatch, hq, hkv, tensor_cores):
    make_backend(monkeypatch, AttentionShape(hq, hkv, 8, 4, torch.float32, torch.float32))
    inits = calls_named("BatchDecodeWithPagedKVCacheWrapper.__init__")
    assert [kw["use_tensor_cores"] for _, _, kw in inits] == [tensor_cores]
    prefill = calls_named("BatchPrefillWithPagedKVCacheWrapper.__init__")
    assert all(kw["backend"] == "fa2" for _, _, kw in inits + prefill)


# ---- the whole backend against the oracle --------------------------------------------------------
def random_step(rng, gen, hq, hkv, d, page_size):
    """A cache already holding each sequence's prior KV, and one mixed step over it."""
    n = rng.randint(1, 5)
    prior = [rng.choice([0, rng.randint(1, 40)]) for _ in range(n)]
    q_lens = [rng.choice([1, rng.randint(1, 20)]) for _ in range(n)]
    totals = [p + q for p, q in zip(prior, q_lens)]
    page_ids = list(range(sum(-(-t // page_size) for t in totals) + 2))
    rng.shuffle(page_ids)
    tables, start = [], 0
    for t in totals:
        count = -(-t // page_size)
        tables.append(page_ids[start : start + count])
        start += count
    cache = torch.randn(len(page_ids), 2, page_size, hkv, d, generator=gen)
    layout = StepLayout(tables, totals, q_lens, page_size)
    k = torch.randn(sum(q_lens), hkv, d, generator=gen)
    v = torch.randn(sum(q_lens), hkv, d, generator=gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    return layout, cache, q, k, v


def run_step(backend, layout, cache, q, k, v, num_layers=2):
    """Plan once, then append + attend per layer (each layer its own copy of the cache)."""
    caches = [cache.clone() for _ in range(num_layers)]
    backend.plan(layout)
    outs = []
    for layer_cache in caches:
        backend.append_kv(layer_cache, k, v)
        outs.append(backend.attend(q, layer_cache))
    return caches, outs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("configured", [True, False])
def test_matches_torch_backend_on_random_mixed_steps(monkeypatch, seed, configured):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hkv = rng.choice([1, 2])
    hq, d, ps = hkv * rng.choice([3, 4]), rng.choice([8, 16]), rng.choice([1, 4, 16])
    layout, cache, q, k, v = random_step(rng, gen, hq, hkv, d, ps)
    shape = AttentionShape(hq, hkv, d, ps, torch.float32, torch.float32) if configured else None
    fi_caches, fi_outs = run_step(make_backend(monkeypatch, shape), layout, cache, q, k, v)
    ref_caches, ref_outs = run_step(TorchPagedAttention(), layout, cache, q, k, v)
    for fi_cache, ref_cache in zip(fi_caches, ref_caches):
        assert torch.equal(fi_cache, ref_cache)  # the same slots written, bit for bit
    for fi_out, ref_out in zip(fi_outs, ref_outs):
        torch.testing.assert_close(fi_out, ref_out, rtol=1e-4, atol=1e-5)
    wrapper = "Decode" if layout.is_decode_only else "Prefill"
    # plan once per step, not once per layer
    assert len(calls_named(f"Batch{wrapper}WithPagedKVCacheWrapper.plan")) == 1
    assert len(calls_named(f"Batch{wrapper}WithPagedKVCacheWrapper.run")) == 2


def test_attend_before_plan_is_refused(monkeypatch):
    backend = make_backend(monkeypatch)
    with pytest.raises(AssertionError, match="plan"):
        backend.attend(torch.zeros(1, 2, 8), torch.zeros(1, 2, 4, 1, 8))


def test_graph_wrappers_replan_into_fixed_buffers(monkeypatch):
    """A graph bucket's buffers keep their addresses; each plan_graph rewrites their contents."""
    shape = AttentionShape(8, 2, 8, 4, torch.float32, torch.float32)
    backend = make_backend(monkeypatch, shape)
    backend.prepare_graph(batch_size=2, max_pages=12)
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(12, 2, 4, 2, 8, generator=gen)
    pointers = None
    for layout in (DECODE, StepLayout([[2], [5, 6, 11]], [3, 10], [1, 1], 4)):
        backend.plan_graph(layout)
        step = backend._step
        now = [t.data_ptr() for t in (step.kv_indptr, step.kv_indices, step.kv_last_page_len,
                                      step.batch_indices, step.positions)]
        assert pointers in (None, now)
        pointers = now
        q, k, v = (torch.randn(2, h, 8, generator=gen) for h in (8, 2, 2))
        fi_cache, ref_cache = cache.clone(), cache.clone()
        backend.append_kv(fi_cache, k, v)
        out = backend.attend(q, fi_cache)
        reference = TorchPagedAttention()
        reference.plan(layout)
        reference.append_kv(ref_cache, k, v)
        assert torch.equal(fi_cache, ref_cache)
        torch.testing.assert_close(out, reference.attend(q, ref_cache), rtol=1e-4, atol=1e-5)
    [(_, _, init)] = [c for c in calls_named("BatchDecodeWithPagedKVCacheWrapper.__init__")
                      if c[2].get("use_cuda_graph")]
    assert init["paged_kv_indices_buffer"].numel() == 12
    with pytest.raises(AssertionError, match="no graph bucket of 3"):
        backend.plan_graph(StepLayout([[0], [1], [2]], [1, 1, 1], [1, 1, 1], 4))


# ---- the calls against the real FlashInfer 0.7.4 signatures --------------------------------------
@pytest.fixture(scope="module")
def real_signatures():
    bundle = next((p for p in BUNDLE_CANDIDATES if p.is_file()), None)
    if bundle is None:
        pytest.skip("the FlashInfer bundle (fi_site_aot.tar.xz) is not on this machine")
    return fake_flashinfer.real_signatures(fake_flashinfer.read_bundle_sources(bundle))


def test_every_call_binds_to_the_real_flashinfer_signatures(monkeypatch, real_signatures):
    shape = AttentionShape(8, 2, 16, 4, torch.float32, torch.float32)
    backend = make_backend(monkeypatch, shape)
    backend.prepare_graph(2, 16)
    gen = torch.Generator().manual_seed(1)
    cache = torch.zeros(16, 2, 4, 2, 16)
    for layout in (MIXED, DECODE):
        backend.plan(layout)
        t = layout.num_tokens
        backend.append_kv(cache, torch.randn(t, 2, 16, generator=gen),
                          torch.randn(t, 2, 16, generator=gen))
        backend.attend(torch.randn(t, 8, 16, generator=gen), cache)
    backend.plan_graph(DECODE)
    backend.attend(torch.randn(2, 8, 16, generator=gen), cache)
    # the two helpers tests/gpu calls to cross-check our batch indices and positions
    arrays = get_plan_arrays(MIXED)
    seq_lens = fake_flashinfer.get_seq_lens(arrays.kv_indptr, arrays.kv_last_page_len, 4)
    fake_flashinfer.get_batch_indices_positions(arrays.qo_indptr, seq_lens, MIXED.num_tokens)
    names = {name for name, _, _ in fake_flashinfer.CALLS}
    assert names == set(fake_flashinfer.REAL_TARGETS), "every entry point was exercised"
    assert fake_flashinfer.bind_all(fake_flashinfer.CALLS, real_signatures) == []


def test_binding_catches_a_wrong_keyword(real_signatures):
    bad = [("BatchDecodeWithPagedKVCacheWrapper.plan", (1, 2, 3, 4, 5, 6, 7),
            {"q_dtype": torch.float16})]
    assert len(fake_flashinfer.bind_all(bad, real_signatures)) == 1
