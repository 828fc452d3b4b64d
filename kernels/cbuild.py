"""Compile and load the C kernels (csrc/) on first use: the system C compiler, no torch headers.

Built for this CPU (`-march=native`) into a cache folder keyed by source, compiler, flags and the
CPU's feature flags, then loaded with ctypes (which releases the GIL during a call). Where no
compiler works, `build` raises `KernelUnavailable` and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import sysconfig
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# -ffp-contract=fast: a*b+c as one fused multiply-add (ISO C mode would keep them apart); the
# same for every tile and call, so results stay deterministic
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread", "-std=c11")
CACHE_ENV = "KVPARK_KERNEL_CACHE"


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here."""


def compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)[:1]  # sysconfig's CC may carry flags for another toolchain


def cpu_fingerprint() -> str:
    # -march=native: a library built on one CPU may not run on another sharing the cache folder
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    home_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpark"
    try:
        home_cache.mkdir(parents=True, exist_ok=True)
        if os.access(home_cache, os.W_OK):
            return home_cache
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"kvpark-kernels-{os.getuid()}"  # read-only home


def build(source: Path) -> Path:
    """The compiled library for this source, compiler and CPU (built once, then reused)."""
    cc = compiler()
    key = hashlib.sha256(source.read_bytes() + " ".join(cc + list(CFLAGS)).encode()
                         + cpu_fingerprint().encode()).hexdigest()[:16]
    folder = cache_dir()
    target = folder / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{target.name}.{os.getpid()}"
    try:
        done = subprocess.run([*cc, *CFLAGS, str(source), "-o", str(partial), "-lm"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"C compiler {cc[0]!r} did not run: {exc}") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise KernelUnavailable(f"{cc[0]} failed on {source.name}: {done.stderr.strip()[-800:]}")
    os.replace(partial, target)  # atomic: concurrent builders each publish a whole file
    return target


def load_library(source: Path) -> ctypes.CDLL:
    """Build `source` if needed and load it."""
    try:
        return ctypes.CDLL(str(build(source)))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load the built {source.stem} kernel: {exc}") from exc
