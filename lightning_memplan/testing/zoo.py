"""A small model zoo in plain PyTorch for tests, benchmarks and the GPU check.

:class:`GPT` covers the decoder-only layouts the memory model distinguishes: GPT-2 style (learned
positions, LayerNorm, GELU MLP, biases), Llama style (RoPE, RMSNorm, SwiGLU, grouped-query attention,
no biases) and tied embeddings; ``attention="sdpa"`` (fused ``F.scaled_dot_product_attention``) or
``"eager"`` (explicit ``softmax(QK^T / sqrt(d) + mask) V`` that materialises the [b, a, s, s] scores).
:class:`MLPNet` and :class:`ConvNet` are non-transformer models for the traced path.

Module layout (attribute names are relied on by :func:`lightning_memplan.model.introspect.spec_from_module`)::

    GPT: tok_emb, pos_emb (or None), blocks[i], norm_f, lm_head
    Block: norm1, attn (q_proj, k_proj, v_proj, o_proj), norm2,
           mlp (gelu: fc_in, fc_out | swiglu: gate_proj, up_proj, down_proj)

The presets return a :class:`GPTConfig`; build the model with ``GPT(gpt2_style())``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memplan.validation import check_int

if TYPE_CHECKING:
    from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "GPT",
    "Attention",
    "Block",
    "ConvNet",
    "GPTConfig",
    "MLP",
    "MLPNet",
    "SwiGLU",
    "apply_rope",
    "causal_lm_loss",
    "gpt2_style",
    "llama_style",
    "random_tokens",
    "rope_cache",
    "tied_style",
]

_FFN_KINDS = ("gelu", "swiglu")
_NORMS = ("layernorm", "rmsnorm")
_POSITIONS = ("learned", "rope")
_ATTENTIONS = ("sdpa", "eager")
_LOSSES = ("naive", "fp32_upcast")
#: RoPE base frequency (Su et al. 2021, "RoFormer", arXiv 2104.09864, eq. 15: theta_i = 10000^(-2i/d)).
ROPE_BASE = 10000.0
NORM_EPS = 1e-5


def _positive(name: str, value: Any) -> None:
    check_int(name, value, hint="a positive int")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Args:
        vocab_size: V, embedding rows and logits columns.
        n_layers: L, transformer blocks.
        hidden: h, model width.
        n_heads: a, query heads.
        n_kv_heads: k, key/value heads (grouped-query attention); ``None`` means ``n_heads``.
        ffn_hidden: f, MLP inner width; ``None`` means 4h for ``"gelu"`` and Llama's
            ``256 * ceil(int(8h/3) / 256)`` for ``"swiglu"`` (same rule as ``ModelSpec.ffn``).
        ffn_kind: ``"gelu"`` (fc_in, fc_out) or ``"swiglu"`` (gate_proj, up_proj, down_proj).
        norm: ``"layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only).
        bias: biases on every linear layer except the lm_head.
        tied_embeddings: lm_head.weight is tok_emb.weight.
        position_embedding: ``"learned"`` (a ``max_positions x h`` table) or ``"rope"``.
        max_positions: longest sequence (rows of the learned table / RoPE cache).
        dropout: dropout probability (embedding, attention probabilities, residual branches); the
            dropout modules exist only when it is > 0.
        attention: ``"sdpa"`` or ``"eager"``.
    """

    vocab_size: int
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int | None = field(default=None, kw_only=True)
    ffn_hidden: int | None = field(default=None, kw_only=True)
    ffn_kind: str = field(default="gelu", kw_only=True)
    norm: str = field(default="layernorm", kw_only=True)
    bias: bool = field(default=True, kw_only=True)
    tied_embeddings: bool = field(default=False, kw_only=True)
    position_embedding: str = field(default="learned", kw_only=True)
    max_positions: int = field(default=1024, kw_only=True)
    dropout: float = field(default=0.0, kw_only=True)
    attention: str = field(default="sdpa", kw_only=True)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "hidden", "n_heads", "max_positions"):
            _positive(name, getattr(self, name))
        if self.hidden % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads!r} must divide hidden={self.hidden!r}")
        if self.n_kv_heads is not None:
            _positive("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_kv_heads={self.n_kv_heads!r} must divide n_heads={self.n_heads!r}")
        if self.ffn_hidden is not None:
            _positive("ffn_hidden", self.ffn_hidden)
        for name, choices in (
            ("ffn_kind", _FFN_KINDS),
            ("norm", _NORMS),
            ("position_embedding", _POSITIONS),
            ("attention", _ATTENTIONS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {choices}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if self.position_embedding == "rope" and (self.hidden // self.n_heads) % 2:
            raise ValueError(f"RoPE needs an even head_dim; got hidden/n_heads={self.hidden // self.n_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.ffn_kind == "swiglu":
            return 256 * math.ceil(int(2 * 4 * self.hidden / 3) / 256)
        return 4 * self.hidden

    def replace(self, **changes: Any) -> GPTConfig:
        return replace(self, **changes)


def gpt2_style(**overrides: Any) -> GPTConfig:
    """Tiny GPT-2 layout: learned positions, LayerNorm, GELU MLP, biases, untied head."""
    base = GPTConfig(512, 2, 64, 4, ffn_kind="gelu", norm="layernorm", bias=True, position_embedding="learned",
                     max_positions=256)
    return base.replace(**overrides)


def llama_style(**overrides: Any) -> GPTConfig:
    """Tiny Llama layout: RoPE, RMSNorm, SwiGLU, grouped-query attention (4 heads, 2 kv-heads), no biases."""
    base = GPTConfig(512, 2, 64, 4, n_kv_heads=2, ffn_kind="swiglu", norm="rmsnorm", bias=False,
                     position_embedding="rope", max_positions=256)
    return base.replace(**overrides)


def tied_style(**overrides: Any) -> GPTConfig:
    """Tiny GPT-2 layout whose lm_head shares the token embedding."""
    return gpt2_style(tied_embeddings=True).replace(**overrides)


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.hidden, eps=NORM_EPS)
    return nn.LayerNorm(config.hidden, eps=NORM_EPS)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cache(max_positions: int, head_dim: int, base: float = ROPE_BASE) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables [max_positions, head_dim] for :func:`apply_rope` (half-split layout)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., s, d]`` by position: pairs ``(x_i, x_{i+d/2})`` turn by ``pos * theta_i``
    (RoFormer eq. 34 in the half-split layout used by GPT-NeoX and Llama in Hugging Face)."""
    s = x.shape[-2]
    return x * cos[:s] + _rotate_half(x) * sin[:s]


class Attention(nn.Module):
    """Causal self-attention with optional grouped-query heads and RoPE."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.kind = config.attention
        self.p_drop = float(config.dropout)
        self.q_proj = nn.Linear(config.hidden, self.n_heads * self.head_dim, bias=config.bias)
        self.k_proj = nn.Linear(config.hidden, self.kv_heads * self.head_dim, bias=config.bias)
        self.v_proj = nn.Linear(config.hidden, self.kv_heads * self.head_dim, bias=config.bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden, bias=config.bias)
        self.attn_drop = nn.Dropout(self.p_drop) if self.p_drop > 0 else None
        self.resid_drop = nn.Dropout(self.p_drop) if self.p_drop > 0 else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        groups = self.n_heads // self.kv_heads
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.p_drop if self.training else 0.0, enable_gqa=groups > 1
            )
        else:
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
            probs = scores.softmax(dim=-1)
            if self.attn_drop is not None:
                probs = self.attn_drop(probs)
            y = probs @ v
        y = self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))
        return self.resid_drop(y) if self.resid_drop is not None else y


