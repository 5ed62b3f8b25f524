"""What one pipeline rank holds: its blocks, embedding and head (:class:`StageLayout`), and their
parameter counts after tensor parallelism (:class:`StageParams`), the FSDP units among them and each
interleaved chunk's share.

Part of the estimate's first stage (``docs/architecture.md``, "The estimate's stages"): computed once per
stage and handed to the later stages as numbers. Symbols as in docs/concepts.md (L blocks, p pipeline
ranks, v chunks per rank, t tensor-parallel ranks, h hidden, V vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from lightning_memplan.model import experts, frameworks, param_counts, terms
from lightning_memplan.model.specs import ModelSpec, ParallelPlan

__all__ = [
    "StageLayout",
    "StageParams",
    "blocks_matmul_local",
    "chunk_shares",
    "fsdp_units",
    "own_unit_params",
    "rescaled",
    "routed_experts_local",
    "stage_layout",
    "stage_params",
]


@dataclass(frozen=True)
class StageLayout:
    """What one pipeline rank holds: ``n_layers`` blocks, and whether it has the embedding/head."""

    stage: int
    n_layers: int
    has_embedding: bool
    has_head: bool


def stage_layout(model: ModelSpec, plan: ParallelPlan, stage: int, framework: str = "torch") -> StageLayout:
    """Split L blocks over p stages (v chunks each when interleaved) as ``framework`` does
    (:func:`lightning_memplan.model.frameworks.rank_block_counts`: the first ``L mod (p v)`` chunks take
    one extra block; Llama 3's stack counts the embedding and the output layer as a block each). Stage 0
    holds the embedding, stage p-1 the final norm and lm_head (and, with tied embeddings and p > 1, its
    own copy of V*h)."""
    return _stage_layout(model.n_layers, plan.pp, plan.virtual_stages if plan.schedule == "interleaved" else 1, stage,
                         framework)


@functools.lru_cache(maxsize=4096)  # keyed by what the split depends on, not by the whole plan
def _stage_layout(n_layers: int, p: int, v: int, stage: int, framework: str) -> StageLayout:
    layers = frameworks.rank_block_counts(n_layers, p, v, framework)[stage] if p > 1 else n_layers
    return StageLayout(stage=stage, n_layers=layers, has_embedding=stage == 0, has_head=stage == p - 1)


@dataclass(frozen=True)
class StageParams:
    """Parameters one rank holds before ZeRO sharding (``local``), its matmul weights (``matmul``) and its
    largest tensor (``largest``), after tensor parallelism."""

    local: int
    matmul: int
    largest: int


def rescaled(model: ModelSpec, count: int) -> int:
    """``count`` rescaled as a stage's parameters are when ``model.n_params`` is explicit (the
    shape-derived count scaled to it); ``count`` itself otherwise."""
    if model.n_params is None:
        return count
    return round(count * model.n_params / terms.param_count(model))


def _block_kinds(model: ModelSpec, n_layers: int) -> tuple[tuple[int, bool | None], ...]:
    """``(blocks, moe)`` per block kind among ``n_layers`` blocks of the stack: one kind for a dense
    model; for an MoE stack its MoE and dense blocks, a stage taking its share of MoE blocks
    (``round(L_moe * n / L)``: exact for the whole stack)."""
    if not experts.is_moe(model):
        return ((n_layers, None),)
    n_moe = round(experts.moe_layer_count(model) * n_layers / model.n_layers)
    return ((n_moe, True), (n_layers - n_moe, False))


def blocks_matmul_local(model: ModelSpec, t: int, n_layers: int) -> int:
    """Matmul weights of ``n_layers`` blocks on one tensor-parallel rank (experts split by t)."""
    return sum(n * math.ceil(terms.layer_matmul_param_count(model, moe=moe) / t) for n, moe in _block_kinds(model, n_layers))


def routed_experts_local(model: ModelSpec, t: int, n_layers: int) -> int:
    """Routed expert weights of ``n_layers`` blocks on one tensor-parallel rank (experts split by t)."""
    per_block = param_counts.routed_expert_param_count(model)
    return sum(n * math.ceil(per_block / t) for n, moe in _block_kinds(model, n_layers) if moe)


@functools.lru_cache(maxsize=4096)  # keyed by what the count depends on, not by the whole plan
def stage_params(model: ModelSpec, t: int, pipelined: bool, layout: StageLayout) -> StageParams:
    """The :class:`StageParams` of ``layout`` on one of ``t`` tensor-parallel ranks.

    TP splits matmul weights, biases, the vocab-parallel embedding and the lm_head by t; norms are
    replicated. With an explicit ``n_params`` the shape-derived count is rescaled to it. ``pipelined``:
    the last stage of a pipeline holds its own lm_head even with tied embeddings."""
    h, v = model.hidden, model.vocab_size
    norm = terms.norm_param_count(model)
    norms = 2 * norm
    params = matmul = 0
    for n_blocks, moe in _block_kinds(model, layout.n_layers):
        layer_matmul = terms.layer_matmul_param_count(model, moe=moe)
        layer_other = terms.layer_param_count(model, moe=moe) - layer_matmul
        per_layer = math.ceil(layer_matmul / t) + math.ceil((layer_other - norms) / t) + norms
        params += n_blocks * per_layer
        matmul += n_blocks * math.ceil(layer_matmul / t)
    largest = max(h * model.ffn, h * model.n_heads * model.dim_head) // t
    if experts.is_moe(model):  # transformers 5.3 keeps each block's experts as one [E, 2 f_e, h] gate_up_proj
        largest = max(largest, model.n_experts * 2 * model.expert_ffn * h // t)
    if layout.has_embedding:
        params += math.ceil(terms.embedding_param_count(model) / t)
        largest = max(largest, math.ceil(v * h / t))
    if layout.has_head:
        head_matrix = math.ceil(v * h / t)
        needs_own_head = not model.tied_embeddings or (pipelined and not layout.has_embedding)
        params += norm + (head_matrix if needs_own_head else 0)
        matmul += head_matrix
        largest = max(largest, head_matrix)
    if model.n_params is not None:
        scale = model.n_params / terms.param_count(model)
        params, matmul, largest = round(params * scale), round(matmul * scale), round(largest * scale)
    return StageParams(params, matmul, largest)


def fsdp_units(model: ModelSpec, t: int, pipelined: bool, layout: StageLayout, local: int) -> tuple[int, int]:
    """(parameters of the largest FSDP block unit, parameters of the root unit: embedding, final norm,
    lm_head) on one rank before sharding. One block is all-gathered at a time (plus the prefetched
    next one); for an MoE stack the largest block is an MoE block, every expert gathered (no expert
    parallelism yet). With an explicit ``n_params`` the block is rescaled as ``local`` is, so the root is
    what the stage holds besides its blocks, never the rest of a rescaled count (a dense
    reading of Mixtral rescaled to 46.7B put 222 GiB in the root)."""
    unit = math.ceil(terms.layer_param_count(model) / t)
    if not experts.is_moe(model) and model.n_params is None:
        return unit, local - layout.n_layers * unit
    blocks = stage_params(model, t, pipelined, dataclasses.replace(layout, has_embedding=False, has_head=False)).local
    if model.n_params is not None:  # stage_params rescaled the blocks already
        unit = round(unit * model.n_params / terms.param_count(model))
    return unit, max(0, local - blocks)


def own_unit_params(model: ModelSpec, plan: ParallelPlan, layout: StageLayout) -> tuple[int, int]:
    """(embedding, lm_head) parameters on one rank that are FSDP2 units of their own
    (``ParallelPlan.own_units``), not in the root unit: ``ceil(V h / t)`` each where the stage holds that
    part and it is untied (a tied matrix is one parameter, which ``memplan_auto`` keeps in the root),
    rescaled as the stage's parameters are when ``n_params`` is explicit; ``(0, 0)`` otherwise."""
    if model.tied_embeddings or not plan.own_units:
        return 0, 0
    matrix = rescaled(model, math.ceil(model.vocab_size * model.hidden / plan.tp))
    emb = matrix if "embedding" in plan.own_units and layout.has_embedding else 0
    head = matrix if "head" in plan.own_units and layout.has_head else 0
    return emb, head


