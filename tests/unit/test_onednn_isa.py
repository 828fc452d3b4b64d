"""oneDNN kept off AMX while batch invariance is on, set before its first use, and read back from
the kernels it runs. The CPU kinds CI meets: AVX2 only (EPYC), AVX-512 with BF16 and no AMX
(Zen 4), AVX-512 with AMX (Sapphire Rapids); each is named by its /proc/cpuinfo flags here, so
every decision is tested on any machine, and the cap taking effect is shown on this one."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

from kvpark.kernels import onednn_isa
from kvpark.kernels.onednn_isa import NO_AMX_ISA, choose_cap, kernels_of

AVX2_EPYC = frozenset({"avx", "avx2", "fma"})
ZEN4 = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}


def test_amx_is_kept_out_while_batch_invariance_is_on():
    cap = choose_cap(SAPPHIRE_RAPIDS, batch_invariant=True, current=None)
    assert cap.value == NO_AMX_ISA == "AVX512_CORE_BF16"
    assert "AMX" in cap.reason and "--no-batch-invariant" in cap.reason


@pytest.mark.parametrize("flags", [AVX2_EPYC, ZEN4], ids=["avx2", "zen4"])
def test_a_cpu_without_amx_is_left_as_it_is(flags):
    assert choose_cap(flags, batch_invariant=True, current=None).value is None


def test_without_batch_invariance_amx_is_allowed():
    assert choose_cap(SAPPHIRE_RAPIDS, batch_invariant=False, current=None).value is None


@pytest.mark.parametrize("current", ["avx2", "AVX512_CORE_BF16", "AVX512_CORE_FP16"])
def test_a_users_cap_below_amx_is_kept(current):
    assert choose_cap(SAPPHIRE_RAPIDS, True, current).value is None


@pytest.mark.parametrize("current", ["AVX512_CORE_AMX", "ALL", "DEFAULT", "avx10_1_512_amx"])
def test_a_users_setting_that_lets_amx_in_is_lowered(current):
    cap = choose_cap(SAPPHIRE_RAPIDS, True, current)
    assert cap.value == NO_AMX_ISA and f"was {current.upper()}" in cap.reason


def test_apply_cap_sets_the_variable_only_when_there_is_a_cap(monkeypatch):
    monkeypatch.delenv(onednn_isa.ENV, raising=False)
    onednn_isa.apply_cap(onednn_isa.IsaCap(None, "nothing"))
    assert onednn_isa.ENV not in os.environ
    onednn_isa.apply_cap(onednn_isa.IsaCap("AVX512_CORE_BF16", "why"))
    assert os.environ[onednn_isa.ENV] == "AVX512_CORE_BF16"


def test_kernel_names_come_from_executed_primitives_only():
    lines = [
        "onednn_verbose,v1,info,cpu,isa:Intel AVX2",
        "onednn_verbose,v1,primitive,create_nested:cache_miss,cpu,matmul,brg_matmul:avx2,undef",
        "onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core_amx,"
        "forward_inference,src:bf16::blocked:ab::f0,,mb64ic576oc576,0.1",
        "not oneDNN's",
    ]
    assert [onednn_isa._executed_kernel(line) for line in lines] == [
        None, None, "brg_matmul:avx512_core_amx", None]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_kernels_of_reads_the_packed_linear_and_passes_other_output_on(capfd):
    weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(32, 64), 4)

    def run() -> None:
        print("a line of the caller's own", flush=True)
        torch.ops.mkldnn._linear_pointwise(torch.randn(4, 64), weight, None, "none", [], "")

    names = kernels_of(run)
    assert len(names) == 1 and ":" in names[0]
    assert kernels_of(lambda: torch.randn(4, 64) + 1) == []  # no oneDNN primitive ran
    out = capfd.readouterr().out
    assert "a line of the caller's own" in out and "onednn_verbose" not in out


SERVER_START = textwrap.dedent("""
    import logging, sys
    from kvpark.kernels import cpu_features, onednn_isa
    from kvpark.pod.serving import stack as server
    from kvpark.pod.args import parse_args

    logging.basicConfig(level="INFO", stream=sys.stderr)
    # a CPU with AMX, and a cap below every CPU's own ISA, so that taking effect shows here too
    flags = cpu_features.read_cpuinfo_flags()
    cpu_features.read_cpuinfo_flags = lambda: flags | {"amx_tile"}
    onednn_isa.NO_AMX_ISA = "SSE41"
    server.build_stack(parse_args(["-m", "synthetic:tiny", "--weights", "fp32"]))
""")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="oneDNN's x86 ISA names")
def test_the_server_caps_onednn_before_its_first_use():
    """build_stack, as a server runs it, in a fresh process: were the cap set after anything had
    asked oneDNN for its ISA (cpu_features.detect, the model's packing), the GEMMs would still
    run this CPU's AVX2/AVX-512 kernels."""
    env = {k: v for k, v in os.environ.items() if k != onednn_isa.ENV}
    done = subprocess.run([sys.executable, "-c", SERVER_START], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next((x for x in done.stderr.splitlines() if "batch invariance:" in x), "")
    assert "ONEDNN_MAX_CPU_ISA=SSE41" in done.stderr
    assert "runs the fp32 linears with" in line, done.stderr[-3000:]
    assert "avx" not in line.split("with", 1)[1].split("at every")[0], line
