"""Train a Hugging Face ``LlamaForCausalLM`` built from a small config (no download) with
``MemoryPlanCallback`` and ``LinearCrossEntropy``.

The model's own forward would build the [B, S, V] logits and an fp32 copy of them; instead the
training step asks the decoder for its hidden states and hands them with ``lm_head.weight`` to the
chunked loss. The memory report after each epoch shows the estimate (Llama layout recognised from the
module tree: GQA, SwiGLU, RMSNorm) next to the measurement.

    python examples/hf_llama/train.py                  # CPU, about a minute
    python examples/hf_llama/train.py --strategy memplan_auto --devices 2
"""

from __future__ import annotations

import argparse
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_memplan  # noqa: F401  (registers strategy="memplan_auto")
from lightning_memplan import LinearCrossEntropy, MemoryPlanCallback
from lightning_memplan.testing.text import WordTokenizer, offline_corpus


class HFLlamaLM(L.LightningModule):
    def __init__(self, vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, lr: float) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(8 * hidden / 3) // 8 * 8,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=2048,
            attn_implementation="sdpa",
        )
        self.model = LlamaForCausalLM(config)
        self.loss_fn = LinearCrossEntropy(shift=True)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        hidden = self.model.model(input_ids=input_ids).last_hidden_state  # [B, S, h], no logits
        loss = self.loss_fn(hidden, self.model.lm_head.weight, input_ids)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--corpus-chars", type=int, default=3_000_000)
    p.add_argument("--out-dir", default="lightning_logs_hf_llama")
    args = p.parse_args(argv)
    L.seed_everything(0, verbose=False)
    text = offline_corpus(args.corpus_chars)
    tokenizer = WordTokenizer.train(text, args.vocab_size)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    n = tokens.numel() // args.seq_len
    windows = tokens[: n * args.seq_len].view(n, args.seq_len)
    loader = DataLoader(TensorDataset(windows), batch_size=args.batch_size, shuffle=True, drop_last=True)
    module = HFLlamaLM(tokenizer.vocab_size, args.hidden, args.layers, args.heads, args.kv_heads, lr=3e-3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        precision=args.precision,
        max_epochs=args.epochs,
        limit_train_batches=args.steps_per_epoch,
        log_every_n_steps=5,
        default_root_dir=args.out_dir,
        callbacks=[MemoryPlanCallback(measure_every_n_steps=10, units="MiB")],
        enable_checkpointing=False,
    )
    trainer.fit(module, loader)
    if torch.distributed.is_initialized():  # multi-process: close the group before exit (see examples/gpt)
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
