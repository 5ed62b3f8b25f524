"""The depth-reduced copy of a Hugging Face model that the config-only path traces.

From a config dict (``ModelSpec.hf_config``, parsed), :func:`build_reduced` builds the real model
class (:func:`model_class`) with ``depth`` blocks on the meta device, in fp32, with the attention
kernel and gradient checkpointing of the traced step; :func:`input_fn_for` says what batch its
``forward`` takes. Nothing here traces or caches (``tracking/hf_calibrate.py``, ``tracking/hf_cache.py``).

Depth reduction: every depth key (``num_hidden_layers`` / ``n_layer`` / ``num_layers``, and a
seq2seq model's decoder and encoder counts) is set to ``depth`` and every per-layer list in the config
(``layer_types``, per-layer windows ...) truncated alike, so one block of the copy is one block of the
full model. Configs whose blocks differ (dense first layers, experts every k-th layer) raise: a
depth-1/depth-2 pair cannot represent them.

Construction cost: under ``torch.device("meta")`` no storage is allocated and every parameter
initialiser (``nn.init.*``, the model's ``_init_weights``) runs on meta tensors, which is a no-op
kernel per parameter, so a 128256 x 8192 embedding costs what a 64 x 32 one does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FULL_BUILD_LAYERS",
    "PREFIX_LAYERS",
    "VOLATILE_KEYS",
    "LayerPlan",
    "build_reduced",
    "build_stack",
    "full_model",
    "layer_plan",
    "canonical_config_json",
    "input_fn_for",
    "model_class",
    "vision_tokens",
    "deep_stack_check",
    "depth_of",
]

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_DECODER_LAYER_KEYS = ("num_decoder_layers", "decoder_layers")
_ENCODER_LAYER_KEYS = ("encoder_layers",)
#: Keys that describe a run, not the architecture: left out of the cache key and of the rebuilt config.
VOLATILE_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_commit_hash")
# Non-uniform layer stacks a depth-1/depth-2 pair cannot represent.
_NON_UNIFORM = ("first_k_dense_replace", "moe_layer_freq", "mlp_only_layers")
_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModelForImageClassification",
)


def canonical_config_json(config: Mapping[str, Any]) -> str:
    """The config as sorted, compact JSON without run-specific keys (the cache key's config part)."""
    clean = {k: v for k, v in config.items() if k not in VOLATILE_KEYS}
    return json.dumps(clean, sort_keys=True, separators=(",", ":"), default=str)


def _depth_of(cfg: Mapping[str, Any]) -> tuple[str, int]:
    for key in _LAYER_KEYS:
        if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
            return key, int(cfg[key])
    raise ValueError(
        f"config (model_type={cfg.get('model_type')!r}) has none of {_LAYER_KEYS}, so its depth is unknown; "
        "pass a config with num_hidden_layers or build ModelSpec(...) directly"
    )


def depth_of(cfg: Mapping[str, Any]) -> int | None:
    """The config's number of blocks (its first depth key), or ``None`` when it names none."""
    try:
        return _depth_of(cfg)[1]
    except ValueError:
        return None


def non_uniform_reason(cfg: Mapping[str, Any]) -> str | None:
    """Why a depth-1/depth-2 trace cannot be scaled to ``cfg``'s full depth (its blocks are not all
    alike: DeepSeek's ``first_k_dense_replace``, Qwen's ``decoder_sparse_step``/``mlp_only_layers``),
    or ``None``. ``ModelSpec.from_hf_config`` then uses the analytic terms where they count each block
    kind (the mixture-of-experts families of ``model/hf_experts.py``)."""
    model_type = cfg.get("model_type")
    for name in _NON_UNIFORM:
        value = cfg.get(name)
        if value not in (None, 0, 1, [], ()):
            return (
                f"{model_type!r} config has {name}={value!r}: its layers are not all alike, so a depth-1/depth-2 "
                "trace cannot be scaled to the full depth; trace the model itself with trace_memory(model, "
                "batch_shape=(b, s)) or pass ModelSpec(..., n_params=...)"
            )
    if cfg.get("decoder_sparse_step") not in (None, 1):
        return (
            f"{model_type!r} config has decoder_sparse_step={cfg['decoder_sparse_step']!r} (experts only every "
            "k-th layer): not uniform; trace the model itself with trace_memory(model, batch_shape=(b, s))"
        )
    return None


def _reduced_config(cfg: Mapping[str, Any], depth: int) -> dict[str, Any]:
    """``cfg`` with ``depth`` blocks: the depth keys set and every per-layer list truncated alike."""
    key, full = _depth_of(cfg)
    out = dict(cfg)
    model_type = cfg.get("model_type")
    reason = non_uniform_reason(cfg)
    if reason is not None:
        raise ValueError(reason)
    decoder = [k for k in _DECODER_LAYER_KEYS if isinstance(cfg.get(k), int)]
    for k in decoder:
        if cfg[k] != full:
            raise ValueError(
                f"{model_type!r} config has {key}={full!r} encoder blocks but {k}={cfg[k]!r} decoder blocks; "
                "the traced path scales one encoder+decoder pair and needs them equal; trace the model itself "
                "with trace_memory(model, batch_shape=(b, s))"
            )
    return {**out, **_truncated(cfg, depth)}


def _truncated(cfg: Mapping[str, Any], depth: int) -> dict[str, Any]:
    """The keys of ``cfg`` that change at ``depth`` blocks: the depth keys and every per-layer list."""
    key, full = _depth_of(cfg)
    out: dict[str, Any] = {key: depth}
    for k in (*_DECODER_LAYER_KEYS, *_ENCODER_LAYER_KEYS):
        if isinstance(cfg.get(k), int):
            out[k] = depth
    for name, value in cfg.items():
        if isinstance(value, list) and len(value) == full and name not in ("architectures",):
            out[name] = value[:depth]
    return out


#: Deepest config whose every block is built (on the meta device, milliseconds a block) to read its block
#: kinds (:func:`layer_plan`); no published model has more than about 200 blocks.
FULL_BUILD_LAYERS = 256
#: The blocks a deeper config is built with to show that its blocks are all alike (:func:`deep_stack_check`).
PREFIX_LAYERS = 64


def deep_stack_check(cfg: Mapping[str, Any], *, attention: str) -> None:
    """For a config deeper than :data:`FULL_BUILD_LAYERS` (building each of its blocks would take minutes and
    gigabytes): check, in bounded time, that its blocks are all alike, so the depth-1/depth-2 copies scale to
    it by arithmetic (``DepthTraces.n_params``: ``P(1) + (L - 1) * (P(2) - P(1))``). Alike means: every
    per-layer list of the config repeats values its first :data:`PREFIX_LAYERS` entries hold, and the model
    built at that depth has blocks of one kind (:func:`layer_plan`). A model that cannot be built at all is
    left to the copies' own build (which says why).

    Raises:
        ValueError: the blocks are of several kinds (the deep stack cannot be read without building it).
    """
    key, full = _depth_of(cfg)
    refuse = (f"config {key}={full} is deeper than the {FULL_BUILD_LAYERS} blocks whose kinds are read by building "
              "each, and its blocks are not all alike ({}); trace your model with trace_memory(model, batch_shape=(b, s)) "
              "or set LIGHTNING_MEMPLAN_HF_TRACE=0 for the analytic terms")
    for name, value in cfg.items():
        if isinstance(value, list) and len(value) == full and name != "architectures":
            seen = {json.dumps(v, sort_keys=True, default=str) for v in value[:PREFIX_LAYERS]}
            if any(json.dumps(v, sort_keys=True, default=str) not in seen for v in value[PREFIX_LAYERS:]):
                raise ValueError(refuse.format(f"{name} takes values beyond its first {PREFIX_LAYERS} entries"))
    prefix = {**cfg, **_truncated(cfg, PREFIX_LAYERS)}
    try:
        plan = layer_plan(_build(_config_object(prefix), attention), prefix)
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, RuntimeError):
        return
    if plan.mixed:
        raise ValueError(refuse.format(f"its first {PREFIX_LAYERS} are of {len(plan.labels)} kinds: "
                                       f"{', '.join(plan.labels)[:300]}"))


