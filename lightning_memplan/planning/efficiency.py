"""How fast one rank runs a transformer block: GEMMs at a shape- and generation-dependent fraction of
peak, the attention kernel at its own fraction, and the element-wise kernels at memory bandwidth.

``t_token(layer) = F_gemm / (peak * e_gemm(M, N)) + c F_attn / (peak * e_attn) + B_elem / (eff * HBM)``

per token, divided by the tensor-parallel size (every term is split by t). ``F_gemm`` and ``F_attn``
come from :mod:`.flops`; ``c`` is the share of the score square a kernel computes (1/2 for a causal
fused kernel, 1 for Megatron 2021's masked eager softmax, which multiplies the full square).

Sources:
  [NV-GEMM] NVIDIA, "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/
            performance/dl-performance-matrix-multiplication): tile and wave quantization; GEMMs
            with dimensions below a few multiples of the 128 x 128/256 tile run far from peak, large
            ones approach the tensor-core peak.
  [FA2]     Dao 2023, "FlashAttention-2", arXiv 2307.08691, section 4: forward + backward 50-70 % of
            A100 peak (up to 73 % forward), counting the causal half only.
  [FA3]     Shah et al. 2024, "FlashAttention-3", arXiv 2407.08608, section 1: FlashAttention-2
            "achieves only 35 % utilization on H100" (the kernel PyTorch's SDPA ran on H100 in 2024).
  [TT-H100] torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` Table 1: Llama 3.1 8B, FSDP 8,
            5,762 tokens/s/GPU eager, 6,667 with torch.compile (+16 %: compile fuses the element-wise
            kernels; what it removes bounds their share of the eager step from below).
  [TT-A100] torchtitan ``docs/performance.md``, Llama 3 on 64 A100 80GB: 8B 2,973 tokens/s (58.2 % MFU,
            selective-op AC), 70B 331 (51.7 %, full AC).
  [N21]     Narayanan et al. 2021, arXiv 2104.04473, Table 1: 137-163 TFLOP/s per A100 (44-52 %),
            rising with the hidden size (larger GEMMs).
  [L3]      Dubey et al. 2024 (Llama 3), arXiv 2407.21783, Table 4: 38-43 % BF16 MFU on H100 at
            TP 8 x PP 16 (bubble, exposed communication included).

Calibration: ``GEMM_PEAK_FRACTION`` and ``ELEMENTWISE_BYTES_*`` were set once against the rows of
``benchmarks/planner_vs_published.py`` (they reproduce the published figures within 15 %); the
per-kernel figures of [FA2]/[FA3] are used as published.
"""

from __future__ import annotations

from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "ATTENTION_HALF_LENGTH",
    "ATTENTION_PEAK_FRACTION",
    "ELEMENTWISE_BYTES_PER_FFN",
    "ELEMENTWISE_BYTES_PER_HIDDEN",
    "EAGER_SCORE_BYTES",
    "GEMM_PEAK_FRACTION",
    "GEMM_TILE",
    "MEMORY_BW_EFFICIENCY",
    "attention_efficiency",
    "elementwise_bytes_per_token",
    "gemm_efficiency",
    "generation",
]

