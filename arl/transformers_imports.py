"""Importing transformers without scikit-learn where transformers would import it needlessly.

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
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

MODULE = "transformers.generation.candidate_generator"
# The module-level import as transformers 5.x (up to 5.2x) wrote it.
EAGER_IMPORT = "\nif is_sklearn_available():\n    from sklearn.metrics import roc_curve\n"
_lock = threading.Lock()  # the check is swapped for one import: one thread at a time
_tried = False  # decided once per process (its three callers each ask)


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
