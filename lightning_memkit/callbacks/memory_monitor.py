"""MemoryMonitor: every training step's peak memory by category, in the user's logger.

The measurement itself is `measure`, a plain context manager; this callback decides *which* steps to
measure, keeps the run cheap, and reports. A measured step follows every op (about 1.3x a plain step on
CPU), so it is done only for steps unlike any measured before. Two steps are alike when their
*signature* matches: the shape, dtype and device of every tensor in the batch, however it is nested
(dicts, ``UserDict`` and Hugging Face's ``BatchEncoding``, dataclasses, named tuples, objects holding
tensors in their attributes: `batch_signature`), which parameters hold a gradient when the step begins,
how many tensors and bytes the optimizers keep (`optimizer_signature`), and whether the step accumulates
or steps. Steps alike allocate alike, so a later step reuses the exact breakdown of its measured twin. A
batch the signature cannot see into (no tensor found, an object without readable attributes) and an
optimizer whose step allocates by value (LBFGS) have no twins: every such step is measured, and so is
every step of a model whose step sizes a tensor by the values of others (``nonzero``, a boolean mask's
selection, a packed sequence's lengths: mixture-of-experts routing token by token, an RNN over packed
sequences), whose steps of the same shapes allocate otherwise. Every ``remeasure_every_n_steps`` steps a
step is measured again anyway, for models whose allocations depend on the data in other ways. On CUDA
the caching allocator also gives the peak of every single step (``torch.cuda.max_memory_allocated``), so
``memory/peak`` is read fresh each step there and the difference from the twin lands in
``memory/temporary``. A compiled step (``torch.compile`` in ``configure_model`` or on the module) is
measured buffer by buffer as well, and compiles as it would unwatched: the same frames, graphs and graph
breaks. FSDP2 and tensor parallel on the CPU measure every step: gloo's worker threads time when a
collective's buffers are freed, so steps alike there differ by up to a layer's buffers.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import numbers
import time
import types
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.rank_zero import rank_prefixed_message
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_memkit._breakdown import CATEGORIES, MemoryBreakdown, MiB, format_bytes
from lightning_memkit._budget import flag, parse_budget, reads_device, whole_number
from lightning_memkit._diagnosis.advise import Advice, advise
from lightning_memkit._diagnosis.html_report import html_report
from lightning_memkit._diagnosis.oom import PHASES, StepInFlight, on_cpu, simulable
from lightning_memkit._diagnosis.report import plot_history, render_summary
from lightning_memkit._diagnosis.snapshot import advised_snapshot, simulated_snapshot, write_snapshot
from lightning_memkit._measuring.kernels import helper_ready, start_helper
from lightning_memkit._measuring.measurement import MemoryMeasurement, measure
from lightning_memkit._measuring.storages import leaves, optimizer_tensors, storage_bytes
from lightning_memkit._sharding.fsdp2 import explain_mixed_tensors, is_sharded
from lightning_memkit._sharding.layout import layout_of
from lightning_memkit.callbacks._memory_log import LogWindow, StepMemory
from lightning_memkit.callbacks._oom_report import report_oom
from lightning_memkit.callbacks._trainer import (
    accumulating_now,
    call_logger,
    optimizer_steps_done,
    the_optimizer,
    trainer_step,
)

_MAX_SIGNATURES = 64
#: Objects a batch signature walks at most; a larger batch is measured every step rather than guessed at.
_MAX_NODES = 10_000
#: Nesting a batch signature follows at most.
_MAX_DEPTH = 32


def _parts(measurement: Any) -> dict[str, int] | None:
    """The parts of categories a measured step logs besides them (bytes), by key after ``memory/``: FSDP2's
    (``fsdp/sharded_parameters``, ...) and the parameters' split where some are frozen
    (``trainable_parameters``, ``frozen_parameters``); ``None`` for a step that has neither."""
    parts = {f"fsdp/{kind}": value for kind, value in (measurement.sharded or {}).items()}
    parts.update(measurement.parameter_split or {})
    return parts or None


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
        budget: int | str | None = None,
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
        self._budget_spec = budget
        self._budget = None if budget is None or reads_device(budget) else parse_budget(budget)
        #: the budget in bytes (``None`` without one, or until ``setup`` for a device-relative one)
        self.budget = None if self._budget is None else self._budget.usable
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
        #: what a step logs besides its breakdown: the parts of categories (`_parts`: FSDP2's, the
        #: parameters' split) and each phase's highest (`MemoryMeasurement.phase_peaks`), for each measured
        #: signature and the last measured step; and for the optimizer step in flight
        self._part_twins: dict[tuple, tuple[dict[str, int] | None, dict[str, int] | None]] = {}
        self._last_parts: dict[str, int] | None = None
        self._last_phases: dict[str, int] | None = None
        self._pending_parts: dict[str, int] | None = None
        self._pending_phases: dict[str, int] = {}
        #: the steps since the last log: the next log carries their highest (`LogWindow`)
        self._window = LogWindow()
        #: whether steps alike allocate alike: not for FSDP2 on the CPU, where gloo's worker threads time
        #: when a collective's buffers are freed (the same step peaked up to a layer's buffers higher)
        self._twins_alike: bool | None = None
        #: How many steps were measured from scratch (the rest reused a twin's breakdown).
        self.measured_steps = 0
        self._twins: OrderedDict[tuple, MemoryBreakdown | None] = OrderedDict()  # None: unmeasurable
        self._since_measured = 0
        self._signature: tuple | None = None
        self._measurement: MemoryMeasurement | None = None
        self._last_measured = MemoryBreakdown()
        #: the op that sized a tensor by values in the last measured step (`MemoryMeasurement.value_shaped`)
        self._last_value_shaped: str | None = None
        self._pending: MemoryBreakdown | None = None
        self._pending_extras: dict[str, float] = {}
        self._device = torch.device("cpu")
        self._warned: set[str] = set()
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
        #: a CPU copy of the batch of the highest measured step (the first until another is higher), for
        #: ``advise``, ``snapshot`` and ``report`` at the end of fit: a `_PeakBatch`
        self._peak_batch: _PeakBatch | None = None
        #: the batch of the step being measured, not copied yet (`_PeakBatch`, ``batch`` aliased)
        self._candidate: _PeakBatch | None = None
        #: when ``setup`` started the CPU kernel helper (`time.perf_counter`), until it is ready
        self._helper_started: float | None = None

    # --- Lightning hooks ----------------------------------------------------------------------

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
        if self._budget_spec is not None and reads_device(self._budget_spec):
            self._budget = parse_budget(self._budget_spec)
            self.budget = self._budget.usable
        if self._device.type == "cpu" and start_helper():
            self._helper_started = time.perf_counter()

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

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step.start(batch, batch_idx)
        self._candidate = None
        if self._disabled or self._failure is not None:
            return
        self._in_step = True
        try:
            self._close_measurement()  # one a skipped step left open (see on_train_epoch_end)
            signature = self._step_signature(trainer, pl_module, batch)
            self._signature = signature
            due = self.remeasure_every_n_steps and self._since_measured + 1 >= self.remeasure_every_n_steps
            if self._twins_alike is None:
                # gloo's worker threads time when a collective's buffers are freed (FSDP2, tensor parallel)
                self._twins_alike = not (
                    self._device.type == "cpu" and (is_sharded(pl_module) or layout_of(pl_module))
                )
            if signature is None or signature not in self._twins or due or not self._twins_alike:
                self._measurement = measure(pl_module, trainer.optimizers, device=self._device, batch=batch)
                self._measurement.__enter__()
                self._measurement.enter_phase(PHASES[0])
                if (self.advise or self.snapshot or self.report) and trainer.is_global_zero:
                    # a new shape may be the run's highest: its batch, kept if it is (`_keep_peak_batch`)
                    aliased = apply_to_collection(batch, torch.Tensor, torch.Tensor.detach)
                    self._candidate = _PeakBatch(aliased)
            elif self._device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self._device)
        except Exception as err:
            self._fail(trainer, err)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._enter(trainer, "backward")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._enter(trainer, "optimizer step")

    def _enter(self, trainer: pl.Trainer, phase: str) -> None:
        """The step in flight enters ``phase`` (one of `PHASES`): for an OOM's explanation, and for the
        phase's highest where the step is measured."""
        self._step.enter(phase)
        if self._measurement is not None and self._step.phase is not None:
            try:
                self._measurement.enter_phase(phase)
            except Exception as err:
                self._fail(trainer, err)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step.end()
        if self._disabled:
            return
        if self._in_step and self._failure is None:
            try:
                breakdown = self._finish_step(trainer)
                parts, phases = self._part_twins.get(self._signature, (self._last_parts, self._last_phases))
                if breakdown is not None and (self._pending is None or breakdown.peak >= self._pending.peak):
                    self._pending = breakdown
                    self._pending_extras = self._cuda_stats()
                    self._pending_parts = parts
                if breakdown is not None:
                    for phase, peak in (phases or {}).items():
                        self._pending_phases[phase] = max(self._pending_phases.get(phase, 0), peak)
                    self._keep_peak_batch(trainer, breakdown)
            except Exception as err:
                self._fail(trainer, err)
        self._in_step = False
        self._candidate = None
        if accumulating_now(trainer):
            return
        peaks = self._agree(trainer)
        if peaks is None or self._pending is None:
            return
        try:
            self._flush(trainer, peaks)
        except Exception as err:
            self._fail(trainer, err)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A LightningModule whose on_train_batch_start returns -1 skips the rest of the epoch after the
        # callbacks' on_train_batch_start: a measurement opened there has no step to measure, and the batch
        # kept for explaining an OOM no step to explain.
        try:
            self._close_measurement()
        except Exception as err:
            self._fail(trainer, err)
        self._step.end()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Explain an out-of-memory error (once: `AutoFit` calls this too, before it undoes its plan), or a
        sharded step that met parameters FSDP2 had not gathered."""
        self._close_measurement_quietly()  # its dispatch mode must not see the simulations
        hint = explain_mixed_tensors(exception, pl_module)
        if hint is not None:
            self._warn_once("mixed", f"MemoryMonitor: {hint}")
        if isinstance(exception, torch.OutOfMemoryError) and not self._explained:  # the rank that ran out
            self._explained = True
            measured = None
            if self._in_step and not self._disabled and self._failure is None and self._signature is not None:
                measured = self._twins.get(self._signature)
            report_oom(trainer, pl_module, self._step, self._budget, who="MemoryMonitor", measured=measured)
        self._step.end()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_measurement_quietly()
        if self._disabled or self._failure is not None or not self.history or not trainer.is_global_zero:
            return
        try:  # the steps after the last logging step: a peak among them must reach the logger too
            self._log_window(trainer)
        except Exception as err:
            self._fail(trainer, err)
            return
        path = None
        try:
            # Under fast_dev_run Lightning writes nothing (no logs, no checkpoints), and nor does this.
            path = None if trainer.fast_dev_run else _run_dir(trainer) / "memory.png"
            self._report(trainer, path)
        except Exception as err:
            where = f" ({path})" if path is not None else ""
            self._warn_once("report", f"MemoryMonitor could not write its end-of-fit report{where}: {err!r}")
        if self._peak_batch is not None:
            self._peak_step(trainer, pl_module, None if path is None else path.parent)
            self._peak_batch = None

    @property
    def state_key(self) -> str:
        """What tells two monitors of one Trainer apart, as for Lightning's own stateful callbacks: the
        budget as given (a device-relative one reads differently from card to card), and the periods of
        logging and re-measuring."""
        return self._generate_state_key(
            budget=self._budget_spec,
            log_every_n_steps=self.log_every_n_steps,
            remeasure_every_n_steps=self.remeasure_every_n_steps,
        )

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

    def state_dict(self) -> dict[str, Any]:
        return {"history": [[step, *(getattr(b, c) for c in CATEGORIES)] for step, b in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [
            (int(row[0]), MemoryBreakdown(**dict(zip(CATEGORIES, map(int, row[1:]), strict=True))))
            for row in state_dict.get("history", [])
        ]

    # --- measuring ----------------------------------------------------------------------------

    @staticmethod
    def _step_signature(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> tuple | None:
        """What decides a step's allocations, cheaply: shapes, gradients held, optimizer state, stepping.

        ``None`` when the batch cannot be seen into (`batch_signature`) or an optimizer's step depends on
        values (`optimizer_signature`): such a step is always measured.
        """
        shapes = batch_signature(batch)
        if shapes is None or any(isinstance(opt, _VALUE_DEPENDENT) for opt in trainer.optimizers):
            return None
        grads = tuple(p.grad is not None for p in pl_module.parameters())
        states = tuple(optimizer_signature(opt) for opt in trainer.optimizers)
        return shapes, grads, states, accumulating_now(trainer)

    def _finish_step(self, trainer: pl.Trainer) -> MemoryBreakdown | None:
        """The step's breakdown; ``None`` for a step that cannot be measured (nor its twins)."""
        signature = self._signature
        if self._measurement is not None:
            unfollowed = self._close_measurement()
            breakdown = None if unfollowed else self._last_measured
            if unfollowed:
                self._warn_once(
                    "unfollowed",
                    f"MemoryMonitor: step {trainer.global_step} is not measured: {unfollowed}, which the "
                    "measurement cannot follow. Steps like it are left unmeasured; training is unaffected.",
                )
            if self._last_value_shaped is not None:  # the step's values sized it: no twin of any other
                self._warn_once(
                    "value_shaped",
                    f"MemoryMonitor: this model's step sizes tensors by the values of others "
                    f"({self._last_value_shaped}: mixture-of-experts routing token by token, sequences "
                    "packed by their lengths), so steps of the same shapes allocate differently: every step "
                    "is measured (about 1.3x a plain step on the CPU), none takes another's figures.",
                )
            elif signature is not None:  # a batch it cannot see into is no twin of any other
                self._twins[signature] = breakdown
                self._twins.move_to_end(signature)
                while len(self._twins) > _MAX_SIGNATURES:
                    self._part_twins.pop(self._twins.popitem(last=False)[0], None)
                if self._last_parts is not None or self._last_phases is not None:
                    self._part_twins[signature] = (self._last_parts, self._last_phases)
            self.measured_steps += breakdown is not None
            self._since_measured = 0
            return breakdown
        self._since_measured += 1
        twin = self._twins[signature]
        if twin is None or self._device.type != "cuda":
            return twin
        # The allocator knows this very step's peak; what differs from the twin is not a known tensor.
        peak = torch.cuda.max_memory_allocated(self._device)
        others = twin.peak - twin.temporary
        return MemoryBreakdown(
            parameters=twin.parameters,
            gradients=twin.gradients,
            optimizer_state=twin.optimizer_state,
            activations=twin.activations,
            temporary=max(peak - others, 0),
        )

    def _close_measurement(self) -> str | None:
        """Close the measurement in flight, if any; returns why its step could not be followed, if so."""
        if self._measurement is None:
            return None
        measurement, self._measurement = self._measurement, None
        measurement.__exit__(None, None, None)
        self._last_measured, self._last_parts = measurement.breakdown, _parts(measurement)
        self._last_phases = measurement.phase_peaks
        self._last_value_shaped = measurement.value_shaped
        return measurement.unfollowed

    def _cuda_stats(self) -> dict[str, float]:
        if self._device.type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(self._device)
        return {
            "memory/reserved": torch.cuda.max_memory_reserved(self._device) / MiB,
            "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "memory/ooms": float(stats.get("num_ooms", 0)),
        }

    # --- reporting ----------------------------------------------------------------------------

    def _flush(self, trainer: pl.Trainer, peaks: list[int]) -> None:
        """Close one optimizer step: keep it in the history, and log the highest step since the last log
        (`LogWindow`) on a logging step, with every rank's highest."""
        assert self._pending is not None
        step = optimizer_steps_done(trainer)
        figures = StepMemory(
            step, self._pending, self._pending_parts or {}, self._pending_phases, self._pending_extras
        )
        self._pending, self._pending_extras, self._pending_parts, self._pending_phases = None, {}, None, {}
        breakdown, parts = figures.breakdown, figures.parts
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

    def _report(self, trainer: pl.Trainer, path: Path | None) -> None:
        """The summary table, and the plot saved to ``path`` (``None``: under ``fast_dev_run``, none)."""
        step, worst = max(self.history, key=lambda item: item[1].peak)
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
        steps, breakdowns = zip(*self.history, strict=True)
        figure = plot_history(steps, breakdowns, path, budget=self.budget)
        if figure is None:
            self._warn_once(
                "matplotlib", "MemoryMonitor: install matplotlib to get the memory plot (memory.png)."
            )
            return
        rank_zero_info(f"MemoryMonitor: memory plot saved to {path}")
        last = max(optimizer_steps_done(trainer) - 1, 0)  # once, at the run's last logging step
        for logger in trainer.loggers:
            self._safely(logger, "log_image", lambda lg=logger: _log_image(lg, figure, path, last))

    def _keep_peak_batch(self, trainer: pl.Trainer, breakdown: MemoryBreakdown) -> None:
        """Keep a CPU copy of the measured step's batch if the step is the highest so far (or the first):
        ``advise``, ``snapshot`` and ``report`` describe it at the end of fit. Only measured steps are
        candidates: a new largest shape is measured anyway, and its twins peak alike."""
        candidate, self._candidate = self._candidate, None
        if candidate is None or (self._peak_batch is not None and breakdown.peak <= self._peak_batch.peak):
            return
        candidate.batch = on_cpu(candidate.batch, copy=True)
        candidate.step, candidate.peak = optimizer_steps_done(trainer), breakdown.peak
        self._peak_batch = candidate

    def _step_as_run(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> tuple[torch.nn.Module, dict]:
        """The model and `estimate_memory`'s arguments for a batch's step as this run takes it. Under
        FSDP2 the module is sharded by now: its unsharded twin's sharded step stands for it."""
        model, optimizer = simulable(pl_module, the_optimizer(trainer))
        # with accumulation, a micro-batch adding to gradients already there: the cycle's highest
        step = trainer_step(trainer, accumulating=trainer.accumulate_grad_batches > 1)
        return model, {"optimizer": optimizer, "device": self._device.type, "step": step}

    def _peak_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, folder: Path | None) -> None:
        """``advise``, ``snapshot`` and ``report`` on the highest measured step's batch as this run takes
        it, simulated once for all three (``folder``: where the files go; ``None``: no files, as under
        fast_dev_run)."""
        kept = self._peak_batch
        assert kept is not None
        which = f"step {kept.step}'s batch (the highest measured step, {format_bytes(kept.peak)})"
        saves = (self.snapshot or self.report) and folder is not None
        try:
            model, kwargs = self._step_as_run(trainer, pl_module)
        except Exception as err:
            self._warn_once("peak step", f"MemoryMonitor could not simulate {which}: {err!r}")
            return
        snapshot: dict | None = None
        if self.advise:
            rank_zero_info(f"MemoryMonitor: advising on {which}: simulating its step, then each fix")
            try:
                if saves:
                    self.advice, snapshot = advised_snapshot(model, kept.batch, **kwargs)
                else:
                    self.advice = advise(model, kept.batch, **kwargs)
            except Exception as err:
                self._warn_once("advise", f"MemoryMonitor could not advise: {err!r}")
            else:
                rank_zero_info(f"MemoryMonitor: memory advice for {which}\n{self.advice}")
                metrics = {f"memory/advice/{f.kind}": f.saved / MiB for f in self.advice}
                at = self.history[-1][0]  # the last step's, as every other key is logged
                for logger in trainer.loggers:
                    log = lambda lg=logger: lg.log_metrics(metrics, step=at)  # noqa: E731
                    self._safely(logger, "log_metrics", log)
        if not saves:
            return
        try:
            if snapshot is None:  # no advice asked, or it failed: the step alone
                snapshot, tracker = simulated_snapshot(model, kept.batch, **kwargs)
                breakdown = tracker.breakdown()
            else:
                breakdown = self.advice.breakdown
            self._save_step(folder, snapshot, breakdown, kept)
        except Exception as err:
            self._warn_once("snapshot", f"MemoryMonitor could not save the simulated step: {err!r}")

    def _save_step(self, folder: Path, snapshot: dict, breakdown: MemoryBreakdown, kept: _PeakBatch) -> None:
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
            findings = None if self.advice is None else self.advice.findings
            title = f"Peak memory of training step {kept.step}, the run's highest measured step, simulated"
            notes = [f"Step {kept.step}'s batch as this run takes its step, simulated; {peaks}."]
            no_findings = "MemoryMonitor(advise=True) adds what the peak holds that it need not."
            page = html_report(
                snapshot, breakdown, findings, title=title, notes=notes, no_findings=no_findings
            )
            path.write_text(page, encoding="utf-8")
            rank_zero_info(f"MemoryMonitor: {which} ({peaks}) as a page: {path}")

    # --- never crash the run we observe -------------------------------------------------------

    def _safely(self, logger: Any, what: str, call: Any) -> None:
        call_logger(logger, what, call, "MemoryMonitor", self._warned)

    def _fail(self, trainer: pl.Trainer, err: Exception) -> None:
        """An internal error on this rank: say so here (every rank speaks for itself) and stop measuring.
        Alone, the monitor is off at once; with several ranks, at the next optimizer step's `_agree`, on
        all of them together: a rank that left early would leave the others waiting in a collective."""
        self._close_measurement_quietly()
        self._failure = err
        if trainer.world_size == 1:
            self._disabled = True
        self._warn_once(
            "disabled",
            f"MemoryMonitor hit an internal error and stops monitoring; training goes on. Error: {err!r}",
            rank=trainer.global_rank if trainer.world_size > 1 else None,
        )

    def _agree(self, trainer: pl.Trainer) -> list[int] | None:
        """Every rank's peak for the optimizer step just done, once all ranks are known to be well;
        ``None`` (and the monitor off everywhere) when any rank failed. A collective with several ranks:
        every rank that is not disabled calls it at every optimizer step, failed or not."""
        mine = -1 if self._pending is None else self._pending.peak
        if trainer.world_size == 1:
            return None if self._failure is not None else [mine]
        try:
            state = torch.tensor([self._failure is None, mine], dtype=torch.int64, device=self._device)
            gathered = trainer.strategy.all_gather(state).reshape(-1, 2).tolist()
        except Exception as err:
            gathered, self._failure = [], self._failure or err
        failed = [rank for rank, (ok, _) in enumerate(gathered) if not ok]
        if self._failure is None and not failed:
            return [peak for _, peak in gathered]
        self._disabled = True
        self._pending = None
        if self._failure is None:
            self._warn_once(
                "disabled",
                f"MemoryMonitor stops monitoring on every rank: rank(s) {failed} hit an internal error (see "
                "their warnings). Training goes on.",
                rank=trainer.global_rank,
            )
        return None

    def _close_measurement_quietly(self) -> None:
        try:
            self._close_measurement()
        except Exception:
            self._measurement = None

    def _warn_once(self, key: str, message: str, rank: int | None = None) -> None:
        """Warn once per key: from rank 0, or from ``rank`` itself (its own failure), rank-prefixed."""
        if key in self._warned:
            return
        self._warned.add(key)
        if rank is None:
            rank_zero_warn(message)
        else:
            warnings.warn(rank_prefixed_message(message, rank), stacklevel=2)


