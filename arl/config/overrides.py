"""Dotted overrides, ``section.key=value`` as the command line gives them, with type conversion
and the nearest valid key suggested for an unknown one."""

import copy
import difflib
import math
import types
from typing import Any, Literal, Union, get_args, get_origin

import attrs
import yaml

from arl.config.backend import parse_backend
from arl.config.errors import ConfigError
from arl.config.rules import BackendString
from arl.config.tree import Config, field_keys
from arl.config.validate import show_value, type_name

# Names a user brings from the README ("eta") or other trainers, for which the nearest key by
# spelling is a wrong one (rollout.eta -> rollout.reward, actor.learning_rate -> min_lr_ratio).
_OTHER_NAMES = {
    "eta": "rollout.max_head_offpolicyness",
    "learning_rate": "actor.lr",
    "model": "actor.path",
    "model_path": "actor.path",
}


def _unknown_key(key: str, keys: dict[str, attrs.Attribute]) -> ConfigError:
    sections = [s.name for s in attrs.fields(Config)]
    if key in sections:
        example = next(k for k in keys if k.startswith(key + "."))
        return ConfigError(
            f"{key!r} is a section, not a key; set one of its fields, e.g. {example}=..."
            " (python -m arl.launch --help lists them)"
        )
    msg = f"unknown config key {key!r}"
    other = _OTHER_NAMES.get(key.rpartition(".")[2].lower())
    if other is not None:
        return ConfigError(f"{msg}; did you mean {other!r}?")
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:  # a bare field name, e.g. 'lr' for 'actor.lr'
        tail = key.rpartition(".")[2]
        close = [k for k in keys if k.endswith("." + tail)][:1]
    if close:
        return ConfigError(f"{msg}; did you mean {close[0]!r}?")
    return ConfigError(f"{msg}; keys are section.field with section one of {', '.join(sections)}")


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _split_list(text: str) -> list[str]:
    """Split ``[a, b]`` or ``a,b`` on commas outside quotes; quotes around an item are dropped."""
    text = text.strip()
    if text.startswith("[") != text.endswith("]"):
        raise ValueError(f"unbalanced brackets in {text!r}; write [a, b] or a,b")
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text.strip():
        return []
    items, cur, quote = [], "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ",":
            items.append(cur)
            cur = ""
            continue
        cur += ch
    if quote:
        raise ValueError(f"unclosed {quote} in {text!r}")
    items.append(cur)
    out = []
    for item in (i.strip() for i in items):
        if len(item) >= 2 and item[0] == item[-1] and item[0] in "'\"":
            item = item[1:-1]
        out.append(item)
    return out


def convert_value(text: str, tp: Any) -> Any:
    """Convert override text to ``tp``; raises ValueError with the expected type on failure."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if text.strip().lower() in ("none", "null", "~"):
            return None
        (inner,) = (a for a in args if a is not type(None))  # fields are only ever X | None
        return convert_value(text, inner)
    if origin is Literal:
        if text not in [str(a) for a in args]:
            raise ValueError(f"choose one of {', '.join(str(a) for a in args)}")
        return next(a for a in args if str(a) == text)
    if origin is dict:
        try:
            value = yaml.safe_load(text) if text.strip() else {}
        except yaml.YAMLError:
            raise ValueError("not a map such as {name: value, other: 2}") from None
        if not isinstance(value, dict):
            raise ValueError("not a map such as {name: value, other: 2}")
        return value
    if origin in (list, tuple):
        items = [convert_value(item, args[0]) for item in _split_list(text)]
        return items if origin is list else tuple(items)
    if tp is bool:
        low = text.strip().lower()
        if low not in _TRUE + _FALSE:
            raise ValueError("use true/false, yes/no or 1/0")
        return low in _TRUE
    if tp is int:
        try:
            return int(text)
        except ValueError:
            pass
        try:
            f = float(text)  # accept 1e6 or 4.0, not 1.5
        except ValueError:
            raise ValueError("not a number") from None
        if not f.is_integer():
            raise ValueError("not a whole number")
        return int(f)
    if tp is float:
        try:
            f = float(text)
        except ValueError:
            raise ValueError("not a number") from None
        if math.isnan(f):
            raise ValueError("nan is not allowed")
        return f
    if tp is str:
        return text
    raise ValueError(f"no conversion for {tp}")  # pragma: no cover - every field type is above


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Return a copy of ``cfg`` with ``key=value`` overrides applied, each converted to its type."""
    cfg = copy.deepcopy(cfg)
    keys = field_keys()
    for item in overrides:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(
                f"override {item!r} is not key=value; write e.g. actor.lr=1e-5 "
                "(section.field=value, no spaces around '=')"
            )
        if key not in keys:
            raise _unknown_key(key, keys)
        field = keys[key]
        try:
            value = convert_value(text, field.type)
        except ValueError as e:
            raise ConfigError(
                f"config key {key!r}: cannot use {text!r}, expected {type_name(field.type)} ({e})"
            ) from None
        rule = field.metadata.get("rule")
        if isinstance(rule, BackendString):  # checked here too, to name the override at fault
            try:
                parse_backend(value, rule.role)  # type: ignore[arg-type]
            except ConfigError as e:
                raise ConfigError(f"config key {key!r}: {e}") from None
        *path, name = key.split(".")
        target: Any = cfg
        kinds = Config
        for i, part in enumerate(path):
            target, kind = getattr(target, part), attrs.fields_dict(kinds)[part].type
            if not isinstance(target, kind):  # a recipe replaced the section
                section = ".".join(path[: i + 1])
                raise ConfigError(
                    f"config key {key!r}: section {section} must be of type {kind.__name__}, "
                    f"got {show_value(target)}; a recipe sets its fields (cfg.{section}.NAME = ...)"
                )
            kinds = kind
        setattr(target, name, value)
    return cfg
