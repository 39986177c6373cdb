"""The suite's tiny models, shared as Lightning's tests share ``BoringModel``: a test takes one of these, with
its sizes, and subclasses it for the one behaviour it needs (a recording hook, manual optimization), rather
than writing its own ``Net``.

- `BlockNet`: repeated residual MLP blocks (`ResidualMLP`), what checkpointing plans block by block;
- `MLPModule`: two Linear layers, no repeated blocks (`helpers.Regression` with its activation, optimizer
  and shuffling chosen);
- `PlainGPT`: the demo GPT as a plain ``nn.Module`` stepped with `lm_loss`; `tiny_lm`: a ``memkit --model``
  factory without repeated blocks;
- `Tagger`: an embedding, torch's LSTM or GRU and a per-token head, also stepped with `lm_loss`;
- `AttributeUNet` (`UNetModule` over it): a diffusion-style UNet whose `ResBlock` and `AttnBlock` blocks
  are plain attributes, no ``nn.ModuleList``;
- `EncoderLM` (`encoder_step`: the same as a plain step): torch's own ``nn.TransformerEncoder``, a model the
  project did not write;
- `BuiltLater`: a regression whose layers ``configure_model`` builds;
- `CompiledDecoder` and `CompiledCNN`: a tiny LLaMA and a CNN compiled in ``configure_model``.

Shared elsewhere: `helpers.Regression` and `helpers.tiny_gpt` (the GPT example with its data), the Hugging
Face zoo in `zoo.py`, the adapter fine-tunes in `peft_models.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from helpers import Regression
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memkit.demos.gpt import GPT, GPTConfig

OptimizerFactory = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]

#: the optimizers a model here is given by name; LBFGS's step(closure) runs training_step and backward
_OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": functools.partial(torch.optim.SGD, lr=0.01),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
    "lbfgs": functools.partial(torch.optim.LBFGS, lr=0.1, history_size=4, max_iter=3),
}
CLASSES = 10  # `BlockNet`'s classes on sequences


def build_optimizer(
    optimizer: str | OptimizerFactory, params: Iterator[nn.Parameter]
) -> torch.optim.Optimizer:
    """``optimizer`` over ``params``: "sgd" (lr 0.01), "adamw" (lr 1e-3), "lbfgs", or a factory of them."""
    if callable(optimizer):
        return optimizer(params)
    if optimizer not in _OPTIMIZERS:
        raise ValueError(
            f"Unknown optimizer {optimizer!r}; choose one of {', '.join(map(repr, _OPTIMIZERS))}"
        )
    return _OPTIMIZERS[optimizer](params)


class ResidualMLP(nn.Module):
    """``x + Linear(GELU(Linear(x)))``, 4 x ``width`` inside, as a transformer's MLP; with ``norm``, BatchNorm
    and dropout after the first Linear too (buffers that move, RNG draws: rows only, not sequences)."""

    def __init__(self, width: int, norm: bool = False) -> None:
        super().__init__()
        extra = [nn.BatchNorm1d(4 * width), nn.Dropout(0.3)] if norm else []
        self.net = nn.Sequential(nn.Linear(width, 4 * width), *extra, nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)  # (B, width) or (B, T, width)


class BlockNet(pl.LightningModule):
    """``n_blocks`` alike `ResidualMLP` blocks of ``width`` and a Linear head: the model with repeated blocks,
    whose step plans in a second or two (one block: nothing to checkpoint, the micro-batch is the lever).

    Rows of ``width`` features regress a random target (MSE, one output); with ``seq_len``, sequences of
    ``seq_len`` positions each take one of `CLASSES` classes (cross-entropy), where the activations outweigh
    parameters, gradients and optimizer state. ``samples`` examples (``None``: 4 batches of ``batch_size``,
    fixed here, so AutoFit's micro-batches cut the same data), reshuffled each epoch with ``shuffle``. The
    default SGD keeps no state: the activations make the peak, as checkpointing's tests want. Every training
    loss is kept in ``losses``. Used by the checkpointing edge cases, the OOM explanations (on sequences) and
    the observe-only usages (with BatchNorm and dropout).
    """

    def __init__(
        self, n_blocks: int = 3, width: int = 32, batch_size: int = 64, samples: int | None = None,
        seq_len: int | None = None, norm: bool = False, optimizer: str = "sgd", shuffle: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()  # ``batch_size`` in hparams: AutoFit sets and restores it there
        self.samples = 4 * batch_size if samples is None else samples
        self.blocks = nn.ModuleList(ResidualMLP(width, norm) for _ in range(n_blocks))
        self.head = nn.Linear(width, 1 if seq_len is None else CLASSES)
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, width), (B, 1); or (B, T, width), (B, T) class ids
        out = self(x)
        if self.hparams.seq_len is None:
            loss = F.mse_loss(out, y)
        else:
            loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return build_optimizer(self.hparams.optimizer, self.parameters())

    def dataset(self) -> TensorDataset:
        """The ``samples`` examples, seeded."""
        g = torch.Generator().manual_seed(0)
        n, t, d = self.samples, self.hparams.seq_len, self.hparams.width
        if t is None:
            return TensorDataset(torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g))
        return TensorDataset(
            torch.randn(n, t, d, generator=g), torch.randint(0, CLASSES, (n, t), generator=g)
        )

    def train_dataloader(self):
        return DataLoader(self.dataset(), batch_size=self.hparams.batch_size, shuffle=self.hparams.shuffle)


class MLPModule(Regression):
    """`helpers.Regression` (Linear, ``activation``, Linear to one output: no repeated blocks, nothing to
    checkpoint) with its ``optimizer`` chosen, a name or a factory (`build_optimizer`), and with ``shuffle``
    its rows reshuffled each epoch (the sampler draws from the global RNG). Used where a test steps a
    LightningModule against the allocator with a given optimizer (bitsandbytes', LBFGS, one whose state
    grows) and by OptimizerSwap's edge cases."""

    def __init__(
        self, width: int = 16, hidden: int = 32, samples: int = 64, batch_size: int = 8, *,
        activation: Callable[[], nn.Module] = nn.ReLU, optimizer: str | OptimizerFactory = "adamw",
        shuffle: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(width, hidden, samples, batch_size=batch_size)
        self.net[1] = activation()
        self.optimizer, self.shuffle = optimizer, shuffle

    # No validation loop: LightningModule's own hooks again, so Lightning sees none (Regression's, without
    # val_samples, is an empty loader that Lightning warns of and sanity-checks); a subclass may add one.
    val_dataloader = pl.LightningModule.val_dataloader
    validation_step = pl.LightningModule.validation_step

    def configure_optimizers(self):
        return build_optimizer(self.optimizer, self.parameters())

    def train_dataloader(self):
        loader = super().train_dataloader()
        return (
            DataLoader(loader.dataset, batch_size=self.batch_size, shuffle=True) if self.shuffle else loader
        )


class PlainGPT(nn.Module):
    """The demo GPT as a plain module: token ids in, logits out, what `estimate_memory` and the checkpointing
    planner step with `lm_loss` (the planner's tests against brute force and real steps). ``config``:
    `GPTConfig`'s fields (its defaults are tiny)."""

    def __init__(self, **config) -> None:
        super().__init__()
        self.gpt = GPT(GPTConfig(**config))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)[0]  # (B, T, vocab_size)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: (B, T, V) logits against (B, T) ids."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Tagger(nn.Module):
    """An embedding, a 2-layer recurrent net (``nn.LSTM``, ``nn.GRU``) at torch's defaults, and a per-token
    head: what oneDNN's RNN layers keep from forward to backward (their workspace) is in its step."""

    def __init__(self, rnn: type[nn.RNNBase], vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 64)
        self.rnn = rnn(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, vocab)
        return self.head(self.rnn(self.embed(ids))[0])


def tiny_lm() -> nn.Module:
    """A ``memkit --model models:tiny_lm`` factory (the OOM explanations' CLI tests): a language model without
    repeated blocks, embedding and head, its peak the logits."""
    return nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 256))


