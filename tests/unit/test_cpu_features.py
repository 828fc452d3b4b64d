"""CPU feature detection and the paths gated on it: a machine without AVX-512 must take the
AVX2 build of the C kernels and keep float32 linears for `--weights bf16`, not crash."""

import subprocess
import sys

import pytest
import torch

from kvpark.kernels.cpu_features import MAX_ISA_ENV, CpuFeatures, Isa, cap_flags, detect
from kvpark.pod.args import parse_args
from kvpark.pod.model.linear import WeightFormat
from kvpark.pod.serving.choices import pick_weight_format

AVX512_EPYC = frozenset({"sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                         "avx512dq", "avx512_bf16"})
AVX2_EPYC = frozenset({"sse4_2", "avx", "avx2", "fma"})


def cpu(flags, torch_bf16=True, machine="x86_64") -> CpuFeatures:
    return CpuFeatures(machine, flags, torch_bf16)


def test_isas_best_first():
    assert cpu(AVX512_EPYC).isas == (Isa.AVX512, Isa.AVX2, Isa.GENERIC)
    assert cpu(AVX2_EPYC).isas == (Isa.AVX2, Isa.GENERIC)
    assert cpu(frozenset({"sse4_2"})).isas == (Isa.GENERIC,)
    assert cpu(frozenset({"asimd"}), machine="aarch64").isas == (Isa.GENERIC,)


def test_bf16_gemm_needs_avx512_or_avx_ne_convert_and_torch_agreeing():
    assert cpu(AVX512_EPYC).can_bf16_gemm
    assert not cpu(AVX2_EPYC).can_bf16_gemm  # where torch's reorder raised on CI
    assert cpu(AVX2_EPYC | {"avx_ne_convert"}).can_bf16_gemm
    assert not cpu(AVX512_EPYC, torch_bf16=False).can_bf16_gemm


def test_amx_tiles_need_both_flags_and_no_cap_below_avx512():
    sapphire_rapids = AVX512_EPYC | {"amx_tile", "amx_bf16", "amx_int8"}
    assert cpu(sapphire_rapids).has_amx_bf16
    assert not cpu(AVX512_EPYC | {"amx_tile"}).has_amx_bf16
    assert not cpu(cap_flags(sapphire_rapids, "avx2")).has_amx_bf16
    assert not cpu(sapphire_rapids, machine="aarch64").has_amx_bf16


def test_the_cap_makes_an_avx512_cpu_look_like_an_avx2_one():
    assert cap_flags(AVX512_EPYC, "avx2") == AVX2_EPYC
    assert cap_flags(AVX512_EPYC, "avx512") == AVX512_EPYC
    assert cpu(cap_flags(AVX512_EPYC, "generic")).isas == (Isa.GENERIC,)
    with pytest.raises(ValueError, match=MAX_ISA_ENV):
        cap_flags(AVX512_EPYC, "avx10")


def test_detect_honours_the_cap_in_a_fresh_process():
    code = ("from kvpark.kernels.cpu_features import detect; c = detect(); "
            "print(c.best_isa.value, c.can_bf16_gemm)")
    out = subprocess.run([sys.executable, "-c", code], env={MAX_ISA_ENV: "avx2", "PATH": ""},
                         capture_output=True, text=True, check=True).stdout.split()
    expected = "avx2" if Isa.AVX2 in detect().isas else "generic"
    assert out == [expected, "False"]


def test_weights_bf16_falls_back_to_fp32_where_the_cpu_has_no_bf16_gemm(caplog):
    args = parse_args(["--weights", "bf16"], env={})
    cpu_device = torch.device("cpu")
    assert pick_weight_format(args, cpu_device, torch.float32,
                              cpu(AVX512_EPYC)) is WeightFormat.BF16
    with caplog.at_level("WARNING"):
        fmt = pick_weight_format(args, cpu_device, torch.float32, cpu(AVX2_EPYC))
    assert fmt is WeightFormat.FP32
    assert "no bf16 GEMMs" in caplog.text and "using fp32 linears" in caplog.text
