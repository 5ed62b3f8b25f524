"""Pipeline parallelism with ``torch.distributed.pipelining`` inside the ordinary ``Trainer.fit`` loop.

**Contract.** A transformer can be split into stages when memplan_auto recognises its block list (see
:mod:`~lightning_memplan.live.layouts`) and it knows how to run a slice of it:

* the zoo GPT and Hugging Face ``LlamaForCausalLM`` (transformers >= 4.53; the LightningModule must
  define ``pipeline_loss``: Hugging Face shifts labels inside the model) are built in;
* any other model defines ``pipeline_forward(self, x, blocks, *, first, last) -> Tensor``: embed ``x``
  when ``first``, run ``blocks`` in order, apply the final norm and head when ``last``; plus the
  attributes ``pipeline_first_modules`` / ``pipeline_last_modules`` (names of the top-level submodules
  only the first / last stage needs; defaults come from the recognised layout).

Each pipeline rank keeps only its blocks (the block ``nn.ModuleList`` becomes an ``nn.ModuleDict`` with
the same keys, so parameter names, and therefore checkpoints, are unchanged) and sets the other stages'
embedding/head attributes to ``None``. The LightningModule may define ``pipeline_batch(batch) ->
(inputs, targets)`` (default: a ``(inputs, targets)`` pair, or a dict with ``input_ids`` and ``labels``)
and ``pipeline_loss(output, target) -> Tensor`` (default: mean token cross-entropy of the last stage's
logits). Its ``training_step`` is not called under PP: the schedule runs forward and backward of all
micro-batches; the mean micro-batch loss is returned to Lightning on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memplan.live.layouts import TransformerLayout, get_submodule_or_none

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["PipelineRunner", "StageModule", "pipeline_blocker", "prune_to_stages", "split_blocks", "stage_indices"]


def _zoo_forward(model: Any, x: torch.Tensor, blocks: Iterable[nn.Module], *, first: bool, last: bool):
    # Mirrors zoo.GPT.forward + GPT.logits, one slice at a time. ``model`` is a zoo.GPT (duck-typed:
    # its submodules are read by name).
    if first:
        x = model.embed(x)
    rope = model.rope()
    for block in blocks:
        x = block(x, rope)
    if last:
        x = model.lm_head(model.norm_f(x))
    return x


def _hf_causal_mask() -> Callable[..., Any] | None:
    """``transformers.masking_utils.create_causal_mask`` (transformers >= 4.53), else ``None``."""
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError:
        return None
    return create_causal_mask


def _hf_causal_mask_for(create_causal_mask: Callable[..., Any], config: Any, h: torch.Tensor,
                        position_ids: torch.Tensor) -> Any:
    """The causal mask of a training slice (no padding mask, no cache, positions ``0..s-1``), called as
    the installed transformers spells it. Version guard: transformers 4.53 to 5.3 take
    ``(config, input_embeds | inputs_embeds, attention_mask, cache_position, past_key_values,
    position_ids)`` (the embeddings argument was renamed in 5, so it is passed positionally); 5.24 has
    no ``cache_position`` and calls the cache ``cache``: ``(config, inputs_embeds, attention_mask, cache,
    position_ids, ...)``. Told apart by the signature, not the version string."""
    import inspect

    if "cache_position" in inspect.signature(create_causal_mask).parameters:  # transformers <= 5.3
        return create_causal_mask(config, h, None, position_ids[0], None, position_ids)
    return create_causal_mask(config, h, None, None, position_ids)  # transformers 5.24


def _hf_llama_forward(model: Any, x: torch.Tensor, blocks: Iterable[nn.Module], *, first: bool, last: bool):
    # Mirrors LlamaModel.forward + LlamaForCausalLM's head, one slice at a time (transformers 5.3 and
    # 5.24 models/llama/modeling_llama.py): no cache, positions 0..s-1, the causal mask of the config's
    # attention implementation (None under SDPA: is_causal), the rotary table from ``model.rotary_emb``
    # (buffers only, held by every stage). ``model`` is a LlamaForCausalLM (duck-typed).
    inner = model.model
    h = inner.embed_tokens(x) if first else x
    position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    create_causal_mask = _hf_causal_mask()
    assert create_causal_mask is not None  # pipeline_blocker refuses older transformers
    mask = _hf_causal_mask_for(create_causal_mask, inner.config, h, position_ids)
    position_embeddings = inner.rotary_emb(h, position_ids=position_ids)
    for block in blocks:
        out = block(h, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        h = out[0] if isinstance(out, tuple) else out  # transformers < 4.54 returns (hidden_states,)
    if last:
        h = model.lm_head(inner.norm(h))
    return h


def _hf_llama_blocker(layout: TransformerLayout, module: nn.Module | None = None) -> str | None:
    """Why the built-in Hugging Face slice forward does not cover this ``hf-llama`` layout (``module``:
    the LightningModule, when known)."""
    if module is not None and not callable(getattr(module, "pipeline_loss", None)):
        # Under PP the schedule replaces training_step; Hugging Face labels are shifted inside the model
        # (and may come with a padding mask), so the zoo's default loss would silently change the run.
        return (
            f"{type(module).__name__} defines no pipeline_loss(logits, labels): under pipeline parallelism "
            "the schedule replaces training_step, and a Hugging Face model's loss convention (labels shifted "
            "inside, e.g. self.model.loss_function(logits=..., labels=..., vocab_size=...)) must be stated"
        )
    config = getattr(getattr(layout.root, "model", None), "config", None)
    kind = getattr(config, "model_type", None)
    if layout.head is None:
        return f"{type(layout.root).__name__} has no lm_head for the last pipeline stage"
    if kind != "llama":
        return (
            f"{type(layout.root).__name__} (model_type={kind!r}): the built-in pipeline forward covers Hugging "
            "Face Llama only (Mistral/Qwen2 may use sliding-window masks); define "
            "`pipeline_forward(x, blocks, *, first, last)` (see docs/strategy.md)"
        )
    if _hf_causal_mask() is None:
        return "pipeline parallelism on a Hugging Face Llama needs transformers >= 4.53 (masking_utils.create_causal_mask)"
    return None


def _stage_parts(layout: TransformerLayout) -> tuple[Callable[..., torch.Tensor], tuple[str, ...], tuple[str, ...]]:
    root = layout.root
    custom = getattr(root, "pipeline_forward", None)
    if callable(custom):
        first = tuple(getattr(root, "pipeline_first_modules", layout.embeddings))
        last = tuple(getattr(root, "pipeline_last_modules", tuple(p for p in (layout.norm, layout.head) if p)))
        return (lambda model, x, blocks, *, first, last: custom(x, blocks, first=first, last=last)), first, last
    if layout.family == "zoo-gpt":
        return _zoo_forward, ("tok_emb", "pos_emb", "emb_drop"), ("norm_f", "lm_head")
    if layout.family == "hf-llama" and _hf_llama_blocker(layout) is None:
        return _hf_llama_forward, layout.embeddings, tuple(p for p in (layout.norm, layout.head) if p)
    raise ValueError(f"no pipeline contract for {type(root).__name__}")


def pipeline_blocker(
    layout: TransformerLayout | None, pp: int, virtual_stages: int = 1, *, module: nn.Module | None = None
) -> str | None:
    """Why the model cannot be cut into ``pp * virtual_stages`` stages (``None`` when it can);
    ``module``: the LightningModule, whose ``pipeline_loss`` a Hugging Face Llama needs."""
    if pp == 1:
        return None
    if layout is None:
        return "the module has no list of repeated blocks to split into stages"
    if not callable(getattr(layout.root, "pipeline_forward", None)):
        if layout.family == "hf-llama":
            if (why := _hf_llama_blocker(layout, module)) is not None:
                return why
        elif layout.family != "zoo-gpt":
            return (
                f"{type(layout.root).__name__} ({layout.family}) does not implement the pipeline contract "
                "`pipeline_forward(x, blocks, *, first, last)` (see docs/strategy.md)"
            )
    n_stages = pp * virtual_stages
    n_blocks = len(layout.block_list)
    if n_blocks < n_stages:
        return f"{n_blocks} blocks cannot fill {n_stages} pipeline stages (pp={pp} x v={virtual_stages})"
    if layout.head is not None and layout.embeddings:
        head, emb = layout.get(layout.head), layout.get(layout.embeddings[0])
        if head is not None and emb is not None and head.weight is emb.weight:
            return "tied embeddings: the lm_head shares the first stage's embedding, which PP cannot split"
    return None


def split_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Contiguous block ranges per stage, sizes differing by at most one (earlier stages get more)."""
    base, extra = divmod(n_blocks, n_stages)
    out, start = [], 0
    for i in range(n_stages):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages held by one pipeline rank: looped placement ``rank, rank + p, ...`` (Narayanan et al. 2021,
    arXiv 2104.04473, section 2.2.2, interleaved schedule)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


