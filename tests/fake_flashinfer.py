"""A CPU stand-in for the parts of FlashInfer 0.7.4 that kvpark calls.

Signatures follow flashinfer/decode.py, prefill.py and page.py of 0.7.4 (the parameters kvpark
can reach; the rest are swallowed by **rest and refused if used). The wrappers keep FlashInfer's
contracts that matter to a caller: int32 index arrays, `plan` before `run`, dtypes fixed at plan,
and in CUDA-graph mode a fixed batch size and fixed-address buffers that `plan` copies into and
`run` reads at call time (as a replayed kernel does). Attention is computed exactly (float64)
from those buffers, so a wrong index array gives a wrong answer.

Every call is recorded in `CALLS` as (name, args, kwargs) so a test can bind it against the
real signatures.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

__version__ = "0.7.4+fake"
CALLS: list[tuple[str, tuple, dict]] = []


def recorded(fn):
    """Record each call exactly as the caller made it (without `self`)."""
    is_method = "." in fn.__qualname__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS.append((fn.__qualname__, args[1:] if is_method else args, dict(kwargs)))
        return fn(*args, **kwargs)

    return wrapper


def _check_int32(**arrays: torch.Tensor) -> None:
    for name, array in arrays.items():
        assert array.dtype == torch.int32, f"{name} must be int32, got {array.dtype}"
        assert array.dim() == 1, f"{name} must be 1-D, got {tuple(array.shape)}"


def _unpack(paged_kv_cache: torch.Tensor, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    assert kv_layout == "NHD", "the fake models the NHD layout only"
    assert paged_kv_cache.dim() == 5 and paged_kv_cache.shape[1] == 2, "expected [P, 2, ps, H, D]"
    return paged_kv_cache[:, 0], paged_kv_cache[:, 1]


def _attend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, batch_size,
            sm_scale):
    """Exact paged attention, causal aligned bottom-right, read from index arrays now."""
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    for b in range(batch_size):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        p0, p1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        last = int(last_page_len[b])
        assert p1 > p0 and 1 <= last <= page_size, f"row {b}: bad pages/last_page_len"
        pages = kv_indices[p0:p1].long()
        kv_len = (p1 - p0 - 1) * page_size + last
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:kv_len].double()
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:kv_len].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * sm_scale
        q_pos = torch.arange(q1 - q0)[:, None] + (kv_len - (q1 - q0))
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


class _GraphBuffers:
    """In CUDA-graph mode plan() copies into caller buffers; otherwise it keeps its own."""

    def __init__(self, use_cuda_graph, indptr, indices, last_page_len):
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert all(torch.is_tensor(t) for t in (indptr, indices, last_page_len)), (
                "CUDA-graph mode needs all three buffers"
            )
            assert len(indptr) == len(last_page_len) + 1, "indptr buffer must be batch + 1"
        self.indptr, self.indices, self.last_page_len = indptr, indices, last_page_len

    @property
    def fixed_batch_size(self) -> int:
        return len(self.last_page_len) if self.use_cuda_graph else 0

    def store(self, indptr, indices, last_page_len, device):
        if not self.use_cuda_graph:
            self.indptr = indptr.to(device)
            self.indices = indices.to(device)
            self.last_page_len = last_page_len.to(device)
            return
        batch = len(last_page_len)
        assert batch == self.fixed_batch_size, (
            f"batch {batch} != fixed batch {self.fixed_batch_size} in cudagraph mode"
        )
        assert len(indices) <= len(self.indices), "indices exceed the allocated buffer"
        self.indptr.copy_(indptr)
        self.last_page_len.copy_(last_page_len)
        self.indices[: len(indices)].copy_(indices)


class BatchDecodeWithPagedKVCacheWrapper:
    @recorded
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None,
                 paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None, jit_kwargs=None):
        assert float_workspace_buffer.dtype == torch.uint8, "workspace must be uint8"
        self.kv_layout = kv_layout
        self.device = float_workspace_buffer.device
        self.use_tensor_cores = use_tensor_cores
        self.backend = backend
        self._buffers = _GraphBuffers(use_cuda_graph, paged_kv_indptr_buffer,
                                      paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self._planned = None
        self.num_plans = 0

    @recorded
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *deprecated_positional_args, q_data_type="float16", kv_data_type=None,
             **rest):
        assert not deprecated_positional_args, "0.7.4 deprecates positional args after page_size"
        assert not rest, f"the fake does not model {sorted(rest)}"
        _check_int32(indptr=indptr, indices=indices, last_page_len=last_page_len)
        assert len(indptr) == len(last_page_len) + 1
        assert num_qo_heads % num_kv_heads == 0
        self._buffers.store(indptr, indices, last_page_len, self.device)
        self._planned = dict(batch=len(last_page_len), heads=(num_qo_heads, num_kv_heads),
                             head_dim=head_dim, page_size=page_size, q_dtype=q_data_type,
                             kv_dtype=kv_data_type or q_data_type)
        self.num_plans += 1

    @recorded
    def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse=False, **rest):
        p = self._planned
        assert p is not None, "plan() before run()"
        assert not args and not rest and out is None and not return_lse
        k_cache, v_cache = _unpack(paged_kv_cache, self.kv_layout)
        assert q.dtype == p["q_dtype"], f"q dtype {q.dtype} != planned {p['q_dtype']}"
        assert k_cache.dtype == p["kv_dtype"], f"kv dtype {k_cache.dtype} != {p['kv_dtype']}"
        assert q.shape == (p["batch"], p["heads"][0], p["head_dim"]), f"q shape {q.shape}"
        assert k_cache.shape[1:] == (p["page_size"], p["heads"][1], p["head_dim"])
        b = self._buffers
        qo_indptr = torch.arange(p["batch"] + 1)
        return _attend(q, k_cache, v_cache, qo_indptr, b.indptr, b.indices, b.last_page_len,
                       p["batch"], 1.0 / math.sqrt(p["head_dim"]))


class BatchPrefillWithPagedKVCacheWrapper:
    @recorded
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None,
                 backend="auto", jit_args=None, jit_kwargs=None, variant_owns_mask=False,
                 max_total_num_rows=None):
        assert not use_cuda_graph, "kvpark never captures prefill"
        assert float_workspace_buffer.dtype == torch.uint8, "workspace must be uint8"
        self.kv_layout = kv_layout
        self.device = float_workspace_buffer.device
        self.backend = backend
        self._planned = None
        self.num_plans = 0

    @recorded
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, sm_scale=None, window_left=-1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, **rest):
        assert not rest and custom_mask is None and sm_scale is None and window_left == -1
        _check_int32(qo_indptr=qo_indptr, paged_kv_indptr=paged_kv_indptr,
                     paged_kv_indices=paged_kv_indices,
                     paged_kv_last_page_len=paged_kv_last_page_len)
        assert len(qo_indptr) == len(paged_kv_indptr) == len(paged_kv_last_page_len) + 1
        self._planned = dict(
            qo_indptr=qo_indptr.to(self.device), kv_indptr=paged_kv_indptr.to(self.device),
            kv_indices=paged_kv_indices.to(self.device),
            last=paged_kv_last_page_len.to(self.device), causal=causal,
            heads=(num_qo_heads, num_kv_heads), head_dim=head_dim_qk, page_size=page_size,
            q_dtype=q_data_type, kv_dtype=kv_data_type or q_data_type)
        self.num_plans += 1

    @recorded
    def run(self, q, paged_kv_cache, *args, out=None, lse=None, return_lse=False, **rest):
        p = self._planned
        assert p is not None, "plan() before run()"
        assert not args and not rest and out is None and not return_lse
        assert p["causal"], "kvpark plans causal prefill"
        k_cache, v_cache = _unpack(paged_kv_cache, self.kv_layout)
        assert q.dtype == p["q_dtype"] and k_cache.dtype == p["kv_dtype"], "dtype != planned"
        assert q.shape[0] == int(p["qo_indptr"][-1]), "q rows != qo_indptr[-1]"
        return _attend(q, k_cache, v_cache, p["qo_indptr"], p["kv_indptr"], p["kv_indices"],
                       p["last"], len(p["last"]), 1.0 / math.sqrt(p["head_dim"]))


@recorded
def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD"):
    _check_int32(batch_indices=batch_indices, positions=positions, kv_indices=kv_indices,
                 kv_indptr=kv_indptr, kv_last_page_len=kv_last_page_len)
    k_cache, v_cache = _unpack(paged_kv_cache, kv_layout)
    nnz, page_size = append_key.shape[0], k_cache.shape[1]
    assert append_key.dim() == append_value.dim() == 3, "append_key/value must be [nnz, H, D]"
    assert append_key.stride(-1) == 1 and append_value.stride(-1) == 1, "last dim contiguous"
    assert append_key.dtype == k_cache.dtype, "append dtype must match the cache"
    assert len(batch_indices) == len(positions) == nnz, "one batch index/position per token"
    assert len(kv_indptr) == len(kv_last_page_len) + 1
    for t in range(nnz):
        b, pos = int(batch_indices[t]), int(positions[t])
        page = int(kv_indices[int(kv_indptr[b]) + pos // page_size])
        k_cache[page, pos % page_size] = append_key[t]
        v_cache[page, pos % page_size] = append_value[t]


def install(monkeypatch) -> ModuleType:
    """Make `kvpark.kernels.flashinfer_paged` load this module on a CPU device."""
    import sys

    from kvpark.kernels import flashinfer_paged

    module = sys.modules[__name__]
    CALLS.clear()
    monkeypatch.setattr(flashinfer_paged, "load_flashinfer", lambda device: module)
    return module


# ---- checking recorded calls against the real 0.7.4 sources ------------------------------------
# recorded name -> (source file, class or None, function whose signature the call must bind to);
# decode `plan` forwards its keywords to `_plan_impl`, which holds the real keyword-only names
REAL_TARGETS = {
    "BatchDecodeWithPagedKVCacheWrapper.__init__":
        ("decode.py", "BatchDecodeWithPagedKVCacheWrapper", "__init__"),
    "BatchDecodeWithPagedKVCacheWrapper.plan":
        ("decode.py", "BatchDecodeWithPagedKVCacheWrapper", "_plan_impl"),
    "BatchDecodeWithPagedKVCacheWrapper.run":
        ("decode.py", "BatchDecodeWithPagedKVCacheWrapper", "run"),
    "BatchPrefillWithPagedKVCacheWrapper.__init__":
        ("prefill.py", "BatchPrefillWithPagedKVCacheWrapper", "__init__"),
    "BatchPrefillWithPagedKVCacheWrapper.plan":
        ("prefill.py", "BatchPrefillWithPagedKVCacheWrapper", "plan"),
    "BatchPrefillWithPagedKVCacheWrapper.run":
        ("prefill.py", "BatchPrefillWithPagedKVCacheWrapper", "run"),
    "append_paged_kv_cache": ("page.py", None, "append_paged_kv_cache"),
    "get_seq_lens": ("page.py", None, "get_seq_lens"),
    "get_batch_indices_positions": ("page.py", None, "get_batch_indices_positions"),
}


def read_bundle_sources(bundle) -> dict[str, str]:
    """decode.py / prefill.py / page.py of the flashinfer package inside the site tarball."""
    import tarfile

    wanted = {f"flashinfer/{name}" for name, _, _ in REAL_TARGETS.values()}
    found: dict[str, str] = {}
    with tarfile.open(bundle) as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if name in wanted:
                found[name.removeprefix("flashinfer/")] = tar.extractfile(member).read().decode()
                if len(found) == len(wanted):
                    break
    assert len(found) == len(wanted), f"missing from the bundle: {wanted - set(found)}"
    return found


def _signature_of(source: str, cls: str | None, func: str):
    """The signature of `cls.func` in `source`, without importing it (annotations dropped)."""
    import ast
    import inspect

    scope = ast.parse(source).body
    if cls is not None:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls).body
    defs = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == func
            and not any(getattr(d, "id", None) == "overload" for d in n.decorator_list)]
    assert len(defs) == 1, f"{cls}.{func}: {len(defs)} non-overload definitions"
    fn = defs[0]
    args = fn.args
    for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
        if a is not None:
            a.annotation = None
    args.defaults = [ast.Constant(None) for _ in args.defaults]
    args.kw_defaults = [None if d is None else ast.Constant(None) for d in args.kw_defaults]
    stub = ast.FunctionDef(name=func, args=args, body=[ast.Pass()], decorator_list=[],
                           returns=None, type_comment=None, type_params=[])
    namespace: dict = {}
    exec(ast.unparse(ast.fix_missing_locations(ast.Module([stub], []))), namespace)
    return inspect.signature(namespace[func])


def real_signatures(sources: dict[str, str]) -> dict:
    return {name: _signature_of(sources[file], cls, func)
            for name, (file, cls, func) in REAL_TARGETS.items()}


def bind_all(calls, signatures) -> list[str]:
    """Bind every recorded call to the real signature; return the ones that do not bind."""
    failures = []
    for name, args, kwargs in calls:
        is_method = "." in name
        try:
            signatures[name].bind(*(("self",) if is_method else ()), *args, **kwargs)
        except TypeError as exc:
            failures.append(f"{name}: {exc}")
    return failures


@recorded
def get_seq_lens(kv_indptr, kv_last_page_len, page_size):
    return (torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size
            + kv_last_page_len)


@recorded
def get_batch_indices_positions(append_indptr, seq_lens, nnz, batch_indices=None,
                                positions=None):
    batch_indices = torch.full((nnz,), -1, dtype=torch.int32)
    positions = torch.zeros(nnz, dtype=torch.int32)
    for b in range(len(append_indptr) - 1):
        start, end = int(append_indptr[b]), int(append_indptr[b + 1])
        batch_indices[start:end] = b
        positions[start:end] = torch.arange(int(seq_lens[b]) - (end - start), int(seq_lens[b]))
    return batch_indices, positions
