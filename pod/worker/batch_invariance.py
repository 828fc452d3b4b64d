"""`--batch-invariant` on the CPU, made to hold and then checked at start-up.

A row's result must not depend on which other rows share its step (greedy output the same alone
or in a crowd, a recompute replay equal to the first run). The model pads every GEMM to
`MIN_INVARIANT_ROWS`; what it cannot control is which kernel oneDNN picks for a row count. So:
1. before oneDNN's first use, `cap_onednn` keeps it off AMX where the CPU has AMX (see
   `kernels/onednn_isa.py` for why AMX breaks it);
2. once the model is built and its threads are set, `check_gemm_kernels` runs the first layer's
   linears at row counts from the smallest to the largest a step uses and reads which oneDNN
   kernel each ran; one kernel for all is what invariance rests on. Where they differ (a CPU or
   a setting this has not met) the log says, in one line, that invariance is given up and why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from kvpark.kernels import cpu_features, onednn_isa

from ..model.linear import MIN_INVARIANT_ROWS, gemm_engine
from ..model.llama import LlamaModel

log = logging.getLogger("kvpark.server")

# row counts around the kernels' block sizes; the step's largest (--batch-size) is added
PROBE_ROWS = (MIN_INVARIANT_ROWS, MIN_INVARIANT_ROWS + 1, 16, 17, 64, 65)
MAX_PROBE_ROWS = 512  # a larger step's GEMM is this one's blocking repeated


def cap_onednn(batch_invariant: bool) -> onednn_isa.IsaCap:
    """Call before anything asks oneDNN which ISA it may use (`cpu_features.detect` does)."""
    cap = onednn_isa.choose_cap(cpu_features.read_cpuinfo_flags(), batch_invariant,
                                os.environ.get(onednn_isa.ENV))
    onednn_isa.apply_cap(cap)
    if cap.value is not None:
        log.info("oneDNN: %s=%s: %s", onednn_isa.ENV, cap.value, cap.reason)
    return cap


@dataclass(frozen=True)
class GemmKernels:
    """oneDNN's kernels for the first layer's linears, by the row count they ran with."""

    by_rows: dict[int, tuple[str, ...]]

    @property
    def is_uniform(self) -> bool:
        return len(set(self.by_rows.values())) <= 1

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for names in self.by_rows.values() for k in names))

    def first_difference(self) -> tuple[int, tuple[str, ...], int, tuple[str, ...]]:
        (rows, names), *rest = self.by_rows.items()
        other_rows, other_names = next((r, n) for r, n in rest if n != names)
        return rows, names, other_rows, other_names


def probe_rows(batch_size: int) -> list[int]:
    return sorted({*PROBE_ROWS, max(MIN_INVARIANT_ROWS, min(batch_size, MAX_PROBE_ROWS))})


def probe_gemm_kernels(model: LlamaModel, rows: list[int]) -> GemmKernels:
    layer = model.layers[0]
    linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
    inputs = {n: [torch.randn(n, lin.in_features) for lin in linears] for n in rows}

    def run(n: int) -> None:
        for lin, x in zip(linears, inputs[n]):
            lin.dense(x)

    with torch.inference_mode():
        return GemmKernels({n: tuple(onednn_isa.kernels_of(lambda n=n: run(n))) for n in rows})


def check_gemm_kernels(model: LlamaModel, batch_size: int) -> GemmKernels | None:
    """Logs whether one oneDNN kernel serves every row count (None: nothing to check)."""
    if not model.batch_invariant or model.device.type != "cpu":
        return None
    fmt = model.weight_format.value
    if gemm_engine(model.weight_format, model.device) == "amx":
        log.info("batch invariance: the %s linears run in kvpark's AMX tile kernel (fixed tiles "
                 "of 16 rows, one instruction order: a row's bits at any row count)", fmt)
        return None
    found = probe_gemm_kernels(model, probe_rows(batch_size))
    if not found.kernels:
        log.info("batch invariance: the %s linears do not run in oneDNN here (torch's own "
                 "GEMMs, padded to %d rows)", fmt, MIN_INVARIANT_ROWS)
    elif found.is_uniform:
        log.info("batch invariance: oneDNN runs the %s linears with %s at every row count "
                 "tried (%s)", fmt, ", ".join(found.kernels),
                 ", ".join(map(str, found.by_rows)))
    else:
        rows, names, other_rows, other_names = found.first_difference()
        cap = os.environ.get(onednn_isa.ENV)
        log.warning("batch invariance does not hold for the %s linears on this CPU: oneDNN "
                    "runs %s for %d rows but %s for %d, so a row's bits depend on its batch "
                    "(%s=%s; oneDNN reads it only before its first use)", fmt,
                    ", ".join(names), rows, ", ".join(other_names), other_rows,
                    onednn_isa.ENV, cap or "unset")
    return found
