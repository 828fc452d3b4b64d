"""Long-lived host buffers must not keep freed heap memory resident.

glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB), so
after the first big step the model's temporaries come from the heap, and the host tier's pages
and parked buffers, allocated between them and kept for minutes, stop the heap from shrinking at
its top: RSS grew several times what the tier held. Fixing the threshold instead cost steps
their speed (every large temporary a fresh mapping), so the engine gives the free memory back
each time it goes idle (`malloc_trim`, which releases free pages anywhere in the heap; a
millisecond or less while nothing waits).

Only where the C library is glibc (detected once; elsewhere one log line says so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
from collections.abc import Callable

log = logging.getLogger(__name__)


def get_trim() -> Callable[[], None] | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none."""
    if platform.libc_ver()[0] != "glibc":
        log.info("C library is not glibc: freed heap memory is left to its malloc")
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return lambda: libc.malloc_trim(0)


class HeapTrimmer:
    """Called by the engine thread when it goes idle."""

    def __init__(self) -> None:
        self._trim = get_trim()

    def on_idle(self) -> None:
        if self._trim is not None:
            self._trim()
