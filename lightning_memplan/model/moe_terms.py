"""Activation terms of mixture-of-experts blocks and multi-head latent attention, each term a function
with its formula and source (as ``model/terms.py``).

Each token of an MoE block goes through the router and its k routed experts (``experts_per_token``)
and every shared expert; the bytes saved for backward are counted per token as autograd saves them in
transformers 5.3's expert kernels (``models/mixtral/modeling_mixtral.py`` ``MixtralExperts.forward``:
``index`` the expert's rows, ``linear(x, gate_up_proj[e])``, ``act(gate) * up``, ``linear(.., down_proj[e])``,
``* routing_weights``; ``MixtralSparseMoeBlock``: ``softmax(router_logits, dtype=float)``, ``topk``).
Symbols as in docs/concepts.md and ``model/param_counts.py``.
"""

from __future__ import annotations

from lightning_memplan.model.experts import is_moe, moe_layer_count, uses_mla
from lightning_memplan.model.specs import ModelSpec

__all__ = ["FP32_BYTES", "INDEX_BYTES", "mean_mlp_saved_bytes", "mla_attention_saved_bytes", "moe_mlp_saved_bytes"]

FP32_BYTES = 4
#: ``torch.topk``/``where`` indices are int64.
INDEX_BYTES = 8


def moe_mlp_saved_bytes(model: ModelSpec, tokens: int, compute: int, *, t: int = 1, cast: bool = False,
                        swiglu_saved: int = 4, expert_bytes: int | None = None) -> int:
    """Bytes one MoE block's MLP saves for ``tokens`` tokens (``c`` = ``compute`` bytes, t tensor-parallel;
    ``expert_bytes``: the element size the routed experts compute in, ``c`` when ``None``):

    - router: its input ``tokens*h`` (a 16-bit copy under autocast, else the norm output itself: counted
      once), the fp32 routing probabilities ``tokens*E*4`` (softmax saves its output), the top-k weights
      and indices ``tokens*k*(4 + 8)``;
    - routed experts: each token's row gathered for each of its k experts, ``k*tokens*h``; the SwiGLU
      ``swiglu_saved*k*tokens*f_e/t`` (gate/up output, activation, product; 2 for gelu/relu); the
      experts' outputs that the routing-weight multiply saves, ``k*tokens*h``, all at ``expert_bytes``.
      transformers' default expert kernel (``experts_implementation`` unset resolves to ``"grouped_mm"``,
      ``modeling_utils.py`` ``get_correct_experts_implementation``) is not autocast-enabled and casts its
      input to the weights' dtype (``integrations/moe.py`` ``_grouped_mm``: ``input.to(weight.dtype)``), so
      under ``bf16-mixed`` (fp32 weights) the routed experts compute and save in fp32, not bf16: the
      caller passes the parameters' element size;
    - shared experts: a dense MLP each, ``swiglu_saved*tokens*f_s/t`` (and 2 input copies under autocast
      for separate gate/up projections), Qwen2-MoE's gate ``tokens*h`` output when it has one.

    Assumes the token-choice eager loop (no capacity factor, no dropped tokens); expert parallelism
    (tokens exchanged all-to-all between ranks) is not modelled.
    """
    h, k, e = model.hidden, model.experts_per_token or 0, model.n_experts
    per_expert = swiglu_saved if model.ffn_kind == "swiglu" else 2
    router = (tokens * h * compute if cast else 0) + tokens * e * FP32_BYTES + tokens * k * (FP32_BYTES + INDEX_BYTES)
    ce = compute if expert_bytes is None else expert_bytes
    routed = 2 * k * tokens * h * ce + per_expert * k * tokens * (model.expert_ffn // t) * ce
    shared = 0
    if model.n_shared_experts:
        copies = 2 if (cast and model.ffn_kind == "swiglu") else (1 if cast else 0)
        shared = model.n_shared_experts * (copies * tokens * h + per_expert * tokens * (model.shared_expert_ffn // t)) * compute
        if model.shared_expert_gate:
            shared += tokens * h * compute  # the shared expert's output, saved by the gate multiply
    # without autocast the router's input is the norm output: the one ``s*b*h`` every MLP input counts
    return router + routed + shared + (0 if cast else tokens * h * compute)


def mean_mlp_saved_bytes(model: ModelSpec, dense_mlp: int, moe_mlp: int) -> int:
    """The mean MLP bytes per block of a stack with ``L_moe`` MoE blocks and ``L - L_moe`` dense ones
    (the total over the stack is exact; a pipeline stage takes its share of blocks at this mean)."""
    if not is_moe(model):
        return dense_mlp
    n_moe = moe_layer_count(model)
    return (n_moe * moe_mlp + (model.n_layers - n_moe) * dense_mlp) // model.n_layers


def mla_attention_saved_bytes(model: ModelSpec, tokens: int, compute: int, *, t: int = 1) -> int | None:
    """Bytes multi-head latent attention saves besides its norms (``None`` when it is not MLA):
    the latents ``tokens*(r_q + r_kv)`` twice (the latent norm's output that ``q_b_proj``/``kv_b_proj``
    save, and the norm's input), q and k at ``a*(d_n + d_r)`` and v at ``a*d_v`` per token as the
    kernel receives them, and the output ``a*d_v`` saved by ``o_proj`` (``modeling_deepseek_v3.py``
    ``DeepseekV3Attention``); heads split by t."""
    if not uses_mla(model):
        return None
    a = model.n_heads // t
    qk = (model.qk_nope_head_dim or 0) + (model.qk_rope_head_dim or 0)
    v = model.v_head_dim or 0
    latents = 2 * tokens * ((model.q_lora_rank or 0) + (model.kv_lora_rank or 0))
    return (latents + tokens * a * (2 * qk + v) + tokens * a * v) * compute