def chunk_shares(
    model: ModelSpec, plan: ParallelPlan, layout: StageLayout, framework: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each local chunk's share of the stage's block activations (its blocks) and of its gradients (its
    parameters: blocks, the embedding on rank 0's first chunk, the final norm and lm_head on the last
    rank's last chunk). One chunk unless interleaved."""
    return _chunk_shares_of(model, plan.tp, plan.pp, plan.virtual_stages if plan.schedule == "interleaved" else 1,
                            layout, framework)


@functools.lru_cache(maxsize=4096)  # keyed by what the shares depend on, not by the batch shape or the whole plan
def _chunk_shares_of(
    model: ModelSpec, t: int, p: int, v: int, layout: StageLayout, framework: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    counts = frameworks.stage_block_counts(model.n_layers, p * v, framework)
    blocks = [counts[layout.stage + c * p] for c in range(v)] if v > 1 else [layout.n_layers]
    local = stage_params(model, t, p > 1, layout).local
    emb = stage_params(model, t, p > 1, dataclasses.replace(layout, has_head=False, n_layers=0)).local if layout.has_embedding else 0
    head = stage_params(model, t, p > 1, dataclasses.replace(layout, has_embedding=False, n_layers=0)).local if layout.has_head else 0
    per_block = (local - emb - head) / max(layout.n_layers, 1)
    params = [n * per_block for n in blocks]
    params[0] += emb
    params[-1] += head
    total_blocks, total_params = max(sum(blocks), 1), max(sum(params), 1.0)
    return tuple(n / total_blocks for n in blocks), tuple(x / total_params for x in params)
