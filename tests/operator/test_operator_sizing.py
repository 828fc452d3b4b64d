"""Pure memory sizing: limit = runtime + weights + host KV pool + preempt budget + shm + headroom,
headroom = max(512 MiB, 10% of the limit) (operator/sizing.py documents each number)."""

from __future__ import annotations

import itertools
import math

import pytest

from kvpark.operator import crd, sizing

MIB = 1 << 20
SMOL = sizing.KNOWN_MODELS["builtin://smollm2-135m"]
SMOL_WEIGHTS = SMOL.params * 4 / MIB  # float32 on the host


def spec(**fields) -> dict:
    return crd.get_spec({"spec": fields})


def expected_limit(need: float) -> int:
    """Smallest multiple of 64 MiB that holds `need` plus its own headroom, by search."""
    limit = 64
    while limit - max(512, 0.1 * limit) < need:
        limit += 64
    return limit


def test_default_gpu_server() -> None:
    plan = sizing.get_sizing(spec())
    pool = 8192 * 2 * 30 * 3 * 64 * 2 / MIB  # tokens x K,V x layers x kv heads x dim x bf16
    assert pool == 180.0
    assert plan.preempt_ram == 180  # auto: one full pool can be parked
    assert plan.shm_mib == 256
    need = 3072 + SMOL_WEIGHTS + 180 + 256
    assert plan.memory == f"{expected_limit(need)}Mi" == "4544Mi"
    assert plan.problem is None


def test_cpu_server_counts_the_pool_in_host_ram() -> None:
    plan = sizing.get_sizing(spec(resources={"gpus": 0}))
    pool = 8192 * 2 * 30 * 3 * 64 * 4 / MIB  # float32 on CPU
    assert plan.preempt_ram == math.ceil(pool) == 360
    assert plan.shm_mib == 64
    need = 1024 + SMOL_WEIGHTS + pool + 360 + 64
    assert plan.memory == f"{expected_limit(need)}Mi"


@pytest.mark.parametrize("gpus, context, ram", list(itertools.product(
    [0, 1], [256, 4096, 65536, 1 << 20], ["auto", 0, 1, 1000, 50000])))
def test_the_limit_holds_everything_and_is_the_smallest(gpus: int, context: int, ram) -> None:
    s = spec(resources={"gpus": gpus}, contextSize=context, preempt={"ramMiB": ram})
    plan = sizing.get_sizing(s)
    limit = sizing.to_mib(plan.memory)
    device_bytes = 2 if gpus else 4
    pool = context * SMOL.kv_bytes_per_token(device_bytes) / MIB
    budget = math.ceil(pool) if ram == "auto" else ram
    assert plan.preempt_ram == budget
    need = sizing.fixed_mib(SMOL_WEIGHTS, pool, gpus, plan.shm_mib) + budget
    assert limit - sizing.headroom_mib(limit) >= need
    assert (limit - 64) - sizing.headroom_mib(limit - 64) < need
    assert limit % 64 == 0


def test_preempt_disabled_needs_no_budget() -> None:
    on = sizing.get_sizing(spec(preempt={"ramMiB": 4096}))
    off = sizing.get_sizing(spec(preempt={"enabled": False, "ramMiB": 4096}))
    assert off.preempt_ram == 0
    assert sizing.to_mib(on.memory) - sizing.to_mib(off.memory) >= 4096


def test_a_given_limit_leaves_the_rest_to_the_budget() -> None:
    plan = sizing.get_sizing(spec(resources={"gpus": 0, "memory": "8Gi"}))
    rest = 1024 + SMOL_WEIGHTS + 360 + 64 + 0.1 * 8192
    assert plan.memory == "8Gi"
    assert plan.preempt_ram == math.floor(8192 - rest) == 5411
    as_bytes = sizing.get_sizing(spec(resources={"gpus": 0, "memory": 8 << 30}))
    assert as_bytes.preempt_ram == plan.preempt_ram


def test_a_given_limit_too_small_is_degraded() -> None:
    plan = sizing.get_sizing(spec(resources={"memory": "2Gi"}))
    assert plan.problem is not None and plan.problem.reason == "MemoryTooSmall"
    assert "2Gi" in plan.problem.message
    enough = sizing.get_sizing(spec(resources={"memory": "6Gi"}, preempt={"ramMiB": 1024}))
    assert enough.problem is None and enough.preempt_ram == 1024
    short = sizing.get_sizing(spec(resources={"memory": "6Gi"}, preempt={"ramMiB": 4096}))
    assert short.problem is not None and short.problem.reason == "MemoryTooSmall"
    # the message names the limit the operator would have chosen itself
    computed = sizing.get_sizing(spec(preempt={"ramMiB": 4096})).memory
    assert f"below the {computed} " in short.problem.message


def test_unknown_models_need_a_size_or_a_limit() -> None:
    hf = {"uri": "hf://org/repo", "revision": "v1"}
    plan = sizing.get_sizing(spec(model=hf))
    assert plan.problem is not None and plan.problem.reason == "CannotSizeMemory"
    assert plan.memory is None
    sized = sizing.get_sizing(spec(model={**hf, "sizeMiB": 7680}))
    assert sized.problem is None
    assert sized.preempt_ram == math.ceil(8192 * sizing.UNKNOWN_KV_BYTES_PER_TOKEN / MIB)
    assert sizing.to_mib(sized.memory) > 7680 + sizing.RUNTIME_MIB_GPU
    given = sizing.get_sizing(spec(model=hf, resources={"memory": "32Gi"}))
    assert (given.memory, given.preempt_ram, given.problem) == ("32Gi", "auto", None)


def test_no_limit_budget_needs_a_given_limit() -> None:
    plan = sizing.get_sizing(spec(preempt={"ramMiB": -1}))
    assert plan.problem is not None and plan.problem.reason == "CannotSizeMemory"
    given = sizing.get_sizing(spec(preempt={"ramMiB": -1}, resources={"memory": "16Gi"}))
    assert (given.preempt_ram, given.problem) == (-1, None)


def test_unknown_builtin_model() -> None:
    plan = sizing.get_sizing(spec(model={"uri": "builtin://gpt-5"}))
    assert plan.problem is not None and plan.problem.reason == "UnknownBuiltinModel"
    assert "builtin://smollm2-135m" in plan.problem.message


@pytest.mark.parametrize("host_cache", [[], ["--no-host-cache"], ["--cache-ram", "512"],
                                        ["--cache-ram", "0"]])
def test_the_host_cache_lives_inside_the_budget_and_changes_no_limit(host_cache) -> None:
    """The pod's host tier (on by default) is charged to --preempt-ram with the parks: the
    memory limit, the budget and the flags the operator sets are the same with it on, capped
    or off; the user's host-cache flags reach the server untouched."""
    from test_operator_builders import arg, deployment_of, server_container

    plain = server_container(deployment_of({"resources": {"gpus": 0}}))
    with_flags = server_container(deployment_of({"resources": {"gpus": 0},
                                                 "server": {"args": host_cache}}))
    assert with_flags["resources"] == plain["resources"]
    assert arg(with_flags, "--preempt-ram") == arg(plain, "--preempt-ram")
    assert with_flags["args"][-len(host_cache) or len(with_flags["args"]):] == host_cache
    base = sizing.get_sizing(spec(resources={"gpus": 0}))
    assert base.memory == sizing.get_sizing(spec(resources={"gpus": 0},
                                                 server={"args": host_cache})).memory
