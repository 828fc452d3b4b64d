"""The attention backend interface: plan a step once, then per layer append K/V and attend.

Shapes follow FlashInfer's paged layout so a CUDA backend can slot in unchanged:
the KV cache of one layer is `[num_pages, 2, page_size, num_kv_heads, head_dim]` (NHD),
a step's batch is described by CSR-style index arrays over sequences.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .amx_gemm import ATiles


@dataclass(frozen=True)
class StepLayout:
    """Where each sequence of one step reads and writes in the paged pool (host lists)."""

    page_tables: list[list[int]]  # pages of each sequence, covering its KV after this step
    kv_lens: list[int]  # KV length of each sequence after this step's tokens are appended
    q_lens: list[int]  # new (query) tokens of each sequence in this step
    page_size: int
    # of each sequence's query rows, how many come first at prompt positions (the runner's
    # count; a backend may give them their own kernel: kernels/cpu_paged.py); None: not told
    prompt_rows: list[int] | None = None

    def __post_init__(self) -> None:
        assert len(self.page_tables) == len(self.kv_lens) == len(self.q_lens), "ragged layout"
        for table, kv_len, q_len in zip(self.page_tables, self.kv_lens, self.q_lens):
            assert 0 < q_len <= kv_len, f"q_len {q_len} must be in (0, kv_len {kv_len}]"
            assert len(table) * self.page_size >= kv_len, (
                f"{len(table)} pages cannot hold {kv_len} tokens"
            )
        assert self.prompt_rows is None or (
            len(self.prompt_rows) == len(self.q_lens)
            and all(0 <= p <= q for p, q in zip(self.prompt_rows, self.q_lens))), "prompt rows"

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.q_lens)


@dataclass(frozen=True)
class PlanArrays:
    """FlashInfer's plan inputs plus the per-token append targets (int32 tensors)."""

    qo_indptr: torch.Tensor  # [B + 1] query tokens per sequence
    kv_indptr: torch.Tensor  # [B + 1] pages per sequence
    kv_indices: torch.Tensor  # [num used pages] page ids, sequence by sequence
    kv_last_page_len: torch.Tensor  # [B] valid tokens in each sequence's last page (1..page_size)
    batch_indices: torch.Tensor  # [T] sequence of each new token
    positions: torch.Tensor  # [T] position of each new token inside its sequence


def get_plan_arrays(layout: StepLayout, device: torch.device | str = "cpu") -> PlanArrays:
    ps = layout.page_size
    pages_used = [(kv_len + ps - 1) // ps for kv_len in layout.kv_lens]
    qo_indptr, kv_indptr = [0], [0]
    kv_indices: list[int] = []
    batch_indices: list[int] = []
    positions: list[int] = []
    for b, (table, kv_len, q_len) in enumerate(
        zip(layout.page_tables, layout.kv_lens, layout.q_lens)
    ):
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + pages_used[b])
        kv_indices.extend(table[: pages_used[b]])
        batch_indices.extend([b] * q_len)
        positions.extend(range(kv_len - q_len, kv_len))
    last_page_len = [kv_len - (n - 1) * ps for kv_len, n in zip(layout.kv_lens, pages_used)]

    def as_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PlanArrays(
        qo_indptr=as_tensor(qo_indptr),
        kv_indptr=as_tensor(kv_indptr),
        kv_indices=as_tensor(kv_indices),
        kv_last_page_len=as_tensor(last_page_len),
        batch_indices=as_tensor(batch_indices),
        positions=as_tensor(positions),
    )


class AttentionBackend(ABC):
    """One step: `plan(layout)` once, then for every layer `append_kv` and `attend`."""

    name: str
    # a backend that declares it offers `prepare_graph(batch_size, max_pages)` and
    # `plan_graph(layout)`, which CUDA graphs of decode steps need (pod/cuda_graphs.py)
    can_capture_graphs: bool = False
    # prompt rows' attention on AMX tiles, K and V rounded to bf16 (kernels/cpu_paged.py)
    amx_prompt_rows: bool = False

    @abstractmethod
    def plan(self, layout: StepLayout) -> None: ...

    @abstractmethod
    def append_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write this step's keys/values `[T, Hkv, D]` into the layer's cache."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """Causal attention of `q` `[T, Hq, D]` over each sequence's paged KV -> `[T, Hq, D]`."""

    def attend_tiles(self, q: torch.Tensor, kv_cache: torch.Tensor,
                     rows: int) -> ATiles | None:
        """`attend`'s result as `[rows, Hq D]` A tiles of an AMX GEMM (rows past T zero; the
        bits of `attend`'s values rounded to bf16) where this backend writes them this step,
        else None: then the caller takes `attend`'s float32 rows."""
        return None
