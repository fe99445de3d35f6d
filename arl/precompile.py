"""Compiled functions kept whole under ``ARL_CACHE``, so that a later process neither traces nor
compiles them again.

`use_compile_cache` keeps inductor's generated code between runs, but dynamo still traces every
compiled function again in every process before it finds that code (on an H100, ~6 s of a warm
hf engine's start-up: three fused functions and one flex-attention kernel per batch bucket).
`precompiled(fn, name=..., dynamic=...)` is a drop-in for ``torch.compile(fn, dynamic=...)``
that compiles ahead of time at its first call (torch's ``aot_compile``: dynamo's bytecode, its
guards and inductor's code in one artifact) and saves the result::

    <cache>/compile/torch-<version>/precompiled/<name>-<key>-<device>-g<grad mode>-<n>.bin

A later process loads the entries of its key and device at its first call (milliseconds each)
and checks their guards on every call instead of tracing: the inputs' dtypes, devices, ranks,
strides, whatever sizes the compilation specialised, and float arguments (traced as constants).
A call no entry accepts compiles one more entry. What the guards do not check is in the key:
the source file that defines ``fn`` (and any file named in ``also``), every source file of arl
(what ``fn`` may call of it: an attention function, LoRA adapters), the values of ``fn``'s
closure (model constants such as head counts and the norm's epsilon, baked into the artifact;
a decorator's wrapped function by its name and source file), the torch, transformers and
Python versions, ``dynamic`` and inductor ``options``; the device (the CUDA capability and
Triton's version, or the CPU's vector ISA) and the grad mode an entry was compiled under are in
its file's name and checked first.

A loaded entry loads its kernels, and runs its first call, with inductor's ``compile_threads``
at 1: its kernels are already built (Triton's cache), and merely asking whether inductor's
compile pool is ready starts that pool, a process importing torch on several cores for
seconds (measured on an H200 machine: the train rank's first steps after a warm start ran 2-3x
slower, its host-side tensor work 10x, while it started). A process that compiles keeps the
pool.

Calls under ``torch.inference_mode`` compile plainly: an entry loaded back and run in that mode
loses its in-place updates of inputs (torch 2.13), so none is used or kept there.

Anything that goes wrong on this path falls back to plain ``torch.compile`` with one warning:
a torch without ``aot_compile``, a function it cannot trace whole or serialise, an entry that
does not load. When plain compilation then works, the key is marked (``<name>-<key>.off``, the
reason inside), so later runs skip the attempt; a failure of compilation itself (no C++
compiler, say) is raised as ``torch.compile`` would raise it, to the caller's own fallback.
``ARL_PRECOMPILE=0`` turns the whole path off. A function's entries and marks under other
keys (an arl, transformers or model since changed) are removed once no process has loaded or
written them for 14 days; a torch upgrade leaves the old ``torch-<version>`` folder, which
``rm -rf`` reclaims. Entries are pickles written by torch, as
inductor's own cache entries are: the cache directory must be as trusted as the code.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from arl.compile_cache import compile_cache_dir

log = logging.getLogger(__name__)

ENV = "ARL_PRECOMPILE"
_SIMPLE = (int, float, str, bool, type(None))


def enabled() -> bool:
    """Whether `precompiled` keeps compiled functions (``ARL_PRECOMPILE`` is not ``0``) and this
    torch can (``aot_compile`` and ``load_compiled_function``)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return hasattr(torch.compiler, "load_compiled_function")


def precompile_dir(cache_dir: str | None = None) -> Path:
    """Where `precompiled` keeps its entries: ``<compile cache>/precompiled``."""
    return compile_cache_dir(cache_dir) / "precompiled"


def precompiled(
    fn: Callable,
    *,
    name: str,
    dynamic: bool | None = None,
    also: Iterable[str | Path] = (),
    max_compiled: int = 8,
    cache_dir: str | None = None,
    options: dict[str, Any] | None = None,
) -> Callable:
    """``torch.compile(fn, dynamic=dynamic, options=options)``, with what it compiles kept under
    ``ARL_CACHE`` (the module docstring); plain ``torch.compile`` where that is off. ``name``
    names the entries' files; ``also``: further source files whose code the compiled function
    runs (the key hashes them with ``fn``'s own); ``max_compiled``: entries one process may
    compile (dynamo's own recompile limit is 8) before it compiles plainly instead (a guard that
    fails on every new call would otherwise compile on every call); ``options``: inductor
    settings for this function alone (in the key)."""
    if not enabled():
        return torch.compile(fn, dynamic=dynamic, options=options)
    return Precompiled(
        fn,
        name=name,
        dynamic=dynamic,
        also=also,
        max_compiled=max_compiled,
        cache_dir=cache_dir,
        options=options,
    )


