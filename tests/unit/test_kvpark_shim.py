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
    probe = ("import operator, kvpark, kvpark.kernels.flashinfer_paged as f, kvpark.pod.cuda_graphs"
             " as g; print(operator.__file__); print(f.__file__); print(g.__file__)")
    env = {**os.environ, "PYTHONPATH": str(shim)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert not out[0].startswith(str(REPO))  # the standard library's operator
    assert out[1] == str(shim / "kvpark" / "kernels" / "flashinfer_paged.py")
    assert out[2] == str(shim / "kvpark" / "pod" / "cuda_graphs.py")
