"""The arl cache directory, shared by what arl keeps between runs: converted models and their
wheels (`arl.engines.model`), compiled code (`arl.compile_cache`, `arl.precompile`) and, where
Python keeps none, bytecode (`arl.bytecode`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | None = None) -> Path:
    """The arl cache directory: ``cache_dir``, else ``$ARL_CACHE``, else ``~/.cache/arl``."""
    root = cache_dir or os.environ.get("ARL_CACHE") or "~/.cache/arl"
    return Path(root).expanduser()
