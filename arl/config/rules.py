"""Rules on single config fields, declared beside each field in `arl.config.tree`
(``_f(..., rule=Range(lo=0, lo_open=True))``) and checked for every field by
`arl.config.validate.field_problems`; ``--help`` shows what a rule allows.

A rule's `problem(value, cfg)` says why a value is refused ("" when it is not); the walker names
the key and the value. A field typed ``X | None`` skips its rule when none. Plug-in names are
checked against the plug-in's own registry (`OneOf`), read when validation asks, so this
package imports no plug-in and a plug-in registered there is accepted without an edit here.
An import string's check, `import_problem`, is here with its rule (`ImportPath`); the rules
between fields (`arl.config.validate`) call it too.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import attrs

from arl.config.backend import engine_names, parse_backend
from arl.config.errors import ConfigError
from arl.config.registry import registry_names
from arl.protocol.imports import ImportRefused, resolve_import, split_target, under_prefix


@attrs.frozen
class Range:
    """A number within bounds (each optional, open or closed); ``inf`` lets infinity through
    as "no limit" (every other float field must be finite); ``note`` explains the bound."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    inf: bool = False
    text: str = ""  # the bound as the message says it, where the generated form is unclear

    def describe(self) -> str:
        """The bound as a message states it: ``must be > 0``, ``must be in (0, 1]``."""
        if self.text:
            return self.text
        if self.hi is None:
            return f"must be {'>' if self.lo_open else '>='} {self.lo}"
        if self.lo is None:
            return f"must be {'<' if self.hi_open else '<='} {self.hi}"
        left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
        return f"must be in {left}{self.lo}, {self.hi}{right}"

    def problem(self, value: Any, cfg: Any) -> str:
        if isinstance(value, float) and math.isinf(value) and self.inf and value > 0:
            return ""
        lo_ok = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        hi_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return "" if lo_ok and hi_ok else self.describe()


def positive(note: str = "", *, inf: bool = False) -> Range:
    """A number > 0 (``inf``: infinity means no limit)."""
    return Range(lo=0, lo_open=True, note=note, inf=inf)


def at_least_0(note: str = "") -> Range:
    """A number >= 0."""
    return Range(lo=0, note=note)


def unit(*, hi_open: bool = False, note: str = "") -> Range:
    """A fraction in [0.0, 1.0] (or [0.0, 1.0))."""
    return Range(lo=0.0, hi=1.0, hi_open=hi_open, note=note)


@attrs.frozen
class Holds:
    """A value for which ``test`` holds, else ``why`` (a plain name, a non-empty list)."""

    test: Callable[[Any], bool]
    why: str
    note: str = ""

    def describe(self) -> str:
        return self.why

    def problem(self, value: Any, cfg: Any) -> str:
        return "" if self.test(value) else self.why


@attrs.frozen
class OneOf:
    """A plug-in's name: a key of the registry at ``module:attribute`` (or one of ``extra``,
    such as ``auto``)."""

    registry: str
    extra: tuple[str, ...] = ()
    note: str = ""

    def choices(self) -> list[str]:
        """The names allowed now: ``extra``, then the registry's in its order."""
        return [*self.extra, *registry_names(self.registry)]

    def describe(self) -> str:
        return f"choose one of {', '.join(self.choices())}"

    def problem(self, value: Any, cfg: Any) -> str:
        return "" if value in self.choices() else self.describe()


def import_problem(target: str, prefixes: list[str] | tuple[str, ...]) -> str:
    """Why ``target`` may not be used under ``prefixes`` ("" when it may), by the import rule
    that nodes apply too (`arl.protocol.imports`). A module under a prefix is imported here,
    so that an attribute walking out of it is refused before any node starts."""
    try:
        module, _ = split_target(target)
    except ValueError:
        return "must be an import path module:attribute (dotted identifiers)"
    if not under_prefix(module, prefixes):
        return (
            f"module {module!r} is not under cluster.allowed_import_prefixes={list(prefixes)}; "
            "add its prefix there (nodes and the launcher import only from those)"
        )
    try:
        resolve_import(target, prefixes)
    except ImportRefused as e:
        return str(e).removeprefix(f"refusing to import {target!r}: ")
    except AttributeError as e:  # raised by resolve_import, naming the missing step
        return str(e).removeprefix(f"import string {target!r}: ")
    except Exception as e:  # the module itself fails to import, or the name is missing
        return f"cannot be imported: {type(e).__name__}: {e}"
    return ""


def call_problem(obj: Any, args: tuple[str, ...], kwargs: tuple[str, ...] = ()) -> str:
    """Why ``obj`` cannot be called as arl calls it, with the positional ``args`` and keyword
    ``kwargs`` named here ("" when it can): found at launch, not in the nodes' first call."""
    call = ", ".join([*args, *(f"{k}=..." for k in kwargs)])
    if not callable(obj):
        return (
            f"is not callable (an object of type {type(obj).__name__}); arl calls it with ({call})"
        )
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return ""
    try:
        signature.bind(*args, **dict.fromkeys(kwargs))
    except TypeError as e:
        plain = signature.replace(  # the names and defaults are what matter here
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        return f"arl calls it with ({call}), but its signature is {plain} ({e})"
    return ""


@attrs.frozen
class ImportPath:
    """An import string ``module:attribute`` under ``cluster.allowed_import_prefixes``, imported
    to prove it resolves (``optional``: empty means not used); ``called_with``: the positional
    arguments arl calls it with, so that one which cannot take them is refused here."""

    optional: bool = False
    note: str = ""
    called_with: tuple[str, ...] | None = None

    def describe(self) -> str:
        return "an import path module:attribute" + (" or empty" if self.optional else "")

    def problem(self, value: Any, cfg: Any) -> str:
        if self.optional and not value:
            return ""
        prefixes = cfg.cluster.allowed_import_prefixes
        problem = import_problem(value, prefixes)
        if problem or self.called_with is None:
            return problem
        return call_problem(resolve_import(value, prefixes), self.called_with)


@attrs.frozen
class BackendString:
    """An engine placement ``ENGINE:SPEC`` of one role (`arl.config.backend.parse_backend`)."""

    role: str
    note: str = ""
    names_value = True  # parse_backend's message quotes the string itself

    def describe(self) -> str:
        return f"ENGINE one of {', '.join(engine_names(self.role))}"

    def problem(self, value: Any, cfg: Any) -> str:
        try:
            parse_backend(value, self.role)  # type: ignore[arg-type]
        except ConfigError as e:
            return str(e)
        return ""


Rule = Range | Holds | OneOf | ImportPath | BackendString