#: Fraction of the dense 16-bit peak a large cuBLAS GEMM sustains, per GPU generation [NV-GEMM];
#: Hopper's is lower than Ampere's: its peak assumes the 700 W boost clock that GEMMs throttle from,
#: and the tensor cores outrun what non-warp-specialised kernels feed them ([FA3] section 1).
#: Calibrated on [TT-A100], [N21] (Ampere) and [TT-H100], [L3] (Hopper).
GEMM_PEAK_FRACTION: dict[str, float] = {"volta": 0.75, "ampere": 0.80, "hopper": 0.70, "blackwell": 0.70, "other": 0.70}
#: Tile edge (elements) of the GEMM kernels: efficiency ``1 / (1 + T/M + T/N)`` falls as a dimension
#: (tokens per rank M, the smaller output width N after the tensor-parallel split) nears it [NV-GEMM].
GEMM_TILE = 128
#: Fraction of peak the fused attention kernel reaches forward + backward: FlashAttention-2 on A100
#: [FA2], on H100 [FA3]; eager attention (score matmuls) is priced as a GEMM instead.
ATTENTION_PEAK_FRACTION: dict[str, float] = {"volta": 0.40, "ampere": 0.60, "hopper": 0.35, "blackwell": 0.35, "other": 0.40}
#: Key length at which the fused kernel runs at half its long-sequence rate: [FA2] Figure 4 (A100,
#: head dim 128, causal, forward + backward) rises from ~110 TFLOP/s at 512 keys to ~190 at 16K, i.e.
#: ``1 / (1 + L0 / L)`` with L0 ~ 400-500 tokens (fewer blocks per kernel, the tail wave idle).
ATTENTION_HALF_LENGTH = 448
#: Fraction of rated device-memory bandwidth streaming kernels (element-wise ops, the optimizer step)
#: achieve (STREAM-like copy kernels reach 80-90 %).
MEMORY_BW_EFFICIENCY = 0.8
#: Device-memory bytes the eager element-wise kernels of one block move per token per hidden unit,
#: forward + backward: two RMS/LayerNorms computed in fp32 (~32 B per element each), rotary
#: embedding on q and k, residual adds in fp32, autocast casts of the matmul inputs and the attention
#: output copy, about 125 B forward, twice that backward. Calibrated with [TT-H100]'s compile gain.
ELEMENTWISE_BYTES_PER_HIDDEN = 375.0
#: The same per FFN unit: the activation (SiLU/GELU) and the gate product, ~10 B forward, x3 in all.
ELEMENTWISE_BYTES_PER_FFN = 30.0
#: Bytes per score element per head per token of an eager (non-fused) attention, forward + backward:
#: the 16-bit scores written, the softmax reading them and writing the probabilities, and the backward
#: reading both and writing two gradients (Megatron's fused masked softmax, [N21]).
EAGER_SCORE_BYTES = 12.0

_GENERATIONS: tuple[tuple[str, str], ...] = (
    ("b200", "blackwell"), ("gb200", "blackwell"), ("h100", "hopper"), ("h200", "hopper"), ("gh200", "hopper"),
    ("h800", "hopper"), ("a100", "ampere"), ("a800", "ampere"), ("a10", "ampere"), ("v100", "volta"),
)


def generation(hardware: HardwareSpec) -> str:
    """GPU generation from the hardware name (``"h100-sxm"`` -> ``"hopper"``); ``"other"`` if unknown."""
    name = hardware.name.lower()
    for needle, gen in _GENERATIONS:
        if needle in name:
            return gen
    return "other"


def gemm_efficiency(hardware: HardwareSpec, tokens: float, width: float) -> float:
    """Fraction of peak of a GEMM with ``tokens`` rows and an output ``width`` (after the TP split):
    ``GEMM_PEAK_FRACTION[gen] / (1 + T / tokens + T / width)`` [NV-GEMM]."""
    peak = GEMM_PEAK_FRACTION[generation(hardware)]
    return peak / (1.0 + GEMM_TILE / max(tokens, 1.0) + GEMM_TILE / max(width, 1.0))


def attention_efficiency(hardware: HardwareSpec, kv_len: float | None = None) -> float:
    """Fraction of peak of the fused attention kernel, forward + backward [FA2, FA3], for key blocks of
    ``kv_len`` tokens (a context-parallel ring step sees ``s / c``): ``peak / (1 + L0 / kv_len)``."""
    peak = ATTENTION_PEAK_FRACTION[generation(hardware)]
    return peak if kv_len is None else peak / (1.0 + ATTENTION_HALF_LENGTH / max(kv_len, 1.0))


def elementwise_bytes_per_token(model: ModelSpec, seq_len: int, *, eager_attention: bool) -> float:
    """Device-memory bytes of one block's element-wise kernels per token, forward + backward (before
    the TP split): ``375 h + 30 f`` (+ ``12 a s`` for eager attention's scores)."""
    out = ELEMENTWISE_BYTES_PER_HIDDEN * model.hidden + ELEMENTWISE_BYTES_PER_FFN * model.ffn
    if eager_attention:
        out += EAGER_SCORE_BYTES * model.n_heads * seq_len
    return out
