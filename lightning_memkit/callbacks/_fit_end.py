"""What `MemoryMonitor` writes at the end of fit, on rank 0: the peak step's table, ``memory.png`` (a
stacked-area plot of the history, also handed to loggers that take images), and, as asked, ``advise``,
``snapshot`` and ``report`` on the batch of the highest measured step, simulated once for all three.

The batch is kept as the run goes (`PeakBatch`): only a measured step's, when it is the highest so far. A
new largest shape is measured anyway, and its twins peak alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities import rank_zero_info

from lightning_memkit._breakdown import MemoryBreakdown, MiB, format_bytes
from lightning_memkit._diagnosis.advise import Advice, advise
from lightning_memkit._diagnosis.html_report import html_report
from lightning_memkit._diagnosis.oom import on_cpu, simulable
from lightning_memkit._diagnosis.report import plot_history, render_summary
from lightning_memkit._diagnosis.snapshot import advised_snapshot, simulated_snapshot, write_snapshot
from lightning_memkit.callbacks._trainer import optimizer_steps_done, the_optimizer, trainer_step

#: ``warn(key, message)``: warn once per key; ``safely(logger, what, call)``: call a logger, its failure
#: said in one line
Warn = Callable[[str, str], None]
Safely = Callable[[Any, str, Callable[[], Any]], None]


@dataclasses.dataclass
class PeakBatch:
    """The batch of the highest measured step, for ``advise``, ``snapshot`` and ``report``."""

    #: the batch: its tensors aliased while the step runs, a CPU copy once kept
    batch: Any
    #: the optimizer step it belongs to (counted from 0, as the logged steps), and its measured peak (bytes)
    step: int = -1
    peak: int = -1


class PeakBatches:
    """The batch of the step being measured (`offer`), and a CPU copy of the highest measured so far
    (`kept`; the first until another is higher)."""

    def __init__(self) -> None:
        self.kept: PeakBatch | None = None
        #: the batch of the step being measured, not copied yet (``batch`` aliased)
        self._candidate: PeakBatch | None = None

    def offer(self, batch: Any) -> None:
        """The batch of a step about to be measured: it may be the run's highest."""
        self._candidate = PeakBatch(apply_to_collection(batch, torch.Tensor, torch.Tensor.detach))

    def drop(self) -> None:
        """The step in flight is no candidate (any longer)."""
        self._candidate = None

    def keep(self, trainer: pl.Trainer, breakdown: MemoryBreakdown) -> None:
        """Keep a CPU copy of the measured step's batch if the step is the highest so far (or the first)."""
        candidate, self._candidate = self._candidate, None
        if candidate is None or (self.kept is not None and breakdown.peak <= self.kept.peak):
            return
        candidate.batch = on_cpu(candidate.batch, copy=True)
        candidate.step, candidate.peak = optimizer_steps_done(trainer), breakdown.peak
        self.kept = candidate


