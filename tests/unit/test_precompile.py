"""`arl.precompile`: functions compiled ahead of time, kept on disk and loaded by a later process
without tracing; keyed by what their guards do not check; plain ``torch.compile`` where this
path fails (CPU: inductor's C++ backend)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from arl.precompile import Precompiled, precompile_dir, precompiled

# A module of its own (a file: aot_compile reads its source), with closure constants as a model's.
SOURCE = """
import torch


def make(eps, scale):
    def fn(x, w):
        y = torch.nn.functional.silu(x @ w)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * scale

    return fn


def scaled(x, scale):
    return torch.nn.functional.silu(x) * scale


def decorate(fn):
    def wrapper(*args):
        return fn(*args) + 1

    return wrapper


def cosine(x):
    return x.cos()


def write_into(x, cache, rows):
    cache[rows] = x.sin()  # an input updated in place, as the engine's KV cache is
    return x * 2


def with_break(x):
    print("a graph break")  # fullgraph tracing refuses this; plain torch.compile splits here
    return x.sin() + 1
"""


def _module(folder: Path, source: str = SOURCE, name: str = "pc_fns"):
    path = folder / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"{name}_{abs(hash(source))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fns(tmp_path: Path):
    return _module(tmp_path)


def _inputs(rows: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 16, generator=g, dtype=dtype)
    return x, torch.randn(16, 8, generator=g, dtype=dtype)


def _files(cache: Path, suffix: str = ".bin") -> list[str]:
    folder = precompile_dir(str(cache))
    return sorted(p.name for p in folder.glob(f"*{suffix}")) if folder.is_dir() else []


def test_a_later_instance_loads_what_an_earlier_one_compiled_and_traces_nothing(
    fns, tmp_path: Path
) -> None:
    fn = fns.make(1e-5, 2.0)
    first = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    with torch.no_grad():
        for rows in (4, 9):  # one entry serves every row count (dynamic)
            torch.testing.assert_close(first(*_inputs(rows)), fn(*_inputs(rows)))
    assert (first.compiled, first.loaded) == (1, 0)
    assert len(_files(tmp_path)) == 1

    counters.clear()
    later = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    with torch.no_grad():
        for rows in (3, 17, 4):
            torch.testing.assert_close(later(*_inputs(rows)), fn(*_inputs(rows)))
    assert (later.compiled, later.loaded) == (0, 1)
    assert counters["stats"]["unique_graphs"] == 0  # dynamo traced nothing


def test_kept_where_torch_leaves_aot_compile_off_by_default(fns, tmp_path: Path) -> None:
    """torch 2.11 attaches ``aot_compile`` to a compiled function only under dynamo's
    ``enable_aot_compile``, off there by default: `precompiled` turns it on for its own compile."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "enable_aot_compile"):
        pytest.skip("this torch has no enable_aot_compile flag")
    fn = fns.make(1e-5, 2.0)
    with dynamo_config.patch(enable_aot_compile=False), torch.no_grad():
        first = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
        torch.testing.assert_close(first(*_inputs(4)), fn(*_inputs(4)))
        later = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
        torch.testing.assert_close(later(*_inputs(5)), fn(*_inputs(5)))
    assert (first.compiled, later.loaded, later.compiled) == (1, 1, 0)
    assert _files(tmp_path, ".off") == []


def test_entries_of_other_keys_unused_for_weeks_are_removed(fns, tmp_path: Path) -> None:
    fn = fns.make(1e-5, 2.0)
    first = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    with torch.no_grad():
        first(*_inputs(4))
    folder = precompile_dir(str(tmp_path))
    (kept,) = folder.glob("*.bin")
    weeks_ago = time.time() - 30 * 86400
    stale = [folder / "t.fn-00000000000000000000-cpu-g0-1.bin", folder / "t.fn-1111.off"]
    recent = folder / "t.fn-22222222222222222222-cpu-g0-2.bin"  # another checkout's, in use
    other = folder / "t.other-33333333333333333333-cpu-g0-3.bin"  # another function's
    for path in (*stale, recent, other):
        path.write_bytes(b"x")
    for path in (*stale, other, kept):
        os.utime(path, (weeks_ago, weeks_ago))

    later = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(later(*_inputs(5)), fn(*_inputs(5)))
    assert later.loaded == 1
    assert not any(p.exists() for p in stale)
    assert recent.exists() and other.exists()  # pruned by t.other itself, when it runs
    assert kept.stat().st_mtime > weeks_ago + 86400  # touched when loaded: in use


