"""The longest sequence a model can be trained on: a learned absolute position table has one row per position
(GPT-2's ``wpe`` holds ``n_positions = 1024``, ``transformers/models/gpt2/modeling_gpt2.py``; BERT's
``position_embeddings`` ``max_position_embeddings = 512``), so a longer sequence indexes past its end and the
real step fails; an estimate for it is a number for a run that cannot happen. Rotary embeddings (RoPE,
Su et al. 2021, arXiv:2104.09864, section 3.4) compute each position's rotation, so ``max_position_embeddings``
of a RoPE config is what the model was trained on, not a hard limit: it binds nothing here.

``estimate_memory`` warns (:func:`warn_learned_positions`: the estimate is still the tensors' bytes at that
shape, e.g. for a table about to be extended); the command line refuses (``--seq-len``).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["learned_positions_blocker", "warn_learned_positions"]


def learned_positions_blocker(model: Any, seq_len: int) -> str | None:
    """Why ``seq_len`` cannot run on ``model`` (a :class:`~lightning_memplan.model.specs.ModelSpec`): longer
    than its learned position table; ``None`` when it can (any length for RoPE or no position embedding)."""
    limit = getattr(model, "max_positions", None)
    if getattr(model, "position_embedding", None) != "learned" or limit is None or seq_len <= limit:
        return None
    name = getattr(model, "name", None) or "the model"
    return (f"seq_len={seq_len} exceeds the {limit:,d} learned positions of {name} (position_embedding='learned', "
            f"max_positions={limit}): positions past the table do not exist; use seq_len <= {limit}")


def warn_learned_positions(model: Any, seq_len: int) -> None:
    """A ``UserWarning`` naming the limit when ``seq_len`` is longer than ``model``'s learned position table
    (:func:`learned_positions_blocker`); nothing otherwise."""
    blocker = learned_positions_blocker(model, seq_len)
    if blocker is not None:
        warnings.warn(f"{blocker} (the estimate is for a step that cannot run as the model stands)", UserWarning,
                      stacklevel=3)
