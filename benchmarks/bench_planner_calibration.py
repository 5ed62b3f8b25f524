"""What memplan_auto's calibrated check (issue 33, ``parallel/verify.py``) adds to planning: CPU seconds of
rank 0's planning step (``parallel.resolve.resolve``: the planner, then the check of the ranked candidates
against the module's calibrated estimate) with ``calibrate=True`` and with ``calibrate=False``, for small
modules under the budgets of ``tests/distributed/test_memplan_auto_calibrated_*.py`` (2 processes planned
for; no process group is needed to plan) and a GPT-2-small-sized zoo GPT. Each is compared with one real
CPU training step of the same module (forward, backward, AdamW), so the added time reads as "so many
training steps, once at setup".

Timings are ``time.process_time`` (CPU seconds of this process), the least of ``--repeat`` runs, each on a
fresh module (every trace runs again: nothing is cached between runs). The ratio "with / without" is
measured in one process, so it carries over between machines where the seconds do not. Writes a Markdown
table to ``--out`` (default: stdout only)::

    PYTHONPATH=. python benchmarks/bench_planner_calibration.py --out benchmarks/results/cpu_<date>_planner_calibration.md
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

MiB = 2**20


class _LM(L.LightningModule):
    def __init__(self, model: torch.nn.Module, loss: Callable[[torch.nn.Module, Any], torch.Tensor],
                 **extra: Any) -> None:
        super().__init__()
        self.model = model
        self._loss = loss
        for name, fn in extra.items():
            setattr(self, name, fn)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _litgpt() -> tuple[L.LightningModule, Any] | None:
    try:
        import litgpt
    except ImportError:
        return None
    torch.manual_seed(0)
    model = litgpt.GPT(litgpt.Config(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, vocab_size=256,
                                     padded_vocab_size=256, block_size=64, mlp_class_name="LLaMAMLP",
                                     intermediate_size=128, bias=False, norm_class_name="RMSNorm"))
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(batch[0]).reshape(-1, 256), batch[1].reshape(-1))

    return _LM(model, loss), (tokens[:, :-1], tokens[:, 1:])


def _llama() -> tuple[L.LightningModule, Any] | None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         attn_implementation="sdpa"))
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return m(input_ids=batch[0], labels=batch[0]).loss

    def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=256)

    return _LM(model, loss, pipeline_batch=lambda batch: (batch[0], batch[0]), pipeline_loss=pipeline_loss), (ids,)


def _gpt2_small() -> tuple[L.LightningModule, Any]:
    from lightning_memplan.testing.zoo import GPT, causal_lm_loss, gpt2_style

    torch.manual_seed(0)
    model = GPT(gpt2_style(vocab_size=50304, n_layers=12, hidden=768, n_heads=12, max_positions=256))
    tokens = torch.randint(0, 50304, (2, 257), generator=torch.Generator().manual_seed(1))
    return _LM(model, lambda m, batch: causal_lm_loss(m, *batch)), (tokens[:, :-1], tokens[:, 1:])


#: name -> (builder, memory budget per rank in bytes)
CASES: dict[str, tuple[Callable[[], Any], int]] = {
    "litgpt 2 layers, 3 MiB (tp=2)": (_litgpt, 3 * MiB),
    "HF Llama 2 layers, 1.5 MiB (pp=2)": (_llama, int(1.5 * MiB)),
    "HF Llama 2 layers, 4.5 MiB (dp=2)": (_llama, int(4.5 * MiB)),
    "zoo GPT 124M (GPT-2 small shape), 1.5 GiB": (_gpt2_small, int(1.5 * 2**30)),
}


def _plan(module: L.LightningModule, batch: Any, budget: int, calibrate: bool) -> tuple[float, Any, int]:
    from lightning_memplan.live import batch_shape
    from lightning_memplan.live.layouts import find_layout
    from lightning_memplan.model.specs import TrainSpec
    from lightning_memplan.parallel.resolve import PlanningOptions, resolve

    b, s = batch_shape(batch)
    train = TrainSpec(micro_batch=b, seq_len=s, precision="32-true", optimizer="adamw", optimizer_impl="for_loop",
                      device="cpu", loss="naive")
    gc.collect()
    t0 = time.process_time()
    res = resolve(options=PlanningOptions(memory_budget=budget, calibrate=calibrate), module=module,
                  layout=find_layout(module), read_train=lambda: train, precision="32-true", devices=2, num_nodes=1,
                  self_parallel=False, forced=None, forced_source="forced", warn=lambda _: None,
                  read_batch=lambda: batch)
    return time.process_time() - t0, res, len(getattr(res.decision, "checked", ()))


def _step_seconds(module: L.LightningModule, batch: Any) -> float:
    optimizer = module.configure_optimizers()
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        module.training_step(batch, 0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        best = min(best, time.process_time() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per setting, the least counts (default 3)")
    ap.add_argument("--out", default=None, help="write the Markdown table here too")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat={args.repeat} must be >= 1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    rows = ["| case | choice | candidates checked | planning without (s) | with (s) | ratio | added (s) | "
            "one training step (s) | added / step |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, (build, budget) in CASES.items():
        built = build()
        if built is None:
            rows.append(f"| {name} | skipped (not installed) | | | | | | | |")
            continue
        without = min(_plan(build()[0], built[1], budget, False)[0] for _ in range(args.repeat))
        timed = [_plan(build()[0], built[1], budget, True) for _ in range(args.repeat)]
        seconds, res, checked = min(timed, key=lambda t: t[0])
        step = _step_seconds(built[0], built[1])
        added = seconds - without
        rows.append(f"| {name} | {res.plan.describe()} | {checked} | {without:.3f} | {seconds:.3f} | "
                    f"{seconds / max(without, 1e-9):.0f}x | {added:.2f} | {step:.3f} | {added / max(step, 1e-9):.0f} |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    header = (f"# Planning time with the calibrated check (benchmarks/bench_planner_calibration.py)\n\n"
              f"torch {torch.__version__}, 1 intra-op thread, CPU seconds (time.process_time), least of "
              f"{args.repeat} runs, 2 processes planned for.\n\n")
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(header + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
