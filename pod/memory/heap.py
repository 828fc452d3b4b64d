"""Long-lived host buffers must not pin the heap.

glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB), so
after the first big step the model's temporaries come from the heap, and the host tier's pages
and parked buffers, allocated between them and kept for minutes, stop the heap from shrinking:
RSS grew several times what the tier held. A fixed threshold keeps every large temporary in its
own mapping, returned whole when freed; what the budget charges is then what RSS holds.

Only where the C library is glibc (detected at start; elsewhere one log line says so), and not
when the environment sets the threshold itself (`MALLOC_MMAP_THRESHOLD_`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's default before it starts to move


def fix_mmap_threshold() -> bool:
    """True when glibc's threshold is now fixed (or the environment fixed it)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    if platform.libc_ver()[0] != "glibc":
        log.info("C library is not glibc: its malloc's mmap threshold is left as it is")
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        log.warning("glibc refused a fixed mmap threshold: host buffers may pin the heap")
        return False
    return True
