"""What this CPU can run, detected once: the C kernels' instruction set and oneDNN's bf16 GEMMs.

Machines that run the same image differ (CI gets a 2-core EPYC with AVX-512 one day and one with
AVX2 only the next), so every ISA-specific path asks here instead of assuming the build machine:
- the C kernels are compiled for one `Isa` at a time (`cbuild.build(source, isa)`); the best one
  the CPU has is used, and tests run every one the CPU can (the AVX2 path runs on any x86 with
  AVX2, AVX-512 CPUs included);
- bf16 linears prepacked for oneDNN need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: torch raises
  on other CPUs, so `can_bf16_gemm` gates them.

`KVPARK_MAX_CPU_ISA=avx2` (or `generic`) caps what is reported, like oneDNN's
`ONEDNN_MAX_CPU_ISA`: an AVX-512 machine then takes the paths an AVX2-only machine takes.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import platform
from dataclasses import dataclass

log = logging.getLogger(__name__)

MAX_ISA_ENV = "KVPARK_MAX_CPU_ISA"


class Isa(str, enum.Enum):
    """C kernel builds, best first."""

    AVX512 = "avx512"  # -march=native on a CPU with AVX-512 F/BW/VL/DQ
    AVX2 = "avx2"  # -march=native without AVX-512: what an AVX2-only x86 runs
    GENERIC = "generic"  # portable C: what a CPU without AVX2 (or not x86) runs


X86 = ("x86_64", "amd64", "i686", "i386")
# gcc flags per ISA; -mno-avx512f also turns off every AVX-512 extension built on it, and
# -mno-avx2 both (so on x86 the generic build is the portable code, tested there too)
ISA_CFLAGS = {
    Isa.AVX512: ("-march=native",),
    Isa.AVX2: ("-march=native", "-mno-avx512f"),
    Isa.GENERIC: ("-march=native", *(("-mno-avx2",) if platform.machine().lower() in X86
                                     else ())),
}
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
AVX2_FLAGS = frozenset({"avx2", "fma"})


@dataclass(frozen=True)
class CpuFeatures:
    machine: str
    flags: frozenset[str]  # /proc/cpuinfo's, after the cap
    torch_bf16_gemm: bool  # torch's own check (mkldnn_bf16_device_check), before the cap

    @property
    def is_x86(self) -> bool:
        return self.machine.lower() in X86

    @property
    def isas(self) -> tuple[Isa, ...]:
        """The C kernel builds this CPU can run, best first (GENERIC runs everywhere)."""
        runnable = []
        if self.is_x86 and AVX512_FLAGS <= self.flags:
            runnable.append(Isa.AVX512)
        if self.is_x86 and AVX2_FLAGS <= self.flags:
            runnable.append(Isa.AVX2)
        return (*runnable, Isa.GENERIC)

    @property
    def best_isa(self) -> Isa:
        return self.isas[0]

    @property
    def has_amx_bf16(self) -> bool:
        """AMX tiles with bf16 dot products (after the cap: an AVX2 cap leaves none)."""
        return self.is_x86 and {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def can_bf16_gemm(self) -> bool:
        """oneDNN's bf16 linears (prepacked weights) run here."""
        if not self.torch_bf16_gemm:
            return False
        if not self.is_x86:
            return True  # torch's check is the whole story off x86
        return AVX512_FLAGS <= self.flags or "avx_ne_convert" in self.flags

    def describe(self) -> str:
        bf16 = "yes" if self.can_bf16_gemm else "no"
        return f"{self.machine}, C kernels for {self.best_isa.value}, oneDNN bf16 GEMM {bf16}"


@functools.cache
def read_cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields (empty where there is no such file)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def read_cpuinfo_flags() -> frozenset[str]:
    info = read_cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def fingerprint() -> str:
    """Names the CPU for `-march=native` builds: model and flags, never capped."""
    info = read_cpuinfo()
    return "|".join([platform.machine(), info.get("model name", ""),
                     " ".join(sorted(read_cpuinfo_flags()))])


def torch_bf16_gemm() -> bool:
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the check: assume the worst
        return False


def cap_flags(flags: frozenset[str], max_isa: str) -> frozenset[str]:
    """The flags an `max_isa` CPU would show: AVX-512 (and AVX2) extensions removed."""
    allowed = {isa.value for isa in Isa}
    if max_isa not in allowed:
        raise ValueError(f"{MAX_ISA_ENV} must be one of {sorted(allowed)}, not {max_isa!r}")
    if max_isa == Isa.AVX512.value:
        return flags
    kept = {f for f in flags if not f.startswith(("avx512", "amx")) and f != "avx_ne_convert"}
    if max_isa == Isa.GENERIC.value:
        kept -= AVX2_FLAGS
    return frozenset(kept)


@functools.cache
def detect() -> CpuFeatures:
    flags = read_cpuinfo_flags()
    max_isa = os.environ.get(MAX_ISA_ENV, "").strip().lower()
    if max_isa:
        flags = cap_flags(flags, max_isa)
    features = CpuFeatures(platform.machine(), flags, torch_bf16_gemm())
    log.info("CPU: %s%s", features.describe(), f" ({MAX_ISA_ENV}={max_isa})" if max_isa else "")
    return features