@dataclasses.dataclass
class FitEnd:
    """The end-of-fit outputs `MemoryMonitor` was asked for (its arguments of the same names)."""

    summary: bool
    plot: bool
    advise: bool
    snapshot: bool
    report: bool
    #: the budget in bytes, drawn in the table and the plot
    budget: int | None
    #: the run's device, where the peak step is simulated
    device: torch.device
    warn: Warn
    safely: Safely

    def table_and_plot(
        self, trainer: pl.Trainer, history: list[tuple[int, MemoryBreakdown]], path: Path | None
    ) -> None:
        """The summary table, and the plot saved to ``path`` (``None``: under ``fast_dev_run``, none)."""
        step, worst = max(history, key=lambda item: item[1].peak)
        if self.summary:
            print(render_summary(worst, step=step, budget=self.budget))
        if not self.plot:
            return
        if path is None:
            rank_zero_info(
                "MemoryMonitor: no memory plot (memory.png) under `fast_dev_run`, which writes no files; "
                "run without it to get one."
            )
            return
        steps, breakdowns = zip(*history, strict=True)
        figure = plot_history(steps, breakdowns, path, budget=self.budget)
        if figure is None:
            self.warn("matplotlib", "MemoryMonitor: install matplotlib to get the memory plot (memory.png).")
            return
        rank_zero_info(f"MemoryMonitor: memory plot saved to {path}")
        last = max(optimizer_steps_done(trainer) - 1, 0)  # once, at the run's last logging step
        for logger in trainer.loggers:
            self.safely(logger, "log_image", lambda lg=logger: log_image(lg, figure, path, last))

    def peak_step(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        kept: PeakBatch,
        folder: Path | None,
        at: int,
    ) -> Advice | None:
        """``advise``, ``snapshot`` and ``report`` on the highest measured step's batch as this run takes
        it, simulated once for all three (``folder``: where the files go; ``None``: no files, as under
        fast_dev_run). Returns the advice, logged at step ``at`` as every other key is."""
        which = f"step {kept.step}'s batch (the highest measured step, {format_bytes(kept.peak)})"
        saves = (self.snapshot or self.report) and folder is not None
        try:
            model, kwargs = _step_as_run(trainer, pl_module, self.device)
        except Exception as err:
            self.warn("peak step", f"MemoryMonitor could not simulate {which}: {err!r}")
            return None
        advice, snapshot = None, None
        if self.advise:
            advice, snapshot = self._advise(trainer, (model, kwargs), kept.batch, which, saves, at)
        if not saves:
            return advice
        assert folder is not None
        try:
            if snapshot is None:  # no advice asked, or it failed: the step alone
                snapshot, tracker = simulated_snapshot(model, kept.batch, **kwargs)
                breakdown = tracker.breakdown()
            else:
                assert advice is not None
                breakdown = advice.breakdown
            self._save_step(folder, snapshot, breakdown, kept, advice)
        except Exception as err:
            self.warn("snapshot", f"MemoryMonitor could not save the simulated step: {err!r}")
        return advice

    def _advise(
        self,
        trainer: pl.Trainer,
        step: tuple[torch.nn.Module, dict],
        batch: Any,
        which: str,
        saves: bool,
        at: int,
    ) -> tuple[Advice | None, dict | None]:
        """`advise` on the ``step`` (`_step_as_run`'s) of ``batch``, printed and logged at step ``at``, with
        its simulated snapshot where one is saved (one simulation for both); ``(None, None)`` on failure."""
        model, kwargs = step
        rank_zero_info(f"MemoryMonitor: advising on {which}: simulating its step, then each fix")
        snapshot = None
        try:
            if saves:
                advice, snapshot = advised_snapshot(model, batch, **kwargs)
            else:
                advice = advise(model, batch, **kwargs)
        except Exception as err:
            self.warn("advise", f"MemoryMonitor could not advise: {err!r}")
            return None, None
        rank_zero_info(f"MemoryMonitor: memory advice for {which}\n{advice}")
        metrics = {f"memory/advice/{f.kind}": f.saved / MiB for f in advice}
        for logger in trainer.loggers:
            log = lambda lg=logger: lg.log_metrics(metrics, step=at)  # noqa: E731
            self.safely(logger, "log_metrics", log)
        return advice, snapshot

    def _save_step(
        self, folder: Path, snapshot: dict, breakdown: MemoryBreakdown, kept: PeakBatch, advice: Advice | None
    ) -> None:
        """The highest measured step's simulated twin into ``folder``, as ``snapshot`` and ``report`` ask."""
        peaks = f"simulated peak {format_bytes(breakdown.peak)}; measured: {format_bytes(kept.peak)}"
        which = f"step {kept.step}'s batch, the highest measured step"
        if self.snapshot:
            path = folder / "memory_snapshot.pickle"
            write_snapshot(snapshot, path)
            rank_zero_info(
                f"MemoryMonitor: {which} ({peaks}) saved as a PyTorch memory snapshot to {path}: open it "
                f"at pytorch.org/memory_viz, or `python -m torch.cuda._memory_viz trace_plot {path} -o "
                "step.html`"
            )
        if self.report:
            path = folder / "memory_report.html"
            findings = None if advice is None else advice.findings
            title = f"Peak memory of training step {kept.step}, the run's highest measured step, simulated"
            notes = [f"Step {kept.step}'s batch as this run takes its step, simulated; {peaks}."]
            no_findings = "MemoryMonitor(advise=True) adds what the peak holds that it need not."
            page = html_report(
                snapshot, breakdown, findings, title=title, notes=notes, no_findings=no_findings
            )
            path.write_text(page, encoding="utf-8")
            rank_zero_info(f"MemoryMonitor: {which} ({peaks}) as a page: {path}")


def _step_as_run(
    trainer: pl.Trainer, pl_module: pl.LightningModule, device: torch.device
) -> tuple[torch.nn.Module, dict]:
    """The model and `estimate_memory`'s arguments for a batch's step as this run takes it. Under FSDP2
    the module is sharded by now: its unsharded twin's sharded step stands for it."""
    model, optimizer = simulable(pl_module, the_optimizer(trainer))
    # with accumulation, a micro-batch adding to gradients already there: the cycle's highest
    step = trainer_step(trainer, accumulating=trainer.accumulate_grad_batches > 1)
    return model, {"optimizer": optimizer, "device": device.type, "step": step}


def run_dir(trainer: pl.Trainer) -> Path:
    """The folder of this run's logs, where ``memory.png`` goes: never a folder runs share, where the
    next run would overwrite it (W&B's ``save_dir`` and MLflow's ``mlruns`` hold every run)."""
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            return Path(logger.experiment.dir)  # <save_dir>/wandb/<run>/files, synced with the run
        if isinstance(logger, MLFlowLogger) and logger.save_dir is not None:
            return Path(logger.save_dir, logger.experiment_id, logger.run_id)
        log_dir = getattr(logger, "log_dir", None)  # TensorBoard, CSV: <save_dir>/<name>/version_<n>
        if log_dir:
            return Path(log_dir)
    return Path(trainer.default_root_dir)


def log_image(logger: Any, figure: Any, path: Path, step: int) -> None:
    """Hand the plot to loggers that take images; the others already have the PNG on disk."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_figure("memory/breakdown", figure, global_step=step)
    elif isinstance(logger, WandbLogger):
        logger.log_image(key="memory/breakdown", images=[str(path)], step=step)
    elif isinstance(logger, MLFlowLogger):
        logger.experiment.log_artifact(logger.run_id, str(path))
