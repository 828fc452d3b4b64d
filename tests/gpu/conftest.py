"""GPU tests: every test here carries the `gpu` marker and is skipped cleanly without CUDA;
tests that need FlashInfer take the `flashinfer` fixture, which skips when it cannot load."""

import pytest
import torch
from gpu_common import DEVICE, DTYPE

from kvpark.kernels.flashinfer_paged import FlashInferUnavailable, load_flashinfer
from kvpark.pod.model.llama import LlamaModel
from kvpark.pod.model.synthetic import synthetic_config, synthetic_weights


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch sees no CUDA device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def flashinfer():
    try:
        return load_flashinfer(DEVICE)
    except FlashInferUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2():
    """synthetic:smollm2-135m in bf16 on the GPU (its tokenizer is not needed)."""
    config = synthetic_config("smollm2-135m")
    weights = synthetic_weights(config, device=DEVICE, dtype=DTYPE)
    return LlamaModel(config, weights, batch_invariant=False)
