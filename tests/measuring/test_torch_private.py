"""`_measuring._torch_private`: a torch that moves a private entry point the tracker binds gets a fallback
or an error naming the entry point and the torch version, never a broken import."""

import re

import pytest
import torch

from lightning_memkit._measuring import _torch_private


def test_a_missing_entry_point_is_none_not_an_import_error():
    assert _torch_private._find("torch._no_such_module", "try_get") is None
    assert _torch_private._find("torch._guards", "NoSuchContext", "try_get") is None
    assert _torch_private._find("torch._guards", "CompileContext", "try_get") is not None


def test_a_required_entry_point_torch_lacks_names_it_and_the_torch_version(monkeypatch):
    monkeypatch.setattr(_torch_private, "_top_hooks", None)
    version = re.escape(torch.__version__)
    with pytest.raises(RuntimeError, match=rf"_top_saved_tensors_default_hooks.*torch {version} "):
        _torch_private.top_saved_tensors_hooks()


def test_the_entry_points_this_torch_has_are_bound():
    assert not _torch_private.compiling()
    assert _torch_private.current_autograd_node() is None
    assert _torch_private.top_saved_tensors_hooks() is None
    assert _torch_private.non_overlapping_and_dense(torch.ones(2, 3))
    assert not _torch_private.wraps_tensors(torch.Tensor)
