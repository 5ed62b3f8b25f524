"""Hand-written ``torch.utils.checkpoint`` seen from what the step does (tracking/recompute.py): every block
run again in the backward is full recompute, some is partial, none is none; the code scan is the
fallback without a step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_memplan.testing.zoo import GPT, Block, gpt2_style
from lightning_memplan.tracking.recompute import RecomputeObserver, RecomputeSeen, written_checkpointing
from lightning_memplan.tracking.trace import trace_memory


class _Checkpointed(nn.Module):
    """The zoo GPT's blocks run under ``checkpoint`` by hand: every one (``every=1``), every other one, or in
    ``checkpoint_sequential`` segments; ``reentrant`` picks the autograd form."""

    def __init__(self, mode: str, reentrant: bool = False) -> None:
        super().__init__()
        self.gpt = GPT(gpt2_style(vocab_size=128, n_layers=4, hidden=32, n_heads=2, max_positions=32))
        self.mode, self.reentrant = mode, reentrant

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.gpt.embed(idx)
        if self.mode == "sequential":
            x = ckpt.checkpoint_sequential(self.gpt.blocks, 2, x, use_reentrant=self.reentrant)
        else:
            for i, block in enumerate(self.gpt.blocks):
                run = self.mode == "every" or (self.mode == "half" and i % 2 == 0)
                x = checkpoint(block, x, use_reentrant=self.reentrant) if run else block(x)
        return self.gpt.logits(self.gpt.norm_f(x))


def _seen(module: nn.Module, fake: bool = True) -> RecomputeSeen:
    batch = torch.randint(0, 128, (2, 16))
    with RecomputeObserver({Block}) as observer:
        trace_memory(module, example_input=batch, fake=fake,
                     loss_fn=lambda m, b: F.cross_entropy(m(b).flatten(0, 1), b.flatten()))
    return observer.seen


@pytest.mark.parametrize("reentrant", [False, True])
def test_every_block_checkpointed_is_full_recompute(reentrant):
    seen = _seen(_Checkpointed("every", reentrant))
    assert seen.blocks == seen.rebuilt == 2 * 4  # two traced steps of four blocks, each run again
    assert seen.recompute == "full" and seen.describe() is None


def test_partial_and_none_are_told_apart():
    half = _seen(_Checkpointed("half"))
    assert half.recompute == "none" and half.rebuilt == half.blocks // 2 and "partial" in half.describe()
    sequential = _seen(_Checkpointed("sequential"), fake=False)  # the last segment is never checkpointed
    assert sequential.recompute == "none" and 0 < sequential.rebuilt < sequential.blocks
    plain = _seen(_Checkpointed("none"))
    assert plain == RecomputeSeen(blocks=8) and plain.describe() is None


def test_checkpointing_inside_the_blocks_is_a_note():
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + checkpoint(block[0], x, use_reentrant=False)
            return x

    with RecomputeObserver({nn.Sequential}) as observer:
        Inner()(torch.randn(2, 8, requires_grad=True)).sum().backward()
    seen = observer.seen
    assert seen.recompute == "none" and seen.others_rebuilt == 2 and "inside the blocks" in seen.describe()


def test_the_hook_is_gone_after_the_block():
    with RecomputeObserver({Block}) as observer:
        pass
    GPT(gpt2_style(vocab_size=16, n_layers=1, hidden=8, n_heads=2))(torch.randint(0, 16, (1, 4)))
    assert observer.seen == RecomputeSeen()


def test_the_code_scan_finds_each_way_of_calling_checkpoint():
    assert written_checkpointing(_Checkpointed("every")) == ["_Checkpointed.forward"]
    assert written_checkpointing(GPT(gpt2_style(vocab_size=16, n_layers=1, hidden=8, n_heads=2))) == []

    class ViaTorch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)

    assert written_checkpointing(ViaTorch()) == ["ViaTorch.forward"]