class MLP(nn.Module):
    """GPT-2 MLP: ``fc_out(gelu(fc_in(x)))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden, config.ffn, bias=config.bias)
        self.fc_out = nn.Linear(config.ffn, config.hidden, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class SwiGLU(nn.Module):
    """Llama MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020, arXiv 2002.05202)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.ffn, bias=config.bias)
        self.up_proj = nn.Linear(config.hidden, config.ffn, bias=config.bias)
        self.down_proj = nn.Linear(config.ffn, config.hidden, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config)
        self.attn = Attention(config)
        self.norm2 = _norm(config)
        self.mlp = SwiGLU(config) if config.ffn_kind == "swiglu" else MLP(config)
        self.mlp_drop = nn.Dropout(config.dropout) if config.dropout > 0 else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        y = self.mlp(self.norm2(x))
        return x + (self.mlp_drop(y) if self.mlp_drop is not None else y)


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx) -> hidden [b, s, h]`` after the final norm.

    Logits come separately from :meth:`logits` so a loss may avoid materialising them.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.hidden)
        self.pos_emb = (
            nn.Embedding(config.max_positions, config.hidden) if config.position_embedding == "learned" else None
        )
        self.emb_drop = nn.Dropout(config.dropout) if config.dropout > 0 else None
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm_f = _norm(config)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tied_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if config.position_embedding == "rope":
            cos, sin = rope_cache(config.max_positions, config.head_dim)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 initialisation (Radford et al. 2019): N(0, 0.02) weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, s = idx.shape
        if s > self.config.max_positions:
            raise ValueError(f"sequence length {s} exceeds max_positions={self.config.max_positions}")
        x, rope = self.embed(idx), self.rope()
        for block in self.blocks:
            x = block(x, rope)
        return self.norm_f(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings, then embedding dropout: the blocks' input [b, s, h]."""
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        return self.emb_drop(x) if self.emb_drop is not None else x

    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary (cos, sin) tables every block takes, or ``None`` with learned positions."""
        return (self.rope_cos, self.rope_sin) if self.rope_cos is not None else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(hidden)``: [b, s, V]."""
        return self.lm_head(hidden)

    def num_params(self) -> int:
        """Exact parameter count, a tied matrix counted once."""
        return sum(p.numel() for p in self.parameters())

    def spec(self) -> ModelSpec:
        """The :class:`~lightning_memplan.model.specs.ModelSpec` of this model (exact ``n_params``)."""
        from lightning_memplan.model.specs import ModelSpec

        c = self.config
        return ModelSpec(
            c.n_layers,
            c.hidden,
            c.n_heads,
            c.vocab_size,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            ffn_hidden=c.ffn,
            ffn_kind=c.ffn_kind,
            norm=c.norm,
            bias=c.bias,
            tied_embeddings=c.tied_embeddings,
            position_embedding=c.position_embedding,
            max_positions=c.max_positions,
            dropout=float(c.dropout),
            n_params=self.num_params(),
            name=f"zoo-gpt-{c.ffn_kind}-{c.norm}-{c.position_embedding}",
        )


def causal_lm_loss(model: GPT, idx: torch.Tensor, targets: torch.Tensor, *, loss: str = "naive") -> torch.Tensor:
    """Mean next-token cross-entropy of ``model`` on ``idx`` against ``targets`` (both [b, s]).

    ``loss="naive"`` feeds the logits in their own dtype to ``F.cross_entropy``; ``"fp32_upcast"``
    first makes an explicit ``logits.float()`` copy, as Hugging Face causal-LM heads do.
    """
    if loss not in _LOSSES:
        raise ValueError(f"loss={loss!r} must be one of {_LOSSES}")
    logits = model.logits(model(idx))
    if loss == "fp32_upcast":
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def random_tokens(
    config: GPTConfig, micro_batch: int, seq_len: int, *, seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A reproducible ``(idx, targets)`` pair of [b, s] token ids."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


class MLPNet(nn.Module):
    """Non-transformer classifier: ``n_layers`` of Linear + GELU, then a Linear head.

    ``forward(x [b, in_features]) -> logits [b, n_classes]``.
    """

    def __init__(self, in_features: int = 256, hidden: int = 512, n_layers: int = 3, n_classes: int = 10) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("hidden", hidden), ("n_layers", n_layers),
                            ("n_classes", n_classes)):
            _positive(name, value)
        self.in_features, self.n_classes = in_features, n_classes
        dims = [in_features] + [hidden] * n_layers
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims[:-1], dims[1:], strict=True))
        self.head = nn.Linear(hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)

    def example_batch(self, batch: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch, self.in_features, generator=gen), torch.randint(0, self.n_classes, (batch,),
                                                                                    generator=gen)


class ConvNet(nn.Module):
    """Non-transformer image classifier: conv-BN-ReLU stages with stride-2 downsampling, pooled head.

    ``forward(x [b, in_channels, H, W]) -> logits [b, n_classes]``.
    """

    def __init__(self, in_channels: int = 3, channels: tuple[int, ...] = (16, 32, 64), n_classes: int = 10,
                 image_size: int = 32) -> None:
        super().__init__()
        _positive("in_channels", in_channels)
        _positive("n_classes", n_classes)
        _positive("image_size", image_size)
        self.in_channels, self.n_classes, self.image_size = in_channels, n_classes, image_size
        layers: list[nn.Module] = []
        prev = in_channels
        for i, ch in enumerate(channels):
            layers += [nn.Conv2d(prev, ch, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                       nn.BatchNorm2d(ch), nn.ReLU()]
            prev = ch
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(prev, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))

    def example_batch(self, batch: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, self.in_channels, self.image_size, self.image_size, generator=gen)
        return x, torch.randint(0, self.n_classes, (batch,), generator=gen)
