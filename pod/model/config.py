"""The shape of a llama-family decoder, shared by the loaders and the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 8192
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    architecture: str = "llama"

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"{self.num_heads} query heads do not group over {self.num_kv_heads} KV heads"
        )

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads
