"""Published architectures as :class:`~lightning_memplan.model.specs.ModelSpec` presets, each with its source.

The presets are field dicts (``ModelSpec.preset(name)`` builds the spec from one): this module imports no
spec, so ``specs`` -> ``presets`` is one-way.
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = ["MODEL_PRESETS", "PRESET_SOURCES", "preset_fields"]


def _gpt2(name: str, layers: int, hidden: int, heads: int) -> dict[str, Any]:
    # Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", Table 2; Hugging Face
    # gpt2* config.json: V=50257, learned positions n_positions=1024, GELU MLP 4h, LayerNorm, biases,
    # lm_head tied to wte.
    return dict(
        n_layers=layers, hidden=hidden, n_heads=heads, vocab_size=50257,
        ffn_kind="gelu", norm="layernorm", bias=True, tied_embeddings=True,
        position_embedding="learned", max_positions=1024, name=name,
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int) -> dict[str, Any]:
    return dict(
        n_layers=layers, hidden=hidden, n_heads=heads, vocab_size=vocab,
        n_kv_heads=kv, ffn_hidden=ffn, ffn_kind="swiglu", norm="rmsnorm", bias=False,
        tied_embeddings=False, position_embedding="rope", name=name,
    )


#: Preset name -> ``ModelSpec`` keyword arguments.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": _gpt2("gpt2", 12, 768, 12),
    "gpt2-medium": _gpt2("gpt2-medium", 24, 1024, 16),
    "gpt2-large": _gpt2("gpt2-large", 36, 1280, 20),
    "gpt2-xl": _gpt2("gpt2-xl", 48, 1600, 25),
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 8, 28672, 32000),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    "gpt3-175b": dict(
        n_layers=96, hidden=12288, n_heads=96, vocab_size=50257,
        ffn_kind="gelu", norm="layernorm", bias=True, tied_embeddings=True,
        position_embedding="learned", max_positions=2048, name="gpt3-175b",
    ),
}

PRESET_SOURCES: dict[str, str] = {
    "gpt2": "Radford et al. 2019, Table 2 (117M row); HF gpt2/config.json",
    "gpt2-medium": "Radford et al. 2019, Table 2 (345M row); HF gpt2-medium/config.json",
    "gpt2-large": "Radford et al. 2019, Table 2 (762M row); HF gpt2-large/config.json",
    "gpt2-xl": "Radford et al. 2019, Table 2 (1542M row); HF gpt2-xl/config.json",
    "llama-7b": "Touvron et al. 2023 (arXiv 2302.13971) Table 2; HF llama-7b config: ffn 11008",
    "llama-13b": "Touvron et al. 2023 (arXiv 2302.13971) Table 2; HF llama-13b config: ffn 13824",
    "llama-70b": "Touvron et al. 2023b (Llama 2, arXiv 2307.09288) Table 1 (GQA, 8 kv heads); ffn 28672",
    "llama3-8b": "Llama 3 Herd of Models (arXiv 2407.21783) Table 3: 32 layers, 4096, 32 heads, 8 kv, ffn 14336, V 128256",
    "llama3-70b": "Llama 3 Herd of Models (arXiv 2407.21783) Table 3: 80 layers, 8192, 64 heads, 8 kv, ffn 28672",
    "llama3-405b": "Llama 3 Herd of Models (arXiv 2407.21783) Table 3: 126 layers, 16384, 128 heads, 8 kv, ffn 53248",
    "gpt3-175b": "Brown et al. 2020 (arXiv 2005.14165) Table 2.1: 96 layers, d_model 12288, 96 heads, n_ctx 2048",
}


def preset_fields(name: str) -> dict[str, Any]:
    """The ``ModelSpec`` fields of the preset ``name`` (case-insensitive; ``_`` and ``-`` are
    interchangeable); a copy, ``ModelSpec(**preset_fields(name))``.

    Raises:
        ValueError: unknown name, listing the known ones and the closest match.
    """
    if not isinstance(name, str):
        raise TypeError(f"name={name!r} must be a preset name string such as 'llama3-8b'")
    key = name.strip().lower().replace("_", "-")
    if key in MODEL_PRESETS:
        return dict(MODEL_PRESETS[key])
    close = difflib.get_close_matches(key, MODEL_PRESETS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"model preset {name!r} is unknown{hint}; known presets: {', '.join(MODEL_PRESETS)}")
