"""FSDP2 + QLoRA and DDP + QLoRA on 2 gloo CPU ranks (issue 35): a small Hugging Face Llama loaded by
transformers with NF4 double-quantised base weights stored in fp32 (``BitsAndBytesConfig(
bnb_4bit_quant_storage=torch.float32)``, the peft docs page "FSDP + QLoRA": the packed values in the
parameter dtype so FSDP can flatten and shard them), peft LoRA r=8 on q/v, ``fully_shard`` per decoder
layer and the root (ZeRO-3), or ``DistributedDataParallel``.

What is checked, on every rank:

- FSDP keeps each rank's shard of the packed values with the rest (fp32 norms, embedding, head, adapter):
  the sharded storages equal a hand count, ``(sum n/2 + 4 (N - Q + A)) / 2``; each ``Linear4bit``'s
  ``QuantState`` (absmaxes, codes, the nested constants) stays whole on every rank (an attribute of the
  layer, bitsandbytes 0.50.2 ``nn/modules.py`` ``fix_4bit_weight_quant_state_from_module``), and the
  estimate's parameters are those two exactly;
- one decoder layer gathered (``unshard``) holds its packed values, norms and adapter: a hand count;
- one steady-state step (Lightning's order) measured by PyTorch's ``FSDPMemTracker`` (DDP: ``MemTracker``),
  plus what those trackers cannot see (``FSDPMemTracker.track_external`` is a no-op: the ``QuantState``
  tensors; DDP's gradient buckets, allocated at construction: their size from DDP's own logging data),
  against the config-only estimate within 5 %.

Measured (``pytest -s``): see the printed lines; the shapes (2, 128) is a traced (fitted) shape of the
config-only coefficients, (3, 96) held out.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from typing import Any

import pytest
import torch

from lightning_memplan.testing import run_distributed

pytest.importorskip("transformers", reason="real Hugging Face models")
pytest.importorskip("peft", reason="LoRA adapters")
pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.hf]

LAYERS, HIDDEN, VOCAB, RANK = 2, 128, 1024, 8
TARGETS = ("q_proj", "v_proj")
FSDP_SHAPES = [(2, 128), (3, 96)]
DDP_SHAPES = [(3, 96)]


def _config() -> Any:
    import transformers

    return transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=344, vocab_size=VOCAB)


def _qlora() -> Any:
    import peft
    import transformers

    folder = tempfile.mkdtemp()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config()).save_pretrained(folder)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.float32,
                                                                 device_map="cpu")
    return peft.get_peft_model(base, peft.LoraConfig(r=RANK, target_modules=list(TARGETS)))


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    return sum(seen.values())


def _quant_states(model: Any) -> list[Any]:
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _measure(model: Any, wrapped: Any, kind: str, opt: Any, b: int, s: int, rank: int, extra: int) -> int:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_memplan.testing.hf_architectures import _skip_frozen_grad_hooks, loss_of
    from lightning_memplan.tracking.step import PrecisionEmulation, run_training_step
    from lightning_memplan.tracking.tracker import quantization_constants

    tracker = FSDPMemTracker(model, opt) if kind == "fsdp" else MemTracker()
    _skip_frozen_grad_hooks(tracker, model)
    if kind == "ddp":
        tracker.track_external(model, opt, *[c for p in model.parameters() for c in quantization_constants(p)])
    ids = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(rank))
    with tracker:
        inputs = {"input_ids": ids.clone(), "labels": ids.clone()}
        run_training_step(wrapped, inputs, loss_of, opt, precision=PrecisionEmulation(precision="32-true"))
        del inputs
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]) + extra


def qlora_worker(rank: int, world: int, kind: str, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_memplan.tracking.tracker import quantization_constants

    torch.set_num_threads(1)
    model = _qlora()
    layers = _quant_states(model)
    constants = _storage_bytes(c for m in layers for c in quantization_constants(m.weight))
    out: dict[str, Any] = {"constants": constants}
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        blocks = model.base_model.model.model.layers
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped, extra = model, constants  # FSDPMemTracker does not track external tensors
        out["sharded"] = _storage_bytes(p.to_local() for p in model.parameters())
        out["quant_state_whole"] = all(
            m.quant_state.absmax.numel() == math.ceil(math.prod(m.quant_state.shape) / 64) for m in layers)
        blocks[0].unshard()
        group = blocks[0]._get_fsdp_state()._fsdp_param_group
        out["gathered_block"] = _storage_bytes(t for fp in group.fsdp_params for t in fp.all_gather_outputs)
        blocks[0].reshard()
    else:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        extra = int(wrapped._get_ddp_logging_data()["bucket_sizes"])  # allocated before any tracker
        out["buckets"] = extra
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():  # steady state: states and gradients as after a first step
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    out["measured"] = {shape: _measure(model, wrapped, kind, opt, *shape, rank, extra) for shape in shapes}
    return out


def _hand_count() -> dict[str, int]:
    """Values and bytes of the tiny Llama + LoRA, counted from the config (not from the estimate)."""
    h, kv, f = HIDDEN, HIDDEN // 4 * 2, 344
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]  # (in, out): q k v o gate up down
    q = sum(i * o for i, o in linears)
    norms = 2 * h
    adapter = RANK * (h + h) + RANK * (h + kv)  # q: r (in + out), v: r (in + out) per block
    return {"packed_block": q // 2, "norms_block": norms, "adapter_block": adapter,
            "rest": 2 * VOCAB * h + h + LAYERS * norms}


def _estimate(kind: str, b: int, s: int) -> Any:
    from lightning_memplan.model.estimate import estimate_memory
    from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

    spec = ModelSpec.from_hf_config(_config()).with_lora(rank=RANK, targets=TARGETS)
    train = TrainSpec(micro_batch=b, seq_len=s, precision="32-true", optimizer_impl="for_loop", device="cpu",
                      base_weights="nf4-dq")
    return estimate_memory(spec, train, ParallelPlan(dp=2, zero=3) if kind == "fsdp" else ParallelPlan(dp=2))


@pytest.mark.parametrize(("kind", "shapes"), [("fsdp", FSDP_SHAPES), ("ddp", DDP_SHAPES)])
def test_qlora_under_fsdp2_and_ddp_matches_the_estimate(kind: str, shapes: list[tuple[int, int]]) -> None:
    results = run_distributed(qlora_worker, 2, kind, shapes, timeout_s=600)
    hand = _hand_count()
    whole = (LAYERS * (hand["packed_block"] + 4 * (hand["norms_block"] + hand["adapter_block"]))
             + 4 * (hand["rest"] - LAYERS * hand["norms_block"]))
    for rank, r in enumerate(results):
        estimate = _estimate(kind, *shapes[0])
        params = estimate.by_phase[estimate.peak_phase]["params"]
        if kind == "fsdp":
            assert r["quant_state_whole"], rank
            assert r["sharded"] == whole // 2, (rank, r["sharded"], whole)
            assert params == r["sharded"] + r["constants"], (rank, params, r)
            unit = hand["packed_block"] + 4 * (hand["norms_block"] + hand["adapter_block"])
            assert r["gathered_block"] == unit, (rank, r["gathered_block"], unit)
        else:
            assert params == whole + r["constants"], (rank, params, whole, r["constants"])
            assert r["buckets"] == 4 * LAYERS * hand["adapter_block"]  # the adapter's gradients only
        for shape, measured in r["measured"].items():
            total = _estimate(kind, *shape).total
            print(f"rank {rank} {kind} b,s={shape}: estimate {total:,} B, measured {measured:,} B "
                  f"({total / measured - 1:+.2%})")
            assert total == pytest.approx(measured, rel=0.05), (rank, kind, shape, total, measured)


def test_tensor_parallel_and_sharded_int8_are_refused_with_the_reason() -> None:
    from lightning_memplan.model.estimate import estimate_memory
    from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

    spec = ModelSpec.from_hf_config(_config(), calibration="analytic").with_lora(rank=RANK, targets=TARGETS)
    train = TrainSpec(micro_batch=1, seq_len=64, precision="32-true", device="cpu", base_weights="nf4")
    with pytest.raises(ValueError, match=r"tp=2.*not DTensors"):
        estimate_memory(spec, train, ParallelPlan(tp=2))
    with pytest.raises(ValueError, match=r"base_weights='int8' cannot be sharded by FSDP \(got zero=3\)"):
        estimate_memory(spec, train.replace(base_weights="int8"), ParallelPlan(dp=2, zero=3))
