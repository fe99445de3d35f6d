"""Compiled bytecode kept under the arl cache when Python would not keep it.

Every arl process imports torch (and a rollout node transformers): thousands of modules. Python
normally caches their bytecode beside the sources (``__pycache__``), so a later process only
loads it. Where it cannot, each process compiles every module from source again: when
``PYTHONDONTWRITEBYTECODE`` (or ``-B``) is set, as many container images do, or when
site-packages cannot be written and was installed without bytecode. On one H100 machine set up
that way, ``import torch, transformers`` took 10-11 s in each process and 5.2 s with its bytecode
kept; compiling sources was 8 s of a warm engine start-up.

`cache_bytecode` is called first by arl's entry points (``python -m arl.launch``, ``arl-node``)
and by nothing a library user imports. In those two cases, and only when the bytecode of the
probe package (torch) is missing beside its source, it points Python's bytecode cache at

    <cache>/pycache/     (<cache>: $ARL_CACHE, else ~/.cache/arl)

(``sys.pycache_prefix``, which mirrors each source's absolute path below it and writes nothing
beside the sources), for this process and, through ``PYTHONPYCACHEPREFIX`` in the environment,
for every process it starts (nodes, inductor's compile workers, an inference server). Python
checks each cached file against its source's modification time as usual. ``ARL_PYCACHE=0`` turns
this off; a ``PYTHONPYCACHEPREFIX`` the user set is kept as it is. It takes ~100 MB for torch and
transformers, and the first run pays the compilation once.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from arl.cache import cache_root

OFF_ENV = "ARL_PYCACHE"
_OFF = ("0", "off", "false", "no")


def _bytecode_missing(probe: str) -> bool:
    """Whether Python would compile ``probe``'s ``__init__`` from source on each import: its
    cached bytecode is absent and either bytecode is not written or its folder is read-only."""
    try:
        spec = importlib.util.find_spec(probe)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.cached or not spec.origin:
        return False
    if os.path.exists(spec.cached):
        return False
    if sys.dont_write_bytecode:
        return True
    pycache = os.path.dirname(spec.cached)
    writable_dir = pycache if os.path.isdir(pycache) else os.path.dirname(spec.origin)
    return not os.access(writable_dir, os.W_OK)


def cache_bytecode(probe: str = "torch", cache_dir: str | None = None) -> Path | None:
    """Keep compiled bytecode under ``<cache>/pycache`` when ``probe``'s bytecode is not kept
    beside its source (see the module's docstring); returns the folder, or None when Python's
    own caching is left as it is. Call it before the heavy imports."""
    if os.environ.get(OFF_ENV, "").strip().lower() in _OFF:
        return None
    if sys.pycache_prefix is not None:  # the user's PYTHONPYCACHEPREFIX (or an earlier call)
        return Path(sys.pycache_prefix) if not sys.dont_write_bytecode else None
    if not _bytecode_missing(probe):
        return None
    prefix = cache_root(cache_dir) / "pycache"
    try:
        prefix.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a cache that cannot be written changes nothing
    if not os.access(prefix, os.W_OK):
        return None
    sys.pycache_prefix = str(prefix)
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return prefix
