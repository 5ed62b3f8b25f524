"""A rank that hangs (rather than dies) before memplan_auto's rank agreement makes both ranks fail within
a stated bound, each error naming the stalled rank (parallel/stall.py).

Two gloo processes are started as plain subprocesses (not ``run_distributed``, which terminates the
others as soon as one fails: here each process's own exit, its time and its message are the result).
The process group exists before ``fit`` (as under torchrun with an explicit ``init_process_group``);
rank 1 then sleeps ``STALL_S`` seconds before calling ``fit``. With ``MEMPLAN_STALL_TIMEOUT_S=T``:

- rank 0 must fail within ``T`` (+ the fit's own setup, bounded generously by ``SETUP_S``), its
  ``StallError`` naming rank 1;
- rank 1 must fail as soon as it reaches the agreement (within ``STALL_S + SETUP_S``), naming itself.

Without the rendezvous, rank 0 would wait in the broadcast for the collective timeout (here 120 s,
30 minutes by default) and rank 1 would then hang or fail with a bare collective error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_memplan.parallel.stall import STALL_TIMEOUT_ENV
from lightning_memplan.testing import find_free_port

T = 3.0  # MEMPLAN_STALL_TIMEOUT_S in the test: the bound on the peers' wait
STALL_S = 12.0  # how long rank 1 hangs (> T: it is a stall, not a slow start)
SETUP_S = 20.0  # generous bound on a tiny fit's own setup before the agreement (imports excluded)

WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys, time
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning_memplan.strategies import MemplanAutoStrategy
    from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(32, 1, 16, 2, max_positions=8))

        def training_step(self, batch, batch_idx):
            return causal_lm_loss(self.model, *batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    rank, out, stall = int(os.environ["RANK"]), sys.argv[1], float(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    start = time.monotonic()
    try:
        if rank == 1:
            time.sleep(stall)
        tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
        data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MemplanAutoStrategy(memory_budget=2**30),
                            max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
        status = "ok"
    except BaseException as exc:
        status = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as fh:
        json.dump({"status": status, "elapsed": time.monotonic() - start}, fh)
    os._exit(0 if status == "ok" else 1)
    """
)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_stalled_rank_fails_every_rank_in_bounded_time_naming_it(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = find_free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", NODE_RANK="0", **{STALL_TIMEOUT_ENV: str(T)})
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"rank{rank}.json"), str(STALL_S)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        ))
    deadline = time.monotonic() + 150
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a rank hung past the bound: " + (proc.stderr.read()[-2000:] if proc.stderr else ""))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert codes == [1, 1], results
    rank0, rank1 = results
    # rank 1 hangs before fit: rank 0 stops at memplan's first rendezvous (before Lightning's first collective)
    assert rank0["status"].startswith("StallError") and "rank(s) [1] did not reach the start of fit" in rank0["status"]
    assert rank0["elapsed"] < T + SETUP_S, rank0
    assert rank0["elapsed"] >= T  # it waited the stated time, no less
    assert rank1["status"].startswith("StallError") and "rank 1 stalled" in rank1["status"], rank1
    assert rank1["elapsed"] < STALL_S + SETUP_S, rank1
    assert STALL_TIMEOUT_ENV in rank0["status"] and STALL_TIMEOUT_ENV in rank1["status"]  # says how to change it
