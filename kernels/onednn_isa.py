"""oneDNN's instruction-set cap, and which of its kernels a GEMM actually ran.

oneDNN chooses a GEMM kernel per shape. On a CPU with AMX (Intel Sapphire Rapids and later) a
bf16 GEMM goes to AMX tile kernels for some row counts and to AVX-512 ones for others (oneDNN's
brgemm matmul sends "small shapes" to the VNNI kernels, and splits K across threads on AMX for
some shapes): the two sum a row's products in different orders, so a row's bits would depend
on how many rows ride with it. Kept below AMX (`AVX512_CORE_BF16`, what an AVX-512 BF16 CPU
without AMX runs), every bf16 GEMM takes the one brgemm kernel family whose K blocking does not
depend on the row count. float32 GEMMs never use AMX unless fp32 math is allowed to round to
bf16, so the cap costs them nothing.

oneDNN reads `ONEDNN_MAX_CPU_ISA` once, the first time anything asks it which ISA it may use
(torch's bf16 check `cpu_features.detect()` does): the cap must be set before that, at start.
Whether it took is checked afterwards by running GEMMs with oneDNN's verbose log on and reading
the kernel names it prints (`kernels_of`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

ENV = "ONEDNN_MAX_CPU_ISA"
NO_AMX_ISA = "AVX512_CORE_BF16"
# oneDNN's names for the ISA levels without AMX (its cpu_isa_traits); a user's cap among them is
# kept, any other (an AMX level, ALL, DEFAULT) would let the tile kernels in
WITHOUT_AMX = frozenset({
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX10_2_512",
})
AMX_FLAG = "amx_tile"  # /proc/cpuinfo's flag for AMX's tile registers


@dataclass(frozen=True)
class IsaCap:
    """What `ONEDNN_MAX_CPU_ISA` should hold (None: leave it as it is) and why, for the log."""

    value: str | None
    reason: str


def choose_cap(cpu_flags: frozenset[str], batch_invariant: bool, current: str | None) -> IsaCap:
    """The cap batch invariance needs on this CPU, given the variable's value before start."""
    current = (current or "").strip().upper() or None
    if not batch_invariant:
        return IsaCap(None, "batch invariance is off: oneDNN may use every kernel it has")
    if AMX_FLAG not in cpu_flags:
        return IsaCap(None, "no AMX on this CPU: nothing to keep out")
    if current in WITHOUT_AMX:
        return IsaCap(None, f"{ENV}={current} already keeps AMX out")
    was = f" (was {current})" if current else ""
    return IsaCap(NO_AMX_ISA, f"AMX kept out of oneDNN's GEMMs{was}: its tile kernels take some "
                  "row counts and not others, so a row's bf16 bits would depend on its batch; "
                  "--no-batch-invariant lets AMX in")


def apply_cap(cap: IsaCap) -> None:
    """Before oneDNN's first use only: later it has read the variable and ignores it."""
    if cap.value is not None:
        os.environ[ENV] = cap.value


def kernels_of(run: Callable[[], object]) -> list[str]:
    """oneDNN's names of the kernels `run` executed, in order (e.g. `brg_matmul:avx512_core_bf16`);
    empty where none ran (MKL or a torch kernel did the work)."""
    import torch

    with _stdout_captured() as lines:
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            run()
    return [name for line in lines if (name := _executed_kernel(line))]


def _executed_kernel(line: str) -> str | None:
    # onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx2,forward_inference,...
    fields = line.split(",")
    if not fields or fields[0] != "onednn_verbose" or "exec" not in fields:
        return None
    at = fields.index("exec") + 3  # past the engine and the primitive kind
    return fields[at] if at < len(fields) else None


@contextlib.contextmanager
def _stdout_captured() -> Iterator[list[str]]:
    """oneDNN prints its verbose log with C's printf to file descriptor 1: that goes to a file
    for the duration, and whatever else was written there meanwhile is passed on afterwards."""
    lines: list[str] = []
    sys.stdout.flush()
    with tempfile.TemporaryFile() as file:
        saved = os.dup(1)
        os.dup2(file.fileno(), 1)
        try:
            yield lines
        finally:
            ctypes.CDLL(None).fflush(None)  # C's buffer, before the descriptor points back
            os.dup2(saved, 1)
            os.close(saved)
            file.seek(0)
            lines.extend(file.read().decode(errors="replace").splitlines())
    others = [line for line in lines if not line.startswith("onednn_verbose")]
    if others:
        os.write(1, ("\n".join(others) + "\n").encode())
