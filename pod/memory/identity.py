"""`ModelIdentity`: what the bytes of a page of K/V depend on, in one place. The prefix cache's
hash seed, a slot file's header, the draft model's part of its target's identity and the
`system_fingerprint` all come from it, so none can leave out a field the others have: cached
K/V are never reused across other weights, another precision, other linears or another layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelIdentity:
    """The weights (name, file size, a digest of sampled embedding rows and the final norm), how
    they are computed (dtype, linears, blocks) and the pool's layout (pages, their type, and a
    hybrid model's state slots)."""

    model: str
    source_bytes: int  # the weight file's size (a directory's files together; 0: synthetic)
    weights_sha256: str
    dtype: str
    weight_format: str
    blocks: bool  # decode rows read quantised blocks (their K/V differ from prompt rows)
    num_layers: int  # the pool's: the target's layers, then a draft model's
    num_kv_heads: int
    head_dim: int
    page_size: int
    draft: str = ""  # the draft model's `weights_key` (--model-draft), "" without one
    state_layout: str = ""  # a hybrid model's state slot (`DeltaNetConfig.state_layout`)
    kv_dtype: str = ""  # the pool's type where it is not `dtype` (--cache-type-k/v bf16)

    @property
    def weights_key(self) -> str:
        """The weights and how their linears run: what a draft model adds to its target's
        identity (its layout is the pool's, already in the target's)."""
        return (f"{self.model}|{self.source_bytes}|{self.weights_sha256}|{self.dtype}"
                f"|{self.weight_format}|blocks={self.blocks}")

    @property
    def text(self) -> str:
        """Every field, as one string: the prefix cache's hash seed."""
        return json.dumps(asdict(self), sort_keys=True)

    def fingerprint(self, kernels: str) -> str:
        """What decides the numbers of an output: every field plus the kernels that compute
        attention and sampling (`kernels`: device, backend, batch invariance)."""
        return hashlib.sha256(f"{self.text}|{kernels}".encode()).hexdigest()

    def differences(self, saved: dict[str, object]) -> list[str]:
        """`field: file X, this server Y` for each field that differs (or is missing; a field
        with a default, such as `draft`, reads as its default in older files)."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        return [f"{name}: file {saved.get(name, defaults.get(name))!r}, this server {value!r}"
                for name, value in asdict(self).items()
                if saved.get(name, defaults.get(name)) != value]


def get_weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over 64 evenly spread rows of the token embedding and the final norm: cheap at
    start-up, and any other checkpoint (or seed of a synthetic one) differs there."""
    h = hashlib.sha256()
    embed = weights["model.embed_tokens.weight"]
    for tensor in (embed[:: max(1, embed.shape[0] // 64)], weights["model.norm.weight"]):
        h.update(tensor.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def get_source_bytes(source: str) -> int:
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return 0
