"""A routed mixture of experts sharded with FSDP2 (issue 26 item 1): each rank's estimate follows the
routing of that rank's own batch, against each real gloo rank's allocator.

Two ranks run Hugging Face's Qwen2-MoE with its eager experts (each expert's tokens gathered with
``nonzero`` of the router's choice), ``fully_shard`` on each decoder layer and the root as Lightning's
``ModelParallelStrategy`` documents, each on a batch of its own, so that the ranks route differently. The
optimizer's rate is 0: the weights, and so the routing, of the measured step are those the estimate sees.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed
from helpers import counted_rank, counted_ranks, counted_step, needs_distributed
from test_moe import _eager_moe, _loss

from lightning_memkit import estimate_memory
from lightning_memkit._checkpointing.blocks import find_blocks
from lightning_memkit._sharding.fsdp2 import largest_unit_shard, shard_layout

WORLD = 2
BATCH = 8


def _batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids: a batch of its own, so that its experts get their own share of tokens."""
    return torch.randint(0, 128, (BATCH, 16), generator=torch.Generator().manual_seed(100 + rank))


def _rank(rank: int, out: Path) -> None:
    """One rank: three plain steps of the sharded model on its batch, the allocator's peak of the last."""
    counter = counted_rank(out, rank, WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    model, _ = _eager_moe(BATCH)
    shard_layout(model, init_device_mesh("cpu", (WORLD,)), [name for name, _ in find_blocks(model)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    ids = _batch(rank)

    def step() -> None:
        _loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad()

    peaks = [counted_step(counter, model, [optimizer], ids, step) for _ in range(3)]
    (out / f"rank_{rank}.json").write_text(json.dumps({"peaks": peaks}))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(once):
    return counted_ranks(once, "moe_fsdp2", _rank, WORLD, "FSDP2 mixture-of-experts")


@pytest.mark.slow
@needs_distributed
def test_each_ranks_routed_step_is_estimated_from_its_own_batch(ranks):
    model, _ = _eager_moe(BATCH)
    blocks = [name for name, _ in find_blocks(model)]
    staged = largest_unit_shard(model, blocks, 1, itemsize=4)  # what gloo may stage in its own thread
    estimates = []
    for rank in range(WORLD):
        ids = _batch(rank)
        truth = json.loads((ranks / f"rank_{rank}.json").read_text())["peaks"][-1]
        estimate = estimate_memory(
            model, (ids, ids), optimizer="adamw", loss_fn=_loss, device="cpu", strategy="fsdp2",
            world_size=WORLD,
        ).peak  # fmt: skip
        estimates.append(estimate)
        close = abs(estimate - truth) <= 0.01 * truth or 0 < truth - estimate <= 0.01 * truth + staged
        assert close, f"rank {rank}: estimate {estimate:,} B, allocator {truth:,} B"
    assert estimates[0] != estimates[1]  # the ranks' routings differ, and each estimate follows its own
