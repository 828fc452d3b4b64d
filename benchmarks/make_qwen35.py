"""A seeded-random Qwen3.5 of a published small size, written as llama.cpp's converter writes a
`qwen35` GGUF, for the hybrid benchmarks (no checkpoint is downloaded).

    python benchmarks/make_qwen35.py --out /tmp/qwen35-0.8b.gguf

Shapes: Qwen3.5-0.8B's text model (24 layers, 3 Gated DeltaNet then 1 gated attention; hidden
1024, MLP 3584, 8 query / 2 KV heads of 256, 16 + 16 DeltaNet heads of 128, partial RoPE 0.25,
tied embeddings) with one change: SmolLM2's 49,152-token vocabulary instead of 248,320 (no
Qwen tokenizer ships offline; both servers read the same file). Weights: transformers'
initialisation of `Qwen3_5ForCausalLM` under a fixed seed, norms and decay parameters moved off
their initial values as the tests do. Needs `transformers` (the test extra).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from qwen35_reference import import_qwen35, write_reference_gguf  # noqa: E402

QWEN35_08B = dict(
    vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=16, max_position_embeddings=262144, tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25},
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/qwen35-0.8b.gguf")
    p.add_argument("--f32", action="store_true", help="float32 matrices (default float16)")
    p.add_argument("--seed", type=int, default=0)
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
    count = sum(p.numel() for p in model.parameters())
    write_reference_gguf(model, Path(args.out), half=not args.f32)
    print(f"{args.out}: {count / 1e6:.0f}M parameters, {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
