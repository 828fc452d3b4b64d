"""What the flags choose on this machine: device, dtype, the linears' format and blocks for decode
rows, the attention backend, the pool's size in pages; and the model built as they say (the
target and a draft model alike)."""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from kvpark.kernels import amx_gemm, cpu_features, quant_linear
from kvpark.kernels.attention import AttentionBackend
from kvpark.kernels.cpu_features import CpuFeatures
from kvpark.kernels.quant_linear import QuantizedWeight
from kvpark.kernels.torch_paged import TorchPagedAttention

from ..args import ServerArgs, kv_cache_type
from ..memory.budget import MIB
from ..model.blocks_at_load import blocks_nbytes, make_missing_blocks
from ..model.config import ModelConfig
from ..model.hybrid import HybridModel
from ..model.linear import WeightFormat
from ..model.llama import LlamaModel
from ..model.loader import LoadedModel
from ..model.mtp import MTPHead, has_mtp_weights

log = logging.getLogger("kvpark.server")


def pick_device(args: ServerArgs) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def pick_dtype(args: ServerArgs, device: torch.device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def pick_kv_dtype(args: ServerArgs, device: torch.device, dtype: torch.dtype,
                  amx_prompt_rows: bool = False) -> torch.dtype:
    """The KV pool's type (-ctk/-ctv, --kv-cache-dtype; `args.check` refused two). A float32
    model on the CPU may keep bf16 K/V (its C kernels read them), and does by default where its
    prompt rows' attention runs on AMX (`amx_prompt_rows`: it rounds K and V to bf16 for its
    tiles already; a decode step then reads half the bytes). Anything else keeps the compute
    type (FlashInfer and the torch backend attend in it): a ValueError (one log line, exit
    code 2) for a type the pool cannot take here."""
    named = kv_cache_type(args)
    if named in (None, "auto"):
        return torch.bfloat16 if amx_prompt_rows and dtype == torch.float32 else dtype
    kv = getattr(torch, named)
    if kv == dtype or (device.type == "cpu" and dtype == torch.float32 and kv == torch.bfloat16):
        return kv
    where = "a float32 model on the CPU takes f32 or bf16" if dtype == torch.float32 \
        and device.type == "cpu" else f"here it holds the compute type ({_name(dtype)})"
    raise ValueError(f"the KV pool cannot hold {named}: {where}")


def pick_prefill_first(args: ServerArgs, device: torch.device) -> float:
    """Seconds a decode row may sit out steps for waiting prompts (`--prefill-first`). Auto:
    one second on the CPU, where a step's decode rows cost a pass over weights of their own
    (benchmarks/README.md, "Prompts first"); 0 on CUDA, where a step's decode rows share the
    prompt rows' weights: vLLM's order, every running sequence in every step (not measured
    there)."""
    if args.prefill_first == "auto":
        return 1.0 if device.type == "cpu" else 0.0
    return float(args.prefill_first)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pick_weight_format(args: ServerArgs, device: torch.device, dtype: torch.dtype,
                       cpu: CpuFeatures | None = None) -> WeightFormat:
    """bf16 linears are a CPU option over a float32 model (on CUDA the dtype says it all); a CPU
    without oneDNN's bf16 GEMMs keeps float32 (unpacked bf16 GEMMs there are slower than it).
    Where AMX runs, `--weights auto|gguf` computes dense rows on its tiles unless `--amx off`."""
    if device.type != "cpu" or dtype != torch.float32:
        return WeightFormat.FP32
    if args.weights in ("auto", "gguf"):
        return WeightFormat.AMX_BF16 if uses_amx_tiles(args) else WeightFormat.FP32
    if args.weights != "bf16":
        return WeightFormat.FP32
    cpu = cpu or cpu_features.detect()
    if not cpu.can_bf16_gemm:
        log.warning("--weights bf16: this CPU has no bf16 GEMMs for oneDNN (they need AVX-512 "
                    "BW/VL/DQ or AVX-NE-CONVERT; %s); using fp32 linears", cpu.describe())
        return WeightFormat.FP32
    return WeightFormat.BF16


def uses_amx_tiles(args: ServerArgs) -> bool:
    """`--amx auto` takes the tiles where they run (amx_gemm.usable says once why not); `on`
    insists on them."""
    if args.amx == "off":
        return False
    if amx_gemm.usable():
        return True
    if args.amx == "on":
        raise ValueError("--amx on: AMX does not run here (see the log line above)")
    return False


def pick_blocks(args: ServerArgs, loaded: LoadedModel, device: torch.device,
                dtype: torch.dtype) -> dict[str, QuantizedWeight] | None:
    """Blocks for decode rows on a float32 CPU model (`--weights auto|gguf`): a GGUF's own
    Q4_1 / Q8_0 matrices, and Q8_0 made at load for each linear stored without them (every
    linear of a hybrid: its loader keeps no blocks)."""
    if args.weights not in ("auto", "gguf"):
        return None
    reason = None
    if device.type != "cpu" or dtype != torch.float32:
        reason = "decode from blocks is a float32 CPU path"
    elif not quant_linear.is_available():
        reason = "the C kernel did not build (see --attention-backend cpu)"
    if reason is not None:
        if args.weights == "gguf":
            raise ValueError(f"--weights gguf: {reason}")
        return None
    started = time.perf_counter()
    made = make_missing_blocks(loaded.config, loaded.weights, loaded.quantized)
    if made:
        log.info("--weights %s: made Q8_0 blocks at load for %d linears the checkpoint stores "
                 "without blocks (%.0f MiB, %.1f s); %d kept as the checkpoint's own",
                 args.weights, len(made), blocks_nbytes(made) / MIB,
                 time.perf_counter() - started, len(loaded.quantized))
    return {**loaded.quantized, **made}


CPU_DEFAULT_CTX = 8192
ACTIVATION_RESERVE_BYTES = 1 << 30  # CUDA: activations, sampling, graph pool
FLASHINFER_RESERVE_BYTES = (128 + 8 * 8) << 20  # workspace + per-wrapper buffers


def pick_backend(args: ServerArgs, device: torch.device, config: ModelConfig,
                 dtype: torch.dtype, amx_prompt_rows: bool = False) -> AttentionBackend:
    """`amx_prompt_rows`: the model's prompt rows run on AMX (its linears do), so the C
    kernel gives their attention AMX too where the head size fits."""
    if args.attention_backend in ("auto", "flashinfer") and device.type == "cuda":
        try:
            from kvpark.kernels.flashinfer_paged import AttentionShape, FlashInferPagedAttention

            shape = AttentionShape(config.num_heads, config.num_kv_heads, config.head_dim,
                                   args.page_size, dtype, dtype)
            return FlashInferPagedAttention(device, shape=shape)
        except ImportError as exc:  # FlashInferUnavailable is an ImportError too
            if args.attention_backend == "flashinfer":
                raise
            log.warning("FlashInfer unavailable (%s); using the torch backend", exc)
    if args.attention_backend == "flashinfer":
        raise ValueError("--attention-backend flashinfer needs a CUDA device")
    if args.attention_backend in ("auto", "cpu") and device.type == "cpu":
        return pick_cpu_backend(args, dtype, amx_prompt_rows, config.head_dim,
                                config.num_heads // max(1, config.num_kv_heads))
    if args.attention_backend == "cpu":
        raise ValueError("--attention-backend cpu runs on the CPU only")
    return TorchPagedAttention(device)


def pick_cpu_backend(args: ServerArgs, dtype: torch.dtype, amx_prompt_rows: bool = False,
                     head_dim: int = 0, group: int = 1) -> AttentionBackend:
    """The C kernel (reads pages in place) where it builds; the torch reference otherwise."""
    from kvpark.kernels.cpu_paged import (
        CpuPagedAttention,
        KernelUnavailable,
        why_no_amx_prompt_rows,
    )

    why_not = why_no_amx_prompt_rows(head_dim, group) if amx_prompt_rows else None
    if why_not is not None:
        log.info("attention: prompt rows in float32 (%s)", why_not)
        amx_prompt_rows = False

    if dtype != torch.float32:
        if args.attention_backend == "cpu":
            raise ValueError("--attention-backend cpu computes in float32 only")
        return TorchPagedAttention("cpu")
    try:
        return CpuPagedAttention(amx_prompt_rows=amx_prompt_rows)
    except KernelUnavailable as exc:
        if args.attention_backend == "cpu":
            raise
        log.warning("C paged attention unavailable (%s); using the torch backend", exc)
        return TorchPagedAttention("cpu")


def make_mtp_head(args: ServerArgs, loaded: LoadedModel, model: LlamaModel | HybridModel
                  ) -> tuple[MTPHead | None, str]:
    """`--spec-type draft-mtp`: the model's MTP head and its part of the identity (a digest of
    its weights); a ValueError (one log line, exit code 2) where the model has none."""
    if args.spec_type != "draft-mtp":
        return None, ""
    if args.spec_draft_n_max == 0:
        log.info("--spec-type draft-mtp: the MTP head is not used, --spec-draft-n-max is 0")
        return None, ""
    if not isinstance(model, HybridModel) or not has_mtp_weights(loaded.config, loaded.weights):
        raise ValueError(f"--spec-type draft-mtp: {loaded.name} has no multi-token-prediction "
                         "head (Qwen3.5 checkpoints with mtp.* weights, or qwen35 GGUF files "
                         "with nextn blocks, have one): use ngram-simple or --model-draft")
    digest = hashlib.sha256()
    for name in sorted(n for n in loaded.weights if n.startswith("mtp.")):
        digest.update(loaded.weights[name].detach().float().cpu()[:64].numpy().tobytes())
    log.info("MTP head: %d block after the model's %d layers drafts (--spec-type draft-mtp)",
             loaded.config.num_mtp_layers, loaded.config.num_layers)
    return MTPHead(model, loaded.weights), f"mtp|{digest.hexdigest()}"


def pick_num_pages(args: ServerArgs, config: ModelConfig, num_layers: int, dtype: torch.dtype,
                   device: torch.device, reserved_bytes: int = 0) -> int:
    """-c in pages; on CUDA without -c, what the free memory allows once `reserved_bytes` (a
    hybrid model's state slots) are set aside (a page holds `num_layers` layers: the target's
    attention layers and a draft model's)."""
    page_bytes = (num_layers * 2 * args.page_size * config.num_kv_heads * config.head_dim
                  * torch.empty((), dtype=dtype).element_size())
    if args.ctx_size is not None:
        return max(1, args.ctx_size // args.page_size)
    if device.type != "cuda":
        return CPU_DEFAULT_CTX // args.page_size
    free, _ = torch.cuda.mem_get_info(device)
    usable = (free * args.gpu_memory_fraction - ACTIVATION_RESERVE_BYTES
              - FLASHINFER_RESERVE_BYTES - reserved_bytes)
    return max(1, int(usable // page_bytes))


def make_model(args: ServerArgs, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
               blocks: dict[str, QuantizedWeight] | None) -> LlamaModel | HybridModel:
    """The model over loaded weights, its linears as the flags say (the target and a draft)."""
    if loaded.config.is_hybrid:
        return HybridModel(loaded.config, loaded.weights,
                           batch_invariant=args.batch_invariant and device.type == "cpu",
                           weight_format=pick_weight_format(args, device, dtype),
                           quantized=blocks)
    return LlamaModel(loaded.config, loaded.weights,
                      batch_invariant=args.batch_invariant and device.type == "cpu",
                      weight_format=pick_weight_format(args, device, dtype), quantized=blocks)
