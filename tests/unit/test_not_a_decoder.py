"""``monitoring.first_batch.not_a_decoder``: which Hugging Face models the analytic terms (decoder-only
language models) do not describe, read from the model (its config and ``can_generate()``)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_memplan.monitoring.first_batch import not_a_decoder

pytestmark = pytest.mark.hf
transformers = pytest.importorskip("transformers", reason="real Hugging Face models from small configs")

_TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
         "vocab_size": 64}


class _Wrapper(nn.Module):
    """A LightningModule-like holder: the Hugging Face model is a submodule."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


@pytest.mark.parametrize(("model", "expected"), [
    (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY)), None),
    (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2,
                                                                  vocab_size=64)), None),
    (lambda: transformers.BertForMaskedLM(transformers.BertConfig(**_TINY)),
     "BertForMaskedLM is not a decoder-only language model"),
    (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)),
     "T5ForConditionalGeneration is an encoder-decoder model"),
])
def test_decoders_pass_and_encoders_and_encoder_decoders_are_named(model, expected) -> None:
    found = not_a_decoder(_Wrapper(model()))
    assert (found is None) if expected is None else (found is not None and found.startswith(expected)), found


def test_a_module_without_a_hugging_face_model_is_left_to_its_layout() -> None:
    assert not_a_decoder(nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4))) is None
