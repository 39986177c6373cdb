"""Train a Hugging Face causal LM with MemoryMonitor and AutoFit: the README's example, runnable.

    python examples/hf/train.py                          # a tiny random LLaMA on the CPU
    python examples/hf/train.py --max-steps 200 --budget 16MB

The model is built from a small random config (``AutoModelForCausalLM.from_config``), so nothing is
downloaded; the data is this file's own bytes, one token per byte. ``AutoFit`` plans the micro-batch,
gradient accumulation, activation checkpointing and optimizer for the budget before the first step: it
sets the DataModule's ``batch_size`` (which ``train_dataloader`` reads) and the Trainer's
``accumulate_grad_batches``, keeping the global batch. ``MemoryMonitor`` logs each step's memory by
category (``memory/*`` keys, MiB), prints the peak step's table at the end and writes ``memory.png``
beside the logs. On a GPU give a card's size or name instead (``--budget 24GiB``, ``--budget L4``).

The classes below are the README's code, line for line (tests/project/test_docs.py checks it, and runs this).
"""

import argparse
import logging
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_memkit import AutoFit, MemoryMonitor


class CausalLM(L.LightningModule):
    def __init__(self, learning_rate=3e-3):
        super().__init__()
        self.save_hyperparameters()
        config = AutoConfig.for_model(  # a tiny random LLaMA; or AutoConfig.from_pretrained(name)
            "llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )  # fmt: skip
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss  # the model shifts the labels itself
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)


class Windows(Dataset):  # windows of byte tokens: no tokenizer, nothing downloaded
    def __init__(self, tokens, seq_len):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self):
        return len(self.tokens) - self.seq_len

    def __getitem__(self, i):
        window = self.tokens[i : i + self.seq_len]
        return {"input_ids": window, "labels": window}


class ByteData(L.LightningDataModule):
    def __init__(self, batch_size=16, seq_len=64):
        super().__init__()
        self.batch_size = batch_size  # AutoFit sets this to the micro-batch it plans
        self.seq_len = seq_len

    def setup(self, stage):
        self.train_set = Windows(torch.tensor(list(Path(__file__).read_bytes())), self.seq_len)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


def train(max_steps=10, batch_size=16, seq_len=64, budget="8MB", root_dir="lightning_logs"):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=max_steps,
        log_every_n_steps=2,
        logger=CSVLogger(root_dir, name="hf"),  # or TensorBoardLogger, WandbLogger, MLFlowLogger
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[MemoryMonitor(budget=budget), AutoFit(budget=budget)],
    )
    trainer.fit(CausalLM(), datamodule=ByteData(batch_size=batch_size, seq_len=seq_len))
    return trainer


class _LightningNoise(logging.Filter):
    """Lightning's start-up lines that are not about this run (hardware probes, a product tip)."""

    def filter(self, record):
        return not any(part in record.getMessage() for part in ("available: ", "💡 Tip"))


def quiet_console():
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_LightningNoise())
    # torch's pytree deprecation that Lightning 2.6 triggers on every run, and a tiny dataset's warning
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-steps", type=int, default=10, help="optimizer steps (default: 10)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, sequences (default: 16)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    parser.add_argument("--budget", default="8MB", help="the memory budget per device (default: 8MB)")
    parser.add_argument("--root-dir", default="lightning_logs", help="where the logs and memory.png go")
    args = parser.parse_args(argv)
    quiet_console()
    return train(args.max_steps, args.batch_size, args.seq_len, args.budget, args.root_dir)


if __name__ == "__main__":
    main()
