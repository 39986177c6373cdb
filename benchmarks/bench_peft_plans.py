"""`memkit plan` for LoRA and QLoRA fine-tunes of LLaMA shapes, on 24, 48 and 80 GB cards (the README's
table, docs/peft.md's): can model X be fine-tuned on my card at 2,048 tokens, and how?

Each model is an ``hf:`` directory holding only a ``config.json`` of its published shape (LLaMA-2-7B,
LLaMA-3-8B, LLaMA-2-13B, LLaMA-2-70B; weights in bf16, as they are published), written to a temporary
folder; nothing is downloaded. Each row is one ``memkit plan --json`` run in this process:

- LoRA: ``--lora 8`` over the bf16 base; QLoRA: ``--lora 8 --quantize nf4`` (nf4, double quantization, bf16
  compute), both on every block linear (q, k, v, o, gate, up, down), AdamW on the adapters;
- ``--global-batch 1 --seq-len 2048``: the smallest step that answers "does it fit, with what
  checkpointing"; ``--precision bf16-mixed``, as the QLoRA recipes train (Hugging Face's ``bf16=True``:
  autocast over the bf16 base and peft's fp32 adapters), AdamW only (lighter optimizers save little on
  adapters); ``--refine-limit 2`` bounds the
  block-by-block checkpointing search;
- cards by name (RTX-4090, A6000, A100-80GB): the CUDA context and a 5 % reserve are taken off, then a 10 %
  margin; the 70B QLoRA row on two RTX-4090s is FSDP2's (``--gpus 2 --strategy fsdp2``, bf16 storage).

    python benchmarks/bench_peft_plans.py              # every row (about 10 minutes on 2 cores)
    python benchmarks/bench_peft_plans.py llama2-7b    # one model's rows
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

#: name -> LlamaConfig fields (the published shapes).
_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "vocab_size")  # fmt: skip
SHAPES = {
    "llama2-7b": dict(zip(_FIELDS, (4096, 11008, 32, 32, 32, 32000), strict=True)),
    "llama3-8b": dict(zip(_FIELDS, (4096, 14336, 32, 32, 8, 128256), strict=True), rope_theta=500000.0),
    "llama2-13b": dict(zip(_FIELDS, (5120, 13824, 40, 40, 40, 32000), strict=True)),
    "llama2-70b": dict(zip(_FIELDS, (8192, 28672, 80, 64, 8, 32000), strict=True)),
}
SETUPS = {"LoRA": ["--lora", "8"], "QLoRA": ["--lora", "8", "--quantize", "nf4"]}
CARDS = {"24 GB": ["--gpu", "RTX-4090"], "48 GB": ["--gpu", "A6000"], "80 GB": ["--gpu", "A100-80GB"]}
#: What `plan_fit` says when nothing fits: the leanest plan it tried and its peak.
LEANEST = r"the leanest plan \(micro-batch 1, (\w+) checkpointing, \w+\) peaks at ([\d.]+ \w+)"
#: The FSDP+QLoRA anchor: a 70B model on two 24 GB cards.
EXTRA = [("llama2-70b", "QLoRA", "2 x 24 GB", ["--gpu", "RTX-4090", "--gpus", "2", "--strategy", "fsdp2"])]


def write_configs(folder: Path) -> None:
    from transformers import LlamaConfig

    for name, shape in SHAPES.items():
        config = LlamaConfig(**shape, max_position_embeddings=4096, dtype="bfloat16", use_cache=False)
        config.save_pretrained(folder / name)


def plan(folder: Path, model: str, setup: str, card_flags: list[str]) -> tuple[str, float]:
    """One ``memkit plan``: its answer in a few words, and the seconds it took."""
    from lightning_memkit._breakdown import format_bytes
    from lightning_memkit.cli import main

    gpus = card_flags[card_flags.index("--gpus") + 1] if "--gpus" in card_flags else "1"  # a sequence each
    argv = ["plan", "--model", f"hf:{folder / model}", *card_flags, "--global-batch", gpus,
            "--seq-len", "2048", "--precision", "bf16-mixed", "--optimizer", "adamw",
            "--refine-limit", "2", *SETUPS[setup], "--json"]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    seconds = time.perf_counter() - start
    if status != 0:  # plan_fit's refusal: the leanest plan it tried, and its peak
        leanest = re.search(LEANEST, err.getvalue())
        return (
            f"does not fit | {leanest[1]}: {leanest[2]} (the leanest)" if leanest else "does not fit |",
            seconds,
        )
    found = json.loads(out.getvalue())
    peaks = {a["checkpointing"]: a["peak"] for a in found["alternatives"] if a["micro_batch_size"] == 1}
    how = f"{found['checkpointing']} checkpointing, {found['precision']}"
    seen = ", ".join(f"{mode}: {format_bytes(peaks[mode])}" for mode in ("none", "full") if mode in peaks)
    return f"fits: {format_bytes(found['estimated_peak'])} ({how}) | {seen}", seconds


def main(names: list[str]) -> None:
    warnings.filterwarnings("ignore")
    rows = [(m, s, c, flags) for m in names or SHAPES for s in SETUPS for c, flags in CARDS.items()]
    rows += [row for row in EXTRA if row[0] in (names or SHAPES)]
    print("| model | set-up | card | memkit plan, 1 x 2048 tokens | peaks (checkpointing) | planned in |")
    print("|---|---|---|---|---|---:|")
    with tempfile.TemporaryDirectory() as root:
        write_configs(Path(root))
        for model, setup, card, flags in rows:
            answer, seconds = plan(Path(root), model, setup, flags)
            print(f"| {model} | {setup} | {card} | {answer} | {seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
