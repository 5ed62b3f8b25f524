"""``estimate_eval_memory`` against the tensor tracker on a no-grad forward and loss of the zoo's GPT
(GELU / SwiGLU, SDPA / eager) and a tiny Hugging Face Llama, several batch shapes, within 5%; its inputs
are checked."""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.eval_estimate import EVAL_PHASES, estimate_eval_memory
from lightning_memplan.model.specs import ModelSpec, TrainSpec
from lightning_memplan.testing.zoo import GPT, causal_lm_loss, gpt2_style, llama_style, random_tokens
from lightning_memplan.tracking.tracker import TensorTracker

pytestmark = pytest.mark.hf

TOLERANCE = 0.05
SHAPES = [(2, 40), (8, 72)]
ZOO = {
    # logits dominate (V large against h)
    "gelu-head": gpt2_style(vocab_size=512, n_layers=2, hidden=64, n_heads=4),
    # one block's MLP working set dominates (h large against V)
    "gelu-block": gpt2_style(vocab_size=96, n_layers=2, hidden=256, n_heads=4),
    "swiglu-block": llama_style(vocab_size=96, n_layers=2, hidden=256, n_heads=4, n_kv_heads=2),
    "eager": gpt2_style(vocab_size=96, n_layers=2, hidden=128, n_heads=4, attention="eager"),
}


def _tracked(model: torch.nn.Module, s: int, vocab: int, run, batch) -> tuple[int, dict[str, int]]:
    tracker = TensorTracker(model, seq_len=s, vocab_size=vocab)
    tracker.track(batch, "other")  # the step's batch, alive while it runs (a dataloader's is)
    with torch.no_grad(), tracker:
        run()
    report = tracker.report()
    return report.total, dict(report.peak)


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize(("b", "s"), SHAPES)
def test_zoo_no_grad_forward_within_5_percent(name, b, s):
    config = ZOO[name]
    torch.manual_seed(0)
    model = GPT(config)
    idx, targets = random_tokens(config, b, s)
    measured, peak = _tracked(model, s, config.vocab_size, lambda: causal_lm_loss(model, idx, targets), (idx, targets))
    train = TrainSpec(micro_batch=1, seq_len=1, precision="32-true", attention=config.attention)
    est = estimate_eval_memory(model.spec(), train, phase="val", micro_batch=b, seq_len=s, grads_alive=False,
                               optimizer_states=False)
    assert est.total == pytest.approx(measured, rel=TOLERANCE), (est.components(), peak)
    dynamic = measured - peak["params"]
    assert dynamic > 0.1 * measured  # the batch-dependent part is a real share of what is compared
    assert est.params == peak["params"]


def test_hf_llama_no_grad_forward_within_5_percent():
    transformers = pytest.importorskip("transformers")
    for vocab, hidden, ffn in ((512, 64, 128), (96, 256, 512)):
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa",
        )
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        spec = ModelSpec.from_module(model)
        train = TrainSpec(micro_batch=1, seq_len=1, precision="32-true", loss="fp32_upcast")
        for b, s in SHAPES:
            batch = {"input_ids": torch.randint(0, vocab, (b, s))}
            batch["labels"] = batch["input_ids"].clone()
            measured, peak = _tracked(model, s, vocab, lambda batch=batch, model=model: model(**batch).loss, batch)
            # a Hugging Face model in eval builds a DynamicCache (use_cache) and holds inputs_embeds
            est = estimate_eval_memory(spec, train, phase="val", micro_batch=b, seq_len=s, grads_alive=False,
                                       optimizer_states=False, kv_cache=True, held_hidden=1)
            assert est.total == pytest.approx(measured, rel=TOLERANCE), (vocab, b, s, est.components(), peak)
            bare = estimate_eval_memory(spec, train, phase="val", micro_batch=b, seq_len=s, grads_alive=False,
                                        optimizer_states=False)
            assert bare.total < est.total  # the cache and the held hidden state are real bytes


#: (V, b, s, g, whether the generation is the step's peak): the cache binds the generation and the step
#: (a long generation, a small vocabulary); the prefill binds the generation (a long prompt, few new
#: tokens); the last position's logits weigh in the generation (V = 4096 against h = 64). In the last
#: two the loss's [b, s, V] logits are the step's peak.
GENERATE_ROWS = [(512, 8, 8, 96, True), (512, 8, 64, 8, False), (4096, 8, 8, 24, False)]


