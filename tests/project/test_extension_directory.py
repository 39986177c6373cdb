"""The counting allocator's extension is compiled in a folder of each checkout's own: two checkouts on one
machine (a clean CI clone beside a working copy) never rebuild each other's or wait on one lock."""

from pathlib import Path

from lightning_memkit.testing import extension_directory


def test_each_checkout_builds_in_its_own_folder_unless_torch_extensions_dir_says(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    one = extension_directory(Path("/checkout/one/lightning_memkit/csrc/counting_allocator.cpp"))
    two = extension_directory(Path("/checkout/two/lightning_memkit/csrc/counting_allocator.cpp"))
    assert one != two and one.is_dir() and two.is_dir()
    assert one.parent == two.parent == tmp_path / "torch_extensions"
    assert one == extension_directory(Path("/checkout/one/lightning_memkit/csrc/counting_allocator.cpp"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "chosen"))
    assert extension_directory(Path("/checkout/one/lightning_memkit/csrc/counting_allocator.cpp")) is None
