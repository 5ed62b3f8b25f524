"""Test and benchmark helpers shipped with the package (model zoo, multi-process launcher).

They live in the package, not in ``tests/``, because benchmarks, examples and the GPU check script
reuse them (benchmarks reuse the tests' reference implementations).
"""

from lightning_memplan.testing.distributed import find_free_port, run_distributed
from lightning_memplan.testing.zoo import (
    GPT,
    ConvNet,
    GPTConfig,
    MLPNet,
    causal_lm_loss,
    gpt2_style,
    llama_style,
    random_tokens,
    tied_style,
)

__all__ = [
    "GPT",
    "ConvNet",
    "GPTConfig",
    "MLPNet",
    "causal_lm_loss",
    "find_free_port",
    "gpt2_style",
    "llama_style",
    "random_tokens",
    "run_distributed",
    "tied_style",
]
