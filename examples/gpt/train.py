"""Train the bundled GPT and watch its memory: the main lightning_memkit example.

    python examples/gpt/train.py                       # tiny GPT on CPU, about a minute on 2 busy cores
    python examples/gpt/train.py --max-steps 1000 --batch-size 16 --seq-len 128   # the longer run
    python examples/gpt/train.py --preset gpt2 --accelerator gpu --precision bf16-mixed --budget 24GiB
    python examples/gpt/train.py --autofit 40MB     # micro-batch, accumulation, checkpointing, optimizer
    python examples/gpt/train.py --checkpointing-budget 60MB --optimizer-budget 60MB
    python examples/gpt/train.py fit --config examples/gpt/config.yaml   # the same run through LightningCLI
    tensorboard --logdir lightning_logs

MemoryMonitor logs each step's memory by category to TensorBoard, prints a summary table at the end and
writes memory.png next to the TensorBoard events. After training, the model writes a short sample.

To make the run fit a memory budget, ``--autofit`` plans the micro-batch (``--batch-size`` stays the
global batch), gradient accumulation, activation checkpointing and optimizer together (AutoFit);
``--checkpointing-budget`` and ``--optimizer-budget`` use one lever each (ActivationCheckpointing,
OptimizerSwap). Budgets are sizes ("24GB", "6GiB") or, for --autofit, GPU names ("A100-40GB").
``--release-gradients`` frees the gradients after each optimizer step (GradientRelease): the next
forward runs without them, and the budget callbacks plan for that. ``--fused-step`` steps each parameter
inside backward instead (FusedOptimizerStep): no step holds all the gradients; no gradient accumulation.
``--offload`` keeps the optimizer's state, fp32 master weights and the gradients' sum in host memory
(OptimizerOffload): on a GPU the device holds the weights and the activations, little else.
"""

import argparse
import logging
import math
import sys
import warnings
from typing import TYPE_CHECKING

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_memkit import (
    ActivationCheckpointing,
    AutoFit,
    FusedOptimizerStep,
    GradientRelease,
    MemoryMonitor,
    OptimizerOffload,
    OptimizerSwap,
)
from lightning_memkit.demos.gpt import PRESETS, GPTDataModule, GPTLightningModule

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

_CLI_SUBCOMMANDS = ("fit", "validate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS), help="model size (default: tiny)")
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps (default: 100)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="sequences per optimizer step (default: 8); --autofit may split them into micro-batches",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    parser.add_argument(
        "--learning-rate", type=float, default=3e-3, help="peak learning rate (default: 3e-3)"
    )
    parser.add_argument("--budget", default=None, help="memory budget for MemoryMonitor, e.g. 24GiB")
    parser.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (default: auto)")
    parser.add_argument("--devices", default="auto", help="number or list of devices (default: auto)")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    parser.add_argument(
        "--val-every-n-steps", type=int, default=25, help="validate every N steps (default: 25)"
    )
    parser.add_argument(
        "--log-every-n-steps",
        type=int,
        default=5,
        help="Trainer logging interval, memory keys too (default: 5)",
    )
    parser.add_argument("--default-root-dir", default="lightning_logs", help="logs and memory plot go here")
    parser.add_argument("--seed", type=int, default=0)
    fit = parser.add_argument_group("fitting a memory budget")
    fit.add_argument("--autofit", metavar="BUDGET", help="AutoFit: plan every lever to fit, e.g. 24GB, T4")
    fit.add_argument("--checkpointing-budget", metavar="BUDGET", help="ActivationCheckpointing's budget")
    fit.add_argument("--optimizer-budget", metavar="BUDGET", help="OptimizerSwap's budget")
    step = fit.add_mutually_exclusive_group()
    step.add_argument(
        "--release-gradients",
        action="store_true",
        help="GradientRelease: free the gradients after each optimizer step (same training, lower peak)",
    )
    step.add_argument(
        "--fused-step",
        action="store_true",
        help="FusedOptimizerStep: step each parameter inside backward (same training, no gradients held)",
    )
    step.add_argument(
        "--offload",
        action="store_true",
        help="OptimizerOffload: the optimizer's state, fp32 masters and gradients in host memory",
    )
    args = parser.parse_args(argv)
    if args.autofit and (args.checkpointing_budget or args.optimizer_budget):
        parser.error("--autofit already chooses the checkpointing and the optimizer; give it alone")
    block_size = PRESETS[args.preset]["block_size"]
    if args.seq_len > block_size:
        parser.error(
            f"--seq-len {args.seq_len} is longer than the {args.preset} preset's block_size {block_size}"
        )
    return args


class _LightningNoise(logging.Filter):
    """Lightning's start-up lines that are not about this run (hardware probes, a product tip): the
    example's output is the training, the memory table and the sample."""

    NOISE = ("available: ", "💡 Tip")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(part in record.getMessage() for part in self.NOISE)


def quiet_console() -> None:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_LightningNoise())
    # torch's pytree deprecation that Lightning 2.6 triggers on every run; not ours to fix
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)


