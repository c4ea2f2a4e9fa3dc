"""The native kernels' build: what the first one costs, in words, and where a finished one lies.

What it knows: the estimate, as plain text, so that `kvfence.config` can show it in `--kernels`' help without
importing torch (the launcher and the router of a deployment never load it), and the file torch's JIT builder
leaves for an extension, which an engine process imports directly once it exists. What it does not know: the
kernels' source, flags or functions (`kvfence.models.native_kernels`), or how to build (torch's `load_inline`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

NATIVE_BUILD_ESTIMATE = "30-60 s on two idle cores, a few minutes on a busy machine"  # how long the first build takes


def built_extension_path(name: str) -> Path:
    """Where torch's JIT builder (`torch.utils.cpp_extension.load_inline`) puts extension `name`'s module: its
    `_get_build_directory(name)` (the $TORCH_EXTENSIONS_DIR, else the user cache's torch_extensions/py<ver>_<accel>),
    then `<name>.so`; tests/test_native_build.py compares it with torch's own."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        cache = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
        root = os.path.join(cache, f"{python}_{accelerator}")
    return Path(root) / name / f"{name}.so"


def load_built_extension(name: str) -> Any | None:
    """Extension `name` as an earlier `load_inline` built it, imported straight from its file, or None when there is
    no such file or it does not import (then `load_inline` builds or repairs it, with its lock). The name carries a
    hash of the source and flags, so a file there is this source's build. Importing `torch.utils.cpp_extension`
    costs every engine process ~5 MiB of resident memory (it imports setuptools); this does not."""
    path = built_extension_path(name)
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module
