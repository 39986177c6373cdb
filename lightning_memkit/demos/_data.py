"""The demo GPT's data: a corpus generated at run time, a byte-level tokenizer and a LightningDataModule.

The corpus is made of short English stories from a small grammar, generated from a seed. That needs no
download and no shipped file, gives the same bytes on every machine, and is regular enough that a tiny model
learns its spelling and syntax within a hundred steps, so a falling loss is a quick, reliable signal.
"""

import random

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

# fmt: off
_NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Kate", "Leo",
          "Maria", "Noah", "Olga", "Paul"]
_ANIMATE = ["cat", "dog", "fox", "bird", "sailor", "farmer", "teacher", "child", "king", "baker", "painter",
            "doctor", "horse", "owl", "rabbit", "soldier"]
_THINGS = ["ball", "map", "boat", "letter", "apple", "book", "lamp", "key", "coat", "basket", "clock",
           "drum", "hat", "ring", "cake", "kite"]
_ADJECTIVES = ["old", "young", "small", "big", "red", "green", "quiet", "happy", "tired", "brave", "clever",
               "strange", "bright", "heavy", "empty", "warm"]
_TRANSITIVE = ["saw", "found", "carried", "painted", "followed", "watched", "liked", "helped", "visited",
               "lost", "opened", "hid", "wanted", "took", "gave away", "remembered"]
_INTRANSITIVE = ["slept", "laughed", "waited", "sang", "ran home", "sat down", "smiled", "danced"]
_PLACES = ["in the garden", "near the river", "at the market", "under the bridge", "on the hill",
           "by the sea", "in the forest", "behind the house", "at the station", "in the kitchen"]
_DESTINATIONS = ["to the garden", "to the river", "to the market", "home", "to the sea", "to the forest",
                 "to the station", "to school"]
_TIMES = ["In the morning", "At night", "After lunch", "One day", "Later", "On Sunday", "That evening",
          "Before dawn"]
_FEELINGS = ["happy", "sad", "tired", "surprised", "angry", "calm", "hungry", "proud"]
# fmt: on


def make_corpus(num_sentences: int = 20_000, seed: int = 0) -> str:
    """Short English stories, paragraphs of three to six sentences; the same text for the same seed."""
    rng = random.Random(seed)
    pick = rng.choice

    def article(word: str, definite: bool) -> str:
        if definite:
            return "the"
        return "an" if word[0] in "aeiou" else "a"

    def noun_phrase(nouns: list[str]) -> str:
        noun = pick(nouns)
        words = [pick(_ADJECTIVES), noun] if rng.random() < 0.6 else [noun]
        return f"{article(words[0], rng.random() < 0.5)} {' '.join(words)}"

    def subject() -> str:
        return pick(_NAMES) if rng.random() < 0.5 else noun_phrase(_ANIMATE)

    templates = [
        lambda: f"{pick(_TIMES)}, {subject()} {pick(_TRANSITIVE)} {noun_phrase(_THINGS)} {pick(_PLACES)}.",
        lambda: f"{subject()} {pick(_TRANSITIVE)} {noun_phrase(_THINGS)}.",
        lambda: f"{subject()} {pick(_INTRANSITIVE)} {pick(_PLACES)}.",
        lambda: (
            f"{subject()} was {pick(_FEELINGS)} because {subject()} {pick(_TRANSITIVE)} "
            f"{noun_phrase(_THINGS)}."
        ),
        lambda: f"{subject()} and {subject()} went {pick(_DESTINATIONS)}.",
        lambda: f'"Look at {noun_phrase(_THINGS)}," said {pick(_NAMES)}.',
    ]
    paragraphs, sentences = [], []
    for _ in range(num_sentences):
        sentence = pick(templates)()
        start = 1 if sentence[0] == '"' else 0
        sentences.append(sentence[:start] + sentence[start].upper() + sentence[start + 1 :])
        if len(sentences) >= rng.randint(3, 6):
            paragraphs.append(" ".join(sentences))
            sentences = []
    paragraphs.append(" ".join(sentences))
    return "\n\n".join(p for p in paragraphs if p) + "\n"


def encode(text: str) -> list[int]:
    """Text to token ids: the UTF-8 bytes, so the vocabulary is 256 and any prompt can be encoded."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Token ids to text. Invalid UTF-8 and ids above 255 (from a larger vocabulary) become U+FFFD."""
    return bytes(i if i < 256 else 0xFF for i in ids).decode("utf-8", errors="replace")


class _Chunks(Dataset):
    """Consecutive, non-overlapping windows of a token stream: item i is (input, target shifted by one)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if len(tokens) <= seq_len:
            raise ValueError(
                f"A split of {len(tokens)} tokens cannot fill one sequence of {seq_len + 1} tokens"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].long()  # (seq_len + 1,)
        return chunk[:-1], chunk[1:]


class GPTDataModule(L.LightningDataModule):
    """The generated corpus, byte-tokenized and split into train and validation by position.

    Args:
        batch_size: sequences per micro-batch. A public attribute read when a dataloader is made, so
            Lightning's ``BatchSizeFinder`` (and lightning_memkit's auto-fit) can change it.
        seq_len: tokens per sequence; at most the model's ``block_size``.
        num_sentences: size of the corpus; the default gives about 1.2 MB of text.
        val_fraction: share of the corpus, taken from its end, held out for validation.
        seed: seeds the corpus and the order of training batches.
        num_workers: dataloader worker processes.
    """

    def __init__(
        self,
        batch_size: int = 16,
        seq_len: int = 128,
        num_sentences: int = 20_000,
        val_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.train_set: _Chunks | None = None
        self.val_set: _Chunks | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        hp = self.hparams
        tokens = torch.tensor(encode(make_corpus(hp.num_sentences, hp.seed)), dtype=torch.uint8)
        n_train = int(len(tokens) * (1 - hp.val_fraction))
        self.train_set = _Chunks(tokens[:n_train], self.seq_len)
        self.val_set = _Chunks(tokens[n_train:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            generator=generator,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.hparams.num_workers)
