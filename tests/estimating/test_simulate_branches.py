"""The simulated step takes the branches the real batch takes (`lightning_memkit._estimating.shadow`).

Values the step reads from the batch (a padding mask's ``.all()``, positions built with ``torch.arange``,
the size of a boolean-mask selection) are computed for real, so the estimate follows the real step's
path; each accuracy test compares with the allocator's record of the same plain step (forward, backward,
``step()``, ``zero_grad()``, after one warm-up step), run for real.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo import ZooModule, zoo_batch

from lightning_memkit import estimate_memory
from lightning_memkit.testing import allocator_peak

TOLERANCE = 0.01  # |estimate - allocator| <= 1 %


def _assert_close(estimate: int, truth: int) -> None:
    error = (estimate - truth) / truth
    assert abs(error) <= TOLERANCE, f"estimate {estimate:,} vs allocator {truth:,} ({100 * error:+.2f} %)"


def _returned(loss, _target):
    return loss


def _real_and_estimated(make_model, batch, **kwargs):
    """(allocator peak of a real steady-state AdamW step, estimate) for ``make_model()``'s ``model(batch)``
    loss; both models are built from the same seed."""
    torch.manual_seed(0)
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        model(batch).backward()
        adamw.step()
        adamw.zero_grad()

    step()  # AdamW's state exists from the second step on
    truth = allocator_peak(step)
    torch.manual_seed(0)
    twin = make_model()
    adamw_factory = functools.partial(torch.optim.AdamW, lr=1e-3)
    estimate = estimate_memory(twin, (batch, None), optimizer=adamw_factory, loss_fn=_returned, device="cpu")
    return truth, estimate.peak


class Branchy(nn.Module):
    """A token model whose memory depends on values of the batch, as Hugging Face's masking code does.

    - "packed sequences" are detected from positions built with ``torch.arange``: never, for real, but a
      placeholder ``False`` for ``.all()`` would build a (B, T, T) float tensor;
    - attention with an explicit (B, T, T) mask only where the batch has padding;
    - the loss over the real tokens only: a boolean-mask selection, whose shape is data-dependent;
    - with ``noisy``, random numbers drawn in the shape of batch-derived tensors (they must not be drawn
      for real by the estimate) that change no shape.
    """

    def __init__(self, vocab=64, dim=32, noisy=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        self.noisy = noisy

    def forward(self, batch):
        ids, mask = batch
        b, t = ids.shape
        h = self.embed(ids)
        positions = torch.arange(t).expand(b, t)
        if not (torch.diff(positions, dim=-1) == 1).all():  # packed sequences
            distance = (positions[:, :, None] - positions[:, None, :]).float().abs()
            h = h * distance.mean(-1, keepdim=True)
        if not (mask == 1).all():  # padding
            scores = (h @ h.transpose(1, 2)).masked_fill(mask[:, None, :] == 0, float("-inf"))
            h = scores.softmax(-1) @ h
        if self.noisy:
            h = h + torch.rand_like(mask, dtype=h.dtype)[..., None] * 1e-3
            h = h[:, torch.randperm(t)]
            ids = ids.gather(1, torch.bernoulli(torch.zeros_like(ids, dtype=torch.float)).long())
        keep = mask.bool()
        return F.cross_entropy(self.head(h[keep]), ids[keep])


def _tokens(padded: bool, batch=8, seq_len=256, vocab=64):
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[:, seq_len * 3 // 4 :] = 0
    return ids, mask


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_the_estimate_takes_the_branches_of_the_real_batch(padded):
    truth, estimate = _real_and_estimated(Branchy, _tokens(padded))
    _assert_close(estimate, truth)


def test_the_estimate_leaves_the_rng_stream_untouched():
    """Random ops on batch-derived tensors are not replayed for real: the RNG state is as it was."""
    batch = _tokens(padded=True)
    model = Branchy(noisy=True)
    state = torch.get_rng_state()
    estimate = estimate_memory(model, (batch, None), optimizer="adamw", loss_fn=_returned, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)
    truth, _ = _real_and_estimated(functools.partial(Branchy, noisy=True), batch)
    _assert_close(estimate.peak, truth)


def test_transformers_is_tracing_is_patched_during_the_estimate_only():
    """transformers takes its "tracing" paths for any FakeTensor; not for the simulation's, and only while
    it runs: afterwards every module holds the original functions again."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    from transformers.utils import import_utils

    is_tracing, is_fake_tensor = import_utils.is_tracing, import_utils.is_fake_tensor
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append((masking_utils.is_tracing(x), import_utils.is_fake_tensor(x)))
            return super().forward(x).sum()

    estimate_memory(Probe(4, 4), (torch.ones(2, 4), None), optimizer="sgd", loss_fn=_returned, device="cpu")
    assert seen == [(False, False)]
    assert masking_utils.is_tracing is is_tracing and import_utils.is_tracing is is_tracing
    assert import_utils.is_fake_tensor is is_fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a fake tensor of anyone else's is a trace, as before
        assert masking_utils.is_tracing(torch.ones(2))


class _Plain(nn.Module):
    """A zoo model as a plain module: ``model(batch)`` is its Hugging Face loss."""

    def __init__(self, name):
        super().__init__()
        self.zoo = ZooModule(name)

    def forward(self, batch):
        return self.zoo(batch)


@pytest.mark.parametrize("name", ["qwen2", "gpt_neox"])  # the ones that went wrong; test_zoo.py has all
def test_zoo_token_models_within_one_percent(name):
    truth, estimate = _real_and_estimated(functools.partial(_Plain, name), zoo_batch(name))
    _assert_close(estimate, truth)
