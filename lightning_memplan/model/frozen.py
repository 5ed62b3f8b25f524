"""Frozen parts of a model without an adapter: which blocks, embedding and head have ``requires_grad=False``,
and what that removes from a training step.

Fine-tuning with a frozen backbone (``p.requires_grad_(False)`` on the embedding and the first blocks, the
top blocks and the head trained) changes three things autograd does [PT autograd]:

1. **Saved activations.** An operation records a graph node, and saves its inputs for backward, only when
   one of its inputs requires a gradient (torch 2.13 docs, "Autograd mechanics: Locally disabling gradient
   computation ... requires_grad"). With the embedding frozen, no tensor in the first frozen blocks
   requires a gradient, so *the blocks before the first trainable parameter save nothing*; the first
   trainable block and everything after it save as usual. (Frozen blocks after a trainable part still
   pass input gradients back: they save what those need, which this model counts as a whole block: an
   upper bound.)
2. **Gradients** exist only for trainable parameters: the head's gradient is the head's own count (all or
   nothing), not the model-wide trainable share, and a frozen embedding has none.
3. **Optimizer states and master copies** exist only for trainable parameters (``n_trainable_params``).

The layout is three :class:`~lightning_memplan.model.specs.ModelSpec` fields, read from a live module by
:func:`frozen_fields`: ``frozen_layers`` (leading blocks whose parameters are all frozen),
``frozen_embedding`` and ``frozen_head``. Their defaults (0, False, False) mean nothing frozen, and then
every function here returns what the estimate used before, so spec-built estimates do not move.
Within a pipeline (p > 1) only the first stage drops the prefix's blocks; a later stage the prefix reaches
into is counted as saving in all its blocks (an upper bound).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_memplan.model import param_counts

if TYPE_CHECKING:
    from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "frozen_fields",
    "frozen_layout",
    "grad_params",
    "no_grad_prefix",
    "saving_layers",
]


def frozen_layout(model: ModelSpec) -> bool:
    """Whether ``model`` describes frozen parts by layout (any of the three fields set); otherwise frozen
    parameters, if any (peft LoRA's base weights), are spread evenly (``trainable_fraction``)."""
    return bool(model.frozen_layers or model.frozen_embedding or model.frozen_head)


def no_grad_prefix(model: ModelSpec) -> int:
    """Leading blocks no gradient reaches: ``frozen_layers`` when the embedding is frozen too (nothing
    before them requires a gradient), else 0."""
    return model.frozen_layers if model.frozen_embedding else 0


def saving_layers(model: ModelSpec, n_layers: int, *, first_stage: bool) -> int:
    """How many of a stage's ``n_layers`` blocks save activations for backward: all but the
    :func:`no_grad_prefix` on the first (or only) stage; a later pipeline stage saves in all its
    blocks (an upper bound when the prefix reaches into it; see the module docstring)."""
    prefix = no_grad_prefix(model)
    if not prefix or not first_stage:  # later pipeline stages: their share of the prefix counted as saving
        return n_layers
    return max(0, n_layers - prefix)


def _block_share(model: ModelSpec) -> float:
    """Share of the parameters of the blocks after the :attr:`frozen_layers` that train, under a frozen
    layout: what trains outside the embedding and the head, over those blocks' parameters (1.0 for a frozen
    backbone whose top blocks train whole; small when adapters inside the blocks are all that trains)."""
    shape_n = param_counts.param_count(model)
    scale = model.num_params / shape_n if shape_n else 1.0  # as the estimate rescales shape counts to N
    emb = param_counts.embedding_param_count(model) * scale
    head = param_counts.head_param_count(model) * scale
    trainable = model.num_params if model.n_trainable_params is None else model.n_trainable_params
    in_blocks = trainable - (0 if model.frozen_embedding else emb) - (0 if model.frozen_head else head)
    blocks = (model.n_layers - model.frozen_layers) * param_counts.layer_param_count(model) * scale
    return min(1.0, max(0.0, in_blocks / blocks)) if blocks > 0 else 0.0


def grad_params(model: ModelSpec, count: int, part: str) -> int:
    """Parameters of ``part`` (``"head"``: final norm and lm_head, ``"embedding"``, ``"last_block"``) that
    get a gradient, out of its ``count``. Under a frozen layout: none of a frozen part, all of a trainable
    head or embedding, the trainable share of the blocks after the frozen ones for the last block
    (:func:`_block_share`). Otherwise the model-wide trainable share (peft's frozen base weights,
    ``round(count * n_trainable / N)``), or all when everything trains."""
    if part not in ("head", "embedding", "last_block"):
        raise ValueError(f"part={part!r} must be 'head', 'embedding' or 'last_block'")
    if frozen_layout(model):
        if part == "last_block":
            return 0 if model.frozen_layers >= model.n_layers else round(count * _block_share(model))
        return 0 if (model.frozen_head if part == "head" else model.frozen_embedding) else count
    if model.n_trainable_params is not None:
        return round(count * model.trainable_fraction)
    return count


# ------------------------------------------------------------------------------------ reading a module
def _all_frozen(params: list[Any]) -> bool:
    return bool(params) and not any(p.requires_grad for p in params)


def frozen_fields(module: Any, blocks: Any, embeddings: list[Any], head: Any) -> dict[str, Any]:
    """The frozen-layout fields of a live module (``{}`` when nothing is frozen by layout): ``blocks`` its
    repeated blocks (an ``nn.ModuleList``), ``embeddings`` its ``nn.Embedding`` tables outside them, ``head``
    its output layer (``None``: none found). The head's parameters are every parameter outside the blocks and
    the embeddings (final norm, lm_head) plus the head's weight even when it is the embedding's (tied)."""
    if blocks is None or not len(blocks):
        return {}
    in_blocks = {id(p) for p in blocks.parameters()}
    emb_params = [p for e in embeddings for p in e.parameters() if id(p) not in in_blocks]
    emb_ids = {id(p) for p in emb_params}
    head_params = [p for p in module.parameters() if id(p) not in in_blocks and id(p) not in emb_ids]
    head_weight = getattr(head, "weight", None)
    if head_weight is not None and id(head_weight) in emb_ids:
        head_params.append(head_weight)
    layers = 0
    for block in blocks:
        if not _all_frozen(list(block.parameters())):
            break
        layers += 1
    fields = {"frozen_layers": layers, "frozen_embedding": _all_frozen(emb_params),
              "frozen_head": _all_frozen(head_params)}
    return fields if any(fields.values()) else {}