@pytest.mark.parametrize(("vocab", "b", "s", "g", "binds"), GENERATE_ROWS)
def test_hf_llama_generate_inside_an_eval_step_within_5_percent(vocab, b, s, g, binds):
    """A validation step that computes its loss and then greedily generates g tokens from its batch (the
    KV cache of ``generate``, issue 26): the generation's own peak beside the model and the prompt
    (``details["eval_generate_peak"]``), and the step's peak (the larger of its forward and its
    ``generate``), each within 5% of the tensor tracker around the real calls."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # exactly g new tokens
    spec = ModelSpec.from_module(model)
    train = TrainSpec(micro_batch=1, seq_len=1, precision="32-true")
    batch = {"input_ids": torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))}
    batch["labels"] = batch["input_ids"].clone()

    def generate() -> None:
        out = model.generate(batch["input_ids"], max_new_tokens=g, do_sample=False, pad_token_id=0)
        assert out.shape == (b, s + g)

    def step() -> None:
        model(**batch).loss  # noqa: B018 - the step's forward; its outputs are dropped before generating
        generate()

    est = estimate_eval_memory(spec, train, phase="val", micro_batch=b, seq_len=s, grads_alive=False,
                               optimizer_states=False, kv_cache=True, held_hidden=1, generate_tokens=g)
    generated, peak = _tracked(model, s, vocab, generate, batch["input_ids"])
    prompt = batch["input_ids"].nbytes
    assert peak["params"] == est.params
    measured_generate = generated - peak["params"] - prompt
    cache = 2 * 2 * b * (s + g - 1) * 2 * 16 * 4  # L k/v, b rows, s + g - 1 tokens, k=2 heads of d=16, fp32
    assert est.details["eval_generate_cache"] == cache
    assert est.details["eval_generate_peak"] == pytest.approx(measured_generate, rel=TOLERANCE), (peak, est.details)
    measured, peak = _tracked(model, s, vocab, step, batch)
    assert est.total == pytest.approx(measured, rel=TOLERANCE), (est.components(), peak)
    assert est.total - est.params == pytest.approx(measured - peak["params"], rel=TOLERANCE)
    without = estimate_eval_memory(spec, train, phase="val", micro_batch=b, seq_len=s, grads_alive=False,
                                   optimizer_states=False, kv_cache=True, held_hidden=1)
    assert (est.total > without.total) is binds
    if binds:  # leaving the generation out misses the step by more than the tolerance
        assert without.total < (1 - TOLERANCE) * measured
        assert cache > 0.3 * (measured - peak["params"])  # the cache is a real share of what is compared
    else:
        assert est.total == without.total


def test_model_states_follow_the_training_estimate_and_the_live_state():
    spec = GPT(gpt2_style(vocab_size=512, n_layers=2, hidden=64, n_heads=4)).spec()
    train = TrainSpec(micro_batch=2, seq_len=32, precision="32-true")
    training = estimate_memory(spec, train)
    full = estimate_eval_memory(spec, train, phase="val", micro_batch=8, seq_len=32)
    assert (full.params, full.grads, full.optimizer) == (
        training.params, training.by_phase["optimizer"]["grads"], training.optimizer
    )
    bare = estimate_eval_memory(spec, train, phase="val", micro_batch=8, seq_len=32, grads_alive=False,
                                optimizer_states=False)
    assert bare.grads == bare.optimizer == 0 and bare.total == full.total - full.grads - full.optimizer
    assert full.peak_phase == "forward" and full.workspace == 0
    # predict computes no loss: logits only, no log-probabilities
    predict = estimate_eval_memory(spec, train, phase="predict", micro_batch=8, seq_len=32)
    assert predict.logits < full.logits
    # larger eval batches cost more; the training estimate is untouched by the eval one
    assert estimate_eval_memory(spec, train, phase="test", micro_batch=16, seq_len=32).total > full.total
    assert estimate_memory(spec, train) == training


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"phase": "eval"}, ValueError, "phase"),
        ({"micro_batch": 0}, ValueError, "micro_batch"),
        ({"seq_len": "64"}, TypeError, "seq_len"),
        ({"grads_alive": 1}, TypeError, "grads_alive"),
        ({"held_hidden": -1}, ValueError, "held_hidden"),
        ({"generate_tokens": -1}, ValueError, "generate_tokens"),
        ({"generate_tokens": 1.5}, TypeError, "generate_tokens"),
        ({"rank": 3}, ValueError, "rank"),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    spec = GPT(gpt2_style(vocab_size=128, n_layers=1, hidden=32, n_heads=2)).spec()
    args = {"phase": "val", "micro_batch": 2, "seq_len": 16, **kwargs}
    with pytest.raises(error, match=match):
        estimate_eval_memory(spec, TrainSpec(micro_batch=1, seq_len=16), **args)
    assert EVAL_PHASES == ("val", "test", "predict")
