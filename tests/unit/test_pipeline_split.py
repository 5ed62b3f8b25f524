"""The pipeline split keeps on each stage only what that stage runs, for nested layouts too: a Hugging
Face ``LlamaForCausalLM``'s first-stage module is ``model.embed_tokens`` (nested), its last-stage ones
``model.norm`` and ``lm_head``. Issue 17: stage 1 kept ``model.embed_tokens`` (its parameter bytes
showed in the measurement) because the names were looked up as top-level attributes only.

No process group is needed: the split reads only the pipeline mesh's size and this rank's index.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.parallel.pipeline import PipelineRunner

transformers = pytest.importorskip("transformers", reason="the Hugging Face Llama layout needs transformers")

pytestmark = pytest.mark.hf


class PipelinedLlama(transformers.LlamaForCausalLM):
    """The pipeline contract on a Llama (``pipeline_forward``); first/last modules from the layout."""

    def pipeline_forward(self, x, blocks, *, first, last):  # pragma: no cover - not run here
        raise NotImplementedError


def _stage(pp_rank: int) -> tuple[torch.nn.Module, set[str]]:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = PipelinedLlama(config)
    mesh = SimpleNamespace(size=lambda: 2, get_local_rank=lambda: pp_rank)
    runner = PipelineRunner(model, find_layout(model), mesh, torch.device("cpu"), microbatches=2, schedule="1f1b",
                            virtual_stages=1)
    return model, {n for m in runner.modules for n, _ in m.named_parameters()}


def test_each_stage_keeps_only_its_nested_parts():
    first, first_params = _stage(0)
    assert first.model.embed_tokens is not None and first.model.norm is None and first.lm_head is None
    assert sorted(first.model.layers.keys()) == ["0", "1"]
    last, last_params = _stage(1)
    assert last.model.embed_tokens is None  # was kept: the nested name was looked up on the root only
    assert last.model.norm is not None and last.lm_head is not None
    assert sorted(last.model.layers.keys()) == ["2", "3"]
    assert not any("embed_tokens" in n for n in last_params)
    assert any("embed_tokens" in n for n in first_params) and not any("lm_head" in n for n in first_params)
