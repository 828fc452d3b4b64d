"""The wheel (what the Dockerfile installs) carries every C source and header the kernels
compile from: a wheel without csrc/*.h served with the torch fallbacks, one log line saying so.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from kvpark.kernels import cbuild

REPO = Path(__file__).resolve().parents[2]
CSRC_IN_WHEEL = "kvpark/kernels/csrc/"


def build_wheel(tmp: Path) -> Path:
    """From a copy of the checkout's files (tracked, or new and not ignored): setuptools reuses
    a build/ folder it finds, so a stale one in the checkout could hide a missing file."""
    tree, out = tmp / "tree", tmp / "dist"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, check=True, capture_output=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(tree)], check=True, capture_output=True)
    (wheel,) = out.glob("kvpark-*.whl")
    return wheel


def test_wheel_has_every_kernel_file_and_they_compile(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name[len(CSRC_IN_WHEEL):] for name in archive.namelist()
                   if name.startswith(CSRC_IN_WHEEL)}
        archive.extractall(tmp_path / "unpacked",
                           [CSRC_IN_WHEEL + name for name in shipped])
    in_checkout = {path.name for path in cbuild.CSRC.iterdir() if path.suffix in (".c", ".h")}
    assert shipped == in_checkout
    # built from the wheel's files alone: the checkout's library (its key hashes every source
    # and header), so the same compile, done once for both
    csrc = tmp_path / "unpacked" / CSRC_IN_WHEEL
    from_wheel = cbuild.build([csrc / source.name for source in cbuild.SOURCES])
    assert from_wheel == cbuild.build(cbuild.SOURCES)
