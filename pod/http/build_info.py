"""What build answers: the package version (/version, /props) and OpenAI's system_fingerprint,
which changes with the build and with whatever decides the numbers."""

from __future__ import annotations

import functools
import hashlib
from importlib.metadata import PackageNotFoundError, version


@functools.cache
def build_version() -> str:
    """Read once: it does not change under a running server, and reading it scans the
    distributions on sys.path (py-spy found it on the event loop for every request)."""
    try:
        return version("kvpark")
    except PackageNotFoundError:
        return "unknown"


@functools.cache
def fingerprint(numerics: str) -> str:
    """OpenAI's system_fingerprint: changes when the build or anything deciding the numbers
    (weights, precision, kernels) does, so a client pairing it with `seed` sees why."""
    digest = hashlib.sha256(f"{build_version()}|{numerics}".encode()).hexdigest()
    return f"fp_{digest[:10]}"
