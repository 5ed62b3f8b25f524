"""memplan_auto's activation checkpointing on a Hugging Face Llama (issue 33): the model's key/value cache
(``config.use_cache``, on by default) grows with every forward, so a checkpointed block's recomputed forward
saw ``[b, kv, 2 s, d]`` keys where its first pass saved ``[b, kv, s, d]`` and ``torch.utils.checkpoint``
raised ``CheckpointError`` in the first backward (the calibrated check's traced step failed the same way).
``use_cache`` is turned off with the checkpointing, as transformers' ``gradient_checkpointing_enable`` does,
and the step's gradients equal the unchanged model's."""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.parallel.fsdp import apply_activation_checkpointing

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("recompute", ["full", "selective", "selective_op"])
def test_checkpointed_llama_runs_backward_with_its_cache_off(recompute):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = _llama()
    reference.model(input_ids=ids)  # the cache on: what the unwrapped model does
    reference(input_ids=ids, labels=ids).loss.backward()
    model = _llama()
    assert model.config.use_cache
    note = apply_activation_checkpointing(find_layout(model), recompute)
    assert "config.use_cache set to False" in note and not model.config.use_cache
    model(input_ids=ids, labels=ids).loss.backward()  # CheckpointError before
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
