"""Wire structs: attrs classes declared once, encoded and checked by one strict cattrs converter.

A class that crosses a process boundary subclasses `WireStruct` and is an attrs class; its
``to_wire()`` is a plain msgpack-able value (a map in field order, lists for tuples, no pickle)
and ``Cls.from_wire(value)`` rebuilds it, so decoding is the validation:

- every field must be present, unless the class lists it in ``wire_optional`` (its default
  applies); a key that is not a field is refused (the converter forbids extra keys);
- an ``int`` field takes an integer (not a bool), a ``float`` field a number, a ``str`` field
  text, a ``bool`` field a bool, a list or tuple field a list, a dict field a map: nothing is
  coerced, so ``"2"`` or ``True`` for an integer is refused;
- the attrs validators and ``__attrs_post_init__`` run last, as on any construction.

A bad value raises the class's ``wire_error`` (a `WireStructError` by default) with every
problem, each naming the struct and the field's path: ``RTensor: 'refs[0].nbytes' must be an
integer, got '8'``. An error the class's own checks raise with a type of their own
(``ConfigError``, ``WeightTransferError``) reaches the caller unchanged.

Per class: ``wire_tag = (key, value)`` puts a marker key first in the map (an RTensor among call
arguments, a rejected group among reports); ``wire_as_list = True`` encodes the fields as one
list in field order (a tensor slot in a pull descriptor, once per tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NewType, TypeVar, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from arl.protocol.errors import ErrorKind

T = TypeVar("T", bound="WireStruct")

# A float that may be NaN or infinite; NaN travels as the text "nan" (and is read back from
# "nan", "inf" or "-inf"), so a reader that is not Python still sees a plain value.
NanFloat = NewType("NanFloat", float)


class WireStructError(ValueError):
    """A wire value that is not the struct it claims to be (a missing, unknown or mistyped
    field); the message names the struct and each field that is wrong."""

    error_kind = ErrorKind.MALFORMED


class WireStruct:
    """Base of the attrs classes that cross the wire (see the module docstring)."""

    __slots__ = ()
    wire_error: ClassVar[type[Exception]] = WireStructError
    wire_tag: ClassVar[tuple[str, Any] | None] = None
    wire_optional: ClassVar[frozenset[str]] = frozenset()
    wire_as_list: ClassVar[bool] = False

    def to_wire(self) -> Any:
        """The plain msgpack-able value of this struct."""
        return converter.unstructure(self)

    @classmethod
    def from_wire(cls: type[T], value: Any) -> T:
        """The struct ``value`` encodes; raises ``cls.wire_error`` naming each bad field."""
        try:
            return converter.structure(value, cls)
        except BaseValidationError as e:
            own = _own_error(e)
            if own is not None:
                raise own from None
            problems = "; ".join(f"{_quote(path)}{why}" for path, why in _problems(e, ""))
            raise cls.wire_error(f"{cls.__name__}: {problems}") from None
        except _Bad as e:  # the value is not even a map (or list)
            raise cls.wire_error(f"{cls.__name__}: expected {e.want}, got {e.got()}") from None


class _Bad(Exception):
    """A value of the wrong kind (``want``: what the field needs, in words)."""

    def __init__(self, want: str, value: Any):
        super().__init__(want)
        self.want, self.value = want, value

    def got(self) -> str:
        text = repr(self.value)
        return text if len(text) <= 80 else f"{type(self.value).__name__} {text[:60]}..."


class _Missing(Exception):
    def __init__(self, want: str):
        super().__init__(want)
        self.want = want


def _quote(path: str) -> str:
    return f"'{path}' " if path else ""


def _own_error(e: BaseValidationError) -> Exception | None:
    """The exception a top-level struct's own checks raised, when it has a type of its own."""
    if isinstance(e, ClassValidationError):
        noted, bare = e.group_exceptions()
        for exc in bare:
            if not noted and not isinstance(exc, ForbiddenExtraKeysError):
                return exc if type(exc) not in (ValueError, TypeError) else None
    return None


