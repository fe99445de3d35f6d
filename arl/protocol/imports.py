"""The import rule: which ``package.module:Name`` strings a launcher or a node may resolve.

A string resolves only to an object *defined* in a module under an allowed prefix:

- prefixes match whole dotted components: ``arl`` (or ``arl.``) allows ``arl`` and ``arl.x``,
  never ``arlfoo``;
- the module is checked before it is imported, so a refused module's code never runs;
- every step of the attribute path must itself be defined under a prefix (a module's
  ``__name__``, any other object's ``__module__``; an instance counts as defined where its
  class is), so ``arl.control.launcher:shutil.rmtree`` is refused although
  ``arl.control.launcher`` is allowed: ``shutil`` is only imported there;
- names are plain identifiers; dunder steps (``__globals__``, ``__main__``) are refused.

The launcher (config validation) and the nodes call the same `resolve_import`.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable
from typing import Any

from arl.protocol.errors import ErrorKind

RULE = (
    "an import string resolves only to an object defined in a module under "
    "cluster.allowed_import_prefixes (whole dotted components, no walking into other modules)"
)


class ImportRefused(PermissionError):
    """An import string that the import rule refuses (the message names the string and why)."""

    error_kind = ErrorKind.IMPORT_REFUSED


def normalize_prefixes(prefixes: Iterable[str]) -> tuple[str, ...]:
    """Prefixes without their trailing dot: ``arl.`` and ``arl`` are the same prefix."""
    return tuple(p.strip().rstrip(".") for p in prefixes)


def under_prefix(name: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted ``name`` equals an allowed prefix or lies below one (whole components)."""
    return any(p and (name == p or name.startswith(p + ".")) for p in normalize_prefixes(prefixes))


def _dunder(part: str) -> bool:
    return part.startswith("__") and part.endswith("__")


def split_target(target: str) -> tuple[str, list[str]]:
    """``pkg.module:A.b`` -> (``pkg.module``, [``A``, ``b``]); ValueError if malformed."""
    if not isinstance(target, str):
        raise ValueError(f"import string must be text, got {type(target).__name__}")
    module, sep, attr = target.partition(":")
    parts = attr.split(".")
    if (
        not sep
        or not all(p.isidentifier() for p in module.split("."))
        or not all(p.isidentifier() for p in parts)
    ):
        raise ValueError(
            f"import string {target!r} must look like 'package.module:Name' (dotted identifiers)"
        )
    return module, parts


def check_import(target: str, prefixes: Iterable[str]) -> tuple[str, list[str]]:
    """The checks that need no import; raises `ImportRefused` (or ValueError if malformed)."""
    prefixes = tuple(prefixes)
    module, parts = split_target(target)
    if not under_prefix(module, prefixes):
        raise ImportRefused(
            f"refusing to import {target!r}: module {module!r} is not under the allowed "
            f"prefixes {list(prefixes)}; add its prefix with --allow-import "
            f"(cluster.allowed_import_prefixes)"
        )
    bad = [p for p in (*module.split("."), *parts) if _dunder(p)]
    if bad:
        raise ImportRefused(f"refusing to import {target!r}: {bad[0]!r} is a dunder name; {RULE}")
    return module, parts


def _defined_in(obj: Any) -> str | None:
    """The module an object was defined in: a module's own name, else its ``__module__``."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    where = getattr(obj, "__module__", None)
    return where if isinstance(where, str) else None


def resolve_import(target: str, prefixes: Iterable[str], import_now: bool = True) -> Any:
    """The object ``target`` names, under the import rule; raises `ImportRefused` otherwise.

    With ``import_now=False`` only `check_import` runs (nothing is imported) and None returns.
    """
    prefixes = tuple(prefixes)
    module, parts = check_import(target, prefixes)
    if not import_now:
        return None
    obj: Any = importlib.import_module(module)
    path = module
    for i, part in enumerate(parts):
        path += (":" if i == 0 else ".") + part
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"import string {target!r}: {path!r} does not exist") from None
        where = _defined_in(obj)
        if where is None or not under_prefix(where, prefixes):
            raise ImportRefused(
                f"refusing to import {target!r}: {path!r} is defined in "
                f"{where or 'no module'!r}, which is not under the allowed prefixes "
                f"{list(prefixes)}; {RULE}"
            )
    return obj
