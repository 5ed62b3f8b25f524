"""Vocab-parallel and vocab + sequence-parallel loss on real gloo processes equal the one-process loss.

Every rank builds the same full tensors from a seed, computes the independent full-logit reference
locally, runs the parallel loss on its shard, and returns both; the parent compares them. V = 41 is
not divisible by 2 or 4, S = 7 not by 2 (uneven vocab and sequence shards).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_memplan.testing.distributed import run_distributed

B, S, H, V = 2, 7, 8, 41
OPTS = {"label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 3.0}


def _full_inputs(seed: int = 0, seq: int = S):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, seq, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    bias = torch.randn(V, generator=g) * 0.3
    target = torch.randint(0, V, (B, seq), generator=g)
    target[0, 1] = -100
    return hidden, weight, bias, target


def _reference(hidden, weight, bias, target, *, reduction="mean", shift=False, **opts):
    """Loss and grads (hidden, weight, bias) from full fp64 logits with F.cross_entropy."""
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    bias = bias.double().requires_grad_()
    h, y = (hidden[:, :-1], target[:, 1:]) if shift else (hidden, target)
    logits = F.linear(h, weight, bias)
    cap = opts.get("softcap")
    if cap:
        logits = cap * torch.tanh(logits / cap)
    flat, yf = logits.reshape(-1, V), y.reshape(-1)
    per = F.cross_entropy(flat, yf, reduction="none", label_smoothing=opts.get("label_smoothing", 0.0))
    valid = yf != -100
    per = per + torch.where(valid, opts.get("z_loss", 0.0) * torch.logsumexp(flat, -1) ** 2, 0.0)
    loss = per.sum() / valid.sum() if reduction == "mean" else per.reshape(y.shape)
    g_out = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64).reshape(loss.shape)
    (loss * g_out).sum().backward()
    return loss.detach(), hidden.grad, weight.grad, bias.grad


def _slices(world):
    """Deliberately uneven plain slices (process_group path): rank r gets sizes[r] rows."""
    sizes = {2: [15, 26], 4: [5, 17, 11, 8]}[world]
    starts = [sum(sizes[:r]) for r in range(world)]
    return sizes, starts


def _process_group_case(rank, world, *, reduction, shift, sequence_parallel, opts):
    import torch.distributed as dist

    from lightning_memplan.loss import linear_cross_entropy

    hidden, weight, bias, target = _full_inputs(seed=1)
    ref = _reference(hidden, weight, bias, target, reduction=reduction, shift=shift, **opts)
    sizes, starts = _slices(world)
    w = weight[starts[rank] : starts[rank] + sizes[rank]].clone().requires_grad_()
    b = bias[starts[rank] : starts[rank] + sizes[rank]].clone().requires_grad_()
    if sequence_parallel:  # equal local sequence lengths on the plain-tensor path: S=8
        hidden, weight, bias, target = _full_inputs(seed=1, seq=8)
        ref = _reference(hidden, weight, bias, target, reduction=reduction, shift=shift, **opts)
        w = weight[starts[rank] : starts[rank] + sizes[rank]].clone().requires_grad_()
        b = bias[starts[rank] : starts[rank] + sizes[rank]].clone().requires_grad_()
        step = 8 // world
        h = hidden[:, rank * step : (rank + 1) * step].clone().requires_grad_()
        y = target[:, rank * step : (rank + 1) * step]
    else:
        h = hidden.clone().requires_grad_()
        y = target
    loss, metrics = linear_cross_entropy(
        h,
        w,
        y,
        bias=b,
        reduction=reduction,
        shift=shift,
        chunk_size=3,
        process_group=dist.group.WORLD,
        sequence_parallel=sequence_parallel,
        return_metrics=True,
        validate_targets=True,
        **opts,
    )
    g_out = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float32).reshape(loss.shape)
    (loss * g_out).sum().backward()
    ref_h = ref[1]
    if sequence_parallel:
        ref_h = ref_h[:, rank * (8 // world) : (rank + 1) * (8 // world)]
    ref_w = ref[2][starts[rank] : starts[rank] + sizes[rank]]
    ref_b = ref[3][starts[rank] : starts[rank] + sizes[rank]]
    return {
        "loss": (loss.detach(), ref[0].float()),
        "hidden": (h.grad, ref_h.float()),
        "weight": (w.grad, ref_w.float()),
        "bias": (b.grad, ref_b.float()),
        "n_tokens": int(metrics.n_tokens),
    }


def _dtensor_case(rank, world, *, sequence_parallel, opts):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from lightning_memplan.loss import LinearCrossEntropy

    hidden, weight, bias, target = _full_inputs(seed=2)
    ref = _reference(hidden, weight, bias, target, shift=True, **opts)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    lm_head = torch.nn.Linear(H, V)
    with torch.no_grad():
        lm_head.weight.copy_(weight)
        lm_head.bias.copy_(bias)
    parallelize_module(lm_head, mesh, ColwiseParallel())  # weight/bias -> DTensor Shard(0), V=41 uneven
    if sequence_parallel:
        h = distribute_tensor(hidden, mesh, [Shard(1)]).requires_grad_()
    else:
        h = hidden.clone().requires_grad_()
    loss_fn = LinearCrossEntropy(shift=True, chunk_size=4, **opts)
    loss = loss_fn(h, lm_head.weight, target, lm_head.bias)
    (
        loss * 0.5
    ).backward()  # the reference's grad_output for a one-element loss is linspace(0.5, 1.5, 1) = 0.5
    grad_h = h.grad.full_tensor() if sequence_parallel else h.grad
    # Wrong-dim DTensor (RowwiseParallel layout: Shard(1) of the [V, h] weight) must be rejected.
    wrong = distribute_tensor(weight, mesh, [Shard(1)])
    try:
        loss_fn(hidden, wrong, target)
        wrong_msg = None
    except ValueError as exc:
        wrong_msg = str(exc)
    return {
        "loss": (loss.detach(), ref[0].float()),
        "hidden": (grad_h, ref[1].float()),
        "weight": (lm_head.weight.grad.full_tensor(), ref[2].float()),
        "bias": (lm_head.bias.grad.full_tensor(), ref[3].float()),
        "placements": str(lm_head.weight.grad.placements),
        "wrong_msg": wrong_msg,
    }


def worker_world2(rank, world):
    return {
        "pg_mean": _process_group_case(
            rank, world, reduction="mean", shift=False, sequence_parallel=False, opts=OPTS
        ),
        "pg_none_shift": _process_group_case(
            rank, world, reduction="none", shift=True, sequence_parallel=False, opts={}
        ),
        "pg_seq": _process_group_case(
            rank, world, reduction="mean", shift=True, sequence_parallel=True, opts=OPTS
        ),
        "dt_vocab": _dtensor_case(rank, world, sequence_parallel=False, opts=OPTS),
        "dt_vocab_seq": _dtensor_case(rank, world, sequence_parallel=True, opts=OPTS),
    }


def worker_world4(rank, world):
    return {"dt_vocab_seq": _dtensor_case(rank, world, sequence_parallel=True, opts=OPTS)}


def _check(results, cases):
    for rank, per_rank in enumerate(results):
        for case in cases:
            out = per_rank[case]
            for key in ("loss", "hidden", "weight", "bias"):
                got, want = out[key]
                torch.testing.assert_close(
                    got,
                    want,
                    atol=2e-5,
                    rtol=2e-5,
                    msg=lambda m, r=rank, c=case, k=key: f"rank {r} {c} {k}: {m}",
                )


@pytest.mark.distributed
def test_vocab_parallel_world2_matches_single_process():
    results = run_distributed(worker_world2, 2)
    _check(results, ["pg_mean", "pg_none_shift", "pg_seq", "dt_vocab", "dt_vocab_seq"])
    # the (replicated) loss and the token count agree on every rank
    assert results[0]["pg_mean"]["n_tokens"] == results[1]["pg_mean"]["n_tokens"] == B * S - 1
    assert "Shard(dim=0)" in results[0]["dt_vocab"]["placements"]
    msg = results[0]["dt_vocab"]["wrong_msg"]
    assert msg is not None and "Shard(dim=1)" in msg and "(41, 8)" in msg and "ColwiseParallel" in msg


@pytest.mark.distributed
@pytest.mark.slow
def test_vocab_and_sequence_parallel_world4_matches_single_process():
    results = run_distributed(worker_world4, 4)
    _check(results, ["dt_vocab_seq"])  # V=41 over 4 ranks: 11/11/11/8 rows; S=7: 2/2/2/1 tokens