class ResBlock(nn.Module):
    """A diffusion UNet's residual block: (GroupNorm, SiLU, 3x3 conv) twice, plus the input (through a 1x1
    conv where the width changes)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, c_in, H, W) -> (B, c_out, H, W)
        h = self.conv1(F.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class AttnBlock(nn.Module):
    """Self-attention over a feature map's H x W positions, one head, written out: its (B, HW, HW) softmax
    is saved for backward."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm, self.qkv, self.proj = nn.GroupNorm(4, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).flatten(2).chunk(3, dim=1)  # (B, c, HW) each
        scores = torch.softmax((q.transpose(1, 2) * c**-0.5) @ k, dim=-1)  # (B, HW, HW)
        # scores on the left: CPU's bmm copies a transposed (HW, HW) operand, which the simulation misses
        out = (scores @ v.transpose(1, 2)).transpose(1, 2)  # (B, c, HW)
        return x + self.proj(out.reshape(b, c, h, w))


class AttributeUNet(nn.Module):
    """A diffusion-style UNet over ``channels`` x ``size`` x ``size`` images whose blocks are attributes, as
    many UNets write them (no ``nn.ModuleList``): six `ResBlock` at widths ``width``, ``2 * width`` and
    ``4 * width`` (the up path takes the skip concatenated), three `AttnBlock` (``2 * width`` at full
    resolution and at half, ``width`` at full), one downsampling and one upsampling between."""

    def __init__(self, width: int = 16, channels: int = 3) -> None:
        super().__init__()
        c = width
        self.stem = nn.Conv2d(channels, c, 3, padding=1)
        self.down1, self.down2, self.down_attn = ResBlock(c, c), ResBlock(c, 2 * c), AttnBlock(2 * c)
        self.pool = nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1)  # (B, 2c, size / 2, size / 2)
        self.mid1, self.mid_attn, self.mid2 = ResBlock(2 * c, 2 * c), AttnBlock(2 * c), ResBlock(2 * c, 2 * c)
        self.up = nn.Upsample(scale_factor=2)
        self.up1, self.up_attn, self.up2 = ResBlock(4 * c, c), AttnBlock(c), ResBlock(c, c)
        self.head = nn.Conv2d(c, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, channels, size, size) -> the same
        skip = self.down_attn(self.down2(self.down1(self.stem(x))))  # (B, 2c, size, size)
        h = self.mid2(self.mid_attn(self.mid1(self.pool(skip))))
        h = self.up2(self.up_attn(self.up1(torch.cat([self.up(h), skip], dim=1))))
        return self.head(h)


