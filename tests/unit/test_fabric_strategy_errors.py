"""``Fabric(strategy="memplan_auto")``: registration without importing Lightning, and the errors raised
before any process group exists (bad arguments, a forced pipeline, an accelerator it cannot drive)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_memplan.model.specs import ParallelPlan

L = pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]


def test_import_registers_for_fabric_without_importing_lightning():
    code = (
        "import sys; import lightning_memplan\n"
        "assert not any(m == 'lightning' or m.startswith('lightning.') for m in sys.modules), 'eager import'\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "assert 'memplan_auto' in STRATEGY_REGISTRY\n"
        "import lightning as L\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'memplan_auto' in StrategyRegistry\n"
        "fabric = L.Fabric(strategy='memplan_auto', accelerator='cpu', devices=1)\n"
        "print(type(fabric.strategy).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MemplanAutoFabricStrategy"


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"memory_budget": 0}, ValueError, "memory_budget=0"),
        ({"plan": "dp=2"}, TypeError, "plan='dp=2'"),
        ({"train": {"micro_batch": 1}}, TypeError, "train="),
        ({"headroom": 1.0}, ValueError, "headroom=1.0"),
        ({"memory_budjet": 1}, TypeError, "MemplanAutoFabricStrategy(memory_budjet=1): unknown option"),
        # pipeline parallelism is refused under Fabric, naming the Trainer strategy that runs it
        ({"plan": ParallelPlan(pp=2, microbatches=2)}, ValueError, "MemplanAutoStrategy(plan=...)"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, exc, words):
    from lightning_memplan.fabric import MemplanAutoFabricStrategy

    with pytest.raises(exc, match=re.escape(words)):
        MemplanAutoFabricStrategy(**kwargs)


class _NoCollectivesAccelerator(L.fabric.accelerators.Accelerator):
    """An accelerator that is neither CPU nor CUDA (as MPS or XLA would be to memplan_auto)."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    @staticmethod
    def parse_devices(devices):
        return int(devices)

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cpu")] * int(devices)

    @staticmethod
    def auto_device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    @classmethod
    def name(cls):
        return "no_collectives"


def test_unsupported_accelerator_is_rejected_when_fabric_is_built():
    import lightning_memplan  # noqa: F401 - registers "memplan_auto"

    initialized = torch.distributed.is_initialized()  # an earlier test in this process may have made one
    with pytest.raises(ValueError, match=r"_NoCollectivesAccelerator.*Fabric\(accelerator='cpu'\)"):
        L.Fabric(accelerator=_NoCollectivesAccelerator(), devices=1, strategy="memplan_auto")
    assert torch.distributed.is_initialized() == initialized  # rejected before any process group
