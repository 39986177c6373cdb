"""The training step as configured: one value every stage passes along instead of a dozen keywords.

A step's memory depends on how it runs: its precision, the checkpointing of its blocks, whether it is the
last micro-batch of an accumulation cycle, the lever that changes the optimizer step (gradients released,
the step fused into backward, the optimizer offloaded: at most one) and, past one device, how the model
is sharded. `Step` holds those, and `estimate_memory`, `advise` and `fit_optimizer` take one as ``step=``
beside their short keywords for the common cases (`Step.split`: one or the other); the planners make one
per candidate (`dataclasses.replace`), and the callbacks read one from the Trainer
(`lightning_memkit.callbacks._trainer.trainer_step`). Checking them is done once, here, not in each
signature that passes them on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from lightning_memkit._budget import valid_name, whole_number
from lightning_memkit._vocabulary import CHECKPOINT_MODES, PRECISIONS

__all__ = ["LEVERS", "LEVER_CALLBACKS", "Lever", "Sharding", "Step", "valid_lever"]

#: What changes the optimizer step (`GradientRelease`, `FusedOptimizerStep`, `OptimizerOffload`).
Lever = Literal["release_gradients", "fused_step", "offload"]
#: The levers, cheapest first.
LEVERS: tuple[str, ...] = get_args(Lever)
#: The callback that makes each lever in a Trainer.
LEVER_CALLBACKS: dict[str, str] = dict(
    zip(LEVERS, ("GradientRelease", "FusedOptimizerStep", "OptimizerOffload"), strict=True)
)


@dataclass(frozen=True)
class Sharding:
    """How a `Step` is sharded: one rank of a model sharded over ``world_size`` ranks with FSDP2
    (``fully_shard``), with tensor parallelism and HSDP's replicas where the layout has them.

    The default layout is the one Lightning documents: ``fully_shard`` on each repeated block, then on the
    root, over every rank; with ``replicate_size``, HSDP (``fully_shard`` over a (replicate, shard) mesh);
    with ``tensor_parallel_size``, each block's projections split first (`_sharding.parallel.tp_plan`).
    A ``parallelize_fn`` replaces it: the layout is then whatever that function does, run on the simulated
    copy of the model with a fake ``DeviceMesh`` named ``("data_parallel", "tensor_parallel")``, as
    Lightning's ``ModelParallelStrategy`` hands ``self.device_mesh`` to ``configure_model``. The fields are
    checked when it is made (`ValueError` / `TypeError` naming the field).

    Attributes:
        world_size: the number of ranks (processes, one GPU each) the model is sharded over, all of them.
        reshard_after_forward: ``fully_shard``'s own: ``False`` keeps each unit's parameters gathered from
            its forward to its backward.
        mp_policy: ``fully_shard``'s ``MixedPrecisionPolicy``, or ``None``.
        tensor_parallel_size: the ranks of one tensor-parallel group (Lightning's word); the data-parallel
            ranks are ``world_size // tensor_parallel_size``.
        replicate_size: HSDP's replicas of the default layout: each rank shards over
            ``data_parallel_size // replicate_size`` ranks.
        parallelize_fn: ``fn(model, device_mesh)`` that applies the layout (Fabric's word), or ``None``.

    Example::

        Sharding(world_size=8)  # FSDP2 over 8 ranks, Lightning's documented layout
        Sharding(world_size=8, tensor_parallel_size=2)  # TP 2 x FSDP2 4
    """

    world_size: int = 1
    reshard_after_forward: bool = True
    mp_policy: Any = None
    tensor_parallel_size: int = 1
    replicate_size: int = 1
    parallelize_fn: Callable[[Any, Any], Any] | None = None

    #: `estimate_memory`'s ``strategy`` for this layout.
    strategy = "fsdp2"

    def __post_init__(self) -> None:
        whole_number("world_size", self.world_size, of="ranks", at_least=1)
        whole_number("tensor_parallel_size", self.tensor_parallel_size, of="ranks", at_least=1)
        whole_number("replicate_size", self.replicate_size, of="replicas", at_least=1)
        if self.mp_policy is not None and type(self.mp_policy).__name__ != "MixedPrecisionPolicy":
            raise TypeError(
                "mp_policy must be FSDP2's MixedPrecisionPolicy, e.g. MixedPrecisionPolicy(param_dtype="
                f"torch.bfloat16, reduce_dtype=torch.float32); got {self.mp_policy!r} "
                f"({type(self.mp_policy).__name__})"
            )
        if self.world_size % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not divide world_size="
                f"{self.world_size}: each tensor-parallel group is that many of the ranks"
            )
        if self.data_parallel_size % self.replicate_size:
            raise ValueError(
                f"replicate_size={self.replicate_size} does not divide the {self.data_parallel_size} "
                "data-parallel ranks: HSDP shards over data_parallel_size // replicate_size ranks"
            )
        if self.parallelize_fn is not None and not callable(self.parallelize_fn):
            raise TypeError(f"parallelize_fn must be fn(model, device_mesh); got {self.parallelize_fn!r}")
        if self.parallelize_fn is not None and self.replicate_size > 1:
            raise ValueError(
                "replicate_size is the default layout's HSDP; with parallelize_fn the layout is that "
                "function's: build the (replicate, shard) mesh there"
            )

    @property
    def data_parallel_size(self) -> int:
        """The ranks that each take their own batch: ``world_size // tensor_parallel_size``."""
        return self.world_size // self.tensor_parallel_size

    @property
    def shard_size(self) -> int:
        """The ranks the default layout shards each parameter over (HSDP's shard group)."""
        return self.data_parallel_size // self.replicate_size

    def describe(self) -> str:
        """The layout in words: ``"FSDP2"`` (over every rank, its own layout or a function's), ``"TP 2 x
        FSDP2 2"``, ``"HSDP 2 x 2"``, ``"configure_model's layout (data_parallel 2 x tensor_parallel 2)"``."""
        if self.parallelize_fn is not None:
            if self.tensor_parallel_size == 1:
                return "FSDP2"
            name = getattr(self.parallelize_fn, "__qualname__", None) or repr(self.parallelize_fn)
            return (
                f"{name}'s layout (data_parallel {self.data_parallel_size} x tensor_parallel "
                f"{self.tensor_parallel_size})"
            )
        if self.replicate_size > 1:
            data = f"HSDP {self.replicate_size} x {self.shard_size}"
        else:
            data = f"FSDP2 {self.shard_size}" if self.tensor_parallel_size > 1 else "FSDP2"
        return f"TP {self.tensor_parallel_size} x {data}" if self.tensor_parallel_size > 1 else data


@dataclass(frozen=True)
class Step:
    """How one training step runs, as far as its memory goes: what `estimate_memory`, `advise` and
    `fit_optimizer` take as ``step=`` (the same as their keywords ``precision=``, ``checkpointing=``, ...;
    `Step.of` makes one from those keywords). Frozen and checked when made; `but` changes fields.

    Attributes:
        precision: a Lightning precision string (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"``, ``"64-true"``).
        checkpointing: ``None`` (the blocks as written), a `CheckpointMode` for every block, or a
            `CheckpointPlan` / ``{module name: mode}`` mapping.
        accumulating: the last micro-batch of a gradient accumulation cycle (its backward adds to
            gradients already there), the cycle's highest.
        first_step: the first step, before the optimizer has state (else the steady state).
        lever: what changes the optimizer step, or ``None``: ``"release_gradients"`` (`GradientRelease`),
            ``"fused_step"`` (`FusedOptimizerStep`) or ``"offload"`` (`OptimizerOffload`).
        sharding: one rank's FSDP2 layout (`Sharding`), or ``None`` for one device. Figures for a sharded
            step are one rank's, in bytes like all of them.
        compile_budget: for a model with compiled modules, torch.compile's
            ``activation_memory_budget`` (the share of the activations its partitioner keeps, 0 to 1);
            ``None``: as configured (``torch._functorch.config``, 1.0 by default). Below the configured
            budget the simulated peak is a lower bound (`estimate_memory`).

    Example::

        step = Step(precision="bf16-mixed", checkpointing="full", sharding=Sharding(world_size=8))
        estimate_memory(model, batch, step=step)  # one rank's step: as precision=..., strategy="fsdp2", ...
        estimate_memory(model, batch, step=step.but(lever="release_gradients"))
    """

    precision: str = "32-true"
    checkpointing: Any = None
    accumulating: bool = False
    first_step: bool = False
    lever: Lever | None = None
    sharding: Sharding | None = None
    compile_budget: float | None = None

    def __post_init__(self) -> None:
        valid_name("precision", self.precision, PRECISIONS)
        if self.compile_budget is not None and not 0 <= self.compile_budget <= 1:
            raise ValueError(
                f"compile_budget is torch.compile's activation_memory_budget, a share of the activations "
                f"from 0 to 1; got {self.compile_budget!r}"
            )
        if isinstance(self.checkpointing, str):
            valid_name("checkpointing", self.checkpointing, CHECKPOINT_MODES)
        valid_lever(self.lever)
        if self.lever == "fused_step" and self.accumulating:
            raise ValueError(
                "The optimizer step fused into backward updates the parameters at every backward, so it "
                "cannot accumulate gradients over micro-batches: plan it with accumulate_grad_batches=1."
            )
        if self.lever == "offload" and self.sharding is not None:
            raise NotImplementedError(
                "The offloaded optimizer runs on one process: under FSDP2, plan CPUOffloadPolicy instead "
                "(plan_fit(strategy='fsdp2', cpu_offload=True))."
            )

    @classmethod
    def of(
        cls,
        *,
        precision: str = "32-true",
        checkpointing: Any = None,
        accumulating: bool = False,
        first_step: bool = False,
        lever: Lever | None = None,
        strategy: str | None = None,
        world_size: int = 1,
        sharding: Sharding | None = None,
        compile_budget: float | None = None,
    ) -> Step:
        """The step `estimate_memory`'s keywords describe (the sharded layout as a `Sharding`, or
        ``strategy="fsdp2"`` over ``world_size`` ranks for FSDP2's documented one)."""
        if sharding is not None:
            sharding = _given_layout(sharding, strategy, world_size)
        elif strategy is not None:
            valid_name("strategy", strategy, (Sharding.strategy,))
            sharding = Sharding(world_size)
        elif world_size != 1:
            raise ValueError(
                "world_size is FSDP2's (its sharded layout's): pass strategy='fsdp2' with it (or "
                "sharding=Sharding(world_size=...)) to simulate one rank's sharded step, or leave it out for "
                "one device"
            )
        return cls(precision, checkpointing, accumulating, first_step, lever, sharding, compile_budget)

    @classmethod
    def split(cls, kwargs: dict[str, Any], caller: str | None = None) -> tuple[Step, dict[str, Any]]:
        """``kwargs`` in `estimate_memory`'s form as a `Step` and the rest (``optimizer``, ``loss_fn``,
        ``device``, ...): the public functions' one way to read their step. A ``step=`` among them is taken
        as it is; a step keyword beside it that is not at its default is a `TypeError` naming it (a
        signature's defaults cannot say whether they were written out, so those pass). With ``caller`` (a
        public function that passes its ``**kwargs`` on as `estimate_memory`'s), a keyword `estimate_memory`
        does not take is a `TypeError` naming ``caller``, not the function it would have reached."""
        rest = {k: v for k, v in kwargs.items() if k not in _KEYWORDS}
        given = {k: v for k, v in kwargs.items() if k in _KEYWORDS}
        if layout := [k for k in rest if k in _LAYOUT_FIELDS]:
            raise TypeError(
                f"{', '.join(layout)}: FSDP2's layout is one keyword, sharding=Sharding(world_size=..., "
                f"{'=..., '.join(layout)}=...)"
            )
        if caller is not None and (unknown := [k for k in rest if k not in _RUN_KEYWORDS]):
            raise TypeError(
                f"{caller}() got an unexpected keyword argument {unknown[0]!r}: it takes estimate_memory's "
                f"keywords, {', '.join(sorted(_KEYWORDS | _RUN_KEYWORDS))}"
            )
        step = rest.pop("step", None)
        if step is None:
            return cls.of(**given), rest
        beside = [k for k, v in given.items() if not (v is _DEFAULTS[k] or v == _DEFAULTS[k])]
        if beside:
            raise TypeError(
                f"give step= or {', '.join(beside)}, not both: the Step holds them (change one with "
                "step.but(...))"
            )
        if not isinstance(step, Step):
            raise TypeError(f"step= must be a Step; got {step!r} ({type(step).__name__})")
        return step, rest

    def keywords(self) -> dict[str, Any]:
        """`estimate_memory`'s keywords for this step (only those that differ from its defaults)."""
        out: dict[str, Any] = {"precision": self.precision}
        if self.checkpointing is not None:
            out["checkpointing"] = self.checkpointing
        if self.accumulating:
            out["accumulating"] = True
        if self.first_step:
            out["first_step"] = True
        if self.lever is not None:
            out["lever"] = self.lever
        if self.sharding is not None and self.sharding == Sharding(self.sharding.world_size):
            out.update(strategy=Sharding.strategy, world_size=self.sharding.world_size)  # the short form
        elif self.sharding is not None:
            out["sharding"] = self.sharding
        if self.compile_budget is not None:
            out["compile_budget"] = self.compile_budget
        return out

    def but(self, **changes: Any) -> Step:
        """This step with ``changes`` (`dataclasses.replace`, checked again)."""
        return replace(self, **changes)

    @property
    def release_gradients(self) -> bool:
        return self.lever == "release_gradients"

    @property
    def fused_step(self) -> bool:
        return self.lever == "fused_step"

    @property
    def offload(self) -> bool:
        return self.lever == "offload"


def valid_lever(lever: Any) -> Lever | None:
    """``lever`` if it is ``None`` or one of `LEVERS`; else the `ValueError` that lists them (with "Did you
    mean" where one is close): every reader of a lever checks it here."""
    return None if lever is None else valid_name("lever", lever, LEVERS)  # type: ignore[return-value]


def _given_layout(sharding: Sharding, strategy: str | None, world_size: int) -> Sharding:
    """``sharding=`` as `Step.of` takes it: a `Sharding`, with ``strategy`` at most ``"fsdp2"`` and
    ``world_size`` at most its own."""
    if not isinstance(sharding, Sharding):
        raise TypeError(f"sharding= must be a Sharding; got {sharding!r} ({type(sharding).__name__})")
    if strategy not in (None, Sharding.strategy):
        raise ValueError(f"sharding= is FSDP2's layout (strategy='fsdp2'); got strategy={strategy!r}")
    if world_size not in (1, sharding.world_size):
        raise TypeError(
            "give sharding= or world_size, not both: the Sharding holds the layout "
            f"({sharding.describe()} over {sharding.world_size} ranks)"
        )
    return sharding


#: `Sharding`'s fields that are no keywords of `Step.of` (`Step.split` names ``sharding=`` for them).
_LAYOUT_FIELDS = frozenset(field.name for field in fields(Sharding)) - {"world_size"}
#: `Step.of`'s keywords, as `estimate_memory` takes them, and their defaults.
_DEFAULTS = {name: p.default for name, p in inspect.signature(Step.of).parameters.items()}
_KEYWORDS = frozenset(_DEFAULTS)
#: `estimate_memory`'s keywords that are not the step's, and ``step`` itself.
_RUN_KEYWORDS = frozenset({"optimizer", "loss_fn", "device", "step"})