def _config_object(cfg: Mapping[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if not model_type or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"config model_type={model_type!r} is not an architecture the installed transformers knows; pass a "
            "config.json with a known model_type, or ModelSpec(n_layers, hidden, n_heads, vocab_size, n_params=...)"
        )
    data = {k: v for k, v in cfg.items() if k not in VOLATILE_KEYS}
    return CONFIG_MAPPING[model_type].from_dict(data)


@functools.lru_cache(maxsize=1)
def _model_class_names() -> frozenset[str]:
    """Every model class name transformers' auto mappings know (``MODEL_*_MAPPING_NAMES`` of
    ``transformers/models/auto/modeling_auto.py``): the only names a config's ``architectures`` may pick."""
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for attr in dir(modeling_auto):
        if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES"):
            for value in getattr(modeling_auto, attr).values():
                names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(n for n in names if isinstance(n, str))


def model_class(config: Any) -> Any:
    """The transformers class a config is trained as: ``config.architectures[0]`` when it names a model
    class of transformers' auto mappings that subclasses ``PreTrainedModel`` (a config.json is someone
    else's file: ``"AutoTokenizer"`` or any other attribute of ``transformers`` is never instantiated),
    else the first auto class (causal LM, seq2seq, masked LM, image classification) that maps the config.

    Raises:
        ValueError: no class builds it (names the model type and what to pass instead).
    """
    import transformers

    known = _model_class_names()
    for arch in getattr(config, "architectures", None) or ():
        if not isinstance(arch, str) or arch not in known:
            continue
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    for auto in _AUTO_CLASSES:
        mapping = getattr(transformers, auto)._model_mapping
        with contextlib.suppress(KeyError, ValueError, AttributeError):
            if type(config) in mapping:
                return mapping[type(config)]
    raise ValueError(
        f"model_type={config.model_type!r}: no causal-LM, seq2seq, masked-LM or image-classification class in "
        "transformers builds it, so a config-only estimate cannot trace it; trace your model with "
        "trace_memory(model, example_input=batch) or pass ModelSpec(..., n_params=...)"
    )


def build_reduced(cfg: Mapping[str, Any], depth: int, *, attention: str, recompute: str) -> Any:
    """The config's model class with ``depth`` blocks on the meta device (fp32), with
    ``attn_implementation=attention`` (a class without an SDPA path runs eager, as Hugging Face does)
    and, for ``recompute="full"``, ``gradient_checkpointing_enable()``.

    Raises:
        ValueError: non-uniform blocks, an unknown architecture, an attention kernel the class lacks,
            or ``recompute="full"`` on a class without gradient checkpointing.
    """
    model = _build(_config_object(_reduced_config(cfg, depth)), attention)
    _enable_recompute(model, recompute)
    return model


def _build(config: Any, attention: str) -> Any:
    import torch

    cls = model_class(config)
    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": attention}
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return cls._from_config(config, **kwargs)
        except (ValueError, ImportError) as exc:
            if attention != "sdpa":
                raise ValueError(
                    f"{type(config).__name__} cannot be built with attn_implementation={attention!r} ({exc}); "
                    "use attention='sdpa'"
                ) from exc
            kwargs["attn_implementation"] = "eager"  # the model has no SDPA path: HF runs it eager
            return cls._from_config(config, **kwargs)


def _enable_recompute(model: Any, recompute: str) -> None:
    if recompute == "full":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"{type(model).__name__} does not support gradient_checkpointing_enable(), so recompute='full' is "
                "not how it trains; use recompute='none' or wrap its blocks and trace the model with trace_memory"
            )
        model.gradient_checkpointing_enable()