@dataclasses.dataclass
class _PeakBatch:
    """The batch of the highest measured step, for ``advise``, ``snapshot`` and ``report``."""

    #: the batch: its tensors aliased while the step runs, a CPU copy once kept
    batch: Any
    #: the optimizer step it belongs to (counted from 0, as the logged steps), and its measured peak (bytes)
    step: int = -1
    peak: int = -1


def _run_dir(trainer: pl.Trainer) -> Path:
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


def _log_image(logger: Any, figure: Any, path: Path, step: int) -> None:
    """Hand the plot to loggers that take images; the others already have the PNG on disk."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_figure("memory/breakdown", figure, global_step=step)
    elif isinstance(logger, WandbLogger):
        logger.log_image(key="memory/breakdown", images=[str(path)], step=step)
    elif isinstance(logger, MLFlowLogger):
        logger.experiment.log_artifact(logger.run_id, str(path))


# --- signatures -----------------------------------------------------------------------------------

#: Optimizers whose step allocates by the values it sees, so that no earlier step is a twin: LBFGS runs
#: the closure until it converges (up to ``max_iter`` times) and keeps a curvature pair only where
#: ``y·s > 1e-10``, so two steps that begin with the same state can peak differently (tiny MLP, history 10:
#: 6.4 % apart).
_VALUE_DEPENDENT: tuple[type, ...] = (torch.optim.LBFGS,)

_ATOMS = (
    type(None), bool, int, float, complex, str, bytes, range, slice, enum.Enum, torch.dtype, torch.device,
    datetime.date, datetime.time, datetime.timedelta,
)  # fmt: skip


_CODE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


class _Opaque(Exception):
    """The batch holds something the signature cannot see into."""


def batch_signature(batch: Any) -> tuple | None:
    """Every tensor in ``batch`` (shape, dtype, device) with the structure around it; ``None`` when it
    cannot be read.

    Walks what users pass as batches, nested arbitrarily: tensors (and arrays with ``shape``/``dtype``),
    sequences, sets, mappings (``dict``, ``UserDict`` and so Hugging Face's ``BatchEncoding``), dataclasses,
    named tuples and any object whose ``__dict__`` or ``__slots__`` holds them; an object met twice (a
    cycle, a shared tensor) is referred back to. Values of numbers and strings are not part of it (a batch
    of per-sample strings would otherwise never match), only their types. ``None`` (measure the step, never
    reuse a twin) when the batch holds no tensor, an object with no attributes to read (a C extension's),
    or more than ``_MAX_NODES`` objects or ``_MAX_DEPTH`` levels.
    """
    seen: dict[int, int] = {}
    found = [0]

    def walk(obj: Any, depth: int) -> Any:
        if isinstance(obj, _ATOMS):
            return type(obj).__name__
        if depth > _MAX_DEPTH or len(seen) >= _MAX_NODES:
            raise _Opaque
        if id(obj) in seen:
            return ("ref", seen[id(obj)])
        seen[id(obj)] = len(seen)
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if isinstance(obj, torch.Tensor):
            found[0] += 1
            if obj.layout is not torch.strided:  # a sparse tensor's memory is its members': nnz varies
                return (kind, tuple(obj.shape), obj.dtype, obj.device, obj.layout, _member_shapes(obj))
            return (kind, tuple(obj.shape), obj.dtype, obj.device)
        shape, dtype = getattr(obj, "shape", None), getattr(obj, "dtype", None)
        if isinstance(shape, tuple) and dtype is not None and not isinstance(obj, type):  # numpy and the like
            found[0] += 1
            return (kind, shape, str(dtype))
        if isinstance(obj, Mapping):
            return (kind, tuple((_key(k), walk(v, depth + 1)) for k, v in obj.items()))
        if isinstance(obj, (list, tuple)):
            return (kind, tuple(walk(v, depth + 1) for v in obj))
        if isinstance(obj, (set, frozenset)):
            return (kind, tuple(sorted(map(repr, (walk(v, depth + 1) for v in obj)))))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
            return (kind, tuple((name, walk(v, depth + 1)) for name, v in fields))
        attributes = _attributes(obj)
        if attributes is None:
            raise _Opaque
        return (kind, tuple((name, walk(v, depth + 1)) for name, v in attributes))

    try:
        signature = walk(batch, 0)
    except Exception:  # _Opaque, or an attribute that raised when read: measure rather than guess
        return None
    return signature if found[0] else None


def _member_shapes(t: torch.Tensor) -> tuple:
    """The shapes of the tensors holding a sparse ``t``'s memory (indices, values: their sizes vary with
    the number of its non-zeros); a layout whose members cannot be read is opaque (measured every step)."""
    try:
        return tuple(tuple(m.shape) for m in leaves(t))
    except Exception:
        raise _Opaque from None


def _key(key: Any) -> Any:
    return key if isinstance(key, _ATOMS) else repr(key)


def _attributes(obj: Any) -> list[tuple[str, Any]] | None:
    """``obj``'s instance attributes (``__dict__`` and ``__slots__``); ``None`` for an object without any.
    Classes, modules and functions are read as their types alone: they are code, not data."""
    if isinstance(obj, _CODE) or (callable(obj) and not hasattr(obj, "__dict__")):
        return []
    names: list[str] = []
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += (
            [slots] if isinstance(slots, str) else [n for n in slots if n not in ("__dict__", "__weakref__")]
        )
    items = [(n, getattr(obj, n)) for n in names if hasattr(obj, n)]
    if hasattr(obj, "__dict__"):
        items += list(vars(obj).items())
    elif not names:
        return None
    return items


def optimizer_signature(optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(entries, tensors, bytes) of ``optimizer.state``: its count alone misses state that grows inside
    an entry, as LBFGS's history (``old_dirs``, ``old_stps``, ``ro``: lists of tensors) does."""
    tensors = list(optimizer_tensors([optimizer]))
    return len(optimizer.state), len(tensors), storage_bytes(tensors)
