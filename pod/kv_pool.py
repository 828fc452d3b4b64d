"""The paged KV pool shared by every slot: one cache tensor per layer, a free list of pages.

A sequence's page table is a plain `list[int]`; the pool hands pages out and takes them back.
Swapping (`swap.py`, with `kernels/kv_copy.py`) moves whole pages between the pool and a host
buffer, so a parked sequence comes back bit for bit.
"""

from __future__ import annotations

import heapq

import torch


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        assert num_pages > 0 and page_size > 0, "the pool needs at least one page"
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_shape = (2, page_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        # [pages, 2, page_size, Hkv, D] per layer: FlashInfer's NHD paged layout
        self.caches = [
            torch.zeros(num_pages, *self.page_shape, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        # a min-heap hands out low page ids first, so a lone sequence's pages tend to be
        # consecutive and attention can read them through a view
        self._free = list(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def usage_ratio(self) -> float:
        return self.num_used_pages / self.num_pages

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds across all layers (what a swap copies per page)."""
        per_layer = torch.Size(self.page_shape).numel() * self.caches[0].element_size()
        return per_layer * len(self.caches)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        assert self.can_allocate(num_pages), (
            f"asked for {num_pages} pages with {len(self._free)} free"
        )
        return [heapq.heappop(self._free) for _ in range(num_pages)]

    def free(self, pages: list[int]) -> None:
        for page in pages:
            heapq.heappush(self._free, page)

    def free_page_ids(self) -> list[int]:
        return sorted(self._free)

    def swap_shape(self, num_pages: int) -> tuple[int, ...]:
        return (len(self.caches), num_pages, *self.page_shape)

    def swap_bytes(self, num_pages: int) -> int:
        return num_pages * self.page_bytes
