"""PyTorch's ``loss_parallel()`` working set against the estimate's ``loss="loss_parallel"`` term.

torchtitan's TP recipe computes ``F.cross_entropy(pred.flatten(0, 1).float(), labels)`` on DTensor
logits sharded ``Shard(-1)`` inside ``torch.distributed.tensor.parallel.loss_parallel()``. Its forward
(``_log_softmax``) and fused backward (``_nll_loss_and_log_softmax_backward``) hold more [N, V/t] fp32
buffers than the fused log_softmax kernels: measured here with ``TensorTracker`` on 2 gloo ranks, the
phase peaks are 14.0E / 16.0E (bf16 logits) and 12.0E / 16.0E (fp32), E = N * V / t local elements;
:func:`lightning_memplan.model.terms.logits_bytes` must be within 5 % of both.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_memplan.model import terms
from lightning_memplan.model.sizes import kernels_of
from lightning_memplan.model.specs import ModelSpec, TrainSpec
from lightning_memplan.testing import run_distributed

N, V, WORLD = 1024, 2048, 2
RTOL = 0.05


def _measure(rank: int, world: int, dtype: torch.dtype) -> dict:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_memplan.tracking import TensorTracker

    mesh = _mesh(world)
    torch.manual_seed(0)
    full = torch.randn(N, V, dtype=dtype)
    target = torch.randint(0, V, (N,))
    leaf = full.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
    tracker = TensorTracker(None, seq_len=None, vocab_size=None, device="cpu")
    tracker.start()
    pred = DTensor.from_local(leaf * 1, mesh, [Shard(-1)])  # a fresh [N, V/t] tensor, as the lm_head's output
    with loss_parallel():
        loss = F.cross_entropy(pred.float(), target)
        del pred  # torchtitan's train loop drops the logits before backward
        tracker.set_phase("backward")
        loss.backward()
    tracker.stop()
    report = tracker.report()
    reference = F.cross_entropy(full.float(), target)
    return {"phases": {p: sum(c.values()) for p, c in report.by_phase.items()},
            "loss": float(loss.full_tensor() if isinstance(loss, DTensor) else loss), "reference": float(reference)}


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _worker(rank: int, world: int) -> dict:
    return {e: _measure(rank, world, dtype) for e, dtype in ((2, torch.bfloat16), (4, torch.float32))}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_loss_parallel_working_set_matches_the_estimate():
    results = run_distributed(_worker, WORLD, timeout_s=150)
    model = ModelSpec(1, 64, 4, V, name="vocab-only")
    for e in (2, 4):
        train = TrainSpec(micro_batch=1, seq_len=N, loss="loss_parallel", activation_bytes=e)
        est = terms.logits_bytes(model, kernels_of(train), N, vocab_shard=WORLD)
        for per_rank in results:
            res = per_rank[e]
            assert res["loss"] == pytest.approx(res["reference"], rel=1e-2 if e == 2 else 1e-5)
            for phase in ("forward", "backward"):
                measured = res["phases"][phase]
                assert abs(est[phase] / measured - 1) <= RTOL, (e, phase, est[phase], measured)