@dataclass(frozen=True)
class LayerPlan:
    """The blocks of a config's full-depth model, grouped by kind (read from the model the config builds).

    Attributes:
        path: dotted name of the ``nn.ModuleList`` holding the blocks (``"model.layers"``); ``None`` when
            the model has no single list of ``L`` blocks (an encoder-decoder): then every block counts alike.
        kinds: the kind of each block (``0`` = the first block's kind, numbered in order of appearance).
        labels: a short description of each kind (its class and what tells it apart), for messages.
        n_params: the parameters of the full-depth model, counted exactly.
    """

    path: str | None
    kinds: tuple[int, ...]
    labels: tuple[str, ...]
    n_params: int

    @property
    def mixed(self) -> bool:
        """Whether the blocks are of more than one kind."""
        return len(self.labels) > 1

    def counts(self) -> tuple[int, ...]:
        """How many blocks of each kind the config has."""
        return tuple(self.kinds.count(k) for k in range(len(self.labels)))

    def first(self, kind: int) -> int:
        """The index of the first block of ``kind``."""
        return self.kinds.index(kind)


# Attributes of a block that never tell two kinds apart (its position, the module's mode).
_POSITIONAL_ATTRS = ("layer_idx", "layer_id", "layer_number", "training", "idx")


def _block_signature(block: Any) -> tuple[Any, ...]:
    """What a block is made of: every submodule's class and parameter shapes, and the plain attributes
    (``attention_type``, ``is_sliding``, ``sliding_window``, ``use_rope``, ``is_moe_layer`` ...) that
    decide what its forward does; not its position."""
    parts: list[Any] = []
    for name, module in block.named_modules():
        attrs = tuple(sorted(
            (k, v) for k, v in vars(module).items()
            if not k.startswith("_") and k not in _POSITIONAL_ATTRS and isinstance(v, (bool, int, float, str, type(None)))
        ))
        shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
        parts.append((name, type(module).__name__, shapes, attrs))
    return tuple(parts)


