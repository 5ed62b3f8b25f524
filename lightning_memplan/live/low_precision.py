"""Quantized base weights and float8 linears of a running fit, read from its precision plugin and module.

What is read, and from where:

- Lightning's ``BitsandbytesPrecision(mode, dtype, ignore_modules)``
  (``lightning/fabric/plugins/precision/bitsandbytes.py``): its mode through its public ``convert_module``
  on a probe (the replacement layer says ``quant_type`` / ``compress_statistics`` / ``has_fp16_weights``),
  its compute dtype from ``dtype``. Its ``precision`` attribute is the base class's ``"32-true"``, so the
  precision string comes from here. Whether it quantizes the lm_head (``quantized_head``): its
  ``_convert_layers`` replaces every ``nn.Linear`` whose dotted name starts with none of ``ignore_modules``,
  the head included; the probe carries a linear at the module's head path (``live/layouts.find_layout``),
  so the plugin's own rule answers.
- Lightning's ``TransformerEnginePrecision(weights_dtype=...)``: float8 linears (the estimate's
  ``float8="tensorwise"``, the closest torchao recipe: docs/quantized.md says where TransformerEngine
  differs) with ``weights_dtype`` parameters.
- the module (which wins: after setup it is converted): its lm_head quantized or not; bitsandbytes
  ``Linear4bit`` (``weight.quant_type`` ``"nf4"``/``"fp4"``,
  ``weight.compress_statistics`` for double quantisation) and ``Linear8bitLt`` with frozen int8 weights
  (``state.has_fp16_weights`` false), whether wrapped by peft or not; torchao ``NF4Tensor`` weights
  (torchtune's QLoRA: 4-bit NF4 values, int8 scalers per 64 and a fp32 factor per 256, the layout of
  bitsandbytes' ``"nf4-dq"`` less its per-weight 1 KiB map); torchao ``Float8Linear``
  (``config.cast_config_input.scaling_granularity``: tensorwise or axiswise, torchao's ``rowwise``).

bitsandbytes, torchao and TransformerEngine are optional: a check asks for their classes only when the
package is imported already (:func:`_imported`, ``sys.modules``): a module cannot hold a layer or a tensor of
a package nobody imported, and importing bitsandbytes only to find none costs a fit about 2 s
(``python -X importtime``: bitsandbytes 1.7 s, torchao 0.2 s, on a 2-core CPU).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from lightning_memplan.live.layouts import find_layout

__all__ = [
    "QUANT_EXTRA",
    "base_weights_of",
    "float8_of",
    "head_path",
    "infer_low_precision",
    "low_precision_fields",
    "plugin_low_precision",
    "quantized_head_of",
]

#: The extra that installs what these readers recognise.
QUANT_EXTRA = 'pip install "lightning-memplan[quant]"'
_PRECISION_OF_DTYPE: dict[Any, str] = {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float32: "32-true"}


def _imported(package: str) -> bool:
    """Whether ``package`` is imported (in ``sys.modules``): only then can the run hold its layers or tensors
    (Lightning's ``BitsandbytesPrecision`` imports bitsandbytes when it is built)."""
    return package in sys.modules


def _bnb_format(module: torch.nn.Module) -> str | None:
    """The ``TrainSpec.base_weights`` string of one bitsandbytes layer, ``None`` for anything else."""
    import bitsandbytes as bnb

    if isinstance(module, bnb.nn.Linear4bit):
        weight = module.weight
        kind = getattr(weight, "quant_type", "fp4")
        return f"{kind}-dq" if getattr(weight, "compress_statistics", False) else str(kind)
    if isinstance(module, bnb.nn.Linear8bitLt):
        state = getattr(module, "state", None)
        return None if getattr(state, "has_fp16_weights", True) else "int8"
    return None


def _torchao_format(module: torch.nn.Module) -> str | None:
    try:  # torchao >= 0.13 exports it from torchao.quantization; older releases from torchao.dtypes.nf4tensor
        from torchao.quantization import NF4Tensor
    except ImportError:  # pragma: no cover - older torchao
        from torchao.dtypes.nf4tensor import NF4Tensor

    weight = getattr(module, "weight", None)
    return "nf4-dq" if isinstance(weight, NF4Tensor) else None


def base_weights_of(module: Any) -> str | None:
    """The quantized-weight format of ``module``'s linears (``"nf4"``, ``"nf4-dq"``, ``"fp4"``,
    ``"fp4-dq"``, ``"int8"``), ``None`` when none is quantized. Mixed formats: the most common one, with
    a ``UserWarning`` (the estimate takes one format)."""
    if not isinstance(module, torch.nn.Module):
        return None
    readers = [r for pkg, r in (("bitsandbytes", _bnb_format), ("torchao", _torchao_format)) if _imported(pkg)]
    if not readers:
        return None
    counts: dict[str, int] = {}
    for sub in module.modules():
        for read in readers:
            fmt = read(sub)
            if fmt is not None:
                counts[fmt] = counts.get(fmt, 0) + 1
                break
    if not counts:
        return None
    if len(counts) > 1:
        warnings.warn(
            f"the module's linears are quantized in several formats ({counts}); the estimate uses the most common",
            UserWarning, stacklevel=2,
        )
    return max(counts, key=lambda fmt: counts[fmt])


def _layout_paths(module: Any) -> tuple[str | None, str | None]:
    """``(the first linear of the first block, the lm_head)`` of ``module`` as ``named_modules`` names them,
    from its :func:`~lightning_memplan.live.layouts.find_layout` layout (``None`` where none is found)."""
    if not isinstance(module, torch.nn.Module):
        return None, None
    layout = find_layout(module)
    if layout is None:
        return None, None
    prefix = f"{layout.root_path}." if layout.root_path else ""
    head = f"{prefix}{layout.head}" if layout.head else None
    blocks = layout.root.get_submodule(layout.blocks)
    first = next(iter(blocks.children()), None) if isinstance(blocks, torch.nn.Module) else None
    linear = next((name for name, sub in first.named_modules() if isinstance(sub, torch.nn.Linear)), None) if first else None
    block = f"{prefix}{layout.blocks}.0.{linear}" if linear else None
    return block, head


def _blocks_of(module: Any) -> Any:
    """The module's list of blocks (:func:`~lightning_memplan.live.layouts.find_layout`), the module itself
    when none is found: where ``base_weights`` is read (a quantized head alone is not a block format)."""
    layout = find_layout(module) if isinstance(module, torch.nn.Module) else None
    return module if layout is None else layout.root.get_submodule(layout.blocks)


def head_path(module: Any) -> str | None:
    """The dotted path of ``module``'s output projection (``lm_head``) as ``named_modules`` names it, from
    its :func:`~lightning_memplan.live.layouts.find_layout` layout; ``None`` when none is found."""
    return _layout_paths(module)[1]


def quantized_head_of(module: Any) -> bool | None:
    """Whether ``module``'s lm_head is a quantized layer (bitsandbytes or torchao, peft-wrapped or not);
    ``None`` when the head is not found."""
    path = head_path(module)
    if path is None:
        return None
    head = module.get_submodule(path)
    head = getattr(head, "base_layer", head)  # a peft LoRA layer around it
    return base_weights_of(torch.nn.ModuleList([head])) is not None


def float8_of(module: Any) -> str | None:
    """``"tensorwise"`` or ``"rowwise"`` when ``module`` has torchao ``Float8Linear`` layers (the scaling
    of their first one's input cast), else ``None``."""
    if not isinstance(module, torch.nn.Module) or not _imported("torchao"):
        return None
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    for sub in module.modules():
        if isinstance(sub, Float8Linear):
            granularity = sub.config.cast_config_input.scaling_granularity
            return "rowwise" if granularity is ScalingGranularity.AXISWISE else "tensorwise"
    return None


def _probe(path: str | None) -> tuple[torch.nn.Module, str]:
    """A module with a 64 x 64 linear at ``path`` (containers along the dotted path; ``"0"`` without one):
    what ``convert_module`` sees of the run's head, by its name."""
    path = path or "0"
    root = torch.nn.Module()
    parent = root
    *parents, leaf = path.split(".")
    for name in parents:
        child = torch.nn.Module()
        parent.add_module(name, child)
        parent = child
    parent.add_module(leaf, torch.nn.Linear(64, 64, bias=False))
    return root, path


def _converted(plugin: Any, path: str) -> str | None:
    """The format of the layer ``plugin.convert_module`` puts at ``path`` of a probe (``None``: left alone)."""
    with torch.random.fork_rng(devices=[]):
        probe, at = _probe(path)
        return base_weights_of(plugin.convert_module(probe).get_submodule(at))


def _free_name(ignore: Any) -> str | None:
    """A module name no prefix of ``ignore`` covers (``None`` when ``""`` covers every name)."""
    prefixes = {str(p) for p in ignore or ()}
    if "" in prefixes:
        return None
    first = {p[0] for p in prefixes}
    return next(f"{c}memplan_probe" for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in first)


def _bitsandbytes_plugin(plugin: Any, module: Any) -> tuple[str | None, str | None, bool | None]:
    """``(precision, base_weights, quantized_head)`` of a ``BitsandbytesPrecision``, each from the layer its
    ``convert_module`` puts in place of a probe linear named as the module's (nothing is quantized:
    bitsandbytes quantizes when a layer moves to a device), so the plugin's own ``ignore_modules`` rule
    answers: the mode at the first block's first linear (without a module, at a name ``ignore_modules``
    leaves alone), the head at the lm_head's path; the compute ``dtype`` as the ``"-true"`` precision of
    that dtype. Without a head path: every linear is converted unless ``ignore_modules`` names it, so the
    head is quantized when ``ignore_modules`` is empty and not known otherwise (a ``UserWarning``). The
    probes are initialised on the CPU, so the CPU generator is forked around them: the run's random state
    is left as it was."""
    fmt = None
    head: bool | None = None
    ignore = getattr(plugin, "ignore_modules", None)
    block, path = _layout_paths(module)
    try:
        name = block or _free_name(ignore)
        fmt = None if name is None else _converted(plugin, name)
        if path is not None:
            head = isinstance(module.get_submodule(path), torch.nn.Linear) and _converted(plugin, path) is not None
        if fmt is None and head:
            warnings.warn(f"BitsandbytesPrecision(ignore_modules={ignore!r}) quantizes the lm_head but not the blocks' "
                          "linears: the estimate models quantized block linears (base_weights) only and counts "
                          "every weight unquantized here", UserWarning, stacklevel=3)
    except (RuntimeError, TypeError, ValueError) as err:  # a plugin that cannot convert here: mode unknown
        warnings.warn(f"could not read BitsandbytesPrecision's mode ({err}); base_weights left unset",
                      UserWarning, stacklevel=3)
    if fmt is not None and path is None:
        head = True if not ignore else None
        if head is None:
            warnings.warn(f"BitsandbytesPrecision(ignore_modules={ignore!r}) and no lm_head found in the module: "
                          "whether the head is quantized is not known; the estimate counts it unquantized",
                          UserWarning, stacklevel=3)
    return _PRECISION_OF_DTYPE.get(getattr(plugin, "dtype", None)), fmt, head


def plugin_low_precision(plugin: Any, module: Any = None) -> dict[str, Any]:
    """TrainSpec fields a precision plugin implies: ``{"precision": ..., "base_weights": ...,
    "quantized_head": True}`` for ``BitsandbytesPrecision`` (the head as its rule treats ``module``'s,
    :func:`_bitsandbytes_plugin`), ``{"precision": ..., "float8": "tensorwise"}`` for
    ``TransformerEnginePrecision`` (``weights_dtype`` bf16; other dtypes: the precision only), ``{}``
    for any other plugin. Matched by class name, so Lightning is not imported here."""
    names = {cls.__name__ for cls in type(plugin).__mro__}
    if "BitsandbytesPrecision" in names and _imported("bitsandbytes"):
        precision, fmt, head = _bitsandbytes_plugin(plugin, module)
        out: dict[str, Any] = {"precision": precision} if precision else {}
        if fmt and head:
            out["quantized_head"] = True
        return {**out, "base_weights": fmt} if fmt else out
    if "TransformerEnginePrecision" in names:
        precision = _PRECISION_OF_DTYPE.get(getattr(plugin, "weights_dtype", None))
        if precision is None:
            return {}
        return {"precision": precision, **({"float8": "tensorwise"} if precision == "bf16-true" else {})}
    return {}


def _param_bytes(module: Any) -> int | None:
    """Element size of the module's largest floating-point parameter that is not quantized (bitsandbytes'
    packed ``Params4bit`` and ``Int8Params`` are integer storages), ``None`` without one."""
    largest: tuple[int, int] | None = None
    for p in module.parameters() if isinstance(module, torch.nn.Module) else ():
        if p.is_floating_point() and (largest is None or p.numel() > largest[0]):
            largest = (p.numel(), p.element_size())
    return None if largest is None else largest[1]


def infer_low_precision(trainer: Any) -> dict[str, Any]:
    """The TrainSpec fields of a run's quantized or float8 training (``{}`` for neither):
    :func:`low_precision_fields` of the Trainer's precision plugin, its LightningModule and its precision."""
    return low_precision_fields(getattr(trainer, "precision_plugin", None), getattr(trainer, "lightning_module", None),
                                str(getattr(trainer, "precision", "")))


def low_precision_fields(plugin: Any, module: Any, precision: str) -> dict[str, Any]:
    """The TrainSpec fields of quantized or float8 training (``{}`` for neither), for every front door
    (the callback and the Fabric monitor through :func:`infer_low_precision`, memplan_auto's planning for
    the Trainer and Fabric): from the precision ``plugin`` (:func:`plugin_low_precision`), then from the
    ``module``, which wins where it says more (peft + bitsandbytes loaded by transformers under any
    plugin). ``precision`` is the run's precision string (when the plugin names none). With a plugin's
    ``"-true"`` precision, ``param_bytes`` is the module's own parameter element size when that differs
    (fp32 parameters computed in bf16)."""
    fields = plugin_low_precision(plugin, module)
    fmt, recipe, head = base_weights_of(_blocks_of(module)), float8_of(module), quantized_head_of(module)
    if fmt is not None:  # the converted module says what the plugin did
        fields["base_weights"] = fmt
        if head is not None:
            fields.pop("quantized_head", None)
            if head:
                fields["quantized_head"] = True
    elif head:
        warnings.warn("the module's lm_head is quantized but not its blocks' linears: the estimate models quantized "
                      "block linears (base_weights) only and counts every weight unquantized here",
                      UserWarning, stacklevel=2)
    precision = fields.get("precision", precision)
    if recipe is not None and precision in ("bf16-mixed", "bf16-true"):
        fields["float8"] = recipe
    elif recipe is not None:
        warnings.warn(f"float8 linears under precision={precision!r} are not modelled (torchao casts from bf16); "
                      "the estimate counts them as plain linears", UserWarning, stacklevel=2)
    if "precision" in fields:
        size = _param_bytes(module)
        want = {"bf16-true": 2, "16-true": 2, "32-true": 4}[fields["precision"]]
        if size is not None and size != want:
            fields["param_bytes"] = size
    return fields
