"""The config as YAML (`to_yaml`, `from_yaml`, `save_resolved`, `load_yaml`) through a strict
cattrs converter, and the ``--help`` text of every field."""

from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import attrs
import cattrs
import yaml

from arl.config.errors import ConfigError
from arl.config.rules import BackendString, OneOf, Range
from arl.config.tree import Config, field_keys, get_key
from arl.config.validate import show_value, type_name


def _strict(tp: type, accepts: tuple[type, ...]) -> Any:
    """A structure hook that refuses silent coercions such as int(1.5) or bool("false")."""

    def hook(value: Any, _: Any) -> Any:
        if isinstance(value, bool) and bool not in accepts or not isinstance(value, accepts):
            raise TypeError(f"expected {tp.__name__}, got {value!r}")
        return tp(value)

    return hook


converter = cattrs.Converter(forbid_extra_keys=True)
converter.register_unstructure_hook(tuple, list)
converter.register_structure_hook(int, _strict(int, (int,)))
converter.register_structure_hook(float, _strict(float, (int, float)))
converter.register_structure_hook(bool, _strict(bool, (bool,)))
converter.register_structure_hook(str, _strict(str, (str,)))


def _structure_sequence(value: Any, tp: Any) -> Any:
    if not isinstance(value, list | tuple):  # a bare string would otherwise become its letters
        raise TypeError(f"expected a list, got {value!r}")
    items = [converter.structure(v, get_args(tp)[0]) for v in value]
    return items if get_origin(tp) is list else tuple(items)


converter.register_structure_hook_func(
    lambda tp: get_origin(tp) in (list, tuple), _structure_sequence
)


def to_yaml(cfg: Config) -> str:
    """The config as YAML, sections in declaration order."""
    return yaml.safe_dump(converter.unstructure(cfg), sort_keys=False, default_flow_style=False)


def from_yaml(text: str) -> Config:
    """Build a `Config` from YAML; missing keys take their defaults, unknown keys are errors."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config YAML does not parse: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config YAML must be a mapping of sections, got {type(data).__name__}")
    try:
        return converter.structure(data, Config)
    except Exception as e:  # cattrs raises exception groups; flatten them into one message
        if not isinstance(e, cattrs.BaseValidationError):
            raise ConfigError(f"bad config YAML: {e}") from None
        lines = cattrs.transform_error(e, path="config", format_exception=_format_yaml_error)
        raise ConfigError("bad config YAML:\n  " + "\n  ".join(lines)) from None


def _format_yaml_error(exc: BaseException, tp: Any) -> str:
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"unknown keys {', '.join(sorted(exc.extra_fields))}"
    if isinstance(exc, KeyError):
        return "required key missing"
    if tp is not None and get_origin(tp) is Literal:
        return f"expected one of {type_name(tp).replace('|', ', ')}"
    return str(exc)


def save_resolved(cfg: Config, path: str | Path) -> Path:
    """Write the config as YAML to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg))
    return path


def load_yaml(path: str | Path) -> Config:
    """Read a config saved by `save_resolved`."""
    return from_yaml(Path(path).read_text())


def help_text(cfg: Config | None = None) -> str:
    """Every field as ``section.field (type, default): help``, grouped by section."""
    cfg = cfg if cfg is not None else Config()
    lines = []
    for section in attrs.fields(Config):
        lines.append(f"\n{section.name}: {section.metadata['help']}")
        for key, field in field_keys().items():
            if not key.startswith(section.name + "."):
                continue
            default = show_value(get_key(cfg, key), quote=False)
            kind, bound = _shown_rule(field)
            lines.append(f"  {key} ({kind}, {default}): {field.metadata['help']}{bound}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _shown_rule(field: attrs.Attribute) -> tuple[str, str]:
    """A field's type as --help shows it (a plug-in's names from its registry) and what its
    rule allows, where the help does not say it already."""
    rule, kind = field.metadata.get("rule"), type_name(field.type)
    if isinstance(rule, OneOf):
        return "|".join(rule.choices()), ""
    if isinstance(rule, Range):
        optional = " or none" if type(None) in get_args(field.type) else ""
        return kind, f"; {rule.describe()}{optional}"
    if isinstance(rule, BackendString):
        return kind, f"; {rule.describe()}"
    return kind, ""