def _problems(exc: BaseException, path: str) -> list[tuple[str, str]]:
    """``(field path, what is wrong)`` for each leaf of a cattrs error tree."""
    if isinstance(exc, ForbiddenExtraKeysError):
        return [
            (
                path,
                f"has unknown field(s) {sorted(exc.extra_fields)} "
                "(sender and receiver of different arl versions?)",
            )
        ]
    if isinstance(exc, BaseValidationError):
        noted, bare = exc.group_exceptions()
        out = []
        for sub, note in noted:
            if isinstance(note, AttributeValidationNote):
                sub_path = f"{path}.{note.name}" if path else note.name
            elif isinstance(note, IterableValidationNote):
                idx = note.index
                sub_path = idx if isinstance(idx, str) and not path else f"{path}[{idx}]"
            else:
                sub_path = path
            out += _problems(sub, sub_path)
        for sub in bare:
            out += _problems(sub, path)
        return out
    if isinstance(exc, _Bad):
        return [(path, f"must be {exc.want}, got {exc.got()}")]
    if isinstance(exc, _Missing):
        return [(path, f"must be {exc.want}, it is missing")]
    if isinstance(exc, KeyError):  # a required field cattrs did not find
        return [(path, "is missing")]
    # The class's own checks: their message names the field.
    return [(path, str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")]


def _describe(t: Any) -> str:
    """What a field of type ``t`` needs, in words (for error messages)."""
    origin = get_origin(t) or t
    if isinstance(origin, type) and issubclass(origin, WireStruct):
        return "a list" if origin.wire_as_list else "a map"
    return _WORDS.get(t) or _WORDS.get(origin) or "a value"


# --- the converter ------------------------------------------------------------------------

converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)

_WORDS: dict[Any, str] = {
    int: "an integer",
    float: "a number",
    NanFloat: "a number",
    str: "text",
    bool: "true or false",
    list: "a list",
    tuple: "a list",
    dict: "a map",
}


def _int(v: Any, _: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _Bad("an integer", v)


def _float(v: Any, _: Any) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    raise _Bad("a number", v)


def _nan_float(v: Any, _: Any) -> float:
    if v in ("nan", "inf", "-inf"):
        return float(v)
    return _float(v, _)


def _str(v: Any, _: Any) -> str:
    if isinstance(v, str):
        return v
    raise _Bad("text", v)


def _bool(v: Any, _: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise _Bad("true or false", v)


converter.register_structure_hook(int, _int)
converter.register_structure_hook(float, _float)
converter.register_structure_hook(str, _str)
converter.register_structure_hook(bool, _bool)
converter.register_structure_hook(NanFloat, _nan_float)
converter.register_unstructure_hook(NanFloat, lambda v: "nan" if v != v else v)


def _is_sequence(t: Any) -> bool:
    return (get_origin(t) or t) in (list, tuple)


def _sequence_hook(t: Any) -> Callable[[Any, Any], Any]:
    """A list or a homogeneous tuple: must be a list (never a string iterated as characters)."""
    args = [a for a in get_args(t) if a is not Ellipsis]
    elem = args[0] if args else Any
    make = tuple if (get_origin(t) or t) is tuple else list

    def structure(v: Any, _: Any) -> Any:
        if not isinstance(v, list | tuple):
            raise _Bad(f"a list of {_plural(elem)}", v)
        items, errors = [], []
        for i, x in enumerate(v):
            try:
                items.append(converter.structure(x, elem))
            except Exception as e:  # noqa: BLE001 - collected and reported with its index
                e.add_note(IterableValidationNote(f"index {i}", i, elem))
                errors.append(e)
        if errors:
            raise IterableValidationError(f"While structuring {t}", errors, t)
        return make(items)

    return structure


def _is_mapping(t: Any) -> bool:
    return (get_origin(t) or t) is dict


def _mapping_hook(t: Any) -> Callable[[Any, Any], Any]:
    """A map whose keys and values are checked by their types (a bare ``dict``: any values)."""
    args = get_args(t)
    key_t, val_t = args if args else (Any, Any)

    def structure(v: Any, _: Any) -> dict:
        if not isinstance(v, Mapping):
            raise _Bad("a map", v)
        out, errors = {}, []
        for k, x in v.items():
            try:
                out[converter.structure(k, key_t)] = converter.structure(x, val_t)
            except Exception as e:  # noqa: BLE001 - collected and reported with its key
                e.add_note(IterableValidationNote(f"key {k!r}", k, val_t))
                errors.append(e)
        if errors:
            raise IterableValidationError(f"While structuring {t}", errors, t)
        return out

    return structure


def _plural(t: Any) -> str:
    words = _describe(t)
    return {"an integer": "integers", "a number": "numbers", "text": "strings"}.get(words, "values")


converter.register_structure_hook(Any, lambda v, _: v)
converter.register_structure_hook_factory(_is_sequence, _sequence_hook)
converter.register_structure_hook_factory(_is_mapping, _mapping_hook)
converter.register_unstructure_hook_factory(
    _is_sequence, lambda t: lambda v: [converter.unstructure(x) for x in v]
)


def _is_struct(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, WireStruct) and attrs.has(t)


def _struct_structure_hook(cls: type[WireStruct]) -> Callable[[Any, Any], Any]:
    fields = attrs.fields(attrs.resolve_types(cls))
    if cls.wire_as_list:
        return _list_structure_hook(cls)
    inner = make_dict_structure_fn(
        cls, converter, _cattrs_forbid_extra_keys=True, _cattrs_detailed_validation=True
    )
    required = [(a.name, a.type) for a in fields if a.name not in cls.wire_optional]
    tag = cls.wire_tag

    def structure(v: Any, _: Any) -> WireStruct:
        if not isinstance(v, Mapping):
            raise _Bad("a map", v)
        if tag is not None:
            if v.get(tag[0]) != tag[1]:
                raise _Bad(f"a map tagged {{{tag[0]!r}: {tag[1]!r}}}", v)
            v = {k: x for k, x in v.items() if k != tag[0]}
        missing = [(name, t) for name, t in required if name not in v]
        if missing:
            errors = []
            for name, t in missing:
                e = _Missing(_describe(t))
                e.add_note(AttributeValidationNote(f"attribute {name}", name, t))
                errors.append(e)
            unknown = set(v) - {a.name for a in fields}
            if unknown:
                errors.append(ForbiddenExtraKeysError("", cls, unknown))
            raise ClassValidationError(f"While structuring {cls.__name__}", errors, cls)
        return inner(v, cls)

    return structure


def _list_structure_hook(cls: type[WireStruct]) -> Callable[[Any, Any], Any]:
    fields = attrs.fields(attrs.resolve_types(cls))
    names = [a.name for a in fields]

    def structure(v: Any, _: Any) -> WireStruct:
        if not isinstance(v, list | tuple) or len(v) != len(fields):
            raise _Bad(f"a list [{', '.join(names)}]", v)
        values, errors = {}, []
        for a, x in zip(fields, v, strict=True):
            try:
                values[a.name] = converter.structure(x, a.type)
            except Exception as e:  # noqa: BLE001 - collected and reported with its field
                e.add_note(AttributeValidationNote(f"attribute {a.name}", a.name, a.type))
                errors.append(e)
        if not errors:
            try:
                return cls(**values)
            except Exception as e:  # noqa: BLE001 - the class's own checks, as for a map
                errors.append(e)
        raise ClassValidationError(f"While structuring {cls.__name__}", errors, cls)

    return structure


def _struct_unstructure_hook(cls: type[WireStruct]) -> Callable[[Any], Any]:
    if cls.wire_as_list:
        fields = attrs.fields(attrs.resolve_types(cls))
        return lambda obj: [converter.unstructure(getattr(obj, a.name), a.type) for a in fields]
    inner = make_dict_unstructure_fn(cls, converter)
    tag = cls.wire_tag
    if tag is None:
        return inner
    return lambda obj: {tag[0]: tag[1], **inner(obj)}


converter.register_structure_hook_factory(_is_struct, _struct_structure_hook)
converter.register_unstructure_hook_factory(_is_struct, _struct_unstructure_hook)
