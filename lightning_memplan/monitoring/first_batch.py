"""What the first batch adds around the calibration of a :class:`~lightning_memplan.monitoring.session.
MemorySession`: whether its steps run on real CPU tensors (cheaper than fake ones for a small model; the
run's random states are kept by ``monitoring/calibration.run_calibration`` through
:func:`~lightning_memplan.tracking.isolation.preserved_run_state`), and what the trace showed of
hand-written activation checkpointing (:mod:`~lightning_memplan.tracking.recompute`)."""

from __future__ import annotations

import torch

from lightning_memplan.live import find_layout
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.tracking.recompute import RecomputeSeen, written_checkpointing

__all__ = [
    "REAL_TRACE_MAX_BYTES",
    "REAL_TRACE_MAX_FLOPS",
    "block_types",
    "not_a_decoder",
    "real_trace_is_cheaper",
    "recompute_seen",
]

#: A real calibration step (on the CPU, of a private copy) instead of a fake-tensor one when the step at the
#: largest traced shape holds at most this many bytes ...
REAL_TRACE_MAX_BYTES = 256 * 2**20
#: ... and costs at most this many FLOPs (6 N T, Kaplan et al. 2020, arXiv 2001.08361, Table 1: forward and
#: backward of N parameters over T tokens). A fake step costs its operator count in Python dispatch whatever the
#: sizes (0.15-0.5 s a step for a small GPT on a loaded 2-core CPU); a real step of a 1.3M-parameter GPT over
#: 1024 tokens (8e9 FLOPs) cost 2.3x less than the fake one there, one of 0.17M over 256 tokens 6x less.
REAL_TRACE_MAX_FLOPS = 10**10


def real_trace_is_cheaper(spec: ModelSpec, train: TrainSpec) -> bool:
    """Whether the calibration's steps should run on real CPU tensors: a step at the largest traced shape
    (``2b x s``) small in bytes and FLOPs (constants above); the fake trace otherwise."""
    from lightning_memplan.model.estimate import estimate_memory

    big = train.replace(micro_batch=2 * train.micro_batch)
    if 6 * spec.num_params * big.micro_batch * big.seq_len > REAL_TRACE_MAX_FLOPS:
        return False
    try:
        return estimate_memory(spec, big, ParallelPlan()).total <= REAL_TRACE_MAX_BYTES
    except (ValueError, TypeError):
        return False


def block_types(module: torch.nn.Module) -> set[type]:
    """The classes of ``module``'s repeated transformer blocks (``live.find_layout``); empty without any."""
    layout = find_layout(module)
    return {type(b) for b in layout.block_list} if layout is not None else set()


def recompute_seen(
    train: TrainSpec, seen: RecomputeSeen, module: torch.nn.Module, *, explicit: bool, owner: str
) -> tuple[TrainSpec, str | None]:
    """``(train, note)`` after the calibration trace saw ``seen``: ``recompute="full"`` when every block ran
    again in the backward (unless the TrainSpec was given (``explicit``), already has a recompute, or offloads
    activations); a note for a partial recompute, or, with no trace observed, for a ``torch.utils.checkpoint``
    call in the module's code (the estimate then assumes none)."""
    if explicit or train.recompute != "none":
        return train, None
    if seen.recompute == "full" and not train.offload_activations:
        return train.replace(recompute="full"), None
    text = seen.describe()
    if text is None and not seen.blocks:
        where = written_checkpointing(module)
        if where:
            text = (f"torch.utils.checkpoint is called in {', '.join(where[:4])}, and no calibration trace ran to see "
                    "which blocks it recomputes: the estimate assumes none (an upper bound of the backward); keep "
                    f"calibrate=True, or pass {owner}(train_spec=TrainSpec(..., recompute='full')) when every block is "
                    "checkpointed")
    return train, text


def not_a_decoder(module: torch.nn.Module) -> str | None:
    """``"<Class> is an encoder-decoder model"`` (or an encoder, vision or audio model) when the outermost
    Hugging Face model inside ``module`` is not a decoder-only language model, else ``None``.

    Read from the model itself, duck-typed (this package does not import transformers here): a config with
    ``is_encoder_decoder`` (T5, BART, Whisper), or a model that cannot generate text
    (``PreTrainedModel.can_generate()``, true for the classes with ``GenerationMixin``: every ``*ForCausalLM``;
    false for BERT, RoBERTa, DistilBERT, ViT, wav2vec2, CLIP). Modules without such a model: ``None`` (their
    layout, or the guessed-spec note, says the rest)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        can_generate = getattr(sub, "can_generate", None)
        if config is None or not callable(can_generate) or not hasattr(config, "model_type"):
            continue
        name = type(sub).__name__
        if getattr(config, "is_encoder_decoder", False):
            return f"{name} is an encoder-decoder model"
        try:
            generates = bool(can_generate())
        except Exception:  # noqa: BLE001 - a model's own answer; unknown means "say nothing"
            return None
        return None if generates else f"{name} is not a decoder-only language model (an encoder, vision or audio model)"
    return None
