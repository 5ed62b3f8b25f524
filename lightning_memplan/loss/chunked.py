"""The chunked linear cross-entropy autograd function (one process or one rank's vocabulary slice).

Only a [chunk, V_r] slice of logits exists at any moment (V_r = V on one process, the local vocab
slice under vocab parallelism). For ``reduction="mean"|"sum"`` the gradients are computed inside the
forward pass, chunk by chunk, while the chunk's logits are at hand (the approach of Liger-Kernel's
fused linear cross-entropy and of torch's ``LinearCrossEntropyOptions`` path): the step then costs the
same three GEMMs as the naive loss (logits, input grad, weight grad) instead of four with a backward
recompute. The backward scales the stored ``[N, h]`` input gradient and the fp32 ``[V_r, h]`` weight
gradient by the incoming ``grad_output``, so gradient-accumulation scaling, a GradScaler or
``manual_backward`` are honoured. ``reduction="none"`` has a per-token ``grad_output`` that cannot be
folded into a precomputed weight gradient, so there the forward saves only the per-token
log-sum-exp and the backward recomputes each chunk's logits.

No ``.item()`` or other host synchronisation, no ``.backward()`` inside forward. The stored gradients
are scaled in place by the backward, so a second backward through the same graph
(``retain_graph=True``) raises instead of returning a gradient scaled twice, unless the call opted in
with ``allow_retain_graph=True`` (torch's ``LinearCrossEntropyOptions`` makes the same trade).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_memplan.loss.formulas import (
    apply_softcap_,
    combine_entropy,
    combine_lse,
    entropy_partial,
    gradient_row_scale,
    local_entropy,
    softcap_derivative,
    token_loss,
)
from lightning_memplan.model.terms import LOSS_WEIGHT_GRAD_BLOCK_BYTES, loss_gemm_bytes

__all__ = ["ChunkPlan", "ChunkedLinearCrossEntropyFunction", "STAT_FIELDS"]

STAT_FIELDS = ("n_tokens", "correct", "entropy_sum", "lse_sq_sum")
"""Order of the non-differentiable statistics vector returned next to the loss (sums over tokens)."""

_ARGMAX_SENTINEL = torch.iinfo(torch.int64).max

# CPU GEMMs of a 16-bit compute dtype. torch's CPU bf16/fp16 GEMM is slow on CPUs without native
# bf16 instructions (no AVX512-BF16/AMX). Measured with torch 2.13 on one core of the reference
# machine (AMD EPYC, AVX2; 128 token rows, h=1024, V=65536; seconds): the logits x·Wᵀ take 1.90 in
# bf16 and 0.58 in fp32; the input gradient g·W 131 (g row-major) or 1.00 (g column-major) in bf16
# and 0.32 in fp32; the weight gradient gᵀ·x 5.9 in bf16 and 0.80 in fp32. So on CPU the three GEMMs
# run in fp32 on operands rounded to the compute dtype: the products and their fp32 sums are those of
# a 16-bit GEMM with fp32 accumulation, only the output's rounding to 16 bit is skipped. The price is
# fp32 copies of the weight and the hidden states (V·h·4 + N·h·4 bytes; the rule is
# :func:`lightning_memplan.model.terms.loss_gemm_bytes`, which the estimate shares). CUDA keeps the
# 16-bit GEMMs (tensor cores).


@dataclass(frozen=True, kw_only=True)
class ChunkPlan:
    """Resolved, tensor-free settings of one call of :class:`ChunkedLinearCrossEntropyFunction`."""

    ignore_index: int
    """Ignored target id."""
    reduction: str
    """``"mean"``, ``"sum"`` or ``"none"``."""
    label_smoothing: float
    """ε in [0, 1)."""
    z_loss: float
    """λ ≥ 0."""
    softcap: float | None
    """c > 0 or None."""
    chunk_size: int
    """Token rows per chunk."""
    compute_dtype: torch.dtype
    """GEMM dtype (the autocast dtype under autocast, else the weight's dtype)."""
    accum_dtype: torch.dtype
    """Weight/bias gradient accumulator dtype."""
    metrics: bool
    """Whether to compute accuracy/entropy statistics."""
    allow_retain_graph: bool = False
    """Scale the precomputed gradients out of place (one more [V_r, h] buffer in backward) so that
    the graph can be backpropagated more than once (``retain_graph=True``, ``gradcheck``)."""
    grad_enabled: bool
    """Whether autograd will need gradients (``torch.is_grad_enabled()`` at the call)."""
    group: Any = None
    """Vocab-parallel process group, or None for one process."""
    vocab_offset: Any = 0
    """Global id of the first local vocabulary row (int or 0-dim int64 tensor)."""
    inv_vocab: Any = 1.0
    """1/V for the global V (float or 0-dim tensor)."""


class _ChunkRunner:
    """Buffers and the per-chunk loop shared by the forward and the ``"none"`` backward."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        plan: ChunkPlan,
        *,
        need_grads: tuple[bool, bool, bool],
    ) -> None:
        self.plan = plan
        compute = plan.compute_dtype
        self.work_dtype = torch.float64 if compute == torch.float64 else torch.float32
        # the GEMM dtype: see the CPU note above
        same = loss_gemm_bytes(compute.itemsize, hidden.device.type) == compute.itemsize
        self.gemm_dtype = compute if same else self.work_dtype
        self.x = _operand(hidden, compute, self.gemm_dtype)
        self.w = _operand(weight, compute, self.gemm_dtype)
        self.b = None if bias is None else bias.to(self.work_dtype)
        self.n, self.h = self.x.shape
        self.v_local = self.w.shape[0]
        self.need_gx, self.need_gw, self.need_gb = need_grads
        self.any_grad = self.need_gx or self.need_gw or self.need_gb
        self.valid = target != plan.ignore_index
        local = target - plan.vocab_offset
        self.in_shard = self.valid & (local >= 0) & (local < self.v_local)
        self.index = torch.where(self.in_shard, local, torch.zeros_like(local)).unsqueeze(1)
        self.target = target
        rows = min(plan.chunk_size, max(self.n, 1))
        device = self.x.device
        self.buf = torch.empty(rows, self.v_local, dtype=self.work_dtype, device=device)
        self.low = (
            torch.empty(rows, self.v_local, dtype=self.gemm_dtype, device=device)
            if self.gemm_dtype != self.work_dtype
            else None
        )
        self.deriv = (
            torch.empty(rows, self.v_local, dtype=self.work_dtype, device=device)
            if plan.softcap is not None and self.any_grad
            else None
        )
        acc_dtype = torch.float64 if self.work_dtype == torch.float64 else plan.accum_dtype
        self.gx: torch.Tensor | None = None
        if self.need_gx:
            # In the hidden states' own dtype, filled chunk by chunk (no [N, h] cast at the end); fp32
            # under vocab parallelism, where the ranks' partial sums are all-reduced.
            gx_dtype = self.work_dtype if plan.group is not None else hidden.dtype
            self.gx = torch.empty(self.n, self.h, dtype=gx_dtype, device=device)
        self.gw = torch.zeros(self.v_local, self.h, dtype=acc_dtype, device=device) if self.need_gw else None
        self.gb = torch.zeros(self.v_local, dtype=acc_dtype, device=device) if self.need_gb else None

    def _logits(self, start: int, end: int) -> torch.Tensor:
        """Chunk logits ``x_c·Wᵀ (+ b)`` in the fp32 work buffer, soft-capped."""
        c = end - start
        out = self.buf[:c]
        if self.low is None:
            torch.mm(self.x[start:end], self.w.t(), out=out)
        else:
            torch.mm(self.x[start:end], self.w.t(), out=self.low[:c])
            out.copy_(self.low[:c])
        if self.b is not None:
            out.add_(self.b)
        if self.plan.softcap is not None:
            apply_softcap_(out, self.plan.softcap)
            if self.deriv is not None:
                softcap_derivative(out, self.plan.softcap, out=self.deriv[:c])
        return out

    def run(
        self,
        token_weight: torch.Tensor | None,
        *,
        saved_lse: torch.Tensor | None = None,
        loss_out: torch.Tensor | None = None,
        lse_out: torch.Tensor | None = None,
        stats_out: torch.Tensor | None = None,
    ) -> None:
        """Loop over token chunks: loss statistics (forward) and/or gradients (``token_weight``)."""
        plan = self.plan
        eps = plan.label_smoothing
        group = plan.group if saved_lse is None else None
        for start in range(0, self.n, plan.chunk_size):
            end = min(self.n, start + plan.chunk_size)
            logits = self._logits(start, end)
            index = self.index[start:end]
            in_shard = self.in_shard[start:end]
            target_logit = torch.where(in_shard, logits.gather(1, index).squeeze(1), 0.0)
            sum_logits = logits.sum(1) if eps > 0.0 and saved_lse is None else None
            need_stats = stats_out is not None and plan.metrics
            if need_stats:
                row_max, arg = logits.max(1)
            else:
                row_max = logits.amax(1)
            logits.sub_(row_max.unsqueeze(1)).exp_()
            sumexp = logits.sum(1)
            if saved_lse is not None:
                lse = saved_lse[start:end]
            else:
                lse_local = combine_lse(row_max, sumexp)
                entropy = local_entropy(logits, sumexp) if need_stats else None
                if group is None:
                    lse = lse_local
                    pred = arg if need_stats else None
                else:
                    lse, target_logit, sum_logits, entropy, pred = _combine_ranks(
                        group,
                        lse_local,
                        target_logit,
                        sum_logits,
                        entropy,
                        row_max if need_stats else None,
                        arg if need_stats else None,
                        plan.vocab_offset,
                    )
                if lse_out is not None:
                    lse_out[start:end] = lse
                valid = self.valid[start:end]
                if loss_out is not None:
                    loss = token_loss(
                        lse,
                        target_logit,
                        sum_logits,
                        label_smoothing=eps,
                        inv_vocab=plan.inv_vocab,
                        z_loss=plan.z_loss,
                    )
                    loss_out[start:end] = torch.where(valid, loss, 0.0)
                if need_stats:
                    assert stats_out is not None and pred is not None and entropy is not None
                    validf = valid.to(self.work_dtype)
                    target = self.target[start:end] if group is not None else self.index[start:end, 0]
                    stats_out[1] += ((pred == target) & valid).sum()
                    stats_out[2] += (entropy * validf).sum()
                    stats_out[3] += (lse * lse * validf).sum()
            if token_weight is not None:
                self._gradients(logits, start, end, token_weight[start:end], lse, row_max)
        if self.gx is not None and token_weight is not None and plan.group is not None:
            # Each rank holds the partial Σ_{j∈r} ∂loss/∂z_j·W_j; one all-reduce of the [N, h] input
            # gradient per call (fp32) gives the full one on every rank.
            dist.all_reduce(self.gx, op=dist.ReduceOp.SUM, group=plan.group)

    def _gradients(
        self,
        probs: torch.Tensor,
        start: int,
        end: int,
        weight: torch.Tensor,
        lse: torch.Tensor,
        row_max: torch.Tensor,
    ) -> None:
        """Turn the chunk's ``exp(s - m)`` buffer into ∂loss/∂z in place and apply it to the GEMMs."""
        plan = self.plan
        c = end - start
        probs.mul_(gradient_row_scale(weight, lse, row_max, z_loss=plan.z_loss).unsqueeze(1))
        hit = (-(1.0 - plan.label_smoothing) * weight * self.in_shard[start:end]).to(probs.dtype)
        probs.scatter_add_(1, self.index[start:end], hit.unsqueeze(1))
        if plan.label_smoothing > 0.0:
            probs.sub_((plan.label_smoothing * plan.inv_vocab * weight).to(probs.dtype).unsqueeze(1))
        if self.deriv is not None:
            probs.mul_(self.deriv[:c])
        if self.gb is not None:
            self.gb.add_(probs.sum(0, dtype=self.gb.dtype))
        grad = probs if self.low is None else self.low[:c].copy_(probs)
        if self.gx is not None:
            if self.gx.dtype == grad.dtype:
                torch.mm(grad, self.w, out=self.gx[start:end])
            else:
                self.gx[start:end] = torch.mm(grad, self.w)
        if self.gw is not None:
            _accumulate_weight_grad(self.gw, grad, self.x[start:end])


def _operand(tensor: torch.Tensor, compute: torch.dtype, gemm: torch.dtype) -> torch.Tensor:
    """``tensor`` rounded to the compute dtype, held in the GEMM dtype (no copy when it already is)."""
    if tensor.dtype != compute:
        tensor = tensor.to(compute)
    return tensor if tensor.dtype == gemm else tensor.to(gemm)


def _accumulate_weight_grad(acc: torch.Tensor, grad: torch.Tensor, x_c: torch.Tensor) -> None:
    """``acc += gradᵀ·x_c``; a product in another dtype than ``acc`` is computed per vocab block (at
    most :data:`lightning_memplan.model.terms.LOSS_WEIGHT_GRAD_BLOCK_BYTES` of temporaries: the product and
    the ``add_``'s casts, the figure the estimate counts) and added to it. (torch has no GEMM with a
    16-bit input and an fp32 output on CPU; ``mm(out_dtype=)`` is CUDA only.)"""
    if grad.dtype == acc.dtype:
        acc.addmm_(grad.t(), x_c.to(acc.dtype))
        return
    # The mixed-dtype ``add_`` holds fp32 temporaries of the block next to the product: measured with
    # the profiler's allocator events (torch 2.13 CPU, a 16384 x 256 block), 3x the block's fp32 bytes
    # for an fp32 product into a bf16 accumulator, 3x its bf16 bytes for a bf16 product into fp32.
    per_elem = grad.element_size() + 4 + (4 if acc.element_size() < 4 else 0)
    rows = max(256, LOSS_WEIGHT_GRAD_BLOCK_BYTES // max(x_c.shape[1] * per_elem, 1))
    for v0 in range(0, acc.shape[0], rows):
        v1 = min(acc.shape[0], v0 + rows)
        acc[v0:v1].add_(torch.mm(grad[:, v0:v1].t(), x_c))


def _combine_ranks(
    group: Any,
    lse_local: torch.Tensor,
    target_logit: torch.Tensor,
    sum_logits: torch.Tensor | None,
    entropy: torch.Tensor | None,
    row_max: torch.Tensor | None,
    arg: torch.Tensor | None,
    vocab_offset: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """All-reduce the per-row statistics of one chunk across the vocab-parallel group.

    One MAX (the shift for the log-sum-exp merge and, with metrics, the global max logit), one SUM of
    the packed ``[Σexp(lse_r - M), s_t, Σ_j s_j, entropy summand]`` and, with metrics, one MIN that
    picks the lowest global argmax id among ranks holding the max (ties resolved like ``argmax``).
    """
    maxes = lse_local.unsqueeze(0) if row_max is None else torch.stack([lse_local, row_max])
    maxes = maxes.clone()
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    shift = maxes[0]
    fields = [torch.exp(lse_local - shift), target_logit]
    if sum_logits is not None:
        fields.append(sum_logits)
    if entropy is not None:
        fields.append(entropy_partial(entropy, lse_local, shift))
    packed = torch.stack(fields)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    lse = combine_lse(shift, packed[0])
    pos = 2
    if sum_logits is not None:
        sum_logits = packed[pos]
        pos += 1
    pred = None
    if entropy is not None:
        entropy = combine_entropy(packed[pos], packed[0], lse)
        assert row_max is not None and arg is not None
        cand = torch.where(row_max == maxes[1], arg + vocab_offset, _ARGMAX_SENTINEL)
        dist.all_reduce(cand, op=dist.ReduceOp.MIN, group=group)
        pred = cand
    return lse, packed[1], sum_logits, entropy, pred


class ChunkedLinearCrossEntropyFunction(torch.autograd.Function):
    """``(hidden [N,h], weight [V_r,h], bias [V_r]|None, target [N], plan) -> (loss, stats)``.

    ``loss`` is a 0-dim fp32 tensor (``"mean"``/``"sum"``) or [N] fp32 (``"none"``); ``stats`` is the
    non-differentiable fp32 vector of :data:`STAT_FIELDS` (zeros when ``plan.metrics`` is False).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        plan: ChunkPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        needs = ctx.needs_input_grad
        grads = plan.grad_enabled and any(needs[:3])
        precompute = grads and plan.reduction != "none"
        need = (bool(needs[0]), bool(needs[1]), bool(needs[2])) if precompute else (False, False, False)
        runner = _ChunkRunner(hidden, weight, bias, target, plan, need_grads=need)
        valid = runner.valid
        count = valid.sum()
        denom = count.clamp(min=1).to(runner.work_dtype)
        token_weight = None
        if precompute:
            token_weight = valid.to(runner.work_dtype)
            if plan.reduction == "mean":
                token_weight = token_weight / denom
        per_token = torch.empty(runner.n, dtype=runner.work_dtype, device=hidden.device)
        lse = torch.empty_like(per_token) if grads and plan.reduction == "none" else None
        stats = torch.zeros(len(STAT_FIELDS), dtype=runner.work_dtype, device=hidden.device)
        runner.run(token_weight, loss_out=per_token, lse_out=lse, stats_out=stats)
        stats[0] = count
        if plan.reduction == "none":
            loss = per_token
        else:
            loss = per_token.sum()
            if plan.reduction == "mean":
                loss = loss / denom
        ctx.plan = plan
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.consumed = False
        if precompute:
            gx = runner.gx
            if gx is not None and gx.dtype != hidden.dtype:
                gx = gx.to(hidden.dtype)
            ctx.grads = (gx, runner.gw, runner.gb)
        elif grads:
            ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_stats: torch.Tensor) -> tuple[Any, ...]:
        # Under ``manual_backward`` inside an autocast region the GEMMs must keep the forward's dtypes.
        with torch.autocast(grad_loss.device.type, enabled=False):
            return _backward(ctx, grad_loss)


def _backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
    plan: ChunkPlan = ctx.plan
    hidden_dtype, weight_dtype, bias_dtype = ctx.dtypes
    if plan.reduction != "none" and plan.allow_retain_graph:
        gx, gw, gb = ctx.grads
        g = grad_loss.to(gw.dtype if gw is not None else torch.float32)
        out_x = None if gx is None else gx * g.to(gx.dtype)
        out_w = None if gw is None else (gw * g).to(weight_dtype)
        out_b = None if gb is None else (gb * g).to(bias_dtype)
        return out_x, out_w, out_b, None, None
    if plan.reduction != "none":
        if ctx.consumed:
            raise RuntimeError(
                "linear_cross_entropy: backward ran twice through the same graph; the chunked loss "
                "scales its precomputed gradients in place, so a second backward needs allow_retain_graph=True "
                "(costs one more weight-gradient buffer) or reduction='none'."
            )
        ctx.consumed = True
        gx, gw, gb = ctx.grads
        ctx.grads = None
        g = grad_loss.to(gw.dtype if gw is not None else torch.float32)
        out_x = None if gx is None else gx.mul_(g.to(gx.dtype))
        out_w = None if gw is None else gw.mul_(g).to(weight_dtype)
        out_b = None if gb is None else gb.mul_(g).to(bias_dtype)
        return out_x, out_w, out_b, None, None
    hidden, weight, bias, target, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad
    runner = _ChunkRunner(
        hidden,
        weight,
        bias,
        target,
        plan,
        need_grads=(bool(needs[0]), bool(needs[1]), bias is not None and bool(needs[2])),
    )
    token_weight = grad_loss.to(runner.work_dtype) * runner.valid
    runner.run(token_weight, saved_lse=lse)
    out_x = None if runner.gx is None else runner.gx.to(hidden_dtype)
    out_w = None if runner.gw is None else runner.gw.to(weight_dtype)
    out_b = None if runner.gb is None else runner.gb.to(bias_dtype)
    return out_x, out_w, out_b, None, None