def _label(block: Any) -> str:
    sig = {k: v for k, v in vars(block).items() if k in ("attention_type", "layer_type", "is_moe_layer", "is_sliding")}
    children = ",".join(type(m).__name__ for _, m in block.named_children())
    return f"{type(block).__name__}({children})" + (f"{sig}" if sig else "")


def _block_list(model: Any, n_layers: int) -> tuple[str | None, Any]:
    import torch

    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers and n_layers > 0]
    if len(lists) != 1:
        return None, None
    return lists[0]


def full_model(cfg: Mapping[str, Any], *, attention: str) -> Any:
    """The config's model class at its full depth on the meta device (fp32): nothing is allocated, so a
    671B-parameter config costs what a tiny one does apart from the Python objects of its blocks."""
    return _build(_config_object(cfg), attention)


def layer_plan(model: Any, cfg: Mapping[str, Any]) -> LayerPlan:
    """The :class:`LayerPlan` of a full-depth ``model`` built from ``cfg`` (:func:`full_model`)."""
    _, n_layers = _depth_of(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    path, blocks = _block_list(model, n_layers)
    if path is None:
        return LayerPlan(path=None, kinds=(0,) * n_layers, labels=("block",), n_params=n_params)
    seen: dict[tuple[Any, ...], int] = {}
    kinds, labels = [], []
    for block in blocks:
        sig = _block_signature(block)
        if sig not in seen:
            seen[sig] = len(seen)
            labels.append(_label(block))
        kinds.append(seen[sig])
    return LayerPlan(path=path, kinds=tuple(kinds), labels=tuple(labels), n_params=n_params)


def _set_positions(block: Any, index: int) -> None:
    for module in block.modules():
        if isinstance(getattr(module, "layer_idx", None), int):
            module.layer_idx = index


def build_stack(cfg: Mapping[str, Any], full: Any, plan: LayerPlan, blocks: tuple[int, ...], *, attention: str,
                recompute: str) -> Any:
    """A copy of the config's model whose blocks are copies of the full model's blocks ``blocks`` (indices,
    repeats allowed), on the meta device: the embedding, head and every other module as in the config.

    The copy is the config's class built at ``len(blocks)`` blocks; its blocks are then replaced by deep
    copies (meta tensors: nothing allocated) of the chosen full-depth blocks, with their positions
    renumbered, and every per-block list of its config (``layer_types``, ``no_rope_layers`` ...) is taken
    at the chosen indices, so model-level code that reads them sees the chosen blocks.
    """
    import copy

    assert plan.path is not None
    _, n_layers = _depth_of(cfg)
    reduced = dict(cfg)
    for name in _NON_UNIFORM:  # the blocks are replaced: the pattern keys only shape the placeholder copy
        reduced.pop(name, None)
    reduced.pop("decoder_sparse_step", None)
    config = _config_object(_reduced_config(_placeholder(reduced, full.config, blocks), len(blocks)))
    full_config = full.config
    for conf, full_conf in _config_pairs(config, full_config):
        for key, value in vars(full_conf).items():
            if isinstance(value, list) and len(value) == n_layers and not key.startswith("_") and key != "architectures":
                setattr(conf, key, [value[i] for i in blocks])
    model = _build(config, attention)
    target = model.get_submodule(plan.path)
    source = full.get_submodule(plan.path)
    for j, i in enumerate(blocks):
        block = copy.deepcopy(source[i])
        _set_positions(block, j)
        target[j] = block
    _enable_recompute(model, recompute)
    return model


def _config_pairs(config: Any, full_config: Any) -> list[tuple[Any, Any]]:
    """The config and its text sub-config (a multimodal wrapper's), paired with the full model's."""
    pairs = [(config, full_config)]
    for attr in ("text_config",):
        sub, full_sub = getattr(config, attr, None), getattr(full_config, attr, None)
        if sub is not None and full_sub is not None:
            pairs.append((sub, full_sub))
    return pairs


def _placeholder(cfg: dict[str, Any], full_config: Any, blocks: tuple[int, ...]) -> dict[str, Any]:
    """A config whose reduced copy has the chosen blocks' layout where model-level code reads it from
    pattern keys rather than from the blocks: Jamba builds its (training) state cache from
    ``layers_block_type``, a property of ``attn_layer_period``/``offset`` (and the experts of
    ``expert_layer_period``/``offset``), so they are set to give the chosen blocks' kinds at 1-2 blocks."""
    if cfg.get("model_type") != "jamba":
        return cfg

    def period(flags: list[bool]) -> tuple[int, int]:
        on = [j for j, flag in enumerate(flags) if flag]
        if len(on) == len(flags):
            return 1, 0
        if not on:
            return len(flags) + 1, len(flags)
        return 2, on[0]  # one of two blocks

    attn = [full_config.layers_block_type[i] == "attention" for i in blocks]
    moe = [full_config.layers_num_experts[i] > 1 for i in blocks]
    (ap, ao), (ep, eo) = period(attn), period(moe)
    # use_cache=False: its hybrid cache needs an attention block (a 1-block Mamba copy has none); the cache's
    # states are [b, 2h, d_state] zeros per block, which the real step's mixers allocate anyway without it
    return {**cfg, "attn_layer_period": ap, "attn_layer_offset": ao, "expert_layer_period": ep,
            "expert_layer_offset": eo, "use_cache": False}


def input_fn_for(model: Any, cfg: Mapping[str, Any]) -> tuple[Callable[[int, int], dict[str, Any]], bool]:
    """``(input_fn(b, s) -> batch dict, is_vision)`` for the model's forward: token ids that are also
    the labels, or (a vision model) ``pixel_values`` of the config's image size and class labels."""
    import torch

    params = inspect.signature(model.forward).parameters
    if "pixel_values" in params and "input_ids" not in params:
        size = cfg.get("image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (int(size), int(size))
        channels = int(cfg.get("num_channels", 3))
        labels = max(int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)), 1)

        def vision(b: int, s: int) -> dict[str, Any]:
            return {"pixel_values": torch.randn(b, channels, *size), "labels": torch.randint(0, labels, (b,))}

        return vision, True
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(
            f"{cfg.get('model_type')!r} config has vocab_size={vocab!r}; token ids cannot be drawn; pass a config "
            "with vocab_size or trace the model with trace_memory(model, example_input=batch)"
        )

    def tokens(b: int, s: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (b, s))
        return {"input_ids": ids, "labels": ids}

    return tokens, False


def vision_tokens(cfg: Mapping[str, Any]) -> int:
    """Patches + 1 (the class token) of a ViT-style config: the sequence length its attention sees."""
    size = cfg.get("image_size", 224)
    patch = cfg.get("patch_size", 16)
    h, w = (size, size) if not isinstance(size, (list, tuple)) else size
    ph, pw = (patch, patch) if not isinstance(patch, (list, tuple)) else patch
    return (int(h) // int(ph)) * (int(w) // int(pw)) + 1
