"""Test and benchmark helpers shipped with the package (model zoo, multi-process launcher).

They live in the package, not in ``tests/``, because benchmarks, examples and the GPU check script
reuse them (house style 14: benchmarks reuse the tests' reference implementations).
"""

from lightning_memplan.testing.distributed import find_free_port, run_distributed

__all__ = ["find_free_port", "run_distributed"]
