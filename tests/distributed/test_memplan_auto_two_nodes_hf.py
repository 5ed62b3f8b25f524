"""memplan_auto on 2 nodes x 2 processes, launched as Lightning launches a multi-node job: one process per
node started with ``NODE_RANK`` (and a shared ``MASTER_ADDR`` / free ``MASTER_PORT``), each running
``Trainer(num_nodes=2, devices=2, accelerator="cpu")``, whose subprocess script launcher starts the
node's second process by re-running the script (so the script is a real file, written into
``tmp_path``). A tiny Hugging Face Llama (config only, no download), forced into two layouts through
``MemplanAutoStrategy(plan=...)``: dp=4 (replication across the nodes) and dp=2 x tp=2 (tensor parallel
inside a node, data parallel across them). On every rank the ``MemoryPlanCallback`` estimate must come
from a traced step of the run's own module (``"calibrated"``) and be within ``RTOL`` of its measured peak
(the tensor tracker's live bytes) on each tracked step after the warm-up one.

Issue 27 measured +8.9 % (dp=4) and +9.2 % (dp2 x tp2) on every rank, from the analytic model: the
callback skipped calibration for a module memplan_auto had sharded, and the estimate kept the untied
embedding and lm_head in FSDP2's root unit where the strategy gives them units of their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lightning_memplan.testing import find_free_port

pytest.importorskip("transformers", reason="real Hugging Face models")

pytestmark = pytest.mark.hf

RTOL = 0.05
NODES, DEVICES = 2, 2
#: Hard bound on the whole launch (both node processes and the children they start).
TIMEOUT_S = 300

SCRIPT = textwrap.dedent(
    """
    import json, os, sys

    import lightning as L
    import torch
    import transformers
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memplan import MemoryPlanCallback, ParallelPlan
    from lightning_memplan.strategies import MemplanAutoStrategy

    VOCAB, SEQ, BATCH, STEPS = 256, 32, 2, 2
    LAYOUTS = {"dp4": ParallelPlan(dp=4), "dp2xtp2": ParallelPlan(dp=2, tp=2)}


    class LitHF(L.LightningModule):
        def __init__(self):
            super().__init__()
            config = transformers.LlamaConfig(
                num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=172, vocab_size=VOCAB, max_position_embeddings=SEQ)
            torch.manual_seed(0)
            self.model = transformers.AutoModelForCausalLM.from_config(config)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)


    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS * 4, SEQ), generator=torch.Generator().manual_seed(1))
    for name, plan in LAYOUTS.items():
        callback = MemoryPlanCallback(measure_every_n_steps=1, print_report=False, write_files=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, num_nodes=2, strategy=MemplanAutoStrategy(plan=plan), max_steps=STEPS,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[callback], default_root_dir=os.path.join(out_dir, name),
        )
        trainer.fit(LitHF(), DataLoader(TensorDataset(tokens), batch_size=BATCH))
        rank = trainer.global_rank
        summary = next(r for r in callback.report.epochs[-1].ranks if r.rank == rank)
        result = {
            "rank": rank, "node": trainer.node_rank, "world": trainer.world_size,
            "applied": trainer.strategy.applied_plan.describe(),
            "source": callback.report.run["estimate_source"],
            "steps": [(r.step, r.estimated_peak, r.measured_peak) for r in summary.tracked if not r.warmup],
            "notes": list(callback.report.notes),
        }
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as fh:
            json.dump(result, fh)
    """
)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _launch(tmp_path) -> list[tuple[int | None, str]]:
    """Start one process per node, as a multi-node job does, and wait for both nodes, the processes their
    launchers start included, within ``TIMEOUT_S`` (then every one is killed); ``(exit code or None on
    a hang, output tail)`` per node."""
    script = tmp_path / "two_nodes.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), OMP_NUM_THREADS="1")
    procs, logs = [], []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for node in range(NODES):
            log = open(tmp_path / f"node{node}.log", "w+")  # noqa: SIM115 - closed below
            logs.append(log)
            # a session of its own per node: its launcher's child is in the same process group
            procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path,
                                          env={**env, "NODE_RANK": str(node)}, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        while any(_group_alive(proc.pid) for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.2)  # the launchers' children finish after their parents
    finally:
        for proc in procs:
            if _group_alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tails = []
    for log in logs:
        log.seek(0)
        tails.append(log.read()[-3000:])
        log.close()
    return list(zip(codes, tails, strict=True))


@pytest.mark.distributed
@pytest.mark.slow
def test_memplan_auto_on_two_nodes_is_calibrated_within_5_percent_on_every_rank(tmp_path):
    for node, (code, tail) in enumerate(_launch(tmp_path)):
        assert code == 0, f"node {node} exited with {code} (None: still running after {TIMEOUT_S} s):\n{tail}"
    for name, applied in (("dp4", "dp=4"), ("dp2xtp2", "dp=2 tp=2")):
        results = [json.loads((tmp_path / f"{name}.rank{rank}.json").read_text()) for rank in range(NODES * DEVICES)]
        assert [r["node"] for r in results] == [0, 0, 1, 1]  # ranks 0-1 on node 0, 2-3 on node 1
        for r in results:
            assert r["world"] == NODES * DEVICES and r["applied"] == applied, r
            assert r["source"] == "calibrated", (name, r["rank"], r["source"], r["notes"])
            assert r["steps"], (name, r["rank"], "no steady step was tracked")
            for step, est, meas in r["steps"]:
                print(f"{name} rank {r['rank']} (node {r['node']}) step {step}: estimate {est:,} B, "
                      f"measured {meas:,} B, {est / meas - 1:+.2%}")
                assert est == pytest.approx(meas, rel=RTOL), (name, r["rank"], step, est, meas)
