"""MemoryPlanCallback on a CUDA device: allocator peaks per phase, headroom from mem_get_info, and the
calibrated estimate next to the measurement. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from test_callback_helpers import LitGPT, make_trainer, token_loader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.testing.zoo import gpt2_style


@pytest.mark.gpu
def test_cuda_allocator_measurement_per_phase(tmp_path):
    config = gpt2_style()
    cb = MemoryPlanCallback(print_report=False)
    trainer = make_trainer(tmp_path, [cb], accelerator="cuda", limit_train_batches=6)
    trainer.fit(LitGPT(config), token_loader(config, 4, [64, 128], 6))
    rank0 = cb.report.epochs[0].ranks[0]
    assert rank0.backend == "cuda" and rank0.steps == 6
    # Every step measured (not only tracked ones), each phase has its own peak, and the step's peak is
    # the largest phase peak.
    assert set(rank0.measured_phase_peaks) == {"forward", "backward", "optimizer"}
    assert rank0.measured_peak == max(rank0.measured_phase_peaks.values())
    assert rank0.reserved >= rank0.measured_peak
    free, total = torch.cuda.mem_get_info()
    assert rank0.device_memory == total and 0 < rank0.headroom < total
    # The calibrated estimate (traced on CPU) against the allocator: within 10% (the allocator adds
    # cuBLAS workspaces and rounds blocks to 512 bytes, which the tensor model does not see).
    assert cb.report.run["estimate_source"] == "calibrated", cb.report.notes
    assert rank0.ratio == pytest.approx(1.0, abs=0.10)
