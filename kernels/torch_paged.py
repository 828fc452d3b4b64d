"""Paged attention in plain PyTorch: the CPU path and the oracle for every other backend.

Each sequence's pages are gathered (a slice view when they are consecutive) and attended with
`scaled_dot_product_attention`, one sequence at a time, so a sequence's result never depends on
which other sequences share the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionBackend, StepLayout, get_plan_arrays


@dataclass(frozen=True)
class _SeqView:
    q_start: int
    q_len: int
    kv_len: int
    page_slice: slice | None  # consecutive pages: read the cache through a view
    page_ids: torch.Tensor | None  # otherwise: gather these pages
    mask: torch.Tensor | None  # [q_len, kv_len] causal mask when q_len < kv_len and q_len > 1


def _consecutive(pages: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(pages, pages[1:]))


def _seq_view(table: list[int], q_start: int, q_len: int, kv_len: int, page_size: int,
              device: torch.device) -> _SeqView:
    used = table[: (kv_len + page_size - 1) // page_size]
    contiguous = _consecutive(used)
    mask = None
    if 1 < q_len < kv_len:
        query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        mask = torch.arange(kv_len, device=device)[None, :] <= query_pos[:, None]
    return _SeqView(
        q_start=q_start,
        q_len=q_len,
        kv_len=kv_len,
        page_slice=slice(used[0], used[-1] + 1) if contiguous else None,
        page_ids=None if contiguous else torch.tensor(used, dtype=torch.long, device=device),
        mask=mask,
    )


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._views: list[_SeqView] = []
        self._append_pages = torch.empty(0, dtype=torch.long)
        self._append_offsets = torch.empty(0, dtype=torch.long)

    def plan(self, layout: StepLayout) -> None:
        arrays = get_plan_arrays(layout, self.device)
        ps = layout.page_size
        positions = arrays.positions.long()
        page_of_token = positions // ps
        # page id of each new token: kv_indices[kv_indptr[batch] + position // page_size]
        flat = arrays.kv_indptr.long()[arrays.batch_indices.long()] + page_of_token
        self._append_pages = arrays.kv_indices.long()[flat]
        self._append_offsets = positions % ps
        self._views = []
        q_start = 0
        for table, kv_len, q_len in zip(layout.page_tables, layout.kv_lens, layout.q_lens):
            self._views.append(_seq_view(table, q_start, q_len, kv_len, ps, self.device))
            q_start += q_len

    def append_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # kv_cache: [pages, 2, page_size, Hkv, D]; k, v: [T, Hkv, D]
        kv_cache[:, 0][self._append_pages, self._append_offsets] = k.to(kv_cache.dtype)
        kv_cache[:, 1][self._append_pages, self._append_offsets] = v.to(kv_cache.dtype)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        for view in self._views:
            q_seq = q[view.q_start : view.q_start + view.q_len]
            out[view.q_start : view.q_start + view.q_len] = _attend_one(q_seq, kv_cache, view)
        return out


def _read_kv(kv_cache: torch.Tensor, view: _SeqView) -> tuple[torch.Tensor, torch.Tensor]:
    pages = kv_cache[view.page_slice] if view.page_slice is not None else kv_cache[view.page_ids]
    n_pages, _, page_size, n_kv_heads, head_dim = pages.shape
    k = pages[:, 0].reshape(n_pages * page_size, n_kv_heads, head_dim)[: view.kv_len]
    v = pages[:, 1].reshape(n_pages * page_size, n_kv_heads, head_dim)[: view.kv_len]
    return k, v


def _attend_one(q: torch.Tensor, kv_cache: torch.Tensor, view: _SeqView) -> torch.Tensor:
    k, v = _read_kv(kv_cache, view)
    # q: [q_len, Hq, D] -> [Hq, q_len, D]; k, v: [kv_len, Hkv, D] -> [Hkv, kv_len, D]
    q_h, k_h, v_h = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if k_h.dtype != q_h.dtype:
        k_h, v_h = k_h.to(q_h.dtype), v_h.to(q_h.dtype)
    is_causal = view.q_len == view.kv_len and view.q_len > 1
    out = F.scaled_dot_product_attention(
        q_h, k_h, v_h, attn_mask=view.mask, is_causal=is_causal, enable_gqa=True
    )
    return out.transpose(0, 1)
