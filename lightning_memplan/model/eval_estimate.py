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

A step that also calls a Hugging Face model's greedy ``generate(max_new_tokens=g)`` on its batch
(``generate_tokens=g``) holds, at the end, every layer's keys and values of ``s + g - 1`` tokens in a
``DynamicCache`` (:func:`eval_generate_bytes`); the step's peak is the larger of its forward and its
``generate``.

Not modelled: predictions Lightning keeps across batches (``trainer.predict(return_predictions=True)``),
the pipeline schedule's micro-batching of an evaluation (one micro-batch of ``micro_batch`` rows is
assumed in flight), and sampling or beam search inside ``generate`` (greedy decoding only: beams multiply
the cache by their number).

Symbols as in ``docs/concepts.md``: b micro-batch, s sequence length, h hidden, a heads, k kv-heads,
f ffn hidden, V vocab, t tensor-parallel, c context-parallel.
"""

from __future__ import annotations

import dataclasses
import math

from lightning_memplan.model import terms
from lightning_memplan.model.estimate import estimate_memory, stage_layout
from lightning_memplan.model.result import COMPONENTS, PHASES, MemoryEstimate
from lightning_memplan.model.sizes import Kernels, PrecisionBytes, kernels_of
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.validation import check_bool, check_choice, check_int, check_optional_int

__all__ = [
    "EVAL_PHASES",
    "GENERATE_ID_TENSORS",
    "estimate_eval_memory",
    "eval_block_working_bytes",
    "eval_generate_bytes",
    "eval_head_bytes",
    "eval_kv_cache_bytes",
]

#: The evaluation phases of a run, as Lightning's loops name their metrics' stage
#: (``memplan/val/...``, ``memplan/test/...``, ``memplan/predict/...``).
EVAL_PHASES: tuple[str, ...] = ("val", "test", "predict")
#: Phases whose step computes a loss (predict returns the logits).
_LOSS_PHASES = ("val", "test")
#: ``[b, s + i]`` int64 tensors a greedy ``generate`` rebuilds one token longer at every step: the ids
#: (``input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)``, ``_sample``), the attention mask
#: (a default ``torch.ones`` when none is passed, ``_prepare_attention_mask_for_generation``; extended in
#: ``_update_model_kwargs_for_generation``) and the position ids (``attention_mask.long().cumsum(-1) - 1``,
#: ``_prepare_position_ids_for_generation``): transformers 5.3 ``generation/utils.py``.
GENERATE_ID_TENSORS = 3
#: Longest ``generate_tokens`` accepted (a bound on the argument, far above any real generation).
_MAX_GENERATE_TOKENS = 2**24


def eval_block_working_bytes(model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1) -> dict[str, int]:
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
    pb = kernels.sizes
    tokens = b * s
    d = model.dim_head
    attn_elems = tokens * (2 * model.hidden + 3 * model.n_heads * d // t + 2 * model.kv_heads * d // t)
    scores = 0
    if kernels.attention == "eager":
        score_bytes = terms.FP32_BYTES if pb.autocast_copy else pb.compute
        scores = 2 * b * (model.n_heads // t) * s * s * score_bytes + s * s * terms.MASK_BYTES
    ffn_tensors = 3 if model.ffn_kind == "swiglu" else 2
    mlp_elems = tokens * (model.hidden + ffn_tensors * math.ceil(model.ffn / t))
    attn = {"activations": attn_elems * pb.compute, "attention": scores}
    mlp = {"activations": tokens * model.hidden * pb.residual + mlp_elems * pb.compute, "attention": 0}
    return attn if sum(attn.values()) >= sum(mlp.values()) else mlp


def eval_head_bytes(model: ModelSpec, kernels: Kernels, tokens: int, *, loss: bool, vocab_shard: int = 1) -> dict[str, int]:
    """The head of a no-grad forward for ``tokens`` = b*s tokens: the larger of the lm_head's moment (its
    input, the final norm's output ``h``, next to the ``[b, s, V]`` logits it writes) and, with a loss,
    the loss's forward (:func:`~lightning_memplan.model.terms.logits_bytes` ``"forward"``: the logits, an
    fp32 copy under autocast and the log-probabilities; nothing is held for a backward).

    Returns ``{"activations": ..., "logits": ...}``."""
    pb = kernels.sizes
    vocab = math.ceil(model.vocab_size / vocab_shard)
    head_in = tokens * model.hidden * pb.compute
    logits = tokens * vocab * pb.logits
    at_head = {"activations": head_in, "logits": logits}
    if not loss:
        return at_head
    at_loss = {"activations": 0, "logits": terms.logits_bytes(model, kernels, tokens, vocab_shard=vocab_shard)["forward"]}
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
    generate_tokens: int = 0,
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
        generate_tokens: g, the ``max_new_tokens`` of a greedy Hugging Face ``generate`` the step also
            runs on its batch (the ``[b, s]`` prompt); 0 (the default) when it runs none. Its peak
            (:func:`eval_generate_bytes`: the ``DynamicCache`` of ``s + g - 1`` tokens and the last
            position's logits) is compared with the step's forward; the larger is the step's.
        rank: a global rank; ``None`` is the worst rank.

    Returns:
        :class:`~lightning_memplan.model.result.MemoryEstimate` whose peak phase is ``"forward"`` (the
        ``backward`` and ``optimizer`` phases hold the same bytes without the transients: nothing runs
        there); ``details`` has ``eval_block_peak``, ``eval_head_peak`` and, with ``generate_tokens``,
        ``eval_generate_peak`` and ``eval_generate_cache`` (the cache at the end of the generation).

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
    generate_tokens = check_int("generate_tokens", generate_tokens, minimum=0, maximum=_MAX_GENERATE_TOKENS,
                                hint="the max_new_tokens of the step's generate call, or 0 for none; e.g. generate_tokens=64")
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
                       held_hidden=held_hidden, generate_tokens=generate_tokens)
    if rank is not None:
        return _eval_rank(analytic_model, eval_train, plan, state, rank)
    ranks_per_stage = plan.dp * plan.cp * plan.tp
    candidates = [_eval_rank(analytic_model, eval_train, plan, state, stage * ranks_per_stage) for stage in range(plan.pp)]
    return max(candidates, key=lambda e: e.total)


def eval_kv_cache_bytes(model: ModelSpec, sizes: PrecisionBytes, b: int, s: int, n_layers: int, *, t: int = 1) -> int:
    """Keys and values of ``n_layers`` blocks kept by a cache: ``2 L b s (k / t) d`` elements in the compute
    dtype (Hugging Face ``DynamicCache.update`` keeps each layer's ``key_states`` / ``value_states``)."""
    return 2 * n_layers * b * s * math.ceil(model.kv_heads / t) * model.dim_head * sizes.compute


def eval_generate_bytes(
    model: ModelSpec, kernels: Kernels, b: int, s: int, g: int, n_layers: int, *, t: int = 1, has_head: bool = True,
    held_hidden: int = 0,
) -> dict[str, int]:
    """The peak of a greedy ``generate(prompt, max_new_tokens=g, do_sample=False)`` under ``no_grad`` on a
    ``[b, s]`` prompt, for ``n_layers`` blocks on one of t tensor-parallel ranks, beside the model states and
    the prompt (not counted here). Read from transformers 5.3 ``generation/utils.py`` (``_sample``,
    ``_prefill``) and ``cache_utils.py`` (``DynamicLayer.update``):

    - the prefill runs the s prompt tokens as one no-grad forward (the largest block's working set,
      :func:`eval_block_working_bytes`, next to the residual stream, ``held_hidden`` ``[b, s, h]`` tensors,
      the cache of every block at s tokens, the mask and position ids, and RoPE's ``cos``/``sin``
      ``[b, s, d]`` built from the per-row position ids); ``generate`` sets ``model_kwargs["logits_to_keep"]
      = 1`` when the model's forward takes it (``GenerationMixin.generate``), so its head writes ``[b, 1, V]``;
    - each of the next g - 1 forwards runs one token per row; ``DynamicLayer.update`` grows a layer's cache
      with ``self.keys = torch.cat([self.keys, key_states], dim=-2)`` and then the values, so while the
      last block of the last step concatenates its values, its old values (``s + g - 2`` tokens) exist next
      to the new ones: the cache of all blocks at ``n = s + g - 1`` tokens (``2 L b n (k/t) d`` elements,
      :func:`eval_kv_cache_bytes`) plus half a layer's at ``n - 1``;
    - the logits: ``next_token_logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32)``
      keeps one ``[b, V]`` fp32 row per step (the previous step's until the next is made; ``del outputs``
      frees the ``[b, 1, V]`` output), so at the head of the last step the ``[b, 1, V]`` logits sit next to
      the old and the new fp32 copies;
    - :data:`GENERATE_ID_TENSORS` int64 ``[b, n]`` tensors (ids, attention mask, position ids).

    Returns ``{"activations": ..., "attention": ..., "logits": ...}`` at the largest of the prefill's block,
    the prefill's head, the last step's concatenation and the last step's head (the cache is counted as
    activations, as :func:`estimate_eval_memory` counts a forward's cache). ``g = 0`` is no generation
    (all zero); ``g = 1`` runs the prefill only.
    """
    zero = {"activations": 0, "attention": 0, "logits": 0}
    if g <= 0:
        return zero
    pb = kernels.sizes
    h, vocab = model.hidden, model.vocab_size
    fp32_row = b * vocab * terms.FP32_BYTES if has_head else 0  # one next_token_logits
    head_out = b * vocab * pb.logits if has_head else 0  # the [b, 1, V] output of logits_to_keep=1
    tokens = b * s
    # prefill: the prompt's mask and position ids (the ids are the prompt itself), RoPE's per-row tables
    ids = (GENERATE_ID_TENSORS - 1) * tokens * terms.TOKEN_ID_BYTES
    rope = 2 * tokens * model.dim_head * pb.residual if model.position_embedding == "rope" else 0
    cache = eval_kv_cache_bytes(model, pb, b, s, n_layers, t=t)
    block = eval_block_working_bytes(model, kernels, b, s, t=t) if n_layers else {"activations": 0, "attention": 0}
    stream = tokens * h * pb.residual + held_hidden * tokens * h * pb.compute
    moments = [
        {"activations": stream + cache + ids + rope + block["activations"], "attention": block["attention"], "logits": 0},
        # the head, after the inner model returned (its residual stream, held inputs and RoPE tables are
        # gone): the final norm's [b, s, h] output in the residual dtype (the lm_head reads its last
        # position), the [b, 1, V] logits and their fp32 copy
        {"activations": tokens * h * pb.residual + cache + ids, "attention": 0, "logits": head_out + fp32_row},
    ]
    if g >= 2:
        n = s + g - 1  # tokens cached by the last forward: the prompt, then g - 1 single-token steps
        cache = eval_kv_cache_bytes(model, pb, b, n, n_layers, t=t)
        old_values = eval_kv_cache_bytes(model, pb, b, n - 1, 1, t=t) // 2 if n_layers else 0
        ids = GENERATE_ID_TENSORS * b * n * terms.TOKEN_ID_BYTES
        step = eval_block_working_bytes(model, kernels, b, 1, t=t) if n_layers else {"activations": 0, "attention": 0}
        row_stream = b * h * pb.residual + held_hidden * b * h * pb.compute
        moments += [
            {"activations": row_stream + cache + old_values + ids + step["activations"], "attention": step["attention"],
             "logits": fp32_row},
            {"activations": b * h * pb.residual + cache + ids, "attention": 0, "logits": head_out + 2 * fp32_row},
        ]
    return max(moments, key=lambda m: sum(m.values()))


@dataclasses.dataclass(frozen=True)
class _EvalState:
    """What exists beside the eval step's own tensors (the arguments of :func:`estimate_eval_memory`)."""

    phase: str
    grads_alive: bool
    optimizer_states: bool
    kv_cache: bool
    held_hidden: int
    generate_tokens: int = 0


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
        # FSDP's gathered units and DDP's buckets as in the training forward; autocast's weight copies and
        # the evaluation batch (its token ids and targets, one batch of b rows: no pipeline micro-batching)
        "comm": forward["comm"],
        "other": forward["other"] - training.details["batch_input"] + terms.batch_input_bytes(train.micro_batch * train.seq_len),
    }
    layout = stage_layout(model, plan, training.stage, train.framework)
    t, sp = plan.tp, plan.sp
    b, s = train.micro_batch, train.seq_len // plan.cp
    tokens = b * s
    kernels = kernels_of(train)
    pb = kernels.sizes
    residual = tokens * model.hidden * pb.residual // (t if sp else 1)
    held = state.held_hidden * tokens * model.hidden * pb.compute
    cache = eval_kv_cache_bytes(model, pb, b, s, layout.n_layers, t=t) if state.kv_cache else 0
    block = eval_block_working_bytes(model, kernels, b, s, t=t) if layout.n_layers else {"activations": 0, "attention": 0}
    # the last block's working set: every block's keys and values are cached by then
    at_block = {"activations": residual + held + cache + block["activations"], "attention": block["attention"], "logits": 0}
    at_head = {"activations": 0, "attention": 0, "logits": 0}
    if layout.has_head:
        shard = t if kernels.loss in terms.VOCAB_SHARDED_LOSSES else 1
        head = eval_head_bytes(model, kernels, tokens, loss=phase in _LOSS_PHASES, vocab_shard=shard)
        at_head = {"activations": head["activations"] + held + cache, "attention": 0, "logits": head["logits"]}
    dynamic = at_head if sum(at_head.values()) > sum(at_block.values()) else at_block
    # a generate call on the batch (the whole [b, s] prompt: generation runs no context parallelism)
    at_generate = eval_generate_bytes(model, kernels, b, train.seq_len, state.generate_tokens, layout.n_layers, t=t,
                                      has_head=layout.has_head, held_hidden=state.held_hidden)
    if sum(at_generate.values()) > sum(dynamic.values()):
        dynamic = at_generate
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
    if state.generate_tokens:
        details["eval_generate_peak"] = sum(at_generate.values())
        details["eval_generate_cache"] = eval_kv_cache_bytes(
            model, pb, b, train.seq_len + state.generate_tokens - 1, layout.n_layers, t=t)
    return MemoryEstimate(
        **peak, peak_phase="forward", rank=rank, stage=training.stage, by_phase=by_phase, details=details,
        source="analytic", host=training.host,  # what offloading keeps on the host (model/offload.py) stays there
    )