class UNetModule(pl.LightningModule):
    """`AttributeUNet` trained to predict the noise added to random images (MSE), SGD: ``samples`` images
    of ``size`` x ``size`` in batches of ``batch_size``, the attribute AutoFit sets."""

    def __init__(self, width: int = 16, size: int = 16, batch_size: int = 8, samples: int = 32) -> None:
        super().__init__()
        self.unet = AttributeUNet(width)
        self.size, self.batch_size, self.samples = size, batch_size, samples

    def training_step(self, batch, batch_idx):
        images, noise = batch  # (B, 3, size, size) each
        return F.mse_loss(self.unet(images + noise), noise)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` seeded (images, noise) pairs."""
        g = torch.Generator().manual_seed(0)
        return tuple(torch.randn(n, 3, self.size, self.size, generator=g) for _ in range(2))

    def train_dataloader(self):
        return DataLoader(TensorDataset(*self.batch(self.samples)), batch_size=self.batch_size)


class BuiltLater(pl.LightningModule):
    """A regression whose layers ``configure_model`` builds (``build_later``), as Lightning documents for
    large models, or that has none at all."""

    def __init__(self, build_later: bool) -> None:
        super().__init__()
        self.batch_size, self.build_later, self.net = 8, build_later, None

    def configure_model(self) -> None:
        if self.build_later and self.net is None:  # idempotent, as Lightning asks of the hook
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x) if self.net is not None else x.mean(1, keepdim=True)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

    def train_dataloader(self):
        data = TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
        return DataLoader(data, batch_size=self.batch_size)


class EncoderLM(pl.LightningModule):
    """A stack of torch's own ``nn.TransformerEncoderLayer`` with a token head: a model we did not write."""

    def __init__(self, d_model=64, n_layer=2, vocab=256, seq_len=64, batch_size=8, n_batches=8, foreach=None):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=self.hparams.foreach)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        n, t, v = self.hparams.n_batches * self.hparams.batch_size, self.hparams.seq_len, self.hparams.vocab
        x = torch.randint(0, v, (n, t), generator=g)
        return DataLoader(TensorDataset(x, x.roll(-1, dims=1)), batch_size=self.hparams.batch_size)


def encoder_step(d_model=64, n_layer=2, batch=8, seq_len=64, vocab=256, foreach=None):
    """A plain-PyTorch (model, optimizer, step) triple on the encoder stack."""
    torch.manual_seed(0)
    model = EncoderLM(d_model, n_layer, vocab, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    x = torch.randint(0, vocab, (batch, seq_len))

    def step():
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    return model, opt, step


#: the batches a compiled module's (`CompiledDecoder`, `CompiledCNN`) loader yields: one epoch of steps
COMPILED_STEPS = 4


class CompiledDecoder(pl.LightningModule):
    """A tiny random LLaMA (grouped-query attention), compiled in ``configure_model`` as Lightning's docs
    show; ``batch_size`` x ``seq_len`` token ids, seeded."""

    def __init__(self, batch_size: int = 4, seq_len: int = 32, attention_dropout: float = 0.0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.batch_size, self.seq_len = batch_size, seq_len
        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, attention_dropout=attention_dropout,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def configure_model(self) -> None:
        self.model = torch.compile(self.model)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        shape = (COMPILED_STEPS * self.batch_size, self.seq_len)
        ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(0))
        return DataLoader(ids, batch_size=self.batch_size)


class CNN(nn.Module):
    """Two convolutions with BatchNorm, pooled, then a linear head: (B, 3, 32, 32) -> (B, 10). Its own
    ``forward``: ``nn.Sequential.compile()`` compiles no frame (dynamo skips torch.nn's)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))  # (B, 32, 16, 16) -> (B, 32) -> (B, 10)


class CompiledCNN(pl.LightningModule):
    """`CNN` compiled in ``configure_model`` (``self.net.compile()``), cross-entropy over 10 classes, AdamW:
    `COMPILED_STEPS` batches of ``batch_size`` random (B, 3, 32, 32) images, seeded."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size
        torch.manual_seed(0)
        self.net = CNN()

    def configure_model(self) -> None:
        self.net.compile()

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        n = COMPILED_STEPS * self.batch_size
        data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        return DataLoader(data, batch_size=self.batch_size)
