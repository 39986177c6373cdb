"""MemoryMonitor: every training step's peak memory by category, in the user's logger.

The measurement itself is `measure`, a plain context manager; this callback holds the Lightning hooks and
hands each job to its own unit, as Lightning's ``ThroughputMonitor`` keeps its arithmetic in
``Throughput``:

- `_twins.Twins`: which steps are measured, and the breakdown a step alike reuses from its measured twin
  (the signature of a step: its batch's shapes, the gradients held, the optimizers' state, stepping);
- `_memory_log`: one optimizer step's figures over its micro-batches (`PendingStep`), and the highest step
  since the last log (`LogWindow`), which each log carries;
- `_ranks.agree`: with several processes, every rank's peak, and all ranks off together when one fails;
- `_fit_end`: the summary table, ``memory.png``, and ``advise``, ``snapshot`` and ``report`` on the
  highest measured step's batch (`PeakBatches` keeps it);
- `_oom_report.report_oom`: what a step that ran out of memory needed, and the plans that fit.

On CUDA the caching allocator also gives the peak of every single step (``torch.cuda.max_memory_allocated``),
so ``memory/peak`` is read fresh each step there and the difference from the twin lands in
``memory/temporary``. A compiled step (``torch.compile`` in ``configure_model`` or on the module) is
measured buffer by buffer as well, and compiles as it would unwatched: the same frames, graphs and graph
breaks.
"""

from __future__ import annotations

import numbers
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, format_bytes
from lightning_memkit._budget import Budget, BudgetSetting, flag, whole_number
from lightning_memkit._diagnosis.advise import Advice
from lightning_memkit._diagnosis.oom import StepInFlight
from lightning_memkit._measuring.kernels import helper_ready, start_helper
from lightning_memkit._sharding.fsdp2 import explain_mixed_tensors
from lightning_memkit.callbacks._fit_end import FitEnd, PeakBatches, run_dir
from lightning_memkit.callbacks._memory_log import LogWindow, PendingStep
from lightning_memkit.callbacks._oom_report import report_oom
from lightning_memkit.callbacks._ranks import agree
from lightning_memkit.callbacks._trainer import accumulating_now, call_logger, optimizer_steps_done
from lightning_memkit.callbacks._twins import Twins


