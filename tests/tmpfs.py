"""A small real tmpfs for the disk tier's tests: a full disk and a volume that turns read-only
are the kernel's own errors, not a mock's (root mounts one; elsewhere the test skips)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """`path` made and mounted as a tmpfs of `size` (e.g. "64k", "2m") for the block."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def remount_read_only(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
