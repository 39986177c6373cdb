"""``--model hf:<directory or org/name>``: a Hugging Face architecture built from its ``config.json``.

The config is read from a directory, or for an ``org/name`` from the local Hugging Face cache only
(``HF_HUB_CACHE``, ``HF_HOME``), with the hub offline and no repository code run: planning a run never
downloads anything. The model is built with ``AutoModelForCausalLM`` (``AutoModel`` for a family without a
causal-LM head) on the meta device, in the dtype the config records. Where it cannot be built here, the
`UsageError` names the three ways on (`_hf_unavailable`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_memkit.cli._args import UsageError, usage_error

__all__ = ["HF_PREFIX", "config_dtype", "hf_from_config"]

#: ``--model hf:<directory or org/name>``: a Hugging Face architecture from its ``config.json``.
HF_PREFIX = "hf:"


def hf_from_config(spec: str) -> nn.Module:
    """The model ``hf:<directory or org/name>`` describes: its ``config.json`` read (an ``org/name`` from
    the local cache only), then ``AutoModelForCausalLM.from_config`` (``AutoModel`` for a family without a
    causal-LM head) on the meta device: random weights, nothing allocated or downloaded. The parameters
    are in the ``dtype`` (``torch_dtype``) the config records, fp32 where it records none, as
    ``from_pretrained`` and ``from_config`` load them: Lightning's ``32-true`` and mixed precisions train
    them so, a ``-true`` 16-bit precision converts them (`weights_note` says which)."""
    target = spec[len(HF_PREFIX) :].strip()
    if not target:
        raise UsageError(
            f"--model {spec!r} names no model; give hf:<directory holding config.json> or hf:<org/name> "
            "from the local Hugging Face cache"
        )
    path = Path(target).expanduser()
    local = path.is_dir() or target.startswith((".", "~", os.sep)) or target.count("/") > 1
    if local and not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise UsageError(
            f"--model {spec}: {path} {what}; give the directory holding the model's config.json "
            "(config.save_pretrained(directory) writes one)"
        )
    if local and not (path / "config.json").is_file():
        raise UsageError(
            f"--model {spec}: {path} has no config.json, which hf: builds the model from; give the directory "
            "a model or its config was saved to (config.save_pretrained(directory) writes one)"
        )
    try:
        import transformers
    except ImportError:
        raise UsageError(
            _hf_unavailable(spec, target, "transformers is not installed (pip install transformers)")
        ) from None
    source = str(path / "config.json") if local else target
    # trust_remote_code=False: a config that needs its repository's code is refused, never run or asked
    # about; local_files_only and the hub offline: no request is made, whatever HF_HUB_OFFLINE says.
    with (
        _hf_offline(),
        usage_error(
            ValueError,
            OSError,
            AttributeError,  # a field transformers cannot read ("torch_dtype": "auto" saved in the file)
            TypeError,
            context=f"--model {spec}: reading {source} failed",
            fix="hf: builds the model families transformers ships (custom code is not run)",
        ),
    ):
        if local:
            config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
        else:
            cache = _hf_cache()
            try:
                config = transformers.AutoConfig.from_pretrained(
                    target, local_files_only=True, cache_dir=cache, trust_remote_code=False
                )
            except OSError as e:
                why = f"{target!r} is not a directory, nor in the local Hugging Face cache ({cache})"
                raise UsageError(_hf_unavailable(spec, target, why)) from e
    causal = type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
    with (
        _hf_offline(),
        usage_error(
            context=f"--model {spec}: building {auto.__name__}.from_config(<{source}>) failed",
            fix=f"check {source} (build it in Python for the traceback)",
        ),
        torch.device("meta"),
    ):
        return auto.from_config(config, dtype=config_dtype(config), trust_remote_code=False)


def config_dtype(config: Any) -> torch.dtype:
    """The weights' dtype a Hugging Face config records (``dtype``, formerly ``torch_dtype``); fp32 where it
    records none or one that is not a floating-point dtype (``"auto"``)."""
    # torch_dtype only where dtype is not there: transformers >= 4.56 logs its deprecation on reading it
    recorded = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(recorded, str):
        recorded = getattr(torch, recorded.removeprefix("torch."), None)
    return recorded if isinstance(recorded, torch.dtype) and recorded.is_floating_point else torch.float32


@contextlib.contextmanager
def _hf_offline() -> Iterator[None]:
    """huggingface_hub in offline mode, where every request it would make raises: ``local_files_only``
    alone still lets it fetch what it wants besides the files (its user-agent's registry)."""
    from huggingface_hub import constants

    offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = offline


def _hf_cache() -> str:
    """The Hugging Face hub cache the environment names now (``HF_HUB_CACHE``, else ``HF_HOME``/hub, else
    huggingface_hub's default): huggingface_hub reads the variables once, when first imported."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hf_unavailable(spec: str, target: str, why: str) -> str:
    """One line for an ``hf:`` model that cannot be built here: why, that nothing is downloaded, and the
    three ways on: a directory with its config.json, a preset of the same shape, a three-line factory."""
    factory = (
        "# mymodels.py | from transformers import AutoConfig, AutoModelForCausalLM | def build(): return "
        f'AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("{target}"))'
    )
    return (
        f"--model {spec}: {why}, and nothing is downloaded; give hf:<directory> holding its config.json "
        f"(hf download {target} config.json --local-dir <directory>), a preset of the same shape "
        "(llama-7b is LLaMA-2-7B's at a 2,048-token context, llama-70b LLaMA-2-70B's, gpt2 ... gpt2-xl "
        f"GPT-2's), or write the factory [{factory}] and give --model mymodels:build"
    )
