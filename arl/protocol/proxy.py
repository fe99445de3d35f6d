"""Typed callers generated from a worker's API class: each signature is written once.

A worker API is a class (usually a `typing.Protocol`) whose public methods are what a caller
may run on the remote object, with the caller's view of each signature::

    class RolloutWorkerAPI(Protocol):
        async def sleep(self, drop_weights: bool = False) -> int: ...

    worker = proxy(RolloutWorkerAPI, remote)   # remote: anything with node and async call()
    freed = await worker.sleep(True)            # checked here, sent as call("sleep", True)
    ranks = fan_out(TrainWorkerAPI, call, n)    # every rank at once, results in rank order
    await ranks.load_batch(per_rank(parts))     # rank i gets parts[i]

- Only the API's methods exist; any other name raises `UnknownRemoteMethod` naming the API and
  what it declares, before anything is sent. Arguments are bound to the API's signature at the
  caller (a wrong count or name is a `TypeError` here, not a remote one); an argument with a
  ``to_wire()`` (an `RTensor`) travels in its wire form.
- The reply is decoded by the method's return annotation: a class with ``from_wire`` decodes
  (and validates) it; ``int``, ``float``, ``str``, ``bool``, ``dict``, ``list[X]``, ``X | None``
  and ``None`` are checked (an int is accepted for a float); ``Any`` passes. A reply of another
  shape raises `MalformedReply` naming the API, the method and the value.
- ``close`` and ``aclose`` are never remote methods: the node ends an object on ``destroy``.

The wire stays a method-name call (``call`` {obj, method, args, kwargs}); the node runs the
method of that name on the hosted object. `check_implements` is the drift test's check that a
worker class has every API method with the same parameter names.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from arl.protocol.errors import ErrorKind

P = TypeVar("P")

# The node's lifecycle (`destroy`), never a remote call.
_LIFECYCLE = frozenset({"close", "aclose"})


class UnknownRemoteMethod(AttributeError):
    """A remote call of a method that the remote interface does not declare."""


class MalformedReply(ValueError):
    """A reply that does not have the type its API method declares (a bug or a hostile peer)."""

    error_kind = ErrorKind.MALFORMED


class Caller(Protocol):
    """What a proxy sends through: a remote object's handle (e.g. a `RemoteObject`)."""

    node: Any

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` of the remote object."""
        ...


# ``call(method, per_rank_args)``: one call on every rank at once, results in rank order.
FanOutCall = Callable[[str, "list[list] | None"], Awaitable[list]]


def api_methods(api: type) -> frozenset[str]:
    """The public method names an API class declares (``close``/``aclose`` excluded)."""
    return frozenset(
        name
        for klass in api.__mro__
        if klass not in (object, Protocol) and klass.__name__ != "Generic"
        for name, v in vars(klass).items()
        if callable(v) and not name.startswith("_") and name not in _LIFECYCLE
    )


class _Binder:
    """Binds a call's arguments to an API method's signature, at the caller."""

    def __init__(self, api: type, name: str, fn: Callable):
        self.where, self.sig = f"{api.__name__}.{name}", inspect.signature(fn)
        params = list(self.sig.parameters.values())[1:]  # after self
        # Plain positional calls skip inspect's bind (~10 us a call): a count check is enough.
        self.plain = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        self.most = len(params)
        self.least = sum(p.default is p.empty for p in params)

    def __call__(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(positional, keyword) arguments to send; TypeError naming the method if they do
        not fit its signature."""
        if self.plain and not kwargs and self.least <= len(args) <= self.most:
            return args, {}
        try:
            bound = self.sig.bind(None, *args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.where}{self.sig}: {e}") from None
        return bound.args[1:], bound.kwargs


@functools.cache
def _methods(api: type) -> dict[str, tuple[_Binder, Callable[[Any], Any]]]:
    """Each API method's argument binder and reply decoder, resolved once per API."""
    out = {}
    for name in sorted(api_methods(api)):
        fn = getattr(api, name)
        out[name] = (_Binder(api, name, fn), _decoder(_return_type(fn), f"{api.__name__}.{name}"))
    return out


def _return_type(fn: Callable) -> Any:
    """``fn``'s return annotation, evaluated in its module (only it: a parameter's annotation
    may name a type its module imports for type checkers only)."""
    ann = getattr(fn, "__annotations__", {}).get("return", Any)
    if isinstance(ann, str):
        ann = eval(ann, vars(sys.modules[fn.__module__]))  # what typing.get_type_hints does
    return ann


def _refuse(api: type, name: str) -> UnknownRemoteMethod:
    return UnknownRemoteMethod(
        f"{name!r} is not a method of {api.__name__}; it declares {sorted(api_methods(api))} "
        "(add it there and on the worker first)"
    )


def _encode(value: Any) -> Any:
    to_wire = getattr(type(value), "to_wire", None)
    return value.to_wire() if to_wire is not None else value


class _Proxy:
    """Base of the generated proxy classes (one per API)."""

    api: type
    __slots__ = ("remote", "node")

    def __init__(self, remote: Caller):
        self.remote, self.node = remote, remote.node

    def __repr__(self) -> str:
        return f"{self.api.__name__}({self.remote!r})"

    def __getattr__(self, name: str) -> Any:  # reached only for names the API lacks
        if name.startswith("_"):
            raise AttributeError(name)
        raise _refuse(self.api, name)


def _proxy_method(api: type, name: str) -> Callable[..., Awaitable[Any]]:
    bind, decode = _methods(api)[name]

    async def method(self: _Proxy, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = bind(args, kwargs)
        wire_args = [_encode(a) for a in args]
        wire_kwargs = {k: _encode(v) for k, v in kwargs.items()}
        return decode(await self.remote.call(name, *wire_args, **wire_kwargs))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(api, name).__doc__
    return method


@functools.cache
def _proxy_class(api: type) -> type[_Proxy]:
    attrs = {name: _proxy_method(api, name) for name in _methods(api)}
    return type(f"{api.__name__}Proxy", (_Proxy,), {"api": api, "__slots__": (), **attrs})


def proxy(api: type[P], remote: Caller) -> P:
    """``remote`` through ``api``'s methods only (see the module docstring)."""
    return cast(P, _proxy_class(api)(remote))


class PerRank:
    """An argument of a fan-out call that differs by rank: rank i gets ``values[i]``."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[Any]):
        self.values = list(values)


def per_rank(values: Sequence[Any]) -> PerRank:
    """Mark a fan-out argument as one value per rank (in rank order)."""
    return PerRank(values)


class FanOut(Generic[P]):
    """Every rank at once through API ``P``'s methods (the base of the generated fan-out
    classes, one per API; `fan_out` builds one)."""

    api: type
    __slots__ = ("_call", "n_ranks")

    def __init__(self, call: FanOutCall, n_ranks: int):
        self._call, self.n_ranks = call, n_ranks

    def __repr__(self) -> str:
        return f"{self.api.__name__} x {self.n_ranks} ranks"

    def __getattr__(self, name: str) -> Any:  # reached only for names the API lacks
        if name.startswith("_"):
            raise AttributeError(name)
        raise _refuse(self.api, name)


def _fan_out_method(api: type, name: str) -> Callable[..., Awaitable[list]]:
    bind, decode = _methods(api)[name]

    async def method(self: FanOut, *args: Any, **kwargs: Any) -> list:
        values, kwargs = bind(args, kwargs)
        if kwargs:
            raise TypeError(f"{api.__name__}.{name}: a fan-out sends positional arguments only")
        for v in values:
            if isinstance(v, PerRank) and len(v.values) != self.n_ranks:
                raise ValueError(f"{name}: {len(v.values)} values for {self.n_ranks} ranks")
        sent = None
        if values:
            sent = [
                [_encode(v.values[i] if isinstance(v, PerRank) else v) for v in values]
                for i in range(self.n_ranks)
            ]
        return [decode(r) for r in await self._call(name, sent)]

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(api, name).__doc__
    return method


@functools.cache
def _fan_out_class(api: type) -> type[FanOut]:
    attrs = {name: _fan_out_method(api, name) for name in _methods(api)}
    return type(f"{api.__name__}FanOut", (FanOut,), {"api": api, "__slots__": (), **attrs})


def fan_out(api: type, call: FanOutCall, n_ranks: int) -> Any:
    """Every one of ``n_ranks`` workers through ``api``'s methods at once: each method returns
    the decoded replies in rank order; `per_rank` marks an argument that differs by rank."""
    return _fan_out_class(api)(call, n_ranks)


# ---- replies ----------------------------------------------------------------------------------
def _decoder(tp: Any, where: str) -> Callable[[Any], Any]:
    """The function that checks (and decodes) a reply declared as ``tp``."""
    if tp is Any:
        return lambda v: v
    from_wire = getattr(tp, "from_wire", None)
    if isinstance(tp, type) and from_wire is not None:
        return from_wire
    check = _checker(tp)
    text = _type_text(tp)

    def decode(value: Any) -> Any:
        ok, out = check(value)
        if not ok:
            raise MalformedReply(f"{where} must answer {text}, got {_short(value)}")
        return out

    return decode


def _checker(tp: Any) -> Callable[[Any], tuple[bool, Any]]:
    """``check(value) -> (ok, value as tp)`` for the plain types a reply may declare."""
    if tp is None or tp is type(None):
        return lambda v: (v is None, v)
    if tp is Any:
        return lambda v: (True, v)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        checks = [_checker(a) for a in args]

        def union(v: Any) -> tuple[bool, Any]:
            for c in checks:
                ok, out = c(v)
                if ok:
                    return True, out
            return False, v

        return union
    if origin is list or tp is list:
        item = _checker(args[0]) if args else _checker(Any)

        def each(v: Any) -> tuple[bool, Any]:
            if not isinstance(v, list):
                return False, v
            got = [item(x) for x in v]
            return all(ok for ok, _ in got), [x for _, x in got]

        return each
    if origin is dict or tp is dict or origin is Mapping:
        return lambda v: (isinstance(v, dict), v)
    if tp is float:
        return lambda v: (isinstance(v, int | float) and not isinstance(v, bool), _float(v))
    if tp is int:
        return lambda v: (isinstance(v, int) and not isinstance(v, bool), v)
    if tp in (str, bool):
        return lambda v: (isinstance(v, tp), v)
    raise TypeError(f"a reply cannot be declared as {tp!r}: use a plain type or one with from_wire")


def _float(v: Any) -> Any:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v


def _type_text(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


# ---- the drift check ----------------------------------------------------------------------------
def check_implements(worker: type, api: type) -> list[str]:
    """What ``worker`` gets wrong about ``api``: a missing method, other parameter names, or
    a coroutine where the API has a plain method (or the reverse, for async APIs). Empty when
    it implements every method with the API's parameter names."""
    wrong = []
    for name in sorted(api_methods(api)):
        declared = getattr(api, name)
        actual = getattr(worker, name, None)
        if actual is None or not callable(actual):
            wrong.append(f"{worker.__name__} lacks {name}")
            continue
        want = list(inspect.signature(declared).parameters)
        got = list(inspect.signature(actual).parameters)
        if want != got:
            wrong.append(f"{worker.__name__}.{name} takes {got}, {api.__name__} declares {want}")
        if inspect.iscoroutinefunction(declared) and not inspect.iscoroutinefunction(actual):
            wrong.append(f"{worker.__name__}.{name} is not async, as {api.__name__} declares")
    return wrong
