"""Implementation variants that move memory: the RMSNorm (``TrainSpec.norm_impl``) and RoPE.

The independent reference is PyTorch's ``MemTracker`` on a real CPU forward of a stack of small
Llama-style blocks written here, whose norm is ``torch.nn.RMSNorm``, Hugging Face's ``LlamaRMSNorm``
(composite: the normalised tensor cast back to bf16) or Gemma's ``GemmaRMSNorm`` (composite, product in
fp32), and whose RoPE is Hugging Face's ``rotate_half`` in the activation dtype or torchtitan's complex
multiply in fp32. The bytes the forward leaves saved for backward are compared with ``L`` times
:func:`~lightning_memplan.model.terms.layer_activation_bytes` for the variant the module is detected
as, and for a wrong one (which must miss, or the test could not fail).

bf16-true, because on CPU that is where the variants differ: a composite RMSNorm whose input is fp32
saves what the ATen one does (``8h + 4`` bytes per token); on CUDA they differ under bf16-mixed too
(hand-worked below).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_memplan.model import checkpointing as ck
from lightning_memplan.model import terms
from lightning_memplan.model.introspect import norm_impl_of
from lightning_memplan.model.specs import NORM_IMPLS, ModelSpec, TrainSpec

transformers = pytest.importorskip("transformers", reason="Hugging Face's RMSNorm classes are the reference")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb  # noqa: E402

from lightning_memplan.model.sizes import kernels_of  # noqa: E402

pytestmark = pytest.mark.hf

B, S, H, A, L = 2, 64, 128, 4, 2
DH = H // A
F_HIDDEN = H  # a narrow MLP, so the norms are a large share of a block (~40%)


def _rotate_half_rope(q: torch.Tensor, k: torch.Tensor, tables: nn.Module):
    """Hugging Face's RoPE (modeling_llama.apply_rotary_pos_emb) in the activation dtype, [b, a, s, d_h]."""
    return apply_rotary_pos_emb(q, k, tables.cos[None], tables.sin[None])


