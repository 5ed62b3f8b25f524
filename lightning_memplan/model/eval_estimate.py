"""``estimate_eval_memory``: predicted peak tensor bytes of one validation, test or predict step.

An evaluation step runs the forward only, under ``torch.no_grad`` (Lightning's validation, test and
predict loops wrap their steps in ``torch.no_grad`` or ``torch.inference_mode``), so nothing is saved for
a backward: the live tensors are the residual stream, one block's working set at a time, and at the end
the logits with the loss's buffers. What exists next to them is what the training run left:

- the parameters (and the data-parallel buffers, autocast's low-precision weight copies, which autocast
  caches for the eval step's own autocast region as for a training step [PT ``cached_cast``]);
- the last training step's gradients, when they are alive: Lightning zeroes them at the start of the
  next training step (inside its closure, ``_AutomaticOptimization``), but before it runs the validation
  loop inside ``trainer.fit`` it releases them (``_TrainingEpochLoop.on_advance_end`` calls the
  ``on_validation_model_zero_grad`` hook, ``LightningModule.zero_grad()``, ``set_to_none=True``) unless
  validation interrupts gradient accumulation or the hook is overridden [PL 2.x]; measured with the
  tensor tracker: no gradient bytes during validation. A hand-written loop that runs its evaluation
  before ``zero_grad`` keeps them (``grads_alive=True``);
- the optimizer states (``optimizer_states=False`` before the first optimizer step, or without one).

Not modelled: the KV cache of a ``generate`` call inside ``validation_step`` (its size depends on the
generation length and the model's cache class), predictions Lightning keeps across batches
(``trainer.predict(return_predictions=True)``), and the pipeline schedule's micro-batching of an
evaluation (one micro-batch of ``micro_batch`` rows is assumed in flight).

Symbols as in ``docs/DESIGN.md``: b micro-batch, s sequence length, h hidden, a heads, k kv-heads,
f ffn hidden, V vocab, t tensor-parallel, c context-parallel.
"""

from __future__ import annotations

import dataclasses
import math

from lightning_memplan.model import terms
from lightning_memplan.model.estimate import estimate_memory, stage_layout
from lightning_memplan.model.result import COMPONENTS, PHASES, MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.validation import check_bool, check_choice, check_int, check_optional_int

__all__ = [
    "EVAL_PHASES",
    "estimate_eval_memory",
    "eval_block_working_bytes",
    "eval_head_bytes",
    "eval_kv_cache_bytes",
]

#: The evaluation phases of a run, as Lightning's loops name their metrics' stage
#: (``memplan/val/...``, ``memplan/test/...``, ``memplan/predict/...``).
EVAL_PHASES: tuple[str, ...] = ("val", "test", "predict")
#: Phases whose step computes a loss (predict returns the logits).
_LOSS_PHASES = ("val", "test")


