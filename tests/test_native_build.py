"""An engine process imports the native kernels' finished build straight from torch's build directory.

`models.native_build.built_extension_path` must be the file torch's JIT builder writes (compared with torch's own
`_get_build_directory`), and once the kernels are built a fresh interpreter loads them without importing
`torch.utils.cpp_extension` (setuptools and friends: ~5 MiB of resident memory per engine process;
docs/benchmarks.md, "Memory of the runtime").
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

from kvfence.models import native_kernels
from kvfence.models.native_build import built_extension_path, load_built_extension

ROOT = Path(__file__).resolve().parent.parent


def _kernels_name() -> str:
    key = hashlib.sha256(native_kernels._SOURCE_FILE.read_text().encode()).hexdigest()[:12]
    return f"kvfence_native_kernels_{key}"


def test_the_path_is_torchs_build_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    name = _kernels_name()
    assert built_extension_path(name) == Path(_get_build_directory(name, False)) / f"{name}.so"


def test_the_path_follows_torch_extensions_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert built_extension_path("some_ext") == Path(_get_build_directory("some_ext", False)) / "some_ext.so"


def test_nothing_built_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert load_built_extension("kvfence_never_built") is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "broken.so").write_bytes(b"not an ELF file")
    assert load_built_extension("broken") is None  # then load_inline rebuilds it


def test_a_built_kernel_loads_without_torchs_builder() -> None:
    try:
        native_kernels.load()  # builds it here if this machine has not yet
    except native_kernels.NativeKernelsUnavailable as e:
        pytest.skip(f"native kernels unavailable: {e}")
    code = (
        "import sys\nfrom kvfence.models import native_kernels\nm = native_kernels.load()\n"
        "print(m.__name__, hasattr(m, 'llama_decode_layers'), 'torch.utils.cpp_extension' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == [_kernels_name(), "True", "False"]
