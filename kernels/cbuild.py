"""Compile and load the C kernels (csrc/) on first use: the system C compiler, no torch headers.

The kernels and their worker pool are one library (`SOURCES`), so a process has one pool.

Built for one instruction set of this CPU (`cpu_features.Isa`: by default the best it has) into a
cache folder keyed by source, compiler, flags and the CPU's feature flags, then loaded with ctypes
(which releases the GIL during a call). Where no compiler works, `build` raises
`KernelUnavailable` and callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .cpu_features import ISA_CFLAGS, Isa, detect, fingerprint

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "worker_pool.c", CSRC / "quant_linear.c", CSRC / "paged_attention.c",
           CSRC / "layer_ops.c", CSRC / "delta_rule.c", CSRC / "amx_gemm.c",
           CSRC / "quant_tiles.c", CSRC / "amx_attention.c", CSRC / "argmax.c",
           CSRC / "page_copy.c", CSRC / "prompt_layers.c", CSRC / "dequantize.c")
# -ffp-contract=fast: a*b+c as one fused multiply-add (ISO C mode would keep them apart); the
# same for every tile and call, so results stay deterministic
CFLAGS = ("-O3", "-ffp-contract=fast", "-fPIC", "-shared", "-pthread", "-std=c11")
CACHE_ENV = "KVPARK_KERNEL_CACHE"


class KernelUnavailable(RuntimeError):
    """The C kernel could not be built or loaded here."""


def compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)[:1]  # sysconfig's CC may carry flags for another toolchain


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


def pick_isa(isa: Isa | None) -> Isa:
    """`isa`, or the best this CPU has; one it cannot run is refused rather than crash later."""
    runnable = detect().isas
    if isa is None:
        return runnable[0]
    if isa not in runnable:
        raise KernelUnavailable(f"this CPU cannot run the {isa.value} build (it has "
                                f"{', '.join(i.value for i in runnable)})")
    return isa


def build(sources: Path | Sequence[Path], isa: Isa | None = None) -> Path:
    """One library of these sources for this ISA, compiler and CPU (built once, then reused)."""
    sources = [sources] if isinstance(sources, Path) else list(sources)
    isa = pick_isa(isa)
    cc = compiler()
    flags = [*CFLAGS, *ISA_CFLAGS[isa]]
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    # -march=native: a library built on one CPU may not run on another sharing the cache folder
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources + headers)
                         + " ".join(cc + flags).encode() + fingerprint().encode()).hexdigest()[:16]
    folder = cache_dir()
    stem = sources[0].stem if len(sources) == 1 else "kvpark_kernels"
    target = folder / f"{stem}-{isa.value}-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{target.name}.{os.getpid()}"
    try:
        done = subprocess.run([*cc, *flags, *map(str, sources), "-o", str(partial), "-lm"],
                              capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"C compiler {cc[0]!r} did not run: {exc}") from exc
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        names = ", ".join(s.name for s in sources)
        raise KernelUnavailable(f"{cc[0]} failed on {names}: {done.stderr.strip()[-800:]}")
    os.replace(partial, target)  # atomic: concurrent builders each publish a whole file
    return target


def library_or_none(log: logging.Logger, instead: str,
                    isa: Isa | None = None) -> ctypes.CDLL | None:
    """The kernels library, or None after one line on `log` saying what runs `instead`."""
    try:
        return load_library(isa)
    except KernelUnavailable as exc:
        log.info("%s: no C kernels here (%s)", instead, exc)
        return None


@functools.cache
def load_library(isa: Isa | None = None) -> ctypes.CDLL:
    """The kernels library for `isa` (default: the best this CPU has), built if needed."""
    try:
        return ctypes.CDLL(str(build(SOURCES, isa)))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load the built kernels library: {exc}") from exc
