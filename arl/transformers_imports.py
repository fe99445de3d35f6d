"""Importing transformers without the work its first import does needlessly: scikit-learn
(`defer_sklearn`), and a scan of every installed distribution (`cached_distributions`);
`prepare_transformers_import` does both, before a process's first transformers import.

From some 5.x release until 5.2x, ``transformers.generation.candidate_generator`` imports
``sklearn.metrics`` at module level wherever scikit-learn is installed, and importing either
``AutoTokenizer`` or ``AutoModelForCausalLM`` imports that module. scikit-learn (and the pandas
and scipy it imports) then costs every arl node ~1 s of its start-up (transformers 5.17 on the
2-core CPU VM: ``from transformers import AutoTokenizer, AutoModelForCausalLM`` 3.0 s with it,
2.1 s without), on the critical path of both the engine and the train rank. scikit-learn is only
used there for ``roc_curve``, by assisted generation's confidence threshold, which arl never
runs. Later transformers (5.25) import it inside the function that uses it.

`defer_sklearn` does for the affected releases what the later ones do: it imports
``candidate_generator`` with transformers' availability check answering no for that one import,
then puts the check back and gives the module a ``roc_curve`` that imports scikit-learn at its
first call. Assisted generation still works, paying scikit-learn's import when it is used. It
acts only where the module's source holds the module-level import exactly as those releases
wrote it, scikit-learn is installed, and nothing imported the module yet; anywhere else it
imports nothing and returns False. Called by arl's node roles before their first transformers
import (the rollout node's setup, the hf engine's load, the train rank's model load).

Up to 5.2x as well, ``transformers.utils.import_utils`` calls
``importlib.metadata.packages_distributions()`` when it is imported: for each installed
distribution without a ``top_level.txt`` (most wheels built by modern backends, torch among
them) it reads the ``RECORD`` and stats every file it lists: on the H100 machine (transformers
5.17, Python 3.12, 78 such distributions) 27k ``stat`` calls in every arl process that imports
transformers. Timed there on a fresh machine, ``from transformers import AutoModelForCausalLM,
AutoTokenizer`` took 8.8 s plain, 8.2 s computing and keeping the mapping, 7.4 s reading it
back; in warm start-ups 0.2-0.3 s of the train rank's load and of the rollout node's imports.
Later releases call it lazily, after trying the import name. `cached_distributions` computes the
mapping once per environment and keeps it under ``ARL_CACHE``
(``python/distributions-<key>.json``), keyed by the Python version and the distributions'
metadata folders on each ``sys.path`` entry (which installing, upgrading or removing a package
changes); while transformers' utilities are first imported, ``packages_distributions`` answers
from it, then the original is put back.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from arl.cache import cache_root

MODULE = "transformers.generation.candidate_generator"
# The module-level import as transformers 5.x (up to 5.2x) wrote it.
EAGER_IMPORT = "\nif is_sklearn_available():\n    from sklearn.metrics import roc_curve\n"
_lock = threading.Lock()  # the check is swapped for one import: one thread at a time
_tried = False  # decided once per process (its three callers each ask)
_tried_distributions = False


def prepare_transformers_import() -> None:
    """`cached_distributions`, then `defer_sklearn`: what arl does before a process's first
    transformers import (see the module docstring)."""
    cached_distributions()
    defer_sklearn()


def cached_distributions(cache_dir: str | None = None) -> bool:
    """Import ``transformers.utils`` with ``importlib.metadata.packages_distributions``
    answered from ``ARL_CACHE`` (computed and kept there on a first use in this environment),
    then put the original back; returns whether it did. Where transformers is imported already
    or is not installed it does nothing; where the import fails the error is transformers' own
    to raise later, and nothing stays changed."""
    global _tried_distributions
    with _lock:
        if _tried_distributions or "transformers.utils" in sys.modules:
            return False
        _tried_distributions = True
        if importlib.util.find_spec("transformers") is None:
            return False
        try:
            mapping = distributions_mapping(cache_dir)
        except Exception:  # noqa: BLE001 - transformers' own call meets it, if it recurs
            return False
        original = importlib.metadata.packages_distributions

        def from_cache() -> dict[str, list[str]]:
            return {name: list(dists) for name, dists in mapping.items()}

        importlib.metadata.packages_distributions = from_cache
        try:
            importlib.import_module("transformers.utils")
        except Exception:  # noqa: BLE001 - not this function's to report (see the docstring)
            return False
        finally:
            importlib.metadata.packages_distributions = original
        return True


def distributions_mapping(cache_dir: str | None = None) -> dict[str, list[str]]:
    """``importlib.metadata.packages_distributions()`` for this environment, from its file
    under the cache when one was written, else computed and written there (atomically; a
    cache that cannot be written only costs the computation)."""
    path = cache_root(cache_dir) / "python" / f"distributions-{environment_key()}.json"
    try:
        loaded = json.loads(path.read_text())
        if isinstance(loaded, dict) and all(isinstance(v, list) for v in loaded.values()):
            return loaded
    except (OSError, ValueError):
        pass
    mapping = {
        name: list(dists) for name, dists in importlib.metadata.packages_distributions().items()
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(mapping, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
    return mapping


def environment_key() -> str:
    """What `distributions_mapping` depends on: the interpreter, and each ``sys.path`` entry
    with the distributions' metadata it holds (``*.dist-info``, ``*.egg-info``: installing,
    upgrading or removing one adds or renames an entry), or a file entry's modification time."""
    entries: list[Any] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.curdir)
        try:
            if os.path.isdir(path):
                names = sorted(
                    n for n in os.listdir(path) if n.endswith((".dist-info", ".egg-info"))
                )
                entries.append([path, names])
            else:
                entries.append([path, os.stat(path).st_mtime_ns])
        except OSError:
            entries.append([path, None])
    blob = json.dumps([sys.implementation.cache_tag, sys.version, entries]).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


def defer_sklearn() -> bool:
    """Import ``candidate_generator`` without scikit-learn where it would import it at module
    level; returns whether it did (see the module docstring). Where that import fails, nothing
    is changed: transformers' own import raises the same error where it is needed."""
    global _tried
    with _lock:
        if _tried:
            return False
        _tried = True
        return _defer()


def _defer() -> bool:
    if MODULE in sys.modules or "sklearn" in sys.modules:
        return False
    source = _source()
    if source is None or EAGER_IMPORT not in source:
        return False
    if importlib.util.find_spec("sklearn") is None:
        return False  # not installed: transformers' own check says no already
    import transformers.utils as utils

    available = utils.is_sklearn_available

    def not_now() -> bool:
        return False

    utils.is_sklearn_available = not_now
    try:
        module = importlib.import_module(MODULE)
    except Exception:  # noqa: BLE001 - not this function's to report (see the docstring)
        return False
    finally:
        utils.is_sklearn_available = available
        # Whatever imported the check by name meanwhile gets the real one back.
        for name, mod in list(sys.modules.items()):
            held = getattr(mod, "__dict__", {}).get("is_sklearn_available")
            if name.startswith("transformers") and held is not_now:
                mod.is_sklearn_available = available
    module.roc_curve = _roc_curve
    return True


def _roc_curve(*args: Any, **kwargs: Any) -> Any:
    """``sklearn.metrics.roc_curve``, imported at the first call."""
    from sklearn.metrics import roc_curve

    return roc_curve(*args, **kwargs)


def _source() -> str | None:
    """``candidate_generator``'s source, found without importing transformers."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "generation" / "candidate_generator.py"
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            continue
    return None
