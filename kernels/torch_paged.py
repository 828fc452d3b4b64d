"""Paged attention in plain PyTorch: the CPU path and the oracle for every other backend.

Each sequence's pages are gathered and attended with `scaled_dot_product_attention`, one sequence
at a time, over exactly its own KV length: a sequence's result never depends on which other
sequences share the step (no padding, no shared reduction), which is what keeps greedy output
independent of batch neighbours.

Why per sequence and not one padded batch: measured on a 2-core EPYC (benchmarks/README.md,
"CPU decode step"), one SDPA over a padded batch cost the same as four per-sequence calls at
equal lengths and several times more at unequal ones (it attends over the padding), and it is
row-independent only while SDPA's internal KV block size divides the padded length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionBackend, PlanArrays, StepLayout, get_plan_arrays


@dataclass(frozen=True)
class _SeqView:
    q_start: int
    q_len: int
    kv_len: int
    halves: torch.Tensor  # rows of the cache viewed as [pages * 2, page]: K pages, then V pages
    mask: torch.Tensor | None  # [q_len, kv_len] causal mask when 1 < q_len < kv_len


def _seq_view(table: list[int], q_start: int, q_len: int, kv_len: int, page_size: int,
              device: torch.device) -> _SeqView:
    used = table[: (kv_len + page_size - 1) // page_size]
    mask = None
    if 1 < q_len < kv_len:
        query_pos = torch.arange(kv_len - q_len, kv_len, device=device)
        mask = torch.arange(kv_len, device=device)[None, :] <= query_pos[:, None]
    halves = torch.tensor([2 * p for p in used] + [2 * p + 1 for p in used], device=device)
    return _SeqView(q_start, q_len, kv_len, halves, mask)


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._views: list[_SeqView] = []
        self._append_rows = self._append_rows_v = torch.empty(0, dtype=torch.long)

    def plan(self, layout: StepLayout) -> None:
        self._plan_append(get_plan_arrays(layout, self.device), layout.page_size)
        self._plan_views(layout)

    def _plan_append(self, arrays: PlanArrays, ps: int) -> None:
        positions = arrays.positions.long()
        # page id of each new token: kv_indices[kv_indptr[batch] + position // page_size]
        flat = arrays.kv_indptr.long()[arrays.batch_indices.long()] + positions // ps
        pages = arrays.kv_indices.long()[flat]
        # its K row in the cache viewed as [pages * 2 * page_size, Hkv, D]; V is page_size on
        self._append_rows = pages * (2 * ps) + positions % ps
        self._append_rows_v = self._append_rows + ps

    def _plan_views(self, layout: StepLayout) -> None:
        ps = layout.page_size
        self._views = []
        q_start = 0
        for table, kv_len, q_len in zip(layout.page_tables, layout.kv_lens, layout.q_lens):
            self._views.append(_seq_view(table, q_start, q_len, kv_len, ps, self.device))
            q_start += q_len

    def append_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # kv_cache: [pages, 2, page_size, Hkv, D]; k, v: [T, Hkv, D]
        rows = kv_cache.view(-1, *kv_cache.shape[-2:])
        rows.index_copy_(0, self._append_rows, k.to(kv_cache.dtype))
        rows.index_copy_(0, self._append_rows_v, v.to(kv_cache.dtype))

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        # every sequence's heads-first output [1, Hq, q_len, D], joined along the tokens
        halves = kv_cache.view(kv_cache.shape[0] * 2, -1)  # [pages * 2, page_size * Hkv * D]
        outs = [_attend_one(q, halves, kv_cache.shape[-2:], view) for view in self._views]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out[0].transpose(0, 1)  # [T, Hq, D]


def _attend_one(q: torch.Tensor, halves: torch.Tensor, head_shape: torch.Size,
                view: _SeqView) -> torch.Tensor:
    """One sequence's rows of q [T, Hq, D] over its pages -> [1, Hq, q_len, D].

    Its K and V pages are gathered in one index_select of whole half-pages (a memcpy each): the
    cache interleaves K and V page by page, so even consecutive pages cannot be read as one
    strided [kv_len, Hkv, D] view. SDPA gets 4-D heads-first strided views of the gathered
    copy and of q (its CPU flash kernel; 3-D inputs take the slower math path).
    """
    n_kv_heads, head_dim = head_shape
    assert q.stride(-1) == 1, "q's head_dim must be dense"
    kv = halves.index_select(0, view.halves)  # [2 * n, page_size * Hkv * D]: K pages, V pages
    token = n_kv_heads * head_dim
    size, stride = (1, n_kv_heads, view.kv_len, head_dim), (0, head_dim, token, 1)
    k = kv.as_strided(size, stride)
    v = kv.as_strided(size, stride, kv.numel() // 2)
    q_rows, q_heads, _ = q.stride()
    q_seq = q.as_strided((1, q.shape[1], view.q_len, head_dim), (0, q_heads, q_rows, 1),
                         q.storage_offset() + view.q_start * q_rows)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    is_causal = view.q_len == view.kv_len and view.q_len > 1
    return F.scaled_dot_product_attention(
        q_seq, k, v, attn_mask=view.mask, is_causal=is_causal, enable_gqa=True
    )
