"""The ``plan`` subcommand through the real entry point ``lightning_memplan.cli.main``."""

from __future__ import annotations

import json
import time

import pytest

from lightning_memplan.cli import main
from lightning_memplan.cli.plan import parse_allow, parse_bytes
from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.model.specs import ModelSpec, TrainSpec
from lightning_memplan.planning import PlanDecision, plan

GiB = 2**30
ISSUE_EXAMPLE = ["plan", "--model", "llama3-70b", "--hardware", "h100-80gb", "--gpus-per-node", "8", "--nodes", "32",
                 "--seq-len", "8192", "--global-batch", "1024"]


def test_issue_example_prints_decision_and_alternatives(capsys):
    t0 = time.perf_counter()
    assert main(ISSUE_EXAMPLE) == 0
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr().out
    expected = plan(ModelSpec.preset("llama3-70b"), TrainSpec(micro_batch=1, seq_len=8192),
                    HardwareSpec.preset("h100-80gb", gpus_per_node=8, num_nodes=32), global_batch=1024)
    assert f"chosen: {expected.plan.describe()}" in out
    assert "ranked candidates" in out and "rejected:" in out and "memory at the peak" in out
    assert "n_kv_heads=8 not divisible by tp=16" in out
    assert elapsed < 30  # generous: CI machines are shared; the planner itself is timed in test_planner


def test_json_output_round_trips(capsys):
    assert main(ISSUE_EXAMPLE[:-2] + ["--global-batch", "256", "--nodes", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    d = PlanDecision.from_dict(data)
    assert d.fits and d.plan.world_size == 32 and d.global_batch == 256
    assert data["candidates"][0]["plan"] == d.plan.to_dict()


def test_markdown_and_allow(capsys):
    argv = ["plan", "--model", "gpt2", "--hardware", "a100-80gb", "--gpus-per-node", "4", "--seq-len", "1024",
            "--micro-batch", "4", "--allow", "tp", "--markdown"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("## Parallel plan") and "dp=1 tp=" in out  # data parallelism not allowed


def test_nothing_fits_exit_status_and_suggestions(capsys):
    argv = ["plan", "--model", "llama-7b", "--hardware", "l4", "--gpus-per-node", "1", "--seq-len", "2048"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "changes that would make it fit" in out and "the fewest that fit" in out


def test_bad_input_is_a_clear_error(capsys):
    assert main(["plan", "--model", "gpt2", "--hardware", "h300", "--seq-len", "128"]) == 2
    err = capsys.readouterr().err
    assert "hardware preset 'h300' is unknown" in err and "h100-sxm" in err
    assert main(["plan", "--model", "gpt2", "--hardware", "l4", "--seq-len", "128", "--memory-budget", "0"]) == 2
    assert "memory_budget=0" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt2", "--hardware", "l4", "--gpus-per-node", "8", "--seq-len", "128",
                 "--global-batch", "12", "--allow", "dp"]) == 2
    assert "global_batch=12 is not divisible" in capsys.readouterr().err


def test_parse_helpers():
    assert parse_bytes("70GiB") == 70 * GiB and parse_bytes("75 GB") == 75 * 10**9
    assert parse_bytes("70") == 70 * GiB and parse_bytes("7.5e10") == 75 * 10**9
    with pytest.raises(ValueError, match="unknown unit"):
        parse_bytes("3 parsecs")
    assert parse_allow(None) is None
    assert parse_allow(["dp,fsdp", "tp"]) == ("dp", "fsdp", "tp")
    mixed = parse_allow(["dp,tp", "tp=1,2", "recompute=none", "sp=false"])
    assert mixed["tp"] == [1, 2] and mixed["recompute"] == ["none"] and mixed["sp"] == [False]
    assert mixed["pp"] == [1] and mixed["cp"] == [1]  # axes not named stay at 1
    with pytest.raises(ValueError, match="integers"):
        parse_allow(["tp=two"])


def test_without_hardware_detects_the_local_machine(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", "--model", "gpt2", "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "hardware cpu (" in out and "step time not modelled on CPU" in out  # speeds unknown: said, not hidden