def test_a_closure_constant_is_in_the_key(fns, tmp_path: Path) -> None:
    """The artifact bakes the closure in: another epsilon or scale must not reuse it."""
    a, b = fns.make(1e-5, 2.0), fns.make(1e-5, 3.0)
    pa = Precompiled(a, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    pb = Precompiled(b, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    assert pa.key() != pb.key()
    with torch.no_grad():
        pa(*_inputs(4))
        torch.testing.assert_close(pb(*_inputs(4)), b(*_inputs(4)))
    assert pb.compiled == 1 and pb.loaded == 0
    assert len(_files(tmp_path)) == 2


def test_inductor_options_are_in_the_key_and_reach_the_compiler(
    fns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Options change the compiled code: another setting must not reuse an entry, and the
    compiler is asked with them, on this path and where it compiles plainly."""
    opts = {"triton.mix_order_reduction_non_strict_mode": True}
    plain = Precompiled(fns.cosine, name="t.cos", dynamic=True, cache_dir=str(tmp_path))
    tuned = Precompiled(
        fns.cosine, name="t.cos", dynamic=True, cache_dir=str(tmp_path), options=opts
    )
    assert plain.key() != tuned.key()
    asked: list[dict | None] = []
    compile_ = torch.compile

    def spy(fn, **kwargs):
        asked.append(kwargs.get("options"))
        return compile_(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    with torch.no_grad():
        torch.testing.assert_close(tuned(torch.ones(3)), torch.ones(3).cos())
    monkeypatch.setenv("ARL_PRECOMPILE", "0")
    precompiled(fns.cosine, name="t.cos", dynamic=True, options=opts)
    assert asked == [opts, opts]


def test_editing_the_source_file_changes_the_key(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    one = _module(tmp_path / "a")
    two = _module(tmp_path / "b", SOURCE.replace("* scale", "* scale * 1"))
    k1 = Precompiled(one.make(1e-5, 2.0), name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    k2 = Precompiled(two.make(1e-5, 2.0), name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    assert k1.key() != k2.key()


def test_calls_the_guards_refuse_add_entries_and_each_is_kept(fns, tmp_path: Path) -> None:
    """Another dtype, and the grad mode: each compiles an entry of its own, which a later
    instance loads and serves without compiling."""
    fn = fns.make(1e-5, 2.0)
    first = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    calls = [(torch.no_grad, torch.float32), (torch.no_grad, torch.float64)]
    calls.append((torch.enable_grad, torch.float32))
    for mode, dtype in calls:
        with mode():
            first(*_inputs(5, dtype))
    assert first.compiled == 3
    files = _files(tmp_path)
    assert len(files) == 3 and sum("-g1-" in f for f in files) == 1

    later = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    for mode, dtype in reversed(calls):
        with mode():
            torch.testing.assert_close(later(*_inputs(6, dtype)), fn(*_inputs(6, dtype)))
    assert (later.compiled, later.loaded) == (0, 3)


def test_a_float_argument_is_a_guarded_constant(fns, tmp_path: Path) -> None:
    """A float traced as a constant (as a tensor, dynamo restarts its trace, which aot_compile
    cannot do): each value is an entry of its own, and a later instance serves both."""
    x = torch.randn(5, 3)
    first = Precompiled(fns.scaled, name="t.scaled", dynamic=True, cache_dir=str(tmp_path))
    for scale in (0.5, 2.0, 0.5):
        torch.testing.assert_close(first(x, scale), fns.scaled(x, scale))
    assert first.compiled == 2
    later = Precompiled(fns.scaled, name="t.scaled", dynamic=True, cache_dir=str(tmp_path))
    for scale in (2.0, 0.5):
        torch.testing.assert_close(later(x, scale), fns.scaled(x, scale))
    assert (later.loaded, later.compiled) == (2, 0)


def test_a_decorated_function_is_keyed_by_the_function_it_wraps(tmp_path: Path) -> None:
    """A decorator's closure holds the wrapped function: its module, name and source file's
    hash are in the key (transformers decorates its models' forwards so). Here the wrapper's own
    file is the same in both: only the wrapped function's differs."""
    for sub in ("h", "a", "b"):
        (tmp_path / sub).mkdir()
    helper = _module(tmp_path / "h")
    one = _module(tmp_path / "a")
    two = _module(tmp_path / "b", SOURCE.replace("return x.cos()", "return x.sin()"))
    f1, f2 = helper.decorate(one.cosine), helper.decorate(two.cosine)
    k1 = Precompiled(f1, name="t.dec", dynamic=True, cache_dir=str(tmp_path))
    k2 = Precompiled(f2, name="t.dec", dynamic=True, cache_dir=str(tmp_path))
    assert k1.key() != k2.key()
    x = torch.randn(4)
    torch.testing.assert_close(k1(x), x.cos() + 1)
    torch.testing.assert_close(k2(x), x.sin() + 1)
    assert (k1.compiled, k2.compiled) == (1, 1)


def test_past_its_most_entries_a_function_compiles_plainly(
    fns, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Static shapes, a new one per call: after ``max_compiled`` entries, plain compilation
    (a guard failing on every call would otherwise compile on every call)."""
    fn = fns.make(1e-5, 2.0)
    p = Precompiled(fn, name="t.fn", dynamic=False, max_compiled=2, cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="arl.precompile"), torch.no_grad():
        for rows in (3, 4, 5, 6):
            torch.testing.assert_close(p(*_inputs(rows)), fn(*_inputs(rows)))
    assert p.compiled == 2 and len(_files(tmp_path)) == 2
    assert "2 entries compiled in this process, the most it may" in caplog.text
    assert len(_files(tmp_path, ".off")) == 1


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_input_updated_in_place_is_updated_by_a_loaded_entry(
    fns, tmp_path: Path, mode: str
) -> None:
    """The KV cache write of the engine's fused `attn_in`: a later instance's call updates the
    cache as eager does. Under inference mode (where a loaded entry loses the update) calls
    compile plainly and keep nothing."""
    for attempt in range(2):
        p = Precompiled(fns.write_into, name="t.write", dynamic=True, cache_dir=str(tmp_path))
        with getattr(torch, mode)():
            x, rows = torch.randn(3, 4), torch.tensor([0, 2, 5])
            cache, want = torch.zeros(6, 4), torch.zeros(6, 4)
            out = p(x, cache, rows)
            want_out = fns.write_into(x, want, rows)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(cache, want)
        kept = (p.loaded, p.compiled)
        assert kept == ((attempt, 1 - attempt) if mode == "no_grad" else (0, 0))
    assert len(_files(tmp_path)) == (1 if mode == "no_grad" else 0)


def test_off_compiles_plainly_and_keeps_nothing(
    fns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ARL_PRECOMPILE", "0")
    fn = fns.make(1e-5, 2.0)
    compiled = precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    assert not isinstance(compiled, Precompiled)
    torch.testing.assert_close(compiled(*_inputs(4)), fn(*_inputs(4)))
    assert not precompile_dir(str(tmp_path)).exists()


def test_a_function_it_cannot_take_whole_compiles_plainly_and_later_runs_do_not_retry(
    fns, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(4)
    first = Precompiled(fns.with_break, name="t.brk", dynamic=False, cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="arl.precompile"):
        torch.testing.assert_close(first(x), x.sin() + 1)
        torch.testing.assert_close(first(x), x.sin() + 1)
    assert caplog.text.count("t.brk is compiled as before") == 1
    assert "aot_compile failed" in caplog.text
    assert _files(tmp_path) == [] and len(_files(tmp_path, ".off")) == 1

    caplog.clear()
    later = Precompiled(fns.with_break, name="t.brk", dynamic=False, cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="arl.precompile"):
        torch.testing.assert_close(later(x), x.sin() + 1)
    assert caplog.text == "" and later.compiled == 0


def test_a_compiler_failure_is_raised_as_torch_compile_raises_it_and_marks_nothing(
    fns, tmp_path: Path
) -> None:
    """No C++ compiler: the caller's own fallback sees the failure; a later run, with one, keeps
    its functions."""
    import torch._inductor.config as inductor_config

    fn = fns.make(1e-4, 2.0)
    torch._dynamo.reset()
    try:
        no_compiler = {"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False}
        with inductor_config.patch(no_compiler), torch.no_grad():
            p = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
            with pytest.raises(Exception, match="C\\+\\+ compiler"):
                p(*_inputs(4))
    finally:
        torch._dynamo.reset()
    assert _files(tmp_path) == [] and _files(tmp_path, ".off") == []


def test_an_entry_that_does_not_load_falls_back_with_one_warning(
    fns, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fn = fns.make(1e-5, 2.0)
    with torch.no_grad():
        Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))(*_inputs(4))
    (entry,) = precompile_dir(str(tmp_path)).glob("*.bin")
    entry.write_bytes(b"not a pickle of torch's")
    later = Precompiled(fn, name="t.fn", dynamic=True, cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="arl.precompile"), torch.no_grad():
        torch.testing.assert_close(later(*_inputs(4)), fn(*_inputs(4)))
    assert "does not load" in caplog.text and later.compiled == 0
    assert len(_files(tmp_path, ".off")) == 1


def test_a_loaded_entry_loads_and_first_runs_with_one_compile_thread(
    fns, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading an entry and its first call run with inductor's ``compile_threads`` at 1 (its
    kernels are built; asking for the compile pool would start it: the GPU test checks that no
    pool starts); later calls, and the process afterwards, keep the setting as it was."""
    import torch._inductor.config as inductor_config

    import arl.precompile as pc

    with torch.no_grad():
        Precompiled(fns.cosine, name="t.cos", dynamic=True, cache_dir=str(tmp_path))(torch.ones(3))
    monkeypatch.setattr(inductor_config, "compile_threads", 4)
    seen: list[tuple[str, int]] = []
    load = torch.compiler.load_compiled_function

    def load_spy(*args, **kwargs):
        seen.append(("load", inductor_config.compile_threads))
        return load(*args, **kwargs)

    class CallSpy:
        def __init__(self, entry) -> None:
            self.entry = entry

        def guard_check(self, *args, **kwargs):
            return self.entry.guard_check(*args, **kwargs)

        def __call__(self, *args, **kwargs):
            seen.append(("call", inductor_config.compile_threads))
            return self.entry(*args, **kwargs)

    load_entry = pc._load_entry
    monkeypatch.setattr(torch.compiler, "load_compiled_function", load_spy)
    monkeypatch.setattr(pc, "_load_entry", lambda path, fn: CallSpy(load_entry(path, fn)))
    p = Precompiled(fns.cosine, name="t.cos", dynamic=True, cache_dir=str(tmp_path))
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(p(torch.ones(3)), torch.ones(3).cos())
    assert (p.loaded, p.compiled) == (1, 0)
    assert seen == [("load", 1), ("call", 1), ("call", 4)]
    assert inductor_config.compile_threads == 4


def test_a_fresh_process_loads_the_entry(fns, tmp_path: Path) -> None:
    """Across processes, as a second run is: the child loads, traces nothing, and computes what
    eager computes."""
    script = textwrap.dedent(
        f"""
        import importlib.util, json, sys, torch
        from torch._dynamo.utils import counters
        from arl.precompile import Precompiled
        spec = importlib.util.spec_from_file_location("pc_fns", {str(tmp_path / "pc_fns.py")!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        fn = m.make(1e-5, 2.0)
        p = Precompiled(fn, name="t.fn", dynamic=True, cache_dir={str(tmp_path)!r})
        x, w = torch.randn(7, 16), torch.randn(16, 8)
        with torch.no_grad():
            same = torch.allclose(p(x, w), fn(x, w), atol=1e-5)
        print(json.dumps([p.loaded, p.compiled, counters["stats"]["unique_graphs"], same]))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0][:2] == [0, 1] and runs[0][3]
    assert runs[1] == [1, 0, 0, True]


def test_names_that_would_break_the_file_names_are_refused(fns) -> None:
    for bad in ("", "a-b", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="letters, digits, dots and underscores"):
            Precompiled(fns.make(1e-5, 1.0), name=bad, dynamic=True)