def eval_block_working_bytes(model: ModelSpec, train: TrainSpec, b: int, s: int, *, t: int = 1) -> dict[str, int]:
    """The largest working set of one transformer block in a no-grad forward, for b x s tokens on one of
    t tensor-parallel ranks, beside the block's input (the residual stream, not counted here).

    Each operand is freed when its last Python reference goes (no autograd graph holds it):

    - attention (fused SDPA): the norm output ``h``, ``q`` ``a d / t``, ``k`` and ``v`` ``2 k d / t``, the
      attention output and its ``transpose(1, 2).reshape`` copy ``2 a d / t``, the output projection
      ``h``: ``(2h + 3ad/t + 2kd/t) b s`` elements; eager attention adds the scores and the
      probabilities, ``2 b (a/t) s^2`` in fp32 under autocast (softmax runs in fp32) [PT autocast op list];
    - MLP: the residual after attention ``h`` (the block's input is still referenced by the caller's
      loop, ``x = block(x)``), the norm output ``h`` and two ``[b, s, f/t]`` tensors (GELU: ``fc_in``'s
      output and the activation); SwiGLU holds three (``silu(gate)``, ``up`` and their product) before
      ``down_proj``.

    Eager attention also holds its ``[s, s]`` boolean causal mask. Measured with the tensor tracker on
    the zoo's GPT (GELU, SwiGLU, SDPA, eager) and Hugging Face's Llama (tests/unit/test_eval_estimate.py).

    Returns ``{"activations": ..., "attention": ...}`` at the larger of the two, in bytes.
    """
    pb = terms.precision_bytes(train)
    tokens = b * s
    d = model.dim_head
    attn_elems = tokens * (2 * model.hidden + 3 * model.n_heads * d // t + 2 * model.kv_heads * d // t)
    scores = 0
    if train.attention == "eager":
        score_bytes = terms.FP32_BYTES if pb.autocast_copy else pb.compute
        scores = 2 * b * (model.n_heads // t) * s * s * score_bytes + s * s * terms.MASK_BYTES
    ffn_tensors = 3 if model.ffn_kind == "swiglu" else 2
    mlp_elems = tokens * (model.hidden + ffn_tensors * math.ceil(model.ffn / t))
    attn = {"activations": attn_elems * pb.compute, "attention": scores}
    mlp = {"activations": tokens * model.hidden * pb.residual + mlp_elems * pb.compute, "attention": 0}
    return attn if sum(attn.values()) >= sum(mlp.values()) else mlp


def eval_head_bytes(model: ModelSpec, train: TrainSpec, tokens: int, *, loss: bool, vocab_shard: int = 1) -> dict[str, int]:
    """The head of a no-grad forward for ``tokens`` = b*s tokens: the larger of the lm_head's moment (its
    input, the final norm's output ``h``, next to the ``[b, s, V]`` logits it writes) and, with a loss,
    the loss's forward (:func:`~lightning_memplan.model.terms.logits_bytes` ``"forward"``: the logits, an
    fp32 copy under autocast and the log-probabilities; nothing is held for a backward).

    Returns ``{"activations": ..., "logits": ...}``."""
    pb = terms.precision_bytes(train)
    vocab = math.ceil(model.vocab_size / vocab_shard)
    head_in = tokens * model.hidden * pb.compute
    logits = tokens * vocab * pb.logits
    at_head = {"activations": head_in, "logits": logits}
    if not loss:
        return at_head
    at_loss = {"activations": 0, "logits": terms.logits_bytes(model, train, tokens, vocab_shard=vocab_shard)["forward"]}
    return at_loss if sum(at_loss.values()) > sum(at_head.values()) else at_head


def estimate_eval_memory(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan | None = None,
    *,
    phase: str,
    micro_batch: int,
    seq_len: int,
    grads_alive: bool = True,
    optimizer_states: bool = True,
    kv_cache: bool = False,
    held_hidden: int = 0,
    rank: int | None = None,
) -> MemoryEstimate:
    """Predicted peak allocated-tensor bytes of one evaluation step on one rank (module docstring).

    Args:
        model, train, plan: the run, as for :func:`~lightning_memplan.model.estimate.estimate_memory`
            (``train``'s precision, loss and attention apply; its batch shape is the training one).
        phase: ``"val"``, ``"test"`` or ``"predict"`` (predict computes no loss: logits only).
        micro_batch, seq_len: b and s of the evaluation batch (read from the eval dataloader's batch).
        grads_alive: the last training step's gradients exist (Lightning's ``fit`` frees them before
            validation unless it interrupts gradient accumulation; the callback reads it from the module).
        optimizer_states: the optimizer's states exist (after the first optimizer step).
        kv_cache: the forward keeps every layer's keys and values (a Hugging Face model in eval mode with
            ``config.use_cache=True``, its default: a ``DynamicCache`` is built even without ``generate``):
            ``2 b s k d / t`` elements per block run so far (:func:`eval_kv_cache_bytes`).
        held_hidden: more ``[b, s, h]`` tensors the model's outer forward keeps referenced through the
            blocks and the loss (Hugging Face's ``*ForCausalLM``: 1, ``inputs_embeds`` during the layer
            loop and ``hidden_states`` during the loss; a plain loop that rebinds ``x``: 0).
        rank: a global rank; ``None`` is the worst rank.

    Returns:
        :class:`~lightning_memplan.model.result.MemoryEstimate` whose peak phase is ``"forward"`` (the
        ``backward`` and ``optimizer`` phases hold the same bytes without the transients: nothing runs
        there); ``details`` has ``eval_block_peak`` and ``eval_head_peak``.

    Raises:
        ValueError: an unknown ``phase``, a non-positive shape, a plan that cannot split the model.
        TypeError: an argument of the wrong type.
    """
    phase = check_choice("phase", phase, EVAL_PHASES, hint="the loop the step belongs to")
    b = check_int("micro_batch", micro_batch, hint="rows of the evaluation batch, e.g. micro_batch=8")
    s = check_int("seq_len", seq_len, hint="tokens per row of the evaluation batch, e.g. seq_len=512")
    grads_alive = check_bool("grads_alive", grads_alive)
    optimizer_states = check_bool("optimizer_states", optimizer_states)
    kv_cache = check_bool("kv_cache", kv_cache)
    held_hidden = check_int("held_hidden", held_hidden, minimum=0, maximum=64,
                            hint="[b, s, h] tensors the outer forward keeps alive, e.g. 1 for a Hugging Face model")
    plan = plan if plan is not None else ParallelPlan()
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan={plan!r} must be a ParallelPlan (or None for one device)")
    rank = check_optional_int("rank", rank, minimum=0, maximum=plan.world_size - 1,
                              hint=f"a global rank of this plan's {plan.world_size} ranks, or None for the worst one")
    if not isinstance(train, TrainSpec):
        raise TypeError(f"train={train!r} must be a TrainSpec")
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model={model!r} must be a ModelSpec")
    # The model states as the training estimate holds them (analytic: traced coefficients describe a
    # training step's dynamic terms, not these). One micro-batch and no accumulation: nothing in flight.
    analytic_model = dataclasses.replace(model, calibration_source=None) if model.calibration_source else model
    eval_train = train.replace(micro_batch=b, seq_len=s, grad_accumulation=1)
    state = _EvalState(phase=phase, grads_alive=grads_alive, optimizer_states=optimizer_states, kv_cache=kv_cache,
                       held_hidden=held_hidden)
    if rank is not None:
        return _eval_rank(analytic_model, eval_train, plan, state, rank)
    ranks_per_stage = plan.dp * plan.cp * plan.tp
    candidates = [_eval_rank(analytic_model, eval_train, plan, state, stage * ranks_per_stage) for stage in range(plan.pp)]
    return max(candidates, key=lambda e: e.total)


def eval_kv_cache_bytes(model: ModelSpec, train: TrainSpec, b: int, s: int, n_layers: int, *, t: int = 1) -> int:
    """Keys and values of ``n_layers`` blocks kept by a cache: ``2 L b s (k / t) d`` elements in the compute
    dtype (Hugging Face ``DynamicCache.update`` keeps each layer's ``key_states`` / ``value_states``)."""
    return 2 * n_layers * b * s * math.ceil(model.kv_heads / t) * model.dim_head * terms.precision_bytes(train).compute


@dataclasses.dataclass(frozen=True)
class _EvalState:
    """What exists beside the eval step's own tensors (the arguments of :func:`estimate_eval_memory`)."""

    phase: str
    grads_alive: bool
    optimizer_states: bool
    kv_cache: bool
    held_hidden: int


def _eval_rank(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, state: _EvalState, rank: int) -> MemoryEstimate:
    phase, grads_alive, optimizer_states = state.phase, state.grads_alive, state.optimizer_states
    training = estimate_memory(model, train, plan, rank=rank)
    kept = training.by_phase["optimizer"]  # model states, persistent comm buffers; nothing batch-shaped
    forward = training.by_phase["forward"]
    static = {
        "params": kept["params"],
        "grads": kept["grads"] if grads_alive else 0,
        "optimizer": kept["optimizer"] if optimizer_states else 0,
        "master": kept["master"],
        # FSDP's gathered units and DDP's buckets as in the training forward; autocast's weight copies
        "comm": forward["comm"],
        "other": forward["other"],
    }
    layout = stage_layout(model, plan, training.stage, train.framework)
    t, sp = plan.tp, plan.sp
    b, s = train.micro_batch, train.seq_len // plan.cp
    tokens = b * s
    pb = terms.precision_bytes(train)
    residual = tokens * model.hidden * pb.residual // (t if sp else 1)
    held = state.held_hidden * tokens * model.hidden * pb.compute
    cache = eval_kv_cache_bytes(model, train, b, s, layout.n_layers, t=t) if state.kv_cache else 0
    block = eval_block_working_bytes(model, train, b, s, t=t) if layout.n_layers else {"activations": 0, "attention": 0}
    # the last block's working set: every block's keys and values are cached by then
    at_block = {"activations": residual + held + cache + block["activations"], "attention": block["attention"], "logits": 0}
    at_head = {"activations": 0, "attention": 0, "logits": 0}
    if layout.has_head:
        shard = t if train.loss in terms.VOCAB_SHARDED_LOSSES else 1
        head = eval_head_bytes(model, train, tokens, loss=phase in _LOSS_PHASES, vocab_shard=shard)
        at_head = {"activations": head["activations"] + held + cache, "attention": 0, "logits": head["logits"]}
    dynamic = at_head if sum(at_head.values()) > sum(at_block.values()) else at_block
    peak = {c: 0 for c in COMPONENTS}
    peak.update(static)
    peak.update(dynamic)
    rest = {c: 0 for c in COMPONENTS}
    rest.update(static)
    by_phase = {"forward": peak, **{p: dict(rest) for p in PHASES if p != "forward"}}
    details = {
        "eval_block_peak": sum(at_block.values()),
        "eval_head_peak": sum(at_head.values()),
        "eval_grads_alive": int(grads_alive),
        "eval_optimizer_states": int(optimizer_states),
        "eval_kv_cache": cache,
        "layers_on_stage": layout.n_layers,
    }
    return MemoryEstimate(
        **peak, peak_phase="forward", rank=rank, stage=training.stage, by_phase=by_phase, details=details,
        source="analytic",
    )
