"""The uninstalled-checkout shim the GPU check uses (benchmarks/_kvpark_path.py)."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import _kvpark_path  # noqa: E402


def test_shim_maps_the_package_dirs_and_leaves_stdlib_operator_alone(tmp_path):
    shim = _kvpark_path.make_shim(tmp_path)
    _kvpark_path.make_shim(tmp_path)  # idempotent: links are replaced, not duplicated
    probe = ("import operator, kvpark, kvpark.kernels.flashinfer_paged as f, "
             "kvpark.pod.worker.cuda_graphs as g; print(operator.__file__); print(f.__file__); "
             "print(g.__file__)")
    env = {**os.environ, "PYTHONPATH": str(shim)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert not out[0].startswith(str(REPO))  # the standard library's operator
    assert out[1] == str(shim / "kvpark" / "kernels" / "flashinfer_paged.py")
    assert out[2] == str(shim / "kvpark" / "pod" / "worker" / "cuda_graphs.py")


BLOCK_SERVER_DEPS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"numpy", "gguf", "tokenizers", "safetensors", "starlette",
                                  "uvicorn", "jinja2", "prometheus_client"}:
            raise ModuleNotFoundError(f"{name} is not on the GPU machine", name=name)
sys.meta_path.insert(0, Block())
"""


def test_what_the_gpu_check_imports_needs_no_server_dependencies(tmp_path):
    """The GPU machine has torch and triton only: the model, runner, engine, scheduler and every
    kernel module must import without numpy, gguf, tokenizers, starlette and the rest."""
    shim = _kvpark_path.make_shim(tmp_path)
    probe = BLOCK_SERVER_DEPS + (
        "import kvpark.pod.model.llama, kvpark.pod.worker.runner, kvpark.pod.core.engine\n"
        "import kvpark.pod.core.scheduler, kvpark.pod.model.synthetic\n"
        "import kvpark.pod.worker.cuda_graphs\n"
        "import kvpark.kernels.cpu_paged, kvpark.kernels.quant_linear, kvpark.kernels.kv_copy\n"
        "import kvpark.kernels.flashinfer_paged\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(shim)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
