"""The shape of a decoder, shared by the loaders and the model: the llama family, and hybrids
(Qwen3.5) whose linear-attention layers keep a fixed-size recurrent state per sequence."""

from __future__ import annotations

from dataclasses import dataclass

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class DeltaNetConfig:
    """A Gated DeltaNet layer's shapes (Qwen3.5's `linear_*` fields)."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        assert self.num_v_heads % self.num_k_heads == 0, (
            f"{self.num_v_heads} value heads do not group over {self.num_k_heads} key heads")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """The last `conv_kernel - 1` inputs of each channel: [conv_dim, kernel - 1]."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """The delta rule's state: [value heads, k_head_dim, v_head_dim]."""
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    def state_layout(self, num_layers: int) -> str:
        """What the bytes of a state slot depend on besides the weights and dtype: a slot
        file's state is read back only into the same layout."""
        return f"{num_layers}x(conv {self.conv_state_shape}, recurrent " \
               f"{self.recurrent_state_shape} float32)"


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
    # hybrids (Qwen3.5): each layer's kind; empty: every layer is full attention
    layer_types: tuple[str, ...] = ()
    delta_net: DeltaNetConfig | None = None
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim x this dims only
    attention_output_gate: bool = False  # q_proj also yields a sigmoid gate on the output
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Qwen3.5 stores w - 1
    num_mtp_layers: int = 0  # Qwen3.5's multi-token-prediction head (`mtp.*`), a drafter

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            f"{self.num_heads} query heads do not group over {self.num_kv_heads} KV heads"
        )
        assert not self.layer_types or len(self.layer_types) == self.num_layers
        assert (self.delta_net is not None) == (LINEAR_ATTENTION in self.layer_types)

    @property
    def gqa_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state per sequence instead of K/V pages."""
        return self.delta_net is not None

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def attention_layers(self) -> list[int]:
        """The layers with K/V pages in the pool, in order (pool layer j is model layer [j])."""
        return [i for i, kind in enumerate(self.kinds) if kind == FULL_ATTENTION]

    @property
    def delta_net_layers(self) -> list[int]:
        """The layers with a state slot per sequence, in order."""
        return [i for i, kind in enumerate(self.kinds) if kind == LINEAR_ATTENTION]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)