def epochs_for(data: GPTDataModule, max_steps: int) -> dict[str, int]:
    """The epochs that hold ``max_steps``, as the Trainer's ``max_epochs`` and ``limit_train_batches``: the
    progress bar reads "Epoch 0/0" (not "Epoch 0/-2") and "100/100" for a 100-step run (not "100/1441",
    with the ETA of the whole epoch)."""
    data.setup("fit")
    batches = len(data.train_dataloader())
    return {"max_epochs": math.ceil(max_steps / batches), "limit_train_batches": min(max_steps, batches)}


def print_sample(trainer: L.Trainer, model: GPTLightningModule) -> None:
    model.to(trainer.strategy.root_device)  # the Trainer moved it to the CPU at the end of fit
    print("\n--- sample ---")
    print(model.generate("The ", max_new_tokens=200, temperature=0.8, top_k=20))


def callbacks(args: argparse.Namespace) -> list[L.Callback]:
    chosen: list[L.Callback] = [GradientRelease()] if args.release_gradients else []
    if args.fused_step:
        chosen.append(FusedOptimizerStep())
    if args.offload:
        chosen.append(OptimizerOffload())
    if args.autofit:
        chosen.append(AutoFit(budget=args.autofit))
    if args.checkpointing_budget:
        chosen.append(ActivationCheckpointing(budget=args.checkpointing_budget))
    if args.optimizer_budget:
        chosen.append(OptimizerSwap(budget=args.optimizer_budget))
    # the plot draws the budget the run was fitted to, when no other is given
    fitted = args.autofit or args.checkpointing_budget or args.optimizer_budget
    return [*chosen, MemoryMonitor(budget=args.budget or fitted)]


def main(argv: list[str] | None = None) -> L.Trainer:
    args = parse_args(argv)
    quiet_console()
    L.seed_everything(args.seed)
    model = GPTLightningModule(args.preset, learning_rate=args.learning_rate, max_steps=args.max_steps)
    data = GPTDataModule(batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        **epochs_for(data, args.max_steps),
        val_check_interval=min(args.val_every_n_steps, args.max_steps),
        check_val_every_n_epoch=None,  # count val_check_interval in steps across epochs
        limit_val_batches=4,
        enable_model_summary=False,  # MemoryMonitor's table says more about memory
        log_every_n_steps=args.log_every_n_steps,
        enable_checkpointing=False,  # this example is about memory; add a ModelCheckpoint to keep weights
        default_root_dir=args.default_root_dir,
        logger=TensorBoardLogger(args.default_root_dir, name="gpt"),
        callbacks=callbacks(args),
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        print_sample(trainer, model)
    return trainer


def cli_main(args: list[str] | None = None) -> "LightningCLI":
    """The LightningCLI path: ``train.py fit --config config.yaml [--trainer.max_steps 50 ...]``."""
    from lightning.pytorch.cli import LightningCLI  # imported here: jsonargparse is slow to import

    cli = LightningCLI(GPTLightningModule, GPTDataModule, args=args)
    if cli.subcommand == "fit" and cli.trainer.is_global_zero:
        print_sample(cli.trainer, cli.model)
    return cli


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in _CLI_SUBCOMMANDS:
        cli_main()
    else:
        main()