class StageModule(nn.Module):
    """One pipeline stage: its blocks plus, on the first/last stage, the embedding/head modules.

    Only the modules of this stage are registered, so ``fully_shard(stage)`` owns exactly them. The
    transformer itself is held without registration (``object.__setattr__``) to call its forward slice.
    """

    # Set with ``object.__setattr__`` in ``__init__`` (declared here for type checkers).
    _model: nn.Module
    _forward: Callable[..., torch.Tensor]

    def __init__(
        self,
        model: nn.Module,
        forward: Callable[..., torch.Tensor],
        blocks: dict[str, nn.Module],
        *,
        first: bool,
        last: bool,
        first_modules: dict[str, nn.Module],
        last_modules: dict[str, nn.Module],
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_forward", forward)
        self.blocks = nn.ModuleDict(blocks)
        self.first_parts = nn.ModuleDict(first_modules)
        self.last_parts = nn.ModuleDict(last_modules)
        self.is_first, self.is_last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(self._model, x, list(self.blocks.values()), first=self.is_first, last=self.is_last)


def _default_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict) and "input_ids" in batch and "labels" in batch:
        return batch["input_ids"], batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise TypeError(
        f"pipeline parallel needs (inputs, targets) from each batch; got {type(batch).__name__}. Return a "
        "pair or a dict with input_ids and labels, or define LightningModule.pipeline_batch(batch)"
    )


