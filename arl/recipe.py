"""Recipes: a Python file defining ``make_config() -> Config`` (and optionally ``cpu_preset``).

`import_recipe` imports the file as a module; `load_recipe` returns its config. Both refuse a
file that is missing, cannot be imported, or builds something other than a `Config`, with a
`ConfigError` naming the file.
"""

import importlib.util
from pathlib import Path
from types import ModuleType

from arl.config import Config, ConfigError


def import_recipe(path: str) -> ModuleType:
    """Import the recipe file at ``path`` as a module (it must define ``make_config``)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(
            f"recipe {path!r} not found (expected a Python file such as recipes/gsm8k.py)"
        )
    spec = importlib.util.spec_from_file_location(f"arl_recipe_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"recipe {path!r} cannot be imported; is it a .py file?")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "make_config", None)):
        raise ConfigError(f"recipe {path!r} defines no make_config() function returning a Config")
    return module


def load_recipe(path: str, recipe: ModuleType | None = None) -> Config:
    """The ``make_config()`` of the recipe file at ``path`` (imported unless given)."""
    cfg = (recipe or import_recipe(path)).make_config()
    if not isinstance(cfg, Config):
        raise ConfigError(
            f"recipe {path!r}: make_config() returned {type(cfg).__name__}, not arl.config.Config"
        )
    return cfg
