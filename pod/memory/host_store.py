"""Host RAM for swapped sequences: a hard byte budget and real allocation failures.

`reserve` checks the budget before any copy starts, so parked bytes never exceed it, even when a
resume and a park happen in the same step. An allocation the machine refuses is reported as
`HostAllocationError`; the caller parks by recompute instead.

Pinned buffers (CUDA) come from PyTorch's caching host allocator, which rounds every block up to
a power of two: a pinned buffer is charged what it really takes, so the budget holds for the
memory the machine gives, not only for the bytes asked for.
"""

from __future__ import annotations

import torch

from .budget import UNLIMITED_BYTES, fits_budget


class HostAllocationError(RuntimeError):
    pass


class HostStore:
    def __init__(self, budget_bytes: int, pin_memory: bool = False,
                 fail_allocations: bool = False) -> None:
        assert budget_bytes >= UNLIMITED_BYTES, f"budget {budget_bytes} must be >= -1"
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self.fail_allocations = fail_allocations  # --preempt-fail-swap (tests)
        self.held_bytes = 0
        self.peak_bytes = 0

    @property
    def unlimited(self) -> bool:
        return self.budget_bytes == UNLIMITED_BYTES

    def charged_bytes(self, num_bytes: int) -> int:
        """What a buffer of `num_bytes` costs the budget (its pinned block's size)."""
        return charged_bytes(num_bytes, self.pin_memory)

    def can_hold(self, num_bytes: int) -> bool:
        """Room for `num_bytes` more, as charged (callers pass what they will charge)."""
        return fits_budget(num_bytes, self.budget_bytes, self.held_bytes)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, bookkeeping: int = 0
                 ) -> torch.Tensor:
        """A host buffer charged to the budget, with `bookkeeping` bytes more for what its
        owner keeps beside it; raises HostAllocationError when refused."""
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        num_bytes = self.charged_bytes(size) + bookkeeping
        assert self.can_hold(num_bytes), "caller must check the budget before allocating"
        if self.fail_allocations:
            raise HostAllocationError("host allocation refused (--preempt-fail-swap)")
        try:
            buffer = torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
        except (RuntimeError, MemoryError) as exc:  # the allocator's own refusal
            raise HostAllocationError(f"host allocation of {num_bytes} B failed: {exc}") from exc
        self.held_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return buffer

    def release(self, buffer: torch.Tensor, bookkeeping: int = 0) -> None:
        """Give back a whole buffer `allocate` returned (a view of it gives back all of it),
        with the `bookkeeping` it was allocated with."""
        num_bytes = self.charged_bytes(buffer.untyped_storage().nbytes()) + bookkeeping
        assert num_bytes <= self.held_bytes, "released more than was held"
        self.held_bytes -= num_bytes


def charged_bytes(num_bytes: int, pinned: bool) -> int:
    """Pageable memory costs what was asked; a pinned block, the next power of two."""
    if not pinned or num_bytes <= 1:
        return num_bytes
    return 1 << (num_bytes - 1).bit_length()
