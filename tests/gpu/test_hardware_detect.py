"""HardwareSpec.detect() on a real CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.hardware import HardwareSpec, match_device_name

pytestmark = pytest.mark.gpu


def test_detect_matches_the_driver():
    hw = HardwareSpec.detect()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    _, total = torch.cuda.mem_get_info()
    assert hw.memory_bytes == total
    assert hw.gpus_per_node == torch.cuda.device_count()
    chip = match_device_name(props.name)
    if chip is None:
        assert hw.fallback
    else:
        assert not hw.fallback and hw.peak_flops == chip.peak_flops
        # the driver reports a little less than the datasheet capacity (ECC/driver reservations)
        assert 0.9 * chip.memory_bytes <= hw.memory_bytes <= 1.02 * chip.memory_bytes
    assert hw.intra_node_bw is not None and hw.intra_node_bw > 0


def test_detect_is_a_plannable_spec():
    from lightning_memplan.model.specs import ModelSpec, TrainSpec
    from lightning_memplan.planning import plan

    hw = HardwareSpec.detect()
    decision = plan(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=1, seq_len=256), hw)
    assert decision.fits and decision.plan.world_size == hw.world_size
    assert decision.budget.device == hw.memory_bytes  # the budget starts from the detected memory
