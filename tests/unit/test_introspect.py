"""spec_from_module / spec_from_hf_config: published parameter counts and hand-built module trees."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from lightning_memplan.model.introspect import spec_from_hf_config, spec_from_module
from lightning_memplan.model.specs import ModelSpec, TrainSpec
from lightning_memplan.testing.zoo import GPT, ConvNet, MLPNet, gpt2_style, llama_style, tied_style

pytestmark = pytest.mark.hf

# config.json fields of published checkpoints and their parameter counts as reported by
# sum(p.numel() for p in model.parameters()) on the Hugging Face models.
HF_CONFIGS = {
    "llama3-8b": (
        {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
         "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
        8_030_261_248,
    ),
    "mistral-7b": (
        {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
         "max_position_embeddings": 32768, "tie_word_embeddings": False},
        7_241_732_096,
    ),
    "gpt2": (
        {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
        124_439_808,
    ),
    "gemma-2b": (
        {"model_type": "gemma", "num_hidden_layers": 18, "hidden_size": 2048, "num_attention_heads": 8,
         "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 16384, "vocab_size": 256000,
         "max_position_embeddings": 8192},
        2_506_172_416,
    ),
    "pythia-160m": (
        {"model_type": "gpt_neox", "num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12,
         "intermediate_size": 3072, "vocab_size": 50304, "max_position_embeddings": 2048,
         "tie_word_embeddings": False},
        162_322_944,
    ),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_config_reproduces_published_parameter_counts(name: str) -> None:
    config, n_params = HF_CONFIGS[name]
    spec = ModelSpec.from_hf_config(config)
    assert spec.n_params is None  # derived from the shape, not copied
    assert spec.num_params == n_params


def test_hf_config_field_mapping() -> None:
    llama = spec_from_hf_config(HF_CONFIGS["llama3-8b"][0])
    assert (llama.ffn_kind, llama.norm, llama.position_embedding, llama.kv_heads, llama.tied_embeddings) == (
        "swiglu", "rmsnorm", "rope", 8, False)
    gpt2 = spec_from_hf_config(HF_CONFIGS["gpt2"][0])
    assert (gpt2.ffn_kind, gpt2.norm, gpt2.position_embedding, gpt2.max_positions, gpt2.tied_embeddings) == (
        "gelu", "layernorm", "learned", 1024, True)
    assert spec_from_hf_config(HF_CONFIGS["gemma-2b"][0]).dim_head == 256

    class Config:  # a PretrainedConfig-like object
        def to_dict(self):
            return {**HF_CONFIGS["mistral-7b"][0], "attention_dropout": 0.1}

    assert spec_from_hf_config(Config()).dropout == 0.1


def test_hf_config_missing_fields_and_bad_type() -> None:
    with pytest.raises(ValueError, match="n_layers .one of num_hidden_layers, n_layer"):
        spec_from_hf_config({"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10})
    with pytest.raises(TypeError, match="config=3"):
        spec_from_hf_config(3)


@pytest.mark.parametrize("config", [gpt2_style(), llama_style(), tied_style(), gpt2_style(dropout=0.1)],
                         ids=["gpt2", "llama", "tied", "dropout"])
def test_zoo_module_recognised_like_its_own_spec(config) -> None:
    model = GPT(config)
    found, own = spec_from_module(model), model.spec()
    for field in ("n_layers", "hidden", "n_heads", "kv_heads", "dim_head", "vocab_size", "ffn", "ffn_kind", "norm",
                  "bias", "tied_embeddings", "position_embedding", "dropout", "num_params"):
        assert getattr(found, field) == getattr(own, field), field
    # and the shape alone (n_params dropped) gives the same count through the memory model's formula
    assert replace(found, n_params=None).num_params == model.num_params()


# --- hand-built Hugging Face-like module trees (attribute names as in transformers' modeling files) ----
class LlamaRMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))


class LlamaAttention(nn.Module):
    def __init__(self, h: int, a: int, k: int) -> None:
        super().__init__()
        self.head_dim = h // a
        self.q_proj = nn.Linear(h, a * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, k * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, k * self.head_dim, bias=False)
        self.o_proj = nn.Linear(a * self.head_dim, h, bias=False)


class LlamaMLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), \
            nn.Linear(f, h, bias=False)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, h: int, a: int, k: int, f: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = LlamaAttention(h, a, k), LlamaMLP(h, f)
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(h), LlamaRMSNorm(h)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(d // 2), persistent=False)


class LlamaModel(nn.Module):
    def __init__(self, V: int, h: int, L: int, a: int, k: int, f: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(V, h)
        self.layers = nn.ModuleList(LlamaDecoderLayer(h, a, k, f) for _ in range(L))
        self.norm = LlamaRMSNorm(h)
        self.rotary_emb = LlamaRotaryEmbedding(h // a)


class LlamaForCausalLM(nn.Module):
    def __init__(self, V=300, h=96, L=3, a=6, k=2, f=200) -> None:
        super().__init__()
        self.model = LlamaModel(V, h, L, a, k, f)
        self.lm_head = nn.Linear(h, V, bias=False)


class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D: weight [in, out]
    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


class GPT2Block(nn.Module):
    def __init__(self, h: int, a: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = nn.Module()
        self.attn.num_heads = a
        self.attn.c_attn, self.attn.c_proj = Conv1D(3 * h, h), Conv1D(h, h)
        self.mlp = nn.Module()
        self.mlp.c_fc, self.mlp.c_proj = Conv1D(4 * h, h), Conv1D(h, 4 * h)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, V=400, P=128, h=64, L=2, a=4) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte, self.transformer.wpe = nn.Embedding(V, h), nn.Embedding(P, h)
        self.transformer.h = nn.ModuleList(GPT2Block(h, a) for _ in range(L))
        self.transformer.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, V, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def test_llama_like_tree_recognised() -> None:
    model = LlamaForCausalLM()
    spec = spec_from_module(model)
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.kv_heads, spec.vocab_size, spec.ffn) == (3, 96, 6, 2, 300, 200)
    assert (spec.ffn_kind, spec.norm, spec.position_embedding, spec.bias, spec.tied_embeddings) == (
        "swiglu", "rmsnorm", "rope", False, False)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    assert replace(spec, n_params=None).num_params == spec.num_params


def test_gpt2_like_tree_with_conv1d_recognised() -> None:
    model = GPT2LMHeadModel()
    spec = spec_from_module(model)
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.vocab_size, spec.ffn) == (2, 64, 4, 400, 256)
    assert (spec.ffn_kind, spec.norm, spec.position_embedding, spec.max_positions, spec.tied_embeddings, spec.bias) == (
        "gelu", "layernorm", "learned", 128, True, True)
    assert replace(spec, n_params=None).num_params == sum(p.numel() for p in model.parameters())


def test_module_with_hf_config_attribute_reads_the_config() -> None:
    class Config:
        def to_dict(self):
            return HF_CONFIGS["gpt2"][0]

    model = nn.Linear(3, 3)
    model.config = Config()
    spec = spec_from_module(model)
    assert spec.n_layers == 12 and spec.n_params == 12  # shape from the config, count from the module


def test_non_transformers_get_exact_count_and_say_what_was_guessed() -> None:
    for model in (MLPNet(), ConvNet()):
        spec = spec_from_module(model)
        assert spec.num_params == sum(p.numel() for p in model.parameters())
        assert "not a transformer" in spec.name and "guessed" in spec.name
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        spec_from_module("gpt2")


def test_qwen2_qkv_biases_counted_by_hand_without_transformers() -> None:
    """Qwen2: q/k/v carry biases, o_proj and the MLP do not: a*d_h + 2*k*d_h per block (hand count)."""
    cfg = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": False}
    spec = replace(spec_from_hf_config(cfg), hf_config=None)
    attn = 64 * 64 + 2 * 64 * 32 + 64 * 64 + (64 + 2 * 32)  # q, k, v, o weights + q/k/v biases
    block = attn + 3 * 64 * 128 + 2 * 64  # swiglu MLP + two RMSNorms
    assert spec.qkv_bias and not spec.bias
    assert spec.num_params == 100 * 64 + 2 * block + 64 + 100 * 64


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma2", "olmo2", "llama", "gpt2", "phi3", "gpt_neox"])
def test_analytic_parameter_count_equals_the_real_model(name: str) -> None:
    """The config reader alone (no trace) counts what transformers builds: Qwen2 q/k/v biases, Gemma-2's
    four norms per block, Qwen3's per-head and OLMo-2's full-width q/k norms."""
    pytest.importorskip("transformers")
    from lightning_memplan.testing.hf_architectures import ARCHITECTURES
    from lightning_memplan.tracking.hf_trace import model_class

    config = ARCHITECTURES[name].config(0.0)
    with torch.device("meta"):
        real = sum(p.numel() for p in model_class(config)._from_config(config).parameters())
    assert replace(spec_from_hf_config(config), hf_config=None).num_params == real


def test_specs_depends_on_no_memory_term_module() -> None:
    """The import circle specs -> terms -> specs is gone: parameter counts live in model/param_counts.py
    and model/lora.py, which import nothing from the model package at run time."""
    import ast
    from pathlib import Path

    import lightning_memplan.model as pkg

    root = Path(pkg.__file__).parent

    def imported(name: str) -> set[str]:
        tree = ast.parse((root / name).read_text())
        out = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        return out | {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    assert not {m for m in imported("specs.py") if m.endswith((".terms", ".estimate"))}
    for leaf in ("param_counts.py", "lora.py", "experts.py"):
        runtime = {m for m in imported(leaf) if m.startswith("lightning_memplan.model")}
        # specs only under TYPE_CHECKING; experts.py (the MoE fields) is itself such a leaf
        allowed = {"lightning_memplan.model.specs"} | ({"lightning_memplan.model.experts"} if leaf != "experts.py" else set())
        assert runtime <= allowed, runtime
    from lightning_memplan.model import terms

    assert terms.param_count is __import__("lightning_memplan.model.param_counts", fromlist=["x"]).param_count


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_position_table_larger_than_the_vocabulary_is_not_read_as_the_token_table(tied: bool) -> None:
    # issue 25: 1024 learned positions and a 512-token vocabulary were read as vocabulary 1024 (10-38% high)
    from lightning_memplan.model.estimate import estimate_memory
    from lightning_memplan.tracking.trace import trace_memory

    model = GPT(gpt2_style(max_positions=1024, vocab_size=512, tied_embeddings=tied))
    spec = ModelSpec.from_module(model)
    assert (spec.vocab_size, spec.max_positions, spec.position_embedding) == (512, 1024, "learned")
    assert spec.tied_embeddings is tied and spec.n_params == sum(p.numel() for p in model.parameters())
    train = TrainSpec(micro_batch=4, seq_len=64, precision="32-true", device="cpu")
    estimated = estimate_memory(spec, train).total
    traced = trace_memory(model, batch_shape=(4, 64)).estimate.total  # the tensor tracker on a fake step
    assert abs(estimated / traced - 1) < 0.02, (estimated, traced)
