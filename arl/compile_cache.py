"""Where ``torch.compile`` keeps what it compiled, so that a second run compiles nothing.

Inductor caches its generated code (the FX graph cache), AOTAutograd's forward/backward graphs
(the AOTAutograd cache) and the Triton kernels (under its cache folder) on disk, keyed by what
invalidates them: the graph, the input shapes and strides, the device, the torch and Triton
versions, inductor's settings. Its default folder is ``/tmp/torchinductor_<user>``, which a
reboot, a container or a fresh node empties; arl keeps it beside the converted models instead:

    <cache>/compile/torch-<torch version>/      (<cache>: $ARL_CACHE, else ~/.cache/arl)

one folder per torch version, so an upgrade starts a fresh one and the old one can be deleted
whole. `use_compile_cache` is called by every process that compiles, before its first compile
(the hf engine and the train ranks call it when they are built); a ``TORCHINDUCTOR_CACHE_DIR``
already set (by the user, or by an earlier compile in this process) is kept, never overwritten,
and so is a user's ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` or ``TORCHINDUCTOR_AUTOGRAD_CACHE=0``.
Settings go through the environment, so inductor's compile workers inherit them.

Dynamo still traces each compiled function on every run (seconds, not the minutes of code
generation), except those compiled through `arl.precompile`, which keeps them whole beside this
folder's contents (``precompiled/``); the CUDA graphs an engine captures are not cached (they
hold device addresses).
"""

from __future__ import annotations

import os
from pathlib import Path

from arl.cache import cache_root

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
# On by default in the torch versions arl supports; set in the environment too (read when
# inductor's config is first imported), so that compile workers make the same choice.
_ON_BY_DEFAULT = ("TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")


def compile_cache_dir(cache_dir: str | None = None, torch_version: str | None = None) -> Path:
    """``<cache>/compile/torch-<version>``: the compile cache arl uses for this torch."""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    # "2.11.0+cu130": the local part names the CUDA build, whose kernels differ: keep it.
    safe = "".join(c if c.isalnum() or c in ".+-_" else "_" for c in str(torch_version))
    return cache_root(cache_dir) / "compile" / f"torch-{safe}"


def use_compile_cache(cache_dir: str | None = None) -> str:
    """Point inductor's on-disk caches at `compile_cache_dir` unless ``TORCHINDUCTOR_CACHE_DIR``
    is already set, and Triton's (``TRITON_CACHE_DIR``, unless set) at inductor's folder for
    device 0 in it; turn the FX graph and AOTAutograd caches on unless the environment turns
    them off; returns the folder in use. Idempotent; call it before the first compile."""
    for name in _ON_BY_DEFAULT:
        os.environ.setdefault(name, "1")
    used = os.environ.get(CACHE_DIR_ENV)
    if not used:
        path = compile_cache_dir(cache_dir)
        path.mkdir(parents=True, exist_ok=True)
        os.environ[CACHE_DIR_ENV] = used = str(path)
    # Kernels arl launches through Triton itself (arl.engines.hf.kernels) are cached where
    # inductor keeps device 0's, not in Triton's default ~/.triton/cache (which is outside
    # ARL_CACHE, so an "empty cache" would not be one); a user's own setting is kept.
    os.environ.setdefault(TRITON_CACHE_ENV, os.path.join(used, "triton", "0"))
    return used
