"""Chunked and vocab-parallel linear cross-entropy that never materialises [B, S, V] logits.

``linear_cross_entropy`` (functional) and ``LinearCrossEntropy`` (module) compute
``F.cross_entropy(lm_head(hidden).float(), target)`` with optional label smoothing, z-loss and logit
softcap, over token chunks and, under tensor parallelism, over vocabulary shards. See docs/loss.md.
"""

from lightning_memplan.loss.chunked import STAT_FIELDS, ChunkedLinearCrossEntropyFunction, ChunkPlan
from lightning_memplan.loss.functional import TORCH_BACKEND_DEVICES, linear_cross_entropy
from lightning_memplan.loss.metrics import CrossEntropyMetricAggregator, LossMetrics
from lightning_memplan.loss.module import LinearCrossEntropy
from lightning_memplan.loss.options import (
    AUTO_CHUNK_BUDGET_BYTES,
    BACKENDS,
    MODES,
    REDUCTIONS,
    LossOptions,
    auto_chunk_size,
    chunk_row_bytes,
)

__all__ = [
    "AUTO_CHUNK_BUDGET_BYTES",
    "BACKENDS",
    "MODES",
    "REDUCTIONS",
    "STAT_FIELDS",
    "TORCH_BACKEND_DEVICES",
    "ChunkPlan",
    "ChunkedLinearCrossEntropyFunction",
    "CrossEntropyMetricAggregator",
    "LinearCrossEntropy",
    "LossMetrics",
    "LossOptions",
    "auto_chunk_size",
    "chunk_row_bytes",
    "linear_cross_entropy",
]
