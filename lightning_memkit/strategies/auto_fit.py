"""AutoFitStrategy: FSDP2 (Lightning's ``ModelParallelStrategy``) that shards, checkpoints and sizes the run
so that every rank's step fits a budget.

One planner. The plan is `AutoFit`'s (`plan_fit`), made for one rank's FSDP2 step simulated on fake tensors
over a fake process group of the run's world size (`estimate_memory`'s ``strategy="fsdp2"``): micro-batch
and accumulation, checkpointing, the optimizer and, on top, ``reshard_after_forward`` (``False``, no
all-gather in backward, where that still fits). Its step time counts each micro-step's all-gathers and
reduce-scatters at the speed this job's collectives were timed at (`time_link`, as the processes start).
The strategy adds an `AutoFit` callback to the Trainer (its ``setup("fit")`` runs after the datamodule's
and before ``configure_model``), so the plan is made on global rank 0, broadcast, printed, logged and kept
in the checkpoint as AutoFit's is; this module then shards the model the way the plan simulated it.

The sharding. Layers a module builds in ``configure_model`` are not planned (the plan is made before it
runs): build them in ``__init__``, on the meta device for a large model. After ``configure_model``,
unless the user's own ``configure_model`` applied ``fully_shard`` (then their layout is kept, and a
warning names where it differs from the one planned): ``fully_shard`` on each repeated block
`find_blocks` finds, then on the smallest module holding every parameter (a LightningModule's
``self.model``), over every rank (``data_parallel_size`` is the world size, no tensor parallelism), with
the plan's ``reshard_after_forward``. Checkpointing is applied before the sharding, as torchtitan orders
it. ``configure_model`` need not be overridden.

Resume. The plan is in the checkpoint (AutoFit's state). ``ModelParallelStrategy`` loads the checkpoint
after it built the optimizers, so a resumed run plans first. Where the saved plan was made for this run
(the same world size, layout, budget, margin and precision: `_fitting.resume.stale`) and differs, it is
installed over the fresh one as the checkpoint is loaded, before the optimizer state: its batch size,
accumulation, checkpointing, ``reshard_after_forward`` and optimizer (rebuilt). A plan made for another run
(saved on 4 ranks, resumed on 2) is not: the fresh plan trains, a warning names what differed, and the
checkpoint's optimizer state loads where the fresh plan steps the same optimizer; where it steps another,
the resume is refused with the ``optimizers=`` that plans with the checkpoint's (the model is sharded by
then: it is not planned again). CPU offload cannot change once the model is sharded: a checkpoint planned
for this run otherwise is refused, with what to do.

CPU offload. Where no plan fits, the plan is made again with FSDP2's ``CPUOffloadPolicy`` (the shards,
their gradients and the optimizer state in host memory, the optimizer stepping there): its device peak is
an upper bound (`plan_fit`'s ``cpu_offload``), the host memory it needs is ``FitPlan.host_bytes``. The
buffers are moved to the device, the shards left where FSDP2 keeps them.

Mixed precision. With ``precision="bf16-mixed"`` every unit gets FSDP2's ``MixedPrecisionPolicy(
param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (torchtitan's default): the parameters are
all-gathered and computed in bf16 (half the unsharded copies' bytes and the all-gathers' traffic), the
gradients reduce-scattered and the optimizer stepped in fp32; the plan simulates exactly that
(`FitPlan.mp_policy`). The other precisions get no policy.

A budget that nothing fits is refused at ``setup`` with AutoFit's figures (the static floor, the leanest
plan's peak, and the number of FSDP ranks or the GPU that fits).

Registered as ``"autofit"`` (``Trainer(strategy="autofit")``, ``--trainer.strategy autofit`` in LightningCLI)
once ``lightning_memkit`` is imported, before or after Lightning, with the budget ``"auto"``: the CUDA device
each rank runs on. A size is given to the class: ``AutoFitStrategy(budget="24GiB")``, in LightningCLI
``--trainer.strategy lightning_memkit.AutoFitStrategy --trainer.strategy.budget 24GiB``; a run without a CUDA
device is refused at its start, saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _setup_device_mesh
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_memkit._budget import Budget, flag, reads_device, whole_number
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._estimating.fake_model import simulated_layout
from lightning_memkit._fitting.layouts import Layouts
from lightning_memkit._fitting.plan import FitPlan
from lightning_memkit._fitting.resume import stale
from lightning_memkit._sharding import fsdp2 as _fsdp2
from lightning_memkit._sharding.layout import ConfigureModel, apply_layout, mesh_shape
from lightning_memkit._step import Sharding
from lightning_memkit._vocabulary import AUTO
from lightning_memkit.callbacks._autofit_choices import FSDP2Options
from lightning_memkit.callbacks._trainer import built_late, parameters_of
from lightning_memkit.callbacks.auto_fit import AutoFit

__all__ = ["AutoFitStrategy"]


class AutoFitStrategy(ModelParallelStrategy):
    """FSDP2 over every rank, with the sharding, checkpointing, micro-batch, accumulation and optimizer
    planned so that each rank's step fits ``budget``.

    Args:
        budget: per rank, as `AutoFit`'s: bytes, ``"80GB"``, a GPU name (``"H100-80GB"``), a fraction of
            the current CUDA device or ``"auto"`` (it). On CPU give a size.
        margin, batch_arg_name, optimizers, checkpointing: as `AutoFit`'s.
        cost: the throughput model (`plan_fit`'s): ``"auto"`` (timed for real on rank 0 for a run on the
            CPU, FLOPs otherwise), ``"measured"``, ``"flops"``.
        tensor_parallel_size: the ranks of a tensor-parallel group (Lightning's word): 1 (the default, FSDP2
            alone), a divisor of the devices of a node, or ``"auto"``: planned (each block's projections
            split by torchtitan's LLaMA plan, `_sharding.layout.tp_plan`).
        data_parallel_size: the ranks that each take a batch: ``None`` (the default) for the world over
            ``tensor_parallel_size``, FSDP2 over them; a number; HSDP's ``(replicate, shard)``; or
            ``"auto"``: their HSDP split planned too. Where a size is ``"auto"`` the layout is the one of
            least communication whose plan fits every rank (`plan_fit`'s ``sharding=``, `Layouts`), unless
            the module's own ``configure_model`` shards (its layout is then kept). Unlike
            ``ModelParallelStrategy``'s, ``"auto"`` means planned here.
        save_distributed_checkpoint, process_group_backend, timeout: ``ModelParallelStrategy``'s.
    """

    strategy_name = "autofit"

    def __init__(
        self,
        budget: int | float | str | Budget = "auto",
        *,
        margin: float = 0.1,
        batch_arg_name: str = "batch_size",
        optimizers: Sequence[str] | None = None,
        checkpointing: str | Sequence[str] = AUTO,
        cost: str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        tensor_parallel_size: int | str = 1,
        data_parallel_size: int | tuple[int, int] | str | None = None,
    ) -> None:
        flag("save_distributed_checkpoint", save_distributed_checkpoint)
        if process_group_backend is not None and not isinstance(process_group_backend, str):
            raise TypeError(
                "process_group_backend must name a torch.distributed backend ('nccl', 'gloo') or be None "
                f"(the device's default); got {process_group_backend!r}"
            )
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(
                "timeout must be a datetime.timedelta (e.g. timedelta(minutes=30)) or None; got "
                f"{timeout!r} ({type(timeout).__name__})"
            )
        #: the layout's sizes as given (`_layout_sizes`), resolved against the world at setup_environment
        self._sizes = _layout_sizes(tensor_parallel_size, data_parallel_size)
        super().__init__(
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        #: the planner: added to the Trainer's callbacks when the strategy is connected
        self.autofit = _Planner(
            budget,
            margin=margin,
            batch_arg_name=batch_arg_name,
            optimizers=optimizers,
            checkpointing=checkpointing,
            cost=cost,
        )
        #: the layouts the planner chooses among (`_resolved`), once the world is known (``None``: FSDP2)
        self._layouts: Layouts | Sharding | None = None
        #: this job's collectives, timed as the processes start (``None``: one rank)
        self._link: _fsdp2.Link | None = None
        #: the FSDP2 units, as sharded (parents after their children), once set up
        self.units: list[str] = []
        self._offloaded = False  # whether this strategy applied CPUOffloadPolicy
        #: the parameters the plan is made for (elements, names), read as the module is connected
        self._planned: tuple[int | None, set[str]] = (None, set())

    @property
    def plan(self) -> FitPlan | None:
        """The plan the run trains with (`AutoFit.plan`), once planned."""
        return self.autofit.plan

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        _check_root(model)
        # What the plan will be made for: configure_model, which runs after it, must not add to it.
        self._planned = parameters_of(model)
        trainer = model._trainer
        if trainer is None or any(c is self.autofit for c in trainer.callbacks):
            return
        if any(isinstance(c, AutoFit) for c in trainer.callbacks):
            raise ValueError(
                "AutoFitStrategy plans what the AutoFit callback plans (micro-batch, accumulation, "
                "checkpointing, optimizer), on the sharded step: remove AutoFit from the Trainer's "
                "callbacks, and give its arguments to AutoFitStrategy(...)."
            )
        trainer.callbacks.insert(0, self.autofit)  # it plans before the other callbacks' setup

    def _check_planned_parameters(self) -> None:
        """Refuse parameters ``configure_model`` built after the plan was made (at ``setup``, before it): the
        plan's figures are not the model's, and the layout would shard what was never planned."""
        if self._planned[0] is not None and (why := built_late("AutoFitStrategy", self.lightning_module,
                                                                self._planned)):  # fmt: skip
            raise RuntimeError(why)

    @override
    def setup_environment(self) -> None:
        budget = self.autofit.budget
        if self.root_device.type != "cuda" and reads_device(budget):
            raise ValueError(
                f"AutoFitStrategy(budget={budget!r}) reads the CUDA device each rank runs on (by name, "
                f'strategy="autofit" plans for it), but this run is on {self.root_device.type}: give the '
                'budget as a size, Trainer(strategy=AutoFitStrategy(budget="8GiB")), or in LightningCLI '
                "--trainer.strategy=lightning_memkit.AutoFitStrategy --trainer.strategy.budget=8GiB."
            )
        # Lightning's mesh of the sizes given (a size still to plan: 1 tensor-parallel rank, until the plan).
        world = self.num_nodes * self.num_processes
        self._layouts = _resolved(*self._sizes, world, self.num_processes)
        tp = getattr(self._layouts, "tensor_parallel_size", 1)
        self._tensor_parallel_size = tp if isinstance(tp, int) else 1
        self._data_parallel_size = world // self._tensor_parallel_size
        super().setup_environment()
        # How fast this job's collectives are, for the plan's step time (every rank takes part).
        group = self.device_mesh["data_parallel"].get_group()
        self._link = _fsdp2.time_link(group, self.root_device) if self.world_size > 1 else None

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """``ModelParallelStrategy.setup`` with the model sharded as planned where Lightning's requires a
        ``configure_model`` that shards (its check, which refuses a module without one, is why Lightning's is
        not called), then Lightning's steps: materialize, convert, move (`model_to_device`), build the
        optimizers. Offloaded shards are materialized on the host, where FSDP2 keeps them."""
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.autofit.plan is not None and fitting:
            self._check_planned_parameters()
        self._mesh_as_planned()
        self._shard(self.lightning_module)
        _materialize_distributed_module(
            self.model, torch.device("cpu") if self._offloaded else self.root_device
        )
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        """Lightning's, except where FSDP2 offloads the shards (`CPUOffloadPolicy`): they stay on the host,
        and only the buffers go to the device."""
        if not self._offloaded:
            super().model_to_device()
            return
        assert self.model is not None
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.root_device)

    def _mesh_as_planned(self) -> None:
        """Lightning's ``(data_parallel, tensor_parallel)`` mesh rebuilt to the planned layout's where it
        differs (every rank builds it): the data loaders' sampler reads each rank's data-parallel rank from
        it (``distributed_sampler_kwargs``), a tensor-parallel group sharing its batch."""
        plan = self.autofit.plan
        tp = plan.tensor_parallel_size if plan is not None and plan.strategy == "fsdp2" else None
        if tp is None or tp == self._tensor_parallel_size:
            return
        self._tensor_parallel_size, self._data_parallel_size = tp, self.world_size // tp
        mesh = _setup_device_mesh(self._data_parallel_size, tp, self.world_size, self.root_device)
        self._device_mesh = self.lightning_module._device_mesh = mesh

    def _shard(self, module: pl.LightningModule) -> None:
        """Shard ``module`` as its plan simulated (no plan: FSDP2 over every rank, resharding after the
        forward), unless the user's ``configure_model`` sharded it already; sets `units`."""
        plan = self.autofit.plan
        planned = [name for name, _ in find_blocks(module)]
        self._offloaded = False
        if _fsdp2.is_sharded(module):  # the user's own fully_shard in configure_model: kept
            self.units = _fsdp2.units(module)
            self._say_where_kept_differs(module, plan, planned)
        elif plan is not None and (plan.tensor_parallel_size > 1 or plan.replicate_size > 1):
            self.units = self._lay_out(module, plan, planned)
        else:
            self.units = self._fully_shard(module, plan, planned)

    def _say_where_kept_differs(
        self, module: pl.LightningModule, plan: FitPlan | None, planned: list[str]
    ) -> None:
        """Warn where the sharding the user's ``configure_model`` applied is not the one ``plan`` simulated:
        other units, or options the plan gave FSDP2 that theirs lacks."""
        reshard, offload, policy = _fsdp2_choices(plan)
        expected = [*planned, _fsdp2.root_name(module)]
        if sorted(self.units) == sorted(expected) and not offload and reshard and not policy:
            return
        options = ", ".join(
            ([] if reshard else ["reshard_after_forward=False"])
            + (["offload_policy=CPUOffloadPolicy()"] if offload else [])
            + (["mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)"] if policy else [])
        )
        rank_zero_warn(
            f"AutoFitStrategy: configure_model sharded {_names(self.units)}; the plan simulated "
            f"fully_shard on {_names(expected)}{f' with {options}' if options else ''}: its figures "
            "are for that. Leave the sharding to AutoFitStrategy (remove fully_shard from "
            "configure_model) to train as planned."
        )

    def _fully_shard(self, module: pl.LightningModule, plan: FitPlan | None, planned: list[str]) -> list[str]:
        """``fully_shard`` on each block, then the root, over the data-parallel ranks, with the plan's
        ``reshard_after_forward``, CPU offload and mixed precision policy. Returns the FSDP2 units."""
        reshard, offload, policy = _fsdp2_choices(plan)
        mesh = self.device_mesh["data_parallel"]
        options: dict[str, Any] = {"reshard_after_forward": reshard}
        if offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        if policy:
            options["mp_policy"] = _fsdp2.bf16_policy()
        units = _fsdp2.shard_layout(module, mesh, planned, **options)
        self._offloaded = offload
        said = ", offload_policy=CPUOffloadPolicy()" if offload else ""
        if policy:
            said += ", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
        rank_zero_info(
            f"AutoFitStrategy: fully_shard on {_names(units)} over {mesh.size()} ranks, "
            f"reshard_after_forward={reshard}{said}"
        )
        return units

    def _lay_out(self, module: pl.LightningModule, plan: FitPlan, blocks: list[str]) -> list[str]:
        """``plan``'s tensor-parallel or HSDP layout, as its plan simulated it (`_sharding.layout`'s default
        layout over a mesh of the same dimensions, every rank building it): each block's projections split
        over the tensor-parallel ranks, then ``fully_shard`` on each block and the root over the data-parallel
        ones (HSDP's (replicate, shard)). Returns the FSDP2 units."""
        from torch.distributed.device_mesh import init_device_mesh

        layout = Sharding(
            self.world_size, plan.reshard_after_forward is not False,
            _fsdp2.bf16_policy() if plan.mp_policy else None,
            plan.tensor_parallel_size, plan.replicate_size,
        )  # fmt: skip
        shape, names = mesh_shape(layout)
        mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
        apply_layout(module, mesh, layout, blocks)
        dims = ", ".join(f"{name}={size}" for name, size in zip(names, shape, strict=True))
        rank_zero_info(
            f"AutoFitStrategy: {plan.layout} ({dims}): tensor parallel in {_names(blocks)} where planned, "
            f"then fully_shard on each and the root, reshard_after_forward={layout.reshard_after_forward}"
            + (", mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)" if layout.mp_policy else "")
        )
        return [*blocks, _fsdp2.root_name(module)]

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume: the checkpoint's plan, where it was made for this run (`stale`) and differs from the one
        this fit made, is installed first (its batch size, accumulation, checkpointing,
        ``reshard_after_forward``, and its optimizer, rebuilt), so that the checkpoint's optimizer state
        loads into the optimizer it was saved from. A plan made for another run (world size, budget,
        precision, ...) is not: this fit's stays, with the checkpoint's optimizer, or is refused
        (`AutoFit.resume_with`)."""
        saved = _saved_plan(Path(self.broadcast(checkpoint_path)), self.autofit.state_key)
        plan, fitting = self.autofit.plan, self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if saved is not None and plan is not None and saved != plan and fitting:
            if not stale(saved, plan) and saved.cpu_offload != self._offloaded:
                trained = "with" if saved.cpu_offload else "without"
                raise RuntimeError(
                    f"AutoFitStrategy: the checkpoint was trained {trained} CPU offload, and this run's plan "
                    "shards the model otherwise; FSDP2's offload cannot change once sharded. Resume with the "
                    "budget and margin the checkpoint was planned with."
                )
            if self.autofit.resume_with(saved, replan=False):  # the model is sharded: rebuilt, not re-planned
                module = self.lightning_module
                reshard = saved.reshard_after_forward is not False
                for name in self.units[:-1] if reshard else self.units:  # the root keeps its own (gathered)
                    module.get_submodule(name).set_reshard_after_forward(reshard)
                self.setup_optimizers(module.trainer)
                _optimizers_to_device(self.optimizers, self.root_device)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 sharded, checkpointed and sized to fit the CUDA device (lightning_memkit)",
        )


def _saved_plan(path: Path, state_key: str) -> FitPlan | None:
    """AutoFit's plan in the checkpoint at ``path`` (a distributed checkpoint's metadata file, or a file),
    if there is one."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    source = path / _METADATA_FILENAME if path.is_dir() else path
    if not source.is_file():
        return None
    checkpoint = torch.load(source, map_location="cpu", mmap=path.is_file(), weights_only=False)
    state = checkpoint.get("callbacks", {}).get(state_key) or {}
    return FitPlan.from_dict(state["plan"]) if state.get("plan") else None


class _Planner(AutoFit):
    """`AutoFit` as AutoFitStrategy plans with it: the strategy's layouts, FSDP2's CPU offload where nothing
    fits without it, FSDP2's bf16 mixed precision policy and the collectives as timed (`FSDP2Options`); its
    state under AutoFit's key (a checkpoint resumes with either); and a plan whose simulated sharded step met
    parameters the layout never gathers refused, naming the root unit (`_ungathered`), where the
    simulation's DTensor error said nothing of the cause."""

    @property
    def state_key(self) -> str:
        return "AutoFit"

    @override
    def _fsdp2_options(self, trainer: pl.Trainer) -> FSDP2Options:
        return FSDP2Options(cpu_offload=None, mp_policy=True, link=trainer.strategy._link)

    @override
    def _sharding(self, trainer: pl.Trainer, plan: FitPlan | None = None) -> Any:
        """The strategy's layouts to plan (``plan`` None), or the one ``plan`` chose; the run's where the
        module's own ``configure_model`` shards (its layout kept, never planned as another)."""
        layouts = trainer.strategy._layouts
        if layouts is None or _shards_itself(trainer.lightning_module):
            return super()._sharding(trainer, plan)
        if plan is None:
            return layouts
        return Sharding(
            plan.world_size,
            tensor_parallel_size=plan.tensor_parallel_size,
            replicate_size=plan.replicate_size,
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        try:
            super().setup(trainer, pl_module, stage)
        except (ValueError, RuntimeError) as error:
            if "mixed torch.Tensor and DTensor" not in str(error):
                raise
            raise ValueError(_ungathered(pl_module)) from error


def _fsdp2_choices(plan: FitPlan | None) -> tuple[bool, bool, bool]:
    """What ``plan`` gives FSDP2 (no plan: its defaults): ``reshard_after_forward``, CPU offload, and the
    bf16 mixed precision policy."""
    if plan is None:
        return True, False, False
    return plan.reshard_after_forward is not False, plan.cpu_offload, plan.mp_policy


def _layout_sizes(tensor_parallel_size: Any, data_parallel_size: Any) -> tuple[Any, Any]:
    """AutoFitStrategy's layout arguments, checked: ``tensor_parallel_size`` a number or ``"auto"``,
    ``data_parallel_size`` ``None``, a number, ``(replicate, shard)`` or ``"auto"``."""
    if tensor_parallel_size != "auto":
        whole_number("tensor_parallel_size", tensor_parallel_size, of="ranks", at_least=1)
    if isinstance(data_parallel_size, (tuple, list)) and len(data_parallel_size) == 2:
        for name, size in zip(("replicate", "shard"), data_parallel_size, strict=True):
            whole_number(f"data_parallel_size's {name}", size, of="ranks", at_least=1)
        return tensor_parallel_size, tuple(data_parallel_size)
    if data_parallel_size not in (None, "auto"):
        if isinstance(data_parallel_size, str):
            raise ValueError(
                f"data_parallel_size must be a number of ranks, (replicate, shard), 'auto' or None; got "
                f"{data_parallel_size!r}"
            )
        whole_number("data_parallel_size", data_parallel_size, of="ranks", at_least=1)
    return tensor_parallel_size, data_parallel_size


def _resolved(tp: Any, dp: Any, world: int, per_node: int) -> Layouts | Sharding | None:
    """The layout AutoFitStrategy's sizes give ``world`` ranks (``per_node`` a node): the layouts to plan
    among where a size is ``"auto"``, the one given where it has tensor parallelism or HSDP, else ``None``
    (FSDP2 over every rank, as AutoFit reads the run)."""
    ranks = dp[0] * dp[1] if isinstance(dp, tuple) else dp if isinstance(dp, int) else None
    if (ranks is not None and world % ranks) or (
        tp != "auto" and (world % tp or ranks not in (None, world // tp))
    ):
        raise ValueError(
            f"AutoFitStrategy(tensor_parallel_size={tp!r}, data_parallel_size={dp!r}) does not lay out "
            f"the {world} ranks of this run: tensor_parallel_size x data_parallel_size (replicate x shard) "
            "must be the world size; give 'auto' to plan either"
        )
    if tp == "auto" and ranks is not None:  # the data-parallel ranks given: tensor parallel over the rest
        tp = world // ranks
    replicas = dp[0] if isinstance(dp, tuple) else "auto" if dp == "auto" else 1
    if tp == "auto" or replicas == "auto":
        return Layouts(tensor_parallel_size=tp, replicate_size=replicas, devices_per_node=per_node)
    if tp == replicas == 1:
        return None
    return Sharding(world, tensor_parallel_size=tp, replicate_size=replicas)


def _shards_itself(module: pl.LightningModule) -> bool:
    """Whether ``module``'s own ``configure_model`` shards it (run on a simulated copy over a fake mesh):
    its layout is then the run's, not one AutoFitStrategy plans."""
    if not is_overridden("configure_model", module, pl.LightningModule):
        return False
    own = Sharding(module.trainer.world_size, parallelize_fn=ConfigureModel())
    return bool(simulated_layout(module, own))  # nothing sharded: an empty layout


def _ungathered(module: pl.LightningModule) -> str:
    """Why the planned step met parameters FSDP2 had not gathered: the root unit's own (those in no block)
    are gathered only by its forward, which the training step went around."""
    root = _fsdp2.root_name(module)
    blocks = [f"{name}." for name, _ in find_blocks(module)]
    inside = f"{root}." if root else ""
    own = [
        n for n, _ in module.named_parameters() if n.startswith(inside) and not n.startswith(tuple(blocks))
    ]
    unit = f"`{root}` ({type(module.get_submodule(root)).__name__})" if root else type(module).__name__
    call = f"self.{root}(...)" if root else "self(...)"
    return (
        'AutoFitStrategy: the planned step computed with parameters FSDP2 had not gathered ("mixed '
        f"torch.Tensor and DTensor\"). The layout's root unit, the smallest module holding every parameter, "
        f"is {unit}: it gathers its own parameters ({_names(own)}) only while its forward runs, and "
        "training_step used modules inside it without that forward (the decoder, then the head through a "
        f"chunked loss, say). Call {call} (a chunked loss inside the forward of a module holding the head), "
        "or shard by hand in configure_model under ModelParallelStrategy, a unit for each module the step "
        "calls."
    )


def _check_root(module: pl.LightningModule) -> None:
    """Refuse a layout whose root unit would be the LightningModule itself (the smallest module holding
    every parameter: one on the module itself, or several children holding them) where it has no forward
    of its own: FSDP2 gathers a unit's parameters only in that unit's forward, which the training step
    then never calls, so they would stay sharded ("mixed torch.Tensor and DTensor" at the first op)."""
    if _fsdp2.root_name(module) != "" or type(module).forward is not pl.LightningModule.forward:
        return
    if not any(True for _ in module.parameters()):  # none yet: planning says so (`without_parameters`)
        return
    name = type(module).__name__
    own = [n for n, _ in module.named_parameters(recurse=False)]
    holders = [n for n, child in module.named_children() if any(True for _ in child.parameters())]
    held = (
        f"it holds {_names(own)} itself"
        if own
        else f"its parameters are in {_names(holders)}, none of which holds them all"
    )
    move = (
        f"Move {_names(own)} into the module training_step calls (self.model, say)"
        if own
        else (f"Put {_names(holders)} in one module that training_step calls")
    )
    raise ValueError(
        f"AutoFitStrategy: the smallest module holding every parameter is {name} itself ({held}), so its "
        f"root FSDP2 unit would be {name}, whose forward the training step never calls ({name} has none of "
        "its own); FSDP2 gathers a unit's parameters only in that unit's forward, so those would stay "
        f"sharded. {move}, or give {name} a forward that runs the model and call self(...) in training_step."
    )


def _names(units: Sequence[str]) -> str:
    shown = [f"`{name or 'the LightningModule'}`" for name in units]
    return ", ".join(shown) if len(shown) <= 4 else f"{', '.join(shown[:3])}, ... ({len(shown)} units)"
