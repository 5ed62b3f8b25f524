"""The built-in pipeline slice forward of a Hugging Face ``LlamaForCausalLM`` reproduces the model's own
forward (the independent reference: transformers' ``LlamaForCausalLM.forward`` logits) when its stages
are run one after the other, for SDPA and eager attention (eager needs the explicit causal mask)."""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.parallel.pipeline import _stage_parts, pipeline_blocker, split_blocks

transformers = pytest.importorskip("transformers", reason="the Hugging Face Llama layout needs transformers")
pytest.importorskip("transformers.masking_utils", reason="the built-in HF pipeline forward needs transformers >= 4.53")

pytestmark = pytest.mark.hf


def _llama(attn: str, layers: int = 4) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_stage_slices_in_sequence_equal_the_hf_forward(attn, n_stages):
    model = _llama(attn)
    layout = find_layout(model)
    assert layout is not None and pipeline_blocker(layout, n_stages) is None
    forward, first_names, last_names = _stage_parts(layout)
    assert first_names == ("model.embed_tokens",) and last_names == ("model.norm", "lm_head")
    blocks = layout.block_list
    x = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = x
        for i, r in enumerate(split_blocks(len(blocks), n_stages)):
            h = forward(model, h, [blocks[j] for j in r], first=i == 0, last=i == n_stages - 1)
        want = model(input_ids=x).logits
    torch.testing.assert_close(h, want, rtol=0, atol=1e-6)


def test_other_hf_llama_family_models_need_their_own_contract():
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)
    layout = find_layout(transformers.MistralForCausalLM(config))
    assert layout is not None and layout.family == "hf-llama"
    why = pipeline_blocker(layout, 2)
    assert why is not None and "model_type='mistral'" in why and "pipeline_forward" in why


def test_a_lightning_module_must_state_the_hf_loss_to_pipeline():
    """Under PP the schedule replaces ``training_step``; a Hugging Face model shifts its labels inside,
    so without ``pipeline_loss`` the module is not pipelined (nothing silently changes the loss)."""
    import lightning as L

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama("sdpa", layers=2)

    class Stated(Plain):
        def pipeline_loss(self, logits, labels):
            return self.model.loss_function(logits=logits, labels=labels, vocab_size=64)

    for cls, blocked in ((Plain, True), (Stated, False)):
        module = cls()
        why = pipeline_blocker(find_layout(module), 2, module=module)
        assert (why is not None) == blocked, why
        if blocked:
            assert "pipeline_loss" in why and "shifted" in why
