"""What build answers: the package version (/version, /props) and OpenAI's system_fingerprint,
which changes with the build and with whatever decides the numbers."""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version


def build_version() -> str:
    try:
        return version("kvpark")
    except PackageNotFoundError:
        return "unknown"


def fingerprint(numerics: str) -> str:
    """OpenAI's system_fingerprint: changes when the build or anything deciding the numbers
    (weights, precision, kernels) does, so a client pairing it with `seed` sees why."""
    digest = hashlib.sha256(f"{build_version()}|{numerics}".encode()).hexdigest()
    return f"fp_{digest[:10]}"
