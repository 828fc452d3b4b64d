"""Pure: a pod's memory limit, and the preempt budget (--preempt-ram) the pod is told.

    limit    = runtime + weights + host KV pool + preempt budget + shm + headroom
    headroom = max(512 MiB, 10% of the limit)   # the rule pod/budget.py uses for `auto`

The numbers, in MiB, and why:
- runtime: 1024 on CPU (CPython, torch, tokenizers, the HTTP stack); 3072 with a GPU, where the
  CUDA context, cuBLAS and FlashInfer's JIT-compiled kernels are mapped into host memory too.
- weights: builtin models from KNOWN_MODELS at float32 (the GGUF loader dequantises on the host,
  also when the weights then move to the GPU, so the host peak holds them once); other models
  need `spec.model.sizeMiB`.
- host KV pool: with `gpus: 0` only, where the pool lives in host RAM (float32).
- preempt budget: `preempt.ramMiB` when it is a number; `auto` becomes room to park one full
  pool (contextSize x KV bytes per token at the device dtype: bfloat16 on a GPU, float32 on
  CPU); `preempt.enabled: false` needs none.
- shm: the /dev/shm emptyDir (medium Memory). tmpfs pages are charged to the container's memory
  cgroup, so they are part of the limit: 256 with a GPU, 64 on CPU.
Models the table does not know use 128 KiB of KV per token (a Llama-3-8B-class GQA model at
bfloat16) for the pool and the `auto` budget.

When `resources.memory` is set the operator keeps it and works backwards: the budget is what is
left after the rest, and a limit too small for the rest makes the CR Degraded (MemoryTooSmall).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from kubernetes.utils.quantity import parse_quantity

from kvpark.operator.status import Problem

MIB = 1 << 20
RUNTIME_MIB_CPU = 1024
RUNTIME_MIB_GPU = 3072
SHM_MIB_CPU = 64
SHM_MIB_GPU = 256
MIN_HEADROOM_MIB = 512
HEADROOM_FRACTION = 0.10
ROUND_MIB = 64
UNKNOWN_KV_BYTES_PER_TOKEN = 128 * 1024


class ModelShape(NamedTuple):
    params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes  # K and V


KNOWN_MODELS = {
    # HuggingFaceTB/SmolLM2-135M-Instruct: hidden 576, 9 heads of 64, 3 KV heads, tied embeddings
    "builtin://smollm2-135m": ModelShape(134_515_008, 30, 3, 64),
}


class Sizing(NamedTuple):
    memory: str | None  # the container's memory limit (and request); None when it can't be sized
    preempt_ram: int | str  # --preempt-ram: MiB, -1, or "auto" (the pod decides)
    shm_mib: int
    problem: Problem | None = None


def headroom_mib(limit_mib: float) -> float:
    return max(MIN_HEADROOM_MIB, HEADROOM_FRACTION * limit_mib)


def limit_for(need_mib: float) -> int:
    """The smallest limit L (a multiple of ROUND_MIB) with L >= need + headroom(L)."""
    limit = max(need_mib + MIN_HEADROOM_MIB, need_mib / (1 - HEADROOM_FRACTION))
    return ROUND_MIB * math.ceil(limit / ROUND_MIB)


def to_mib(quantity: str | int) -> float:
    return float(parse_quantity(quantity)) / MIB


def get_sizing(spec: Mapping[str, Any]) -> Sizing:
    """`spec` with defaults applied (crd.get_spec)."""
    gpus = spec["resources"]["gpus"]
    shm = SHM_MIB_GPU if gpus else SHM_MIB_CPU
    uri = spec["model"]["uri"]
    shape = KNOWN_MODELS.get(uri)
    if uri.startswith("builtin://") and shape is None:
        known = ", ".join(sorted(KNOWN_MODELS))
        return Sizing(None, "auto", shm, Problem("UnknownBuiltinModel", f"{uri} is not in the "
                                                 f"image; builtin models: {known}"))
    device_bytes = 2 if gpus else 4
    if shape is not None:
        weights: float | None = shape.params * 4 / MIB
        kv_per_token = shape.kv_bytes_per_token(device_bytes)
    else:
        weights = spec["model"].get("sizeMiB")
        kv_per_token = UNKNOWN_KV_BYTES_PER_TOKEN * device_bytes // 2
    pool = spec["contextSize"] * kv_per_token / MIB
    ram = spec["preempt"]["ramMiB"] if spec["preempt"]["enabled"] else 0
    memory = spec["resources"].get("memory")
    if memory is None:
        return size_from_model(weights, pool, ram, gpus, shm)
    return check_given(str(memory), weights, pool, ram, gpus, shm)


def fixed_mib(weights: float, pool: float, gpus: int, shm: int) -> float:
    runtime = RUNTIME_MIB_GPU if gpus else RUNTIME_MIB_CPU
    return runtime + weights + (0 if gpus else pool) + shm


def size_from_model(weights: float | None, pool: float, ram: int | str, gpus: int,
                    shm: int) -> Sizing:
    if weights is None:
        return Sizing(None, ram, shm, Problem(
            "CannotSizeMemory", "the model's size is unknown: set model.sizeMiB or "
            "resources.memory"))
    if ram == -1:
        return Sizing(None, ram, shm, Problem(
            "CannotSizeMemory", "preempt.ramMiB -1 puts no bound on parked KV: set "
            "resources.memory or a ramMiB >= 0"))
    budget = math.ceil(pool) if ram == "auto" else int(ram)
    limit = limit_for(fixed_mib(weights, pool, gpus, shm) + budget)
    return Sizing(f"{limit}Mi", budget, shm)


def check_given(memory: str, weights: float | None, pool: float, ram: int | str, gpus: int,
                shm: int) -> Sizing:
    if weights is None:  # nothing to check against; `auto` lets the pod measure itself
        return Sizing(memory, ram, shm)
    fixed = fixed_mib(weights, pool, gpus, shm)
    asked = 0 if ram in ("auto", -1) else int(ram)
    limit = to_mib(memory)
    room = limit - fixed - headroom_mib(limit)
    if room < asked:
        return Sizing(memory, ram, shm, Problem(
            "MemoryTooSmall", f"resources.memory {memory} is below the {limit_for(fixed + asked)}"
            "Mi this model and preempt budget need"))
    return Sizing(memory, math.floor(room) if ram == "auto" else ram, shm)