class MemoryMonitor(Callback):
    r"""Log every training step's peak memory, split into parameters, gradients, optimizer state,
    activations and temporary buffers.

    Logged keys, on the logging steps (``log_every_n_steps``), each log carrying the **highest step since
    the last log**, so that no peak between two logs is hidden; the steps after the last logging step
    are logged at the end of fit, at the last step. All memory keys in **MiB** (2**20 bytes); with
    gradient accumulation a step is the highest of its micro-batches. The five categories are at the
    moment of that highest step's peak:

    - ``memory/parameters``: parameters and buffers.
    - ``memory/gradients``: ``.grad`` tensors live at the peak.
    - ``memory/optimizer_state``: tensors in ``optimizer.state`` (all optimizers).
    - ``memory/activations``: tensors saved for backward.
    - ``memory/temporary``: everything else live at the peak (workspaces, the batch, logits and loss
      copies, optimizer temporaries, autocast weight copies).
    - ``memory/peak``: the sum of the five above, which is the allocator's peak of the highest step since
      the last log.
    - ``memory/peak_step``: that step's index (counted from 0, as the loggers count steps).
    - ``memory/step_peak``: the logged step's own peak (what ``memory/peak`` logged in earlier versions).
    - ``memory/forward_peak``, ``memory/backward_peak``, ``memory/optimizer_step_peak``: the highest
      total in each phase of a step (forward: ``training_step`` up to ``on_before_backward``; backward: up
      to ``on_before_optimizer_step``; optimizer step: the rest of the step), over the steps since the
      last log; on the CPU the highest of the three is ``memory/peak``; on CUDA they are the tracker's
      count of tensors (without the caching allocator's workspaces), so at most ``memory/peak``.
    - ``memory/peak_fraction``: ``peak / budget`` (unitless); without a budget, on CUDA,
      ``peak / total device memory``.
    - CUDA only: ``memory/reserved`` (MiB, the caching allocator's reserved high-water mark since the
      last log), ``memory/alloc_retries`` and ``memory/ooms`` (cumulative counts: retries mean
      fragmentation).
    - Several processes (DDP, FSDP2): ``memory/rank_{r}/peak`` (MiB), every rank ``r``'s highest step
      since the last log; the keys above are rank 0's, and each rank measures its own step.
    - FSDP2 (``fully_shard``, e.g. under ``ModelParallelStrategy``), in MiB, at ``memory/peak``'s step,
      each a part of a category above: ``memory/fsdp/sharded_parameters`` (this rank's shards) and
      ``memory/fsdp/unsharded_parameters`` (the all-gathered copies in flight), both in
      ``memory/parameters``; ``memory/fsdp/sharded_gradients`` (after their reduce-scatter) and
      ``memory/fsdp/unsharded_gradients`` (before it), in ``memory/gradients``;
      ``memory/fsdp/communication`` (the collectives' buffers), in ``memory/temporary``.
    - Some parameters frozen (a LoRA or QLoRA fine-tune, a frozen backbone), in MiB, at ``memory/peak``'s
      step, the two parts of ``memory/parameters``: ``memory/trainable_parameters`` (those a gradient
      reaches: the adapters) and ``memory/frozen_parameters`` (the frozen base, a quantized weight with
      its quantization state, and the buffers).

    At the end of fit it prints a table of the peak step and saves ``memory.png``, a stacked-area plot of
    the categories over steps, in the logger's directory (and logs it as an image where the logger takes
    images: TensorBoard, W&B, MLflow); under ``fast_dev_run``, which writes no files, it saves no plot and
    says so.

    When a training step runs out of memory (``torch.OutOfMemoryError``), it warns, on rank 0 and before
    the traceback: the phase the step died in (forward, backward, optimizer step); what the step needs, by
    category, measured on an earlier step of the same signature if there was one, else simulated for
    that batch (`estimate_memory`); the memory there was (``budget``, else AutoFit's, else the CUDA
    device's less the context and reserve; on the CPU without any it is unknown and nothing is planned);
    and the fastest plans (at most 3) that fit it (`plan_fit` for the global batch, the Trainer's
    precision and the run's optimizer, with a 10 % margin or AutoFit's), each with its simulated peak, its
    time relative to the fastest and the code that sets it, then the ``AutoFit`` line that makes the
    first. Where the need fits the memory by these figures, it says so (fragmentation, another process)
    and plans for the need. With `AutoFit` in the Trainer it is said once, while AutoFit's plan is still
    applied. The error itself propagates unchanged; a failure to explain it is one line. Nothing is added
    to a step that does not fail; see docs/oom.md.

    Args:
        budget: the memory you want the step to fit: bytes or a size (``"24GB"``, ``"6GiB"``), a GPU name
            (``"A100-40GB"``, ``"H200"``: the card less the CUDA context and a fragmentation reserve), a
            fraction of the CUDA device (``0.9``) or ``"auto"`` (see `parse_budget`; the last two are read
            in ``setup``, on the run's device). Enables ``memory/peak_fraction`` and a warning when a step
            goes over it.
        log_every_n_steps: log every N optimizer steps, on the steps Lightning logs ``self.log`` values at
            (the N-th, 2N-th, ...: step N - 1, 2N - 1, ... counted from 0, and the last step of a stopped
            run), each log the highest of the N steps; the history for the plot keeps them all. Default:
            the Trainer's ``log_every_n_steps``, as Lightning's own monitors do.
        remeasure_every_n_steps: measure a step from scratch at least this often even when it matches
            an already measured one. 0 never re-measures steps alike.
        plot: save (and log) the stacked-area plot at the end of fit.
        summary: print the peak step's table at the end of fit.
        advise: at the end of fit (rank 0), run `lightning_memkit.advise` on the batch of the highest
            measured step (a CPU copy kept whenever a measured step is the highest so far: with dynamic
            padding, the longest batch, a new shape and so measured anyway) with the Trainer's precision,
            optimizer and step levers: print which step it is and what its peak holds that it need not,
            each finding with the bytes its fix saves and the fix, and log ``memory/advice/{kind}`` (MiB,
            e.g. ``memory/advice/gradients``); the `Advice` is kept in ``advice``. With gradient
            accumulation, the micro-batch is advised as adding to the gradients. It simulates a few steps
            (seconds for a small model, about a minute for 7B); a module with manual optimization gets a
            warning instead.
        snapshot: at the end of fit (rank 0), simulate that step as run (the same step ``advise`` reads)
            and save it as a PyTorch memory snapshot, ``memory_snapshot.pickle`` beside ``memory.png``, for
            torch's memory viewer (`lightning_memkit.memory_snapshot`). It is the simulated twin of the
            measured step, and says which step and both peaks.
        report: at the end of fit (rank 0), the same simulated step as one self-contained HTML page,
            ``memory_report.html`` beside ``memory.png``, headed with the step's index: its timeline
            stacked by category with the phases and the peak, the top modules at the peak and, with
            ``advise=True``, the advice.

    Example::

        trainer = Trainer(callbacks=[MemoryMonitor(budget="24GB")])

    Raises:
        MisconfigurationException: at setup, with ``Trainer(logger=False)``.
    """

    def __init__(
        self,
        budget: int | float | str | Budget | None = None,
        log_every_n_steps: int | None = None,
        remeasure_every_n_steps: int = 100,
        plot: bool = True,
        summary: bool = True,
        advise: bool = False,
        snapshot: bool = False,
        report: bool = False,
    ) -> None:
        if log_every_n_steps is not None:  # None: the Trainer's
            log_every_n_steps = whole_number("log_every_n_steps", log_every_n_steps, of="steps", at_least=1)
        flags = {"plot": plot, "summary": summary, "advise": advise, "snapshot": snapshot, "report": report}
        for name, value in flags.items():
            flag(name, value)
        remeasure = remeasure_every_n_steps
        if isinstance(remeasure, bool) or not isinstance(remeasure, numbers.Integral):  # numpy's: yes
            raise TypeError(
                f"`remeasure_every_n_steps` must be an int (0: never re-measure alike steps), got "
                f"{remeasure_every_n_steps!r}"
            )
        if remeasure_every_n_steps < 0:
            raise ValueError(f"`remeasure_every_n_steps` must be >= 0, got {remeasure_every_n_steps}")
        self._budget = BudgetSetting(budget)
        self.log_every_n_steps = log_every_n_steps
        self.remeasure_every_n_steps = int(remeasure_every_n_steps)  # numpy's integers too
        self.plot = plot
        self.summary = summary
        self.advise = advise
        self.snapshot = snapshot
        self.report = report
        self._reset()

    def _reset(self) -> None:
        """What one fit learns: a second fit (another model, another batch) starts from nothing."""
        #: (step, breakdown) of every optimizer step so far, in bytes.
        self.history: list[tuple[int, MemoryBreakdown]] = []
        #: under FSDP2, (step, FSDP2's part of the peak by `SHARDED_KINDS`) for every step of `history`
        self.sharded_history: list[tuple[int, dict[str, int]]] = []
        self._warned: set[str] = set()
        #: the measured steps by signature, and the step in flight's measurement
        self._twins = Twins(self.remeasure_every_n_steps, self._warn_once)
        #: the optimizer step in flight, over its micro-batches (`_memory_log.PendingStep`)
        self._pending = PendingStep()
        #: the steps since the last log: the next log carries their highest (`LogWindow`)
        self._window = LogWindow()
        self._device = torch.device("cpu")
        self._disabled = False
        #: an internal error of this rank, not yet shared with the others (see `_agree`)
        self._failure: Exception | None = None
        #: whether on_train_batch_start ran for the batch now in flight (Lightning skips it for a None batch)
        self._in_step = False
        #: the batch in flight and its phase, for explaining an OOM
        self._step = StepInFlight()
        self._explained = False
        #: what `advise` found at the end of fit (with ``advise=True``)
        self.advice: Advice | None = None
        #: the batch of the highest measured step, for ``advise``, ``snapshot`` and ``report`` at the end of
        #: fit (a CPU copy, kept whenever a measured step is the highest so far)
        self._peak_batches = PeakBatches()
        #: when ``setup`` started the CPU kernel helper (`time.perf_counter`), until it is ready
        self._helper_started: float | None = None

    @property
    def budget(self) -> int | None:
        """The budget in bytes (``None`` without one, or until ``setup`` for one read from the device)."""
        return self._budget.usable

    @property
    def measured_steps(self) -> int:
        """How many steps were measured from scratch (the rest reused a twin's breakdown)."""
        return self._twins.measured_steps

    # --- Lightning hooks ----------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use `MemoryMonitor` callback with `Trainer(logger=False)`: it reports through the "
                "Trainer's loggers. Pass one, e.g. `Trainer(logger=CSVLogger('logs'))`, or use "
                "`lightning_memkit.measure` around your own step."
            )
        self._reset()  # a resumed fit gets its history back in load_state_dict, which comes after
        self._device = trainer.strategy.root_device
        self._budget.resolve()
        if self._device.type == "cpu" and start_helper():
            self._helper_started = time.perf_counter()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._helper_started is None:
            return
        # The CPU kernel helper (`_measuring.kernels`) imports torch and runs a first profile: 2-4 s that
        # the first measured step would otherwise spend waiting for its first answer.
        waiting = time.perf_counter()
        helper_ready()
        now = time.perf_counter()
        rank_zero_info(
            f"MemoryMonitor: started its CPU kernel helper process before the first step ("
            f"{now - self._helper_started:.1f} s since setup, {now - waiting:.1f} s of it waited for here; "
            "once per process), so that the first measured step does not pay for it"
        )
        self._helper_started = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step.start(batch, batch_idx)
        self._peak_batches.drop()
        if self._disabled or self._failure is not None:
            return
        self._in_step = True
        try:
            measuring = self._twins.start(trainer, pl_module, batch, self._device)
            if measuring and (self.advise or self.snapshot or self.report) and trainer.is_global_zero:
                self._peak_batches.offer(batch)  # a new shape may be the run's highest
        except Exception as err:
            self._fail(trainer, err)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._enter(trainer, "backward")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._enter(trainer, "optimizer step")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step.end()
        if self._disabled:
            return
        if self._in_step and self._failure is None:
            try:
                self._add_micro_batch(trainer)
            except Exception as err:
                self._fail(trainer, err)
        self._in_step = False
        self._peak_batches.drop()
        if accumulating_now(trainer):
            return
        peaks = self._agree(trainer)
        if peaks is None or self._pending.breakdown is None:
            return
        try:
            self._flush(trainer, peaks)
        except Exception as err:
            self._fail(trainer, err)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A LightningModule whose on_train_batch_start returns -1 skips the rest of the epoch after the
        # callbacks' on_train_batch_start: a measurement opened there has no step to measure, and the batch
        # kept for explaining an OOM no step to explain.
        try:
            self._twins.close()
        except Exception as err:
            self._fail(trainer, err)
        self._step.end()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Explain an out-of-memory error (once: `AutoFit` calls this too, before it undoes its plan), or a
        sharded step that met parameters FSDP2 had not gathered."""
        self._twins.close_quietly()  # its dispatch mode must not see the simulations
        hint = explain_mixed_tensors(exception, pl_module)
        if hint is not None:
            self._warn_once("mixed", f"MemoryMonitor: {hint}")
        if isinstance(exception, torch.OutOfMemoryError) and not self._explained:  # the rank that ran out
            self._explained = True
            measured = None
            if self._in_step and not self._disabled and self._failure is None:
                measured = self._twins.twin()
            report_oom(
                trainer, pl_module, self._step, self._budget.budget, who="MemoryMonitor", measured=measured
            )
        self._step.end()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._twins.close_quietly()
        if self._disabled or self._failure is not None or not self.history or not trainer.is_global_zero:
            return
        try:  # the steps after the last logging step: a peak among them must reach the logger too
            self._log_window(trainer)
        except Exception as err:
            self._fail(trainer, err)
            return
        outputs = FitEnd(
            summary=self.summary,
            plot=self.plot,
            advise=self.advise,
            snapshot=self.snapshot,
            report=self.report,
            budget=self.budget,
            device=self._device,
            warn=self._warn_once,
            safely=self._safely,
        )
        path = None
        try:
            # Under fast_dev_run Lightning writes nothing (no logs, no checkpoints), and nor does this.
            path = None if trainer.fast_dev_run else run_dir(trainer) / "memory.png"
            outputs.table_and_plot(trainer, self.history, path)
        except Exception as err:
            where = f" ({path})" if path is not None else ""
            self._warn_once("report", f"MemoryMonitor could not write its end-of-fit report{where}: {err!r}")
        kept, self._peak_batches.kept = self._peak_batches.kept, None
        if kept is not None:
            folder = None if path is None else path.parent
            at = self.history[-1][0]  # the last step's, as every other key is logged
            self.advice = outputs.peak_step(trainer, pl_module, kept, folder, at)

    @property
    @override
    def state_key(self) -> str:
        """What tells two monitors of one Trainer apart, as for Lightning's own stateful callbacks: the
        budget as given (a device-relative one reads differently from card to card), and the periods of
        logging and re-measuring."""
        return self._generate_state_key(
            budget=self._budget.given,
            log_every_n_steps=self.log_every_n_steps,
            remeasure_every_n_steps=self.remeasure_every_n_steps,
        )

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint of a version before `state_key` keeps the history under the class name: the only
        monitor of the Trainer takes it (``load_state_dict`` comes after, and finds no state of its own)."""
        states = checkpoint.get("callbacks") or {}
        old = states.get(type(self).__qualname__)
        alone = sum(isinstance(cb, MemoryMonitor) for cb in trainer.callbacks) == 1
        if old is not None and self.state_key not in states and alone:
            self.load_state_dict(old)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": [[step, *(getattr(b, c) for c in CATEGORIES)] for step, b in self.history]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [
            (int(row[0]), MemoryBreakdown(**dict(zip(CATEGORIES, map(int, row[1:]), strict=True))))
            for row in state_dict.get("history", [])
        ]

    # --- one step -----------------------------------------------------------------------------

    def _enter(self, trainer: pl.Trainer, phase: str) -> None:
        """The step in flight enters ``phase`` (one of `PHASES`): for an OOM's explanation, and for the
        phase's highest where the step is measured."""
        self._step.enter(phase)
        if self._step.phase is not None:
            try:
                self._twins.enter_phase(phase)
            except Exception as err:
                self._fail(trainer, err)

    def _finish_step(self, trainer: pl.Trainer) -> MemoryBreakdown | None:
        """The step's breakdown; ``None`` for a step that cannot be measured (nor its twins)."""
        return self._twins.finish(trainer.global_step, self._device)

    def _add_micro_batch(self, trainer: pl.Trainer) -> None:
        """The micro-batch just done joins its optimizer step; a measured step's batch may be the highest."""
        breakdown = self._finish_step(trainer)
        if breakdown is None:
            return
        parts, phases = self._twins.extras()
        self._pending.add(breakdown, parts, phases, self._device)
        self._peak_batches.keep(trainer, breakdown)

    def _flush(self, trainer: pl.Trainer, peaks: list[int]) -> None:
        """Close one optimizer step: keep it in the history, and log the highest step since the last log
        (`LogWindow`) on a logging step, with every rank's highest."""
        figures = self._pending.take(optimizer_steps_done(trainer))
        step, breakdown, parts = figures.step, figures.breakdown, figures.parts
        self.history.append((step, breakdown))
        sharded = {key[len("fsdp/") :]: value for key, value in parts.items() if key.startswith("fsdp/")}
        if sharded:
            self.sharded_history.append((step, sharded))
        self._window.add(figures, peaks)
        if self.budget is not None and breakdown.peak > self.budget:
            self._warn_once(
                "budget",
                f"Step {step} peaked at {format_bytes(breakdown.peak)}, over the budget of "
                f"{format_bytes(self.budget)} by {format_bytes(breakdown.peak - self.budget)}. Largest "
                f"consumer: {max(CATEGORIES, key=lambda c: getattr(breakdown, c))}. Lower the micro-batch, "
                "checkpoint activations (ActivationCheckpointing) or swap the optimizer (OptimizerSwap).",
            )
        # On Lightning's own logging steps (its logger connector's `should_update_logs`): the memory keys
        # share their steps with the module's `self.log` values (CSV writes them in a row of their own at
        # that step, as it does DeviceStatsMonitor's).
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if every and ((step + 1) % every == 0 or trainer.should_stop):
            self._log_window(trainer)

    def _log_window(self, trainer: pl.Trainer) -> None:
        """Log the steps since the last log at the last one's step (rank 0), and start a new window."""
        last = self._window.last
        if trainer.is_global_zero and last is not None:
            total = None
            if self._device.type == "cuda":
                total = torch.cuda.get_device_properties(self._device).total_memory
            metrics = self._window.metrics(self.budget, total)
            for logger in trainer.loggers:
                log = lambda lg=logger: lg.log_metrics(metrics, step=last.step)  # noqa: E731
                self._safely(logger, "log_metrics", log)
        self._window.clear()

    # --- never crash the run we observe -------------------------------------------------------

    def _safely(self, logger: Any, what: str, call: Any) -> None:
        call_logger(logger, what, call, "MemoryMonitor", self._warned)

    def _fail(self, trainer: pl.Trainer, err: Exception) -> None:
        """An internal error on this rank: say so here (every rank speaks for itself) and stop measuring.
        Alone, the monitor is off at once; with several ranks, at the next optimizer step's `_agree`, on
        all of them together: a rank that left early would leave the others waiting in a collective."""
        self._twins.close_quietly()
        self._failure = err
        if trainer.world_size == 1:
            self._disabled = True
        self._warn_once(
            "disabled",
            f"MemoryMonitor hit an internal error and stops monitoring; training goes on. Error: {err!r}",
            rank=trainer.global_rank if trainer.world_size > 1 else None,
        )

    def _agree(self, trainer: pl.Trainer) -> list[int] | None:
        """Every rank's peak for the optimizer step just done, once all ranks are known to be well
        (`_ranks.agree`); ``None`` (and the monitor off everywhere) when any rank failed."""
        agreement = agree(trainer, self._pending.peak, self._failure, self._device)
        self._failure = agreement.failure
        if agreement.peaks is not None:
            return agreement.peaks
        self._disabled = True
        self._pending.clear()
        if self._failure is None:
            self._warn_once(
                "disabled",
                f"MemoryMonitor stops monitoring on every rank: rank(s) {agreement.failed} hit an internal "
                "error (see their warnings). Training goes on.",
                rank=trainer.global_rank,
            )
        return None

    def _warn_once(self, key: str, message: str, rank: int | None = None) -> None:
        """Warn once per key: from rank 0, or from ``rank`` itself (its own failure), rank-prefixed."""
        if key in self._warned:
            return
        self._warned.add(key)
        if rank is None:
            rank_zero_warn(message)
        else:
            warnings.warn(rank_prefixed_message(message, rank), stacklevel=2)
