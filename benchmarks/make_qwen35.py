"""A seeded-random Qwen3.5 of a published small size, written as llama.cpp's converter writes a
`qwen35` GGUF, for the hybrid benchmarks (no checkpoint is downloaded).

    python benchmarks/make_qwen35.py --out /tmp/qwen35-0.8b.gguf
    python benchmarks/make_qwen35.py --mtp --out /tmp/qwen35-0.8b-mtp.gguf  # with an MTP head

Shapes: Qwen3.5-0.8B's text model (24 layers, 3 Gated DeltaNet then 1 gated attention; hidden
1024, MLP 3584, 8 query / 2 KV heads of 256, 16 + 16 DeltaNet heads of 128, partial RoPE 0.25,
tied embeddings) with one change: SmolLM2's 49,152-token vocabulary instead of 248,320 (no
Qwen tokenizer ships offline; both servers read the same file). Weights: transformers'
initialisation of `Qwen3_5ForCausalLM` under a fixed seed, norms and decay parameters moved off
their initial values as the tests do. `--mtp` adds the MTP head Qwen3.5 checkpoints carry (one
gated full-attention block, `fc` and its norms: `nextn` blocks in the file) with seeded weights
of the same initialisation: its guesses are random, so it shows what an MTP step costs, not an
acceptance rate. Needs `transformers` (the test extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from qwen35_reference import import_qwen35, write_qwen35_gguf  # noqa: E402

QWEN35_08B = dict(
    vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=16, max_position_embeddings=262144, tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25},
)


def mtp_weights(c, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """An MTP head in Hugging Face names: normal(0, 0.02) matrices, norms off zero (stored as
    scale - 1) as the model's are."""
    hidden, q_out, kv_out = c.hidden_size, c.num_attention_heads * c.head_dim, \
        c.num_key_value_heads * c.head_dim
    p = "mtp.layers.0."
    shapes = {"mtp.fc.weight": (hidden, 2 * hidden),
              p + "self_attn.q_proj.weight": (2 * q_out, hidden),
              p + "self_attn.k_proj.weight": (kv_out, hidden),
              p + "self_attn.v_proj.weight": (kv_out, hidden),
              p + "self_attn.o_proj.weight": (hidden, q_out),
              p + "mlp.gate_proj.weight": (c.intermediate_size, hidden),
              p + "mlp.up_proj.weight": (c.intermediate_size, hidden),
              p + "mlp.down_proj.weight": (hidden, c.intermediate_size)}
    norms = {"mtp.pre_fc_norm_embedding.weight": hidden, "mtp.pre_fc_norm_hidden.weight": hidden,
             "mtp.norm.weight": hidden, p + "input_layernorm.weight": hidden,
             p + "post_attention_layernorm.weight": hidden,
             p + "self_attn.q_norm.weight": c.head_dim, p + "self_attn.k_norm.weight": c.head_dim}
    weights = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    return weights | {n: torch.randn(size, generator=gen) * 0.3 for n, size in norms.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/qwen35-0.8b.gguf")
    p.add_argument("--f32", action="store_true", help="float32 matrices (default float16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp", action="store_true", help="with an MTP head (nextn blocks)")
    p.add_argument("--q8_0", action="store_true",
                   help="matrices as Q8_0 blocks (default float16), as llama-quantize writes")
    args = p.parse_args()
    causal_lm, text_config = import_qwen35()
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    model = causal_lm(text_config(**QWEN35_08B)).eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    state = dict(model.state_dict())
    if args.mtp:
        state |= mtp_weights(model.config, gen)
    count = sum(t.numel() for name, t in state.items()
                if not (name == "lm_head.weight" and model.config.tie_word_embeddings))
    write_qwen35_gguf(state, model.config, Path(args.out), half=not args.f32, q8_0=args.q8_0)
    print(f"{args.out}: {count / 1e6:.0f}M parameters, {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