def _complex_rope(q: torch.Tensor, k: torch.Tensor, tables: nn.Module):
    """torchtitan's ``apply_rotary_emb`` (models/llama3/model/model.py): fp32 complex multiply, then back."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * tables.freqs_cis).flatten(-2).type_as(x)

    return rotate(q), rotate(k)


class _Block(nn.Module):
    def __init__(self, norm: type[nn.Module], rope) -> None:
        super().__init__()
        self.norm1, self.norm2 = norm(H), norm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(H, F_HIDDEN, bias=False), nn.Linear(H, F_HIDDEN, bias=False)
        self.down = nn.Linear(F_HIDDEN, H, bias=False)
        self.rope = rope

    def forward(self, x: torch.Tensor, tables: nn.Module) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm1(x)
        q, k, v = (p(y).view(b, s, A, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self.rope(q, k, tables)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, H))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class _Stack(nn.Module):
    """Embedding, L blocks; RoPE tables as buffers (torchtune's cache, torchtitan's freqs_cis)."""

    def __init__(self, norm: type[nn.Module], rope=_rotate_half_rope) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, H)
        self.blocks = nn.ModuleList(_Block(norm, rope) for _ in range(L))
        inv = 1.0 / 10000 ** (torch.arange(0, DH, 2).float() / DH)
        ang = torch.outer(torch.arange(S).float(), inv)
        self.register_buffer("cos", torch.cat((ang, ang), -1).cos())
        self.register_buffer("sin", torch.cat((ang, ang), -1).sin())
        # torchtitan's complex64 table; a plain attribute, since Module.to(bfloat16) would make a buffer real
        self.freqs_cis = torch.polar(torch.ones_like(ang), ang)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, self)
        return x


def _spec() -> ModelSpec:
    return ModelSpec(n_layers=L, hidden=H, n_heads=A, vocab_size=256, ffn_hidden=F_HIDDEN, ffn_kind="swiglu",
                     norm="rmsnorm", position_embedding="rope")


def _measured_saved_bytes(model: nn.Module) -> int:
    """Bytes a real forward leaves alive for backward (MemTracker), the [b, s, h] output excluded."""
    from torch.distributed._tools.mem_tracker import MemTracker

    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        out = model(ids)
        after = tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
        out.float().sum().backward()
    return after - before - out.numel() * out.element_size()


def _estimated(norm_impl: str) -> int:
    train = TrainSpec(micro_batch=B, seq_len=S, precision="bf16-true", device="cpu", norm_impl=norm_impl)
    return L * terms.layer_activation_bytes(_spec(), kernels_of(train), B, S)


@pytest.mark.parametrize(
    ("norm", "impl", "wrong"),
    [(nn.RMSNorm, "native", "composite"), (LlamaRMSNorm, "composite", "native"),
     (GemmaRMSNorm, "composite_fp32", "composite")],
    ids=["torch-RMSNorm", "hf-LlamaRMSNorm", "hf-GemmaRMSNorm"],
)
def test_norm_variant_is_detected_and_its_saved_bytes_match_memtracker(norm, impl, wrong):
    """bf16-true, L=2, b=2, s=64, h=128: measured 1.000 of the estimate for each detected variant; the
    wrong variant misses by 12% (native vs composite: 2h bytes per token per norm)."""
    torch.manual_seed(0)
    model = _Stack(norm).to(torch.bfloat16)
    weights = [n.weight.clone() for n in (model.blocks[0].norm1, model.blocks[1].norm2)]

    def no_call(*_):
        raise AssertionError("the probe must not run the module's hooks")

    handle = model.blocks[0].norm1.register_forward_pre_hook(no_call)
    assert norm_impl_of(model) == impl  # a meta-device probe of a copy: the module is not touched
    handle.remove()
    assert all(torch.equal(w, n.weight) for w, n in zip(weights, (model.blocks[0].norm1, model.blocks[1].norm2), strict=True))
    measured = _measured_saved_bytes(model)
    assert measured == pytest.approx(_estimated(impl), rel=0.03)
    assert abs(measured / _estimated(wrong) - 1) > 0.08


@pytest.mark.parametrize("rope", [_rotate_half_rope, _complex_rope], ids=["hf-rotate-half", "titan-complex-fp32"])
def test_rope_variants_save_the_same_bytes(rope):
    """Neither RoPE form saves anything beyond the rotated q and k the attention kernel keeps anyway: the
    multiplies by cos/sin (or freqs_cis) save only those constants, and the fp32 copies of torchtitan's
    form are forward temporaries. So there is no ``rope_impl`` field: both match the same estimate."""
    torch.manual_seed(0)
    model = _Stack(LlamaRMSNorm, rope).to(torch.bfloat16)
    assert _measured_saved_bytes(model) == pytest.approx(_estimated("composite"), rel=0.03)


def test_norm_bytes_on_cuda_worked_by_hand():
    """Per token, h = 128: fused ``_fused_rms_norm`` saves its input and rstd; composite ones an fp32 copy
    of the input, rstd and the normalised tensor (in the input dtype for Llama's, fp32 for Gemma's)."""
    spec, n, h = _spec(), B * S, H
    mixed = TrainSpec(micro_batch=B, seq_len=S, precision="bf16-mixed")  # fp32 residual
    true16 = mixed.replace(precision="bf16-true")
    expect = {
        (mixed, "native"): 4 * h + 4, (mixed, "composite"): 8 * h + 4, (mixed, "composite_fp32"): 8 * h + 4,
        (true16, "native"): 2 * h + 4, (true16, "composite"): 6 * h + 4, (true16, "composite_fp32"): 8 * h + 4,
    }
    for (train, impl), per_token in expect.items():
        assert terms.norm_saved_bytes(spec, kernels_of(train.replace(norm_impl=impl)), n) == n * per_token, (train, impl)
    # a composite norm of a bf16 input saves a copy, not the block input: selective-op shares less with it
    assert terms.norm_saves_its_input(spec, kernels_of(true16)) and not terms.norm_saves_its_input(
        spec, kernels_of(true16.replace(norm_impl="composite")))
    sac = true16.replace(recompute="selective_op")
    grow = ck.selective_op_rebuild_bytes(spec, kernels_of(sac.replace(norm_impl="composite")), B, S)
    assert grow - ck.selective_op_rebuild_bytes(spec, kernels_of(sac), B, S) == 2 * n * (4 * h) + n * h * 2
    # LayerNorm is native_layer_norm whatever norm_impl says
    ln = ModelSpec(n_layers=1, hidden=h, n_heads=A, vocab_size=256, norm="layernorm")
    assert terms.norm_saved_bytes(ln, kernels_of(mixed.replace(norm_impl="composite")), n) == n * (4 * h + 8)


def test_norm_impl_is_validated_and_read_by_the_front_doors():
    assert NORM_IMPLS == ("native", "composite", "composite_fp32")
    with pytest.raises(ValueError, match="norm_impl"):
        TrainSpec(micro_batch=1, seq_len=8, norm_impl="fused")
    from lightning_memplan.parallel.inputs import compose_train_spec

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=128))
    run = compose_train_spec(shape=(1, 8), module=hf, precision="bf16-mixed", grad_accumulation=1,
                             device="cuda", optimizer=("adamw", "foreach"), base=None, runner="the Trainer")
    assert run.norm_impl == "composite"
    assert norm_impl_of(nn.Sequential(nn.LayerNorm(8))) == "native"
    import contextlib
    import io
    import json

    from lightning_memplan.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["estimate", "--model", "llama3-8b", "--micro-batch", "1", "--seq-len", "64", "--norm-impl",
              "composite", "--json"])
    assert json.loads(out.getvalue())["train"]["norm_impl"] == "composite"
    # the callback's inference at fit start reads it from the LightningModule's tree
    from types import SimpleNamespace

    from lightning_memplan.live import infer_train_spec

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    trainer = SimpleNamespace(strategy=None, world_size=1, precision="bf16-true", accumulate_grad_batches=1,
                              optimizers=[opt], lightning_module=_Stack(GemmaRMSNorm))
    assert infer_train_spec(trainer, torch.zeros(2, 8, dtype=torch.long)).norm_impl == "composite_fp32"


def test_norm_impl_is_detected_after_fully_shard():
    """The callback reads the module after the strategy has sharded it: FSDP2's DTensor weights are probed
    through meta copies of their global shapes (an in-process fake process group of 2 ranks, no ports)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = nn.Sequential(nn.Linear(8, 8), LlamaRMSNorm(8))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        assert type(model[1].weight).__name__ == "DTensor"
        assert norm_impl_of(model) == "composite"
    finally:
        dist.destroy_process_group()
