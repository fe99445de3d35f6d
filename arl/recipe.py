"""Recipes: a Python file defining ``make_config() -> Config`` (and optionally ``cpu_preset``).

`import_recipe` imports the file as a module; `load_recipe` returns its config; `apply_cpu_preset`
runs its preset. They refuse a file that is missing, cannot be imported, raises or exits while
it runs, or builds something other than a `Config`, with one `ConfigError` naming the file, the
line and the exception. The recipe's folder is first on ``sys.path`` while its code runs, as
with ``python path/to/recipe.py``, so a recipe can import a module beside it; `arl.launch` keeps
it there, and on the nodes' ``PYTHONPATH``, for the whole run.
"""

import contextlib
import importlib.machinery
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from arl.config import Config, ConfigError
from arl.config.rules import call_problem


def import_recipe(path: str) -> ModuleType:
    """Import the recipe file at ``path`` as a module (it must define ``make_config``)."""
    file = Path(path)
    if file.is_dir():
        inside = sorted(str(p) for p in file.glob("*.py"))
        raise ConfigError(
            f"recipe {path!r} is a directory, not a Python file; name the recipe file"
            + (f", e.g. {inside[0]}" if inside else " (this directory holds no .py file)")
        )
    if not file.is_file():
        raise ConfigError(
            f"recipe {path!r} not found (expected a Python file such as recipes/gsm8k.py)"
        )
    # An explicit source loader reads the file whatever its name ends in, as `python FILE` does.
    name = f"arl_recipe_{file.stem}"
    loader = importlib.machinery.SourceFileLoader(name, str(file))
    spec = importlib.util.spec_from_file_location(name, file, loader=loader)
    assert spec is not None  # given a loader, a spec is always made
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as `python FILE` registers __main__: dataclasses and pickle
    # look a class's module up there.
    sys.modules[name] = module
    try:
        _run(path, spec.loader.exec_module, module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    if not callable(getattr(module, "make_config", None)):
        raise ConfigError(f"recipe {path!r} defines no make_config() function returning a Config")
    # Checked before they run: a call that fails on its arguments would be reported as raised
    # inside arl rather than as the recipe's own mistake.
    for name, args in (("make_config", ()), ("cpu_preset", ("cfg",))):
        if hasattr(module, name) and (problem := call_problem(getattr(module, name), args)):
            raise ConfigError(f"recipe {path}: {name}() {problem}")
    return module


def load_recipe(path: str, recipe: ModuleType | None = None) -> Config:
    """The ``make_config()`` of the recipe file at ``path`` (imported unless given)."""
    cfg = _run(path, (recipe or import_recipe(path)).make_config)
    if not isinstance(cfg, Config):
        raise ConfigError(
            f"recipe {path!r}: make_config() returned {type(cfg).__name__}, not arl.config.Config"
        )
    return cfg


def apply_cpu_preset(path: str, recipe: ModuleType, cfg: Config) -> bool:
    """Run the recipe's ``cpu_preset(cfg)`` on ``cfg``; False when it defines none."""
    preset = getattr(recipe, "cpu_preset", None)
    if preset is None:
        return False
    _run(path, preset, cfg)
    return True


def _run(path: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, the recipe's own code, with any exception it raises (or an exit) turned
    into one `ConfigError` naming the file and the line where it happened."""
    file = Path(path)
    with _folder_first_on_path(file.resolve().parent):
        try:
            return fn(*args)
        except KeyboardInterrupt:
            raise
        except ConfigError as e:  # already a user's message (a bad key, a nested recipe)
            raise ConfigError(f"recipe {path}{_line(file, e)}: {e}") from None
        except SystemExit as e:
            raise ConfigError(
                f"recipe {path}{_line(file, e)} called sys.exit({e.code!r}) while loading "
                "(SystemExit); a recipe must define make_config() and return, not exit"
            ) from None
        except BaseException as e:
            where = f"recipe {path}{_line(file, e)}"
            raise ConfigError(f"{where} raised {_describe(file, e)}{_raised_at(file, e)}") from None


def _line(file: Path, e: BaseException) -> str:
    """`` line N``: where in ``file`` ``e`` happened (the deepest frame there), or ""."""
    here = file.resolve()
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve() == here:
        return f" line {e.lineno}"
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f for f in tb if Path(f.filename).resolve() == here]
    return f" line {frames[-1].lineno}" if frames else ""


def _raised_at(file: Path, e: BaseException) -> str:
    """`` (raised at FILE:LINE)`` when ``e`` was raised outside the recipe (a module it
    imports, a library), else ""."""
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve() == file.resolve():
        return ""  # the recipe's own line is already named; the frame is the import machinery
    tb = traceback.extract_tb(e.__traceback__)
    if not tb or Path(tb[-1].filename).resolve() == file.resolve():
        return ""
    if tb[-1].filename.startswith("<frozen "):  # Python's import machinery: no place to look
        return ""
    return f" (raised at {tb[-1].filename}:{tb[-1].lineno})"


def _describe(file: Path, e: BaseException) -> str:
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve() == file.resolve():
        return f"SyntaxError: {e.msg}"  # str(e) would repeat the file and line
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def _folder_first_on_path(folder: Path) -> Iterator[None]:
    entry = str(folder)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        sys.path.remove(entry)  # the first occurrence: the one inserted above