def _default_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


class PipelineRunner:
    """Prunes the model to this rank's stages, builds ``PipelineStage`` objects and the schedule, and
    runs one optimizer-step's worth of micro-batches per call."""

    def __init__(
        self,
        lightning_module: nn.Module,
        layout: TransformerLayout,
        pp_mesh: DeviceMesh,
        device: torch.device,
        *,
        microbatches: int,
        schedule: str,
        virtual_stages: int,
    ) -> None:
        self.lightning_module = lightning_module
        self.layout = layout
        self.pp_mesh = pp_mesh
        self.device = device
        self.pp = pp_mesh.size()
        self.pp_rank = pp_mesh.get_local_rank()
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.virtual_stages = virtual_stages
        self.n_stages = self.pp * virtual_stages
        self.stage_ids = stage_indices(self.pp_rank, self.pp, virtual_stages)
        self.modules: list[StageModule] = self._prune()
        self._schedule: Any = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    @property
    def has_last_stage(self) -> bool:
        return (self.n_stages - 1) in self.stage_ids

    def _prune(self) -> list[StageModule]:
        return prune_to_stages(self.layout, self.stage_ids, self.n_stages)

    def refresh_blocks(self) -> None:
        """Re-read each stage's blocks from the model after they were replaced (activation checkpointing
        wraps blocks in place)."""
        container = self.layout.root.get_submodule(self.layout.blocks)
        for module in self.modules:
            for key in list(module.blocks.keys()):
                module.blocks[key] = getattr(container, key)

    def _build_schedule(self) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        group = self.pp_mesh.get_group()
        stages: list[_PipelineStageBase] = [
            PipelineStage(module, sid, self.n_stages, self.device, group=group)
            for module, sid in zip(self.modules, self.stage_ids, strict=True)
        ]
        loss_fn = getattr(self.lightning_module, "pipeline_loss", None) or _default_loss
        if self.schedule_name == "interleaved":
            self._schedule = ScheduleInterleaved1F1B(stages, self.microbatches, loss_fn=loss_fn)
        else:
            cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            self._schedule = cls(stages[0], self.microbatches, loss_fn=loss_fn)

    def step(self, batch: Any, *, window_start: bool = True) -> torch.Tensor:
        """Forward and backward of all micro-batches; returns the mean micro-batch loss (every rank).

        The gradients are computed now but handed to the parameters only by :meth:`install_grads`,
        because Lightning zeroes gradients between ``training_step`` and ``backward``. At the start of an
        accumulation window (``window_start``) the previous step's gradients are dropped first -- Lightning
        is about to zero them anyway -- so old and new gradients never coexist; inside a window the
        accumulated gradients are set aside while the schedule runs (it rescales ``.grad`` by 1/m).
        """
        split = getattr(self.lightning_module, "pipeline_batch", None) or _default_batch
        inputs, targets = split(batch)
        if inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"batch size {inputs.shape[0]} is not divisible by microbatches={self.microbatches}; make the "
                "per-rank batch a multiple of it or force a plan with another microbatches="
            )
        if self._schedule is None:
            self._build_schedule()
        params = [p for m in self.modules for p in m.parameters() if p.requires_grad]
        previous = [None if window_start else p.grad for p in params]
        for p in params:
            p.grad = None
        losses: list[torch.Tensor] = []
        # return_outputs=False: training needs the losses only. By default torch's schedules keep every
        # micro-batch's last-stage output (the logits) in stage.output_chunks until the step ends and then
        # concatenate them (torch/distributed/pipelining/stage.py forward_one_chunk, schedules.py
        # _merge_outputs): m micro-batches of logits held and copied for nothing.
        self._schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        self._pending = [(p, p.grad) for p in params]
        for p, g in zip(params, previous, strict=True):
            p.grad = g
        if losses:
            loss = torch.stack([x.detach().float() for x in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        # Only the last stage has the loss: a sum over the pipeline group gives it to every rank.
        torch.distributed.all_reduce(loss, group=self.pp_mesh.get_group())
        return loss

    def install_grads(self) -> None:
        """Add the gradients of the last :meth:`step` to the parameters' (possibly zeroed) ``.grad``."""
        for p, g in self._pending:
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g
        self._pending = []


def prune_to_stages(layout: TransformerLayout, stage_ids: list[int], n_stages: int) -> list[StageModule]:
    """Cut ``layout.root`` in place down to the stages ``stage_ids`` of ``n_stages`` and return one
    :class:`StageModule` per held stage: the block container keeps only their blocks (an
    ``nn.ModuleDict`` with the original keys) and the embedding / head attributes of stages not held
    are set to ``None`` (what a pipeline rank keeps; also the traced copy of ``parallel/pipeline_replay.py``)."""
    forward, first_names, last_names = _stage_parts(layout)
    root = layout.root
    items = layout.block_items()
    ranges = split_blocks(len(items), n_stages)
    keep = {sid: [items[i] for i in ranges[sid]] for sid in stage_ids}
    kept_keys = {key for pairs in keep.values() for key, _ in pairs}
    parent_path, _, name = layout.blocks.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, nn.ModuleDict({key: blk for key, blk in items if key in kept_keys}))
    holds_first, holds_last = 0 in stage_ids, (n_stages - 1) in stage_ids
    # Names may be nested (Hugging Face Llama's ``model.embed_tokens``); ModuleDict keys cannot hold dots.
    firsts = {n.replace(".", "__"): m for n in first_names if (m := get_submodule_or_none(root, n)) is not None}
    lasts = {n.replace(".", "__"): m for n in last_names if (m := get_submodule_or_none(root, n)) is not None}
    for names, held in ((first_names, holds_first), (last_names, holds_last)):
        if not held:
            for n in names:
                if get_submodule_or_none(root, n) is not None:
                    owner_path, _, attr = n.rpartition(".")
                    setattr(root.get_submodule(owner_path) if owner_path else root, attr, None)
    return [
        StageModule(
            root,
            forward,
            dict(keep[sid]),
            first=sid == 0,
            last=sid == n_stages - 1,
            first_modules=firsts if sid == 0 else {},
            last_modules=lasts if sid == n_stages - 1 else {},
        )
        for sid in stage_ids
    ]
