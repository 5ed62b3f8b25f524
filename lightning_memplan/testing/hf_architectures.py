"""Tiny Hugging Face architectures and one measured CPU training step, for tests and benchmarks.

:data:`ARCHITECTURES` builds each family's config at a common small size (4 blocks, width 256,
vocabulary 32000; ViT: 64x64 images in 8x8 patches), with a dropout probability applied to every
dropout field the family has. :func:`measure_step` runs one steady-state training step in
Lightning's order (forward + loss, ``zero_grad(set_to_none=True)``, backward, AdamW step; the measured
step is the second, so optimizer states exist and the previous gradients are alive in its forward)
and measures its peak with PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker`` -- an
independent reference for this project's estimates.

Needs ``transformers`` (imported where used). Nothing is downloaded: every model is built from a
config with random weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memplan.tracking.step import PrecisionEmulation, run_training_step
from lightning_memplan.tracking.tracker import quantization_constants

__all__ = [
    "ARCHITECTURES",
    "SHAPE_ARCHITECTURES",
    "Architecture",
    "build_model",
    "example_batch",
    "loss_of",
    "measure_step",
    "pipeline_llama",
]

HIDDEN = 256
LAYERS = 4
HEADS = 4
VOCAB = 32000
IMAGE, PATCH = 64, 8


@dataclass(frozen=True)
class Architecture:
    """One family: ``config(dropout)`` builds its tiny config; ``attentions``: the attention
    implementations transformers has for it; ``vision``: it takes ``pixel_values``."""

    name: str
    config: Callable[[float], Any]
    attentions: tuple[str, ...] = ("sdpa", "eager")
    vision: bool = False


def _t(name: str) -> Any:
    import transformers

    return getattr(transformers, name)


def _gpt2(p: float) -> Any:
    return _t("GPT2Config")(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=512,
                            resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)


def _decoder(cls: str, **extra: Any) -> Callable[[float], Any]:
    def make(p: float) -> Any:
        return _t(cls)(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
                       intermediate_size=688, vocab_size=VOCAB, attention_dropout=p, **extra)

    return make


def _phi3(p: float) -> Any:
    return _t("Phi3Config")(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            num_key_value_heads=2, intermediate_size=688, vocab_size=VOCAB, attention_dropout=p,
                            resid_pdrop=p, embd_pdrop=p, pad_token_id=0)


def _gemma2(p: float) -> Any:
    return _t("Gemma2Config")(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                              num_key_value_heads=2, head_dim=64, intermediate_size=688, vocab_size=VOCAB,
                              attention_dropout=p, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def _neox(p: float) -> Any:
    return _t("GPTNeoXConfig")(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               intermediate_size=1024, vocab_size=VOCAB, attention_dropout=p, hidden_dropout=p)


def _bert(p: float) -> Any:
    return _t("BertConfig")(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            intermediate_size=1024, vocab_size=VOCAB, hidden_dropout_prob=p,
                            attention_probs_dropout_prob=p, architectures=["BertForMaskedLM"])


def _t5(p: float) -> Any:
    return _t("T5Config")(num_layers=LAYERS, num_decoder_layers=LAYERS, d_model=HIDDEN, d_ff=1024, d_kv=64,
                          num_heads=HEADS, vocab_size=VOCAB, dropout_rate=p, decoder_start_token_id=0,
                          architectures=["T5ForConditionalGeneration"])


def _vit(p: float) -> Any:
    return _t("ViTConfig")(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                           intermediate_size=1024, image_size=IMAGE, patch_size=PATCH, num_labels=10,
                           hidden_dropout_prob=p, attention_probs_dropout_prob=p,
                           architectures=["ViTForImageClassification"])


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("gpt2", _gpt2),
        Architecture("llama", _decoder("LlamaConfig")),
        Architecture("mistral", _decoder("MistralConfig")),
        Architecture("qwen2", _decoder("Qwen2Config")),
        Architecture("qwen3", _decoder("Qwen3Config", head_dim=64)),
        Architecture("gemma2", _gemma2),
        Architecture("olmo2", _decoder("Olmo2Config")),
        Architecture("phi3", _phi3),
        Architecture("gpt_neox", _neox),
        Architecture("mixtral", _decoder("MixtralConfig", num_local_experts=4, num_experts_per_tok=2)),
        Architecture("qwen2_moe", _decoder("Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=344, shared_expert_intermediate_size=688)),
        Architecture("bert_mlm", _bert),
        Architecture("t5", _t5, attentions=("eager",)),  # transformers' T5 has no SDPA path
        Architecture("vit", _vit, vision=True),
    )
}


def build_model(arch: Architecture, *, dropout: float, attention: str, checkpointing: bool, seed: int = 0) -> Any:
    """The real model (random weights, fp32) for ``arch``; HF gradient checkpointing when asked."""
    from lightning_memplan.tracking.hf_trace import model_class

    torch.manual_seed(seed)
    config = arch.config(dropout)
    model = model_class(config)._from_config(config, attn_implementation=attention, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def example_batch(model: Any, micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Token ids with labels (or images with class labels) for ``model``."""
    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    if getattr(cfg, "image_size", None) and not getattr(cfg, "vocab_size", None):
        return {
            "pixel_values": torch.randn(micro_batch, cfg.num_channels, cfg.image_size, cfg.image_size, generator=gen),
            "labels": torch.randint(0, cfg.num_labels, (micro_batch,), generator=gen),
        }
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def loss_of(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own loss (``model(**batch).loss``), as a Trainer's ``training_step`` returns it."""
    return model(**batch).loss


class _NoHook:
    """A removable handle that removes nothing (a frozen parameter gets no gradient hook)."""

    def remove(self) -> None:
        return None


def _skip_frozen_grad_hooks(tracker: Any, model: Any) -> None:
    """Keep MemTracker from hooking the gradients of frozen parameters (peft LoRA's base weights):
    ``Tensor.register_hook`` raises on a tensor that does not require grad, and MemTracker hooks every
    parameter of a module it enters (``_track_module_params_and_buffers``, torch 2.13). A frozen parameter
    is marked as already hooked; its storage is still tracked as a parameter."""
    handles = getattr(tracker, "_param_to_grad_hook_handles", None)
    if handles is None:
        return
    for param in model.parameters():
        if not param.requires_grad:
            handles[param] = (_NoHook(), _NoHook())


def measure_step(model: Any, batch: dict[str, torch.Tensor], *, precision: str) -> int:
    """Peak bytes of one steady-state CPU training step (Lightning's order), measured by MemTracker."""
    from torch.distributed._tools.mem_tracker import MemTracker

    emulation = PrecisionEmulation(precision=precision)
    model = emulation.convert_module(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Steady state before the measured step: gradients held and optimizer states created, as after a first
    # step. One optimizer step on zero gradients leaves the same tensors as a real first step (checked byte
    # for byte: all 14 architectures at 32-true with dropout 0.1, and Mixtral at bf16-mixed, peak equal to a
    # real warm-up step's) at a fraction of its cost (a bf16 step on an AVX2-only CPU takes ~20-40 s).
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    opt.step()
    tracker = MemTracker()
    _skip_frozen_grad_hooks(tracker, model)
    # bitsandbytes' absmaxes and codes are no parameters: MemTracker counts what it is handed ("Other")
    constants = [c for p in model.parameters() for c in quantization_constants(p)]
    tracker.track_external(model, opt, *constants)
    with tracker:
        inputs = {k: v.clone() for k, v in batch.items()}  # the batch is live during the step
        run_training_step(model, inputs, loss_of, opt, precision=emulation)
        del inputs
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


# --- Mixed layer stacks, MLA, attention sinks, SSMs (tiny widths, fp32) ---------------------

#: Width, blocks and vocabulary of :data:`SHAPE_ARCHITECTURES` (small enough for s=8192 real CPU steps).
TINY_HIDDEN = 64
TINY_VOCAB = 2048


def _deepseek_v3(p: float) -> Any:
    # MLA (v head size 16 != q/k head size 24) and first_k_dense_replace=1: one dense block, three MoE.
    return _t("DeepseekV3Config")(
        num_hidden_layers=LAYERS, hidden_size=TINY_HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, vocab_size=TINY_VOCAB, attention_dropout=p, max_position_embeddings=16384,
        architectures=["DeepseekV3ForCausalLM"])


def _llama4(step: int) -> Callable[[float], Any]:
    # Scout (step 1: every block MoE) or Maverick (step 2: MoE every second block); NoPE every 4th block,
    # chunked attention (chunk 256) on the RoPE blocks.
    def make(p: float) -> Any:
        return _t("Llama4TextConfig")(
            num_hidden_layers=LAYERS, hidden_size=TINY_HIDDEN, intermediate_size=64, intermediate_size_mlp=128,
            num_local_experts=4, num_experts_per_tok=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            vocab_size=TINY_VOCAB, interleave_moe_layer_step=step, attention_chunk_size=256, attention_dropout=p,
            max_position_embeddings=16384, architectures=["Llama4ForCausalLM"])

    return make


def _gemma3(p: float) -> Any:
    # Three sliding-window (256) blocks, then one global block.
    return _t("Gemma3TextConfig")(
        num_hidden_layers=LAYERS, hidden_size=TINY_HIDDEN, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=TINY_VOCAB, sliding_window=256, attention_dropout=p,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=16384,
        architectures=["Gemma3ForCausalLM"])


def _gpt_oss(p: float) -> Any:
    # Sliding (128) / full alternation, attention sinks (eager only), 4 experts with biases.
    return _t("GptOssConfig")(
        num_hidden_layers=LAYERS, hidden_size=TINY_HIDDEN, intermediate_size=64, num_local_experts=4,
        num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=TINY_VOCAB,
        sliding_window=128, attention_dropout=p, max_position_embeddings=16384, architectures=["GptOssForCausalLM"])


def _jamba(p: float) -> Any:
    # Mamba blocks with one attention block (index 2) and experts on every second block (1, 3).
    return _t("JambaConfig")(
        num_hidden_layers=LAYERS, hidden_size=TINY_HIDDEN, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
        use_mamba_kernels=False, vocab_size=TINY_VOCAB, attention_dropout=p, architectures=["JambaForCausalLM"])


def _mamba(p: float) -> Any:
    return _t("MambaConfig")(num_hidden_layers=LAYERS, hidden_size=TINY_HIDDEN, state_size=8, expand=2, conv_kernel=4,
                             vocab_size=TINY_VOCAB, architectures=["MambaForCausalLM"])


def _mamba2(p: float) -> Any:
    # The sequence is padded to whole chunk_size (256) tokens.
    return _t("Mamba2Config")(num_hidden_layers=LAYERS, hidden_size=TINY_HIDDEN, num_heads=8, head_dim=16, expand=2,
                              n_groups=1, state_size=16, chunk_size=256, vocab_size=TINY_VOCAB,
                              architectures=["Mamba2ForCausalLM"])


#: The mixed-layer families at tiny width (4 blocks, width 64, V=2048), for the shape/layer-mix benchmark
#: (``benchmarks/bench_hf_architectures.py --shapes``) and ``tests/unit/test_hf_shapes.py``.
SHAPE_ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("deepseek_v3", _deepseek_v3, attentions=("sdpa",)),
        Architecture("llama4_scout", _llama4(1), attentions=("sdpa",)),
        Architecture("llama4_maverick", _llama4(2), attentions=("sdpa",)),
        Architecture("gemma3", _gemma3, attentions=("sdpa",)),
        Architecture("gpt_oss", _gpt_oss, attentions=("eager",)),
        Architecture("jamba", _jamba, attentions=("sdpa",)),
        Architecture("mamba", _mamba, attentions=("eager",)),
        Architecture("mamba2", _mamba2, attentions=("eager",)),
    )
}


def pipeline_llama(layers: int, *, hidden: int = 64, ffn: int = 172, heads: int = 4, vocab: int = 256,
                   seq: int = 32) -> Any:
    """A LightningModule around a tiny Hugging Face ``LlamaForCausalLM`` (2 KV heads, SDPA, seeded) that
    memplan_auto can split into pipeline stages: its batch is ``(token ids,)`` and it names the pipeline's
    inputs/targets (``pipeline_batch``) and loss (``pipeline_loss``: the model's own ``loss_function``)."""
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    class PipelineLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=seq,
                attn_implementation="sdpa"))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            (ids,) = batch
            return ids, ids

        def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.model.loss_function(logits=logits, labels=labels, vocab_size=vocab)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return PipelineLlama()