class Precompiled:
    """A function compiled ahead of time at its first call and kept on disk; see the module
    docstring. Safe to call from several threads (one compiles or loads at a time)."""

    def __init__(
        self,
        fn: Callable,
        *,
        name: str,
        dynamic: bool | None,
        also: Iterable[str | Path] = (),
        max_compiled: int = 8,
        cache_dir: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        if not name or any(c in name for c in "/\\-") or name.startswith("."):
            raise ValueError(f"name {name!r}: use letters, digits, dots and underscores")
        self.fn, self.name, self.dynamic = fn, name, dynamic
        self.options = dict(options or {})
        self.max_compiled = max_compiled
        functools.update_wrapper(self, fn)  # a function's name and signature, as torch.compile's
        self._also = tuple(Path(p) for p in also)
        self._dir = precompile_dir(cache_dir)
        self._key: str | None = None
        self._tags: set[str] = set()  # device tags whose saved entries were looked for
        self._all: list[tuple[bool, Any]] = []  # every entry, in the order they are tried
        self._plain: Callable | None = None  # torch.compile(fn) once this path is given up
        self._inference: Callable | None = None  # torch.compile(fn), for inference-mode calls
        self._why: str | None = None  # why it was given up, warned once plain compiles work
        self._lock = threading.Lock()
        self.loaded = 0  # entries loaded from disk
        self.compiled = 0  # entries compiled in this process

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_inference_mode_enabled():
            # An entry loaded back and run under inference mode loses its in-place updates of
            # inputs (torch 2.13: a KV cache write): such calls compile plainly.
            if self._inference is None:
                self._inference = self._compile_plainly()
            return self._inference(*args, **kwargs)
        if self._plain is None:
            entry = self._find(args, kwargs)
            if entry is not None:
                return entry(*args, **kwargs)
            with self._lock:
                if self._plain is None:
                    entry = self._load_for(args, kwargs) or self._add(args, kwargs)
            if entry is not None:
                return entry(*args, **kwargs)
        try:
            out = self._plain(*args, **kwargs)  # type: ignore[misc]
        except BaseException:
            self._why = None  # compilation itself fails (the caller's to handle): not this path's
            raise
        if self._why is not None:  # plain compilation works where this path did not: say so
            with self._lock:
                why, self._why = self._why, None
            if why is not None:
                self._warn(why, mark=True)
        return out

    def key(self) -> str:
        """The hash that names this function's entries (module docstring: what it covers)."""
        if self._key is None:
            parts = {
                "name": self.name,
                "dynamic": self.dynamic,
                "options": sorted(self.options.items()),
                "qualname": getattr(self.fn, "__qualname__", repr(self.fn)),
                "sources": [_file_hash(p) for p in (_source_file(self.fn), *self._also)],
                "closure": _closure_values(self.fn),
                "arl": _arl_sources(),  # what arl code the function calls (attention, LoRA)
                "transformers": getattr(sys.modules.get("transformers"), "__version__", None),
                "torch": torch.__version__,
                "python": [sys.implementation.name, *sys.version_info[:3]],
                "machine": platform.machine(),
            }
            blob = json.dumps(parts, sort_keys=True).encode()
            self._key = hashlib.sha256(blob).hexdigest()[:20]
        return self._key

    # ---- entries ------------------------------------------------------------------------------
    def _find(self, args: tuple, kwargs: dict) -> Any:
        """The first entry whose grad mode and guards accept this call (None: none does)."""
        grad = torch.is_grad_enabled()
        entries = self._all
        for i, (mode, entry) in enumerate(entries):
            if mode == grad and _accepts(entry, args, kwargs):
                if i:  # most recently used first: calls come in runs of one shape
                    entries.insert(0, entries.pop(i))
                return entry
        return None

    def _load_for(self, args: tuple, kwargs: dict) -> Any:
        """Load the saved entries of this call's device tag, once; the one that accepts the
        call, if any. Under the lock."""
        try:
            tag = _device_tag(args, kwargs)
            if tag in self._tags:
                return self._find(args, kwargs)  # another thread may have added one
            stem = f"{self.name}-{self.key()}"
        except (OSError, TypeError) as exc:  # no source file, or a closure not to be keyed
            self._give_up(f"it cannot be keyed ({exc})")
            return None
        self._tags.add(tag)
        loaded: list[tuple[bool, Any]] = []
        if self._dir.is_dir():
            _prune_stale(self._dir, self.name, self.key())
            if (self._dir / f"{stem}.off").exists():  # an earlier run found this path failing
                self._plain = self._compile_plainly()
                return None
            files = sorted(self._dir.glob(f"{stem}{tag}-g*.bin"), key=lambda p: p.stat().st_mtime)
            if files:
                _name_local_classes(args, kwargs)  # as they were named when compiled
            for path in files:
                try:
                    loaded.append((_grad_mode(path), _Loaded(_load_entry(path, self.fn))))
                except Exception as exc:  # noqa: BLE001 - a torch that cannot load its own entry
                    self._give_up(f"its entry {path.name} does not load ({first_line(exc, 200)})")
                    return None
                with contextlib.suppress(OSError):  # used now: `_prune_stale` goes by this
                    os.utime(path)
        self._all.extend(loaded)
        self.loaded += len(loaded)
        if loaded:
            log.debug("%s: %d precompiled entries loaded (%s%s)", self.name, len(loaded), stem, tag)
        return self._find(args, kwargs)

    def _add(self, args: tuple, kwargs: dict) -> Any:
        """Compile an entry for this call and save it; None (plain from now on) if this path
        fails. Under the lock."""
        if self._plain is not None:
            return None
        if self.compiled >= self.max_compiled:
            self._give_up(f"{self.compiled} entries compiled in this process, the most it may")
            return None
        t0 = time.perf_counter()
        import torch._dynamo.config as dynamo_config  # here: importing dynamo takes ~1 s

        # torch.compile attaches `aot_compile` only while this flag is on (off by default in
        # torch 2.11, on in 2.13).
        aot = {"enable_aot_compile": True} if hasattr(dynamo_config, "enable_aot_compile") else {}
        with dynamo_config.patch(aot):
            compiler = torch.compile(
                self.fn, fullgraph=True, dynamic=self.dynamic, options=self.options or None
            )

        # Floats as constants (guarded): tracing them as tensors restarts the trace, which
        # aot_compile cannot (TensorifyScalarRestartAnalysis).
        floats = {"specialize_float": True} if hasattr(dynamo_config, "specialize_float") else {}
        try:
            _name_local_classes(args, kwargs)
            with dynamo_config.patch(floats), _gradients_set_aside(args, kwargs):
                entry = compiler.aot_compile((args, kwargs))
        except Exception as exc:  # noqa: BLE001 - plain compilation raises it again if it is its
            self._give_up(f"aot_compile failed ({first_line(exc, 200)})")
            return None
        if not callable(getattr(entry, "guard_check", None)):
            self._give_up("this torch's compiled functions cannot check their guards")
            return None
        if hasattr(entry, "disable_guard_check"):  # `_find` checks them first
            entry.disable_guard_check()
        grad = torch.is_grad_enabled()
        stem = f"{self.name}-{self.key()}{_device_tag(args, kwargs)}"
        path = self._dir / f"{stem}-g{int(grad)}-{uuid.uuid4().hex[:8]}.bin"
        t1 = time.perf_counter()
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            # To a temporary file, then renamed; the closure's functions by reference.
            with _gradients_set_aside(args, kwargs):
                entry.save_compiled_function(str(path), **_external(self.fn))
        except Exception as exc:  # noqa: BLE001 - kept in memory for this process only
            path.unlink(missing_ok=True)
            self._warn(f"its compiled entry cannot be saved ({first_line(exc, 200)})", mark=False)
        else:
            t2 = time.perf_counter()
            log.debug(
                "%s: compiled in %.2f s, kept in %.2f s: %s", self.name, t1 - t0, t2 - t1, path
            )
        self._all.append((grad, entry))
        self.compiled += 1
        return entry

    def _give_up(self, why: str) -> None:
        """Compile plainly from here on; the first plain call that works warns (`_warn`)."""
        self._plain = self._compile_plainly()
        self._why = why

    def _compile_plainly(self) -> Callable:
        return torch.compile(self.fn, dynamic=self.dynamic, options=self.options or None)

    def _warn(self, why: str, *, mark: bool) -> None:
        """One warning; with ``mark``, write ``<name>-<key>.off`` so later runs do not retry."""
        log.warning(
            "%s is compiled as before, not kept under %s: %s (ARL_PRECOMPILE=0 skips trying)",
            self.name,
            self._dir,
            why,
        )
        if mark:
            try:
                self._dir.mkdir(parents=True, exist_ok=True)
                (self._dir / f"{self.name}-{self.key()}.off").write_text(why + "\n")
            except (OSError, TypeError):
                pass


STALE_DAYS = 14
_pruned: set[tuple[Path, str]] = set()


def _prune_stale(folder: Path, name: str, key: str) -> None:
    """Remove ``name``'s entries and marks under other keys (an older arl, transformers or
    model; another checkout) that no process has loaded or written for `STALE_DAYS` days; once
    per folder and name in a process. Entries in use are touched when loaded, so two checkouts
    sharing a cache keep theirs."""
    if (folder, name) in _pruned:
        return
    _pruned.add((folder, name))
    cutoff = time.time() - STALE_DAYS * 86400
    for suffix in (".bin", ".off"):
        # `<name>-<key>...`: a name holds no "-" (`Precompiled` refuses one).
        for path in folder.glob(f"{name}-*{suffix}"):
            if path.name[len(name) + 1 :].startswith(key):
                continue
            with contextlib.suppress(OSError):  # gone already (another process)
                if path.stat().st_mtime < cutoff:
                    path.unlink()


def kept_counts(fns: Iterable[Any]) -> tuple[int, int]:
    """Of the `Precompiled` among ``fns``: entries loaded from disk and entries compiled, in
    this process so far."""
    kept = [f for f in fns if isinstance(f, Precompiled)]
    return sum(f.loaded for f in kept), sum(f.compiled for f in kept)


def kept_note(counts: tuple[int, int]) -> str:
    """The end of a ready line that `python -m arl.bench startup` reads back ("" for none)."""
    loaded, compiled = counts
    if not (loaded or compiled):
        return ""
    return f"; compiled functions kept: {loaded} loaded, {compiled} compiled"


def _accepts(entry: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``entry``'s guards accept this call; a call they cannot even be checked on (its
    arguments do not bind to the signature the entry was compiled for) is refused too."""
    try:
        return bool(entry.guard_check(*args, **kwargs))
    except Exception:  # noqa: BLE001 - then another entry, or a new one, serves it
        return False


class _Loaded:
    """An entry loaded from disk: its first call (where inductor may load its kernels) runs with
    `_kernels_in_process`; every later call is the entry's own."""

    __slots__ = ("entry", "ran")

    def __init__(self, entry: Any) -> None:
        self.entry, self.ran = entry, False

    def guard_check(self, *args: Any, **kwargs: Any) -> Any:
        return self.entry.guard_check(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.ran:
            return self.entry(*args, **kwargs)
        with _kernels_in_process():
            out = self.entry(*args, **kwargs)
        self.ran = True
        return out


def _kernels_in_process() -> contextlib.AbstractContextManager:
    """inductor's ``compile_threads`` at 1 (the module docstring: a loaded entry's kernels are
    built, and checking whether the compile pool is ready would start it)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(compile_threads=1)


def _load_entry(path: Path, fn: Callable) -> Any:
    from torch._guards import TracingContext, tracing

    # Unpickling some guard sources installs a guard, which needs a tracing context (torch
    # 2.11-2.13 raise "TracingContext.get() must be called within an ongoing trace" without).
    with path.open("rb") as f, tracing(TracingContext(None)), _kernels_in_process():
        entry = torch.compiler.load_compiled_function(f, f_globals=fn.__globals__, **_external(fn))
    if not callable(getattr(entry, "guard_check", None)):
        raise TypeError("this torch's compiled functions cannot check their guards")
    if hasattr(entry, "disable_guard_check"):  # `Precompiled._find` checks them first
        entry.disable_guard_check()
    return entry


def _grad_mode(path: Path) -> bool:
    """The grad mode in an entry's file name (``...-g1-<n>.bin``)."""
    return path.stem.rsplit("-", 2)[-2] == "g1"


def _source_file(fn: Callable) -> Path:
    path = inspect.getsourcefile(inspect.unwrap(fn))
    if path is None:
        raise OSError(f"no source file for {fn!r}")
    return Path(path)


@functools.cache
def _arl_sources() -> str:
    """One hash of every source file of the arl package: a compiled function may run any of it
    (the train layers' attention and LoRA adapters, say), so a change to arl compiles anew."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _closure_values(fn: Callable, depth: int = 0) -> list:
    """The values of ``fn``'s closure, which the artifact bakes in: plain constants, and functions
    (a decorator's wrapped function: named by module, qualified name, their source file's hash and
    their own closure)."""
    out: list = []
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        value = cell.cell_contents
        if isinstance(value, tuple) and all(isinstance(v, _SIMPLE) for v in value):
            value = list(value)
        elif inspect.isfunction(value):  # its closure too, to a depth (they may recurse)
            inner = _closure_values(value, depth + 1) if depth < 3 else []
            value = [value.__module__, value.__qualname__, _file_hash(_source_file(value)), inner]
        elif not isinstance(value, _SIMPLE):
            raise TypeError(f"closure variable {name!r} is a {type(value).__name__}")
        out.append([name, value])
    return out


@contextlib.contextmanager
def _gradients_set_aside(args: tuple, kwargs: dict) -> Iterator[None]:
    """The gradients of the parameters of module arguments (a layer's ``self``) set to None
    meanwhile: torch saves them with the guards and cannot load them back (its pruned values)."""
    held = [
        (p, p.grad)
        for value in (*args, *kwargs.values())
        if isinstance(value, torch.nn.Module)
        for p in value.parameters()
        if p.grad is not None
    ]
    for p, _ in held:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in held:
            p.grad = grad


def _name_local_classes(args: tuple, kwargs: dict) -> None:
    """Give each class defined inside a function, of a module argument's submodules and of the
    modules they hold outside their submodules (a dict of them, say), a name in its module
    (``_arl_local_<class>_<path in the argument>``): torch needs one to save a guard on it.
    transformers' hub kernels make such a class for each function they may replace (a decoder
    layer's rotary embedding, kept in ``_kernel_funcs``). The same path gives the same name in a
    later process, which names them before it loads (unpickling finds them by that name)."""
    for value in (*args, *kwargs.values()):
        if not isinstance(value, torch.nn.Module):
            continue
        for path, sub in value.named_modules():
            held = [(path, sub)]
            for attr, obj in vars(sub).items():
                items = obj.items() if isinstance(obj, dict) else [("", obj)]
                held += [
                    (f"{path}.{attr}.{key}".strip("."), o)
                    for key, o in items
                    if isinstance(o, torch.nn.Module) and attr != "_modules"
                ]
            for where, obj in held:
                _name_local_class(type(obj), where)


def _name_local_class(cls: type, where: str) -> None:
    if "<locals>" not in cls.__qualname__:
        return
    module = sys.modules.get(cls.__module__)
    alias = "_arl_local_" + "".join(c if c.isalnum() else "_" for c in f"{cls.__name__}_{where}")
    if module is not None and getattr(module, alias, cls) is cls:
        setattr(module, alias, cls)
        cls.__name__ = cls.__qualname__ = alias  # torch saves a type by this name only


def _external(fn: Callable) -> dict[str, Any]:
    """``external_data=`` the functions of ``fn``'s closure, where it has any (a torch whose
    save and load take no such argument still keeps the others)."""
    functions = _closure_functions(fn)
    return {"external_data": functions} if functions else {}


def _closure_functions(fn: Callable) -> dict[str, Callable]:
    """The functions in ``fn``'s closure (and theirs, to a depth), by their place in it: saved
    as references and given back at load, where pickling them by name would fail (a decorator
    holds the function its module's name now gives the decorated one)."""
    out: dict[str, Callable] = {}

    def walk(f: Callable, path: str, depth: int) -> None:
        for i, cell in enumerate(f.__closure__ or ()):
            value = cell.cell_contents
            if inspect.isfunction(value) and id(value) not in seen:
                seen.add(id(value))
                out[f"{path}.{i}"] = value
                if depth < 3:
                    walk(value, f"{path}.{i}", depth + 1)

    seen = {id(fn)}
    walk(fn, "closure", 0)
    return out


def _device_tag(args: tuple, kwargs: dict) -> str:
    """``-cuda<capability>`` (with Triton's version) or ``-cpu<vector ISA>`` of the first tensor
    among the arguments; empty if there is none."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            device = value.device
            if device.type == "cuda":
                major, minor = torch.cuda.get_device_capability(device)
                try:
                    import triton

                    triton_version = triton.__version__
                except ImportError:
                    triton_version = "none"
                tag = f"cuda{major}{minor}_triton{triton_version}"
            elif device.type == "cpu":
                tag = f"cpu_{torch.backends.cpu.get_cpu_capability()}"
            else:
                tag = device.type
            return "-" + "".join(c if c.isalnum() or c in "._" else "_" for c in tag.lower())
    return ""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's kind and the first line of its message, which names the cause (the rest
    of a compiler's message is its whole graph dump); an empty message gives the kind alone."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__
