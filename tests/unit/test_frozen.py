"""A frozen backbone without peft (``requires_grad=False`` set by hand): the layout read from the module,
the analytic estimate against a real step, and nothing moved for a spec without one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.frozen import grad_params, no_grad_prefix, saving_layers
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.testing.zoo import GPT, gpt2_style
from lightning_memplan.tracking.trace import trace_memory


def _gpt(frozen_blocks: int, *, embedding: bool = True, head: bool = False, tied: bool = False, **kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(gpt2_style(vocab_size=320, n_layers=4, hidden=64, n_heads=4, max_positions=96, tied_embeddings=tied,
                           **kw))
    parts = [*model.blocks[:frozen_blocks]]
    if embedding:
        parts += [model.tok_emb, model.pos_emb]
    if head:
        parts += [model.norm_f, model.lm_head]
    for part in parts:
        part.requires_grad_(False)
    return model


def test_the_layout_is_read_from_requires_grad():
    spec = ModelSpec.from_module(_gpt(3))
    assert (spec.frozen_layers, spec.frozen_embedding, spec.frozen_head) == (3, True, False)
    assert spec.n_trainable_params == sum(p.numel() for p in _gpt(3).parameters() if p.requires_grad)
    assert no_grad_prefix(spec) == 3 and saving_layers(spec, 4, first_stage=True) == 1
    assert saving_layers(spec, 2, first_stage=False) == 2  # a later pipeline stage: counted as saving
    trainable_embedding = ModelSpec.from_module(_gpt(2, embedding=False))
    # blocks after a trainable embedding pass its gradient back: they save (an upper bound), nothing is skipped
    assert trainable_embedding.frozen_layers == 2 and no_grad_prefix(trainable_embedding) == 0
    tied = ModelSpec.from_module(_gpt(1, head=True, tied=True))  # the head's matrix is the frozen embedding's
    assert tied.frozen_head and tied.frozen_embedding
    # a trainable final norm beside the frozen tied matrix: the head is not frozen whole (counted whole: an upper bound)
    assert not ModelSpec.from_module(_gpt(1, tied=True)).frozen_head
    nothing = ModelSpec.from_module(_gpt(0, embedding=False))
    assert (nothing.frozen_layers, nothing.frozen_embedding, nothing.frozen_head) == (0, False, False)
    assert "frozen_layers" not in nothing.to_dict()  # a spec without a frozen layout keeps its keys


def test_a_spec_without_a_frozen_layout_estimates_as_before():
    base = ModelSpec.preset("gpt2")
    train = TrainSpec(micro_batch=2, seq_len=256)
    explicit = ModelSpec(**{**base.to_dict(), "frozen_layers": 0, "frozen_embedding": False, "frozen_head": False})
    assert explicit == base and estimate_memory(explicit, train, ParallelPlan()) == estimate_memory(base, train, ParallelPlan())
    assert grad_params(base, 1000, "head") == 1000
    lora = base.with_lora(rank=8)  # peft: frozen weights spread through the blocks, the trainable share
    assert grad_params(lora, 1000, "head") == round(1000 * lora.trainable_fraction)


def test_gradients_follow_the_frozen_parts():
    spec = ModelSpec.from_module(_gpt(3))
    assert grad_params(spec, 1000, "head") == 1000 and grad_params(spec, 1000, "embedding") == 0
    assert grad_params(spec, 1000, "last_block") == 1000  # the top block trains whole
    all_blocks = ModelSpec.from_module(_gpt(4))
    assert grad_params(all_blocks, 1000, "last_block") == 0
    with pytest.raises(ValueError, match="part="):
        grad_params(spec, 1, "neck")


@pytest.mark.parametrize("bad, error", [({"frozen_layers": 5}, ValueError), ({"frozen_layers": True}, TypeError),
                                        ({"frozen_head": "yes"}, TypeError),
                                        ({"frozen_layers": 4, "frozen_embedding": True, "frozen_head": True}, ValueError)])
def test_bad_frozen_fields_are_refused(bad, error):
    with pytest.raises(error, match=next(iter(bad))):
        ModelSpec(n_layers=4, hidden=64, n_heads=4, vocab_size=320, **bad)


def _lm(model, batch):
    idx, targets = batch
    return F.cross_entropy(model.logits(model(idx)).flatten(0, 1), targets.flatten())


# fitted on nothing: the analytic terms; the shapes below were not used to write model/frozen.py
@pytest.mark.parametrize("frozen_blocks", [2, 4])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("shape", [(2, 48), (3, 40)])
def test_analytic_estimate_of_a_frozen_backbone_is_within_5_percent_of_a_real_step(frozen_blocks, attention, shape):
    model = _gpt(frozen_blocks, attention=attention)
    b, s = shape
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 320, (b, s), generator=gen), torch.randint(0, 320, (b, s), generator=gen))
    measured = trace_memory(model, example_input=batch, loss_fn=_lm, optimizer="adamw", fake=False)
    spec = ModelSpec.from_module(model)
    est = estimate_memory(spec, TrainSpec(micro_batch=b, seq_len=s, precision="32-true", attention=attention), ParallelPlan())
    assert abs(est.total / measured.total - 1) <= 0.05, (est.components(), measured.components())
    before = estimate_memory(ModelSpec(**{**spec.to_dict(), "frozen_layers": 0, "frozen_embedding": False}),
                             TrainSpec(micro_batch=b, seq_len=s, precision="32-true", attention=attention), ParallelPlan())
    assert est.total < before.total  # what the backward of the frozen blocks no longer holds
