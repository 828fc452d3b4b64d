"""Tests of ISA-specific paths run where the CPU can run them and skip with the reason elsewhere
(a plain module: `conftest` names clash across folders)."""

import pytest

from kvpark.kernels.cpu_features import Isa, detect


def runnable_isa(isa: Isa) -> Isa:
    """`isa`, or a skip: the AVX2 build runs on every x86 with AVX2 (AVX-512 machines included),
    the AVX-512 one where the CPU has it, the generic (portable C) one everywhere."""
    cpu = detect()
    if isa not in cpu.isas:
        pytest.skip(f"this CPU cannot run the {isa.value} build ({cpu.describe()})")
    return isa


requires_bf16_gemm = pytest.mark.skipif(
    not detect().can_bf16_gemm,
    reason=f"no oneDNN bf16 GEMMs on this CPU (they need AVX-512 BW/VL/DQ or AVX-NE-CONVERT): "
           f"{detect().describe()}")


def _amx_runs() -> bool:
    from kvpark.kernels import amx_gemm

    return amx_gemm.usable()


requires_amx = pytest.mark.skipif(not _amx_runs(), reason="AMX tiles do not run here (CPU, OS "
                                  "or KVPARK_MAX_CPU_ISA)")
