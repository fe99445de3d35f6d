"""`arl.precompile` on CUDA: a process that loads kept entries starts no compile pool.

inductor starts its compile pool (a subprocess that imports torch on several cores) when
generated code only asks whether the pool is ready, as loading a kept entry's Triton kernels
does; on an H200 machine that slowed a warm train rank's first steps 2-3x while it started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FN = """
import torch


def make(eps):
    def fn(x, w):
        y = torch.nn.functional.silu(x @ w)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)

    return fn
"""


def test_a_process_that_loads_its_entries_starts_no_compile_pool(tmp_path: Path) -> None:
    (tmp_path / "pc_gpu.py").write_text(FN)
    script = textwrap.dedent(
        f"""
        import importlib.util, json, os, torch
        from torch._inductor.async_compile import AsyncCompile
        from arl.precompile import Precompiled
        spec = importlib.util.spec_from_file_location("pc_gpu", {str(tmp_path / "pc_gpu.py")!r})
        m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        fn = m.make(1e-5)
        p = Precompiled(fn, name="t.gpu", dynamic=True, cache_dir={str(tmp_path)!r})
        x = torch.randn(37, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
        x.requires_grad_(True)
        y = p(x, w)
        y.float().sum().backward()
        same = torch.allclose(y.float(), fn(x, w).float(), atol=2e-2, rtol=2e-2)
        pool = AsyncCompile.process_pool.cache_info().currsize
        def parent(pid):
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[1]
            except OSError:  # ended meanwhile
                return None
        children = [d for d in os.listdir("/proc") if d.isdigit() and parent(d) == str(os.getpid())]
        import torch._inductor.config as c
        print(json.dumps([p.loaded, p.compiled, pool, len(children), same, c.compile_threads]))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    compiled, loaded = runs
    assert compiled[:2] == [0, 1] and compiled[4], compiled
    assert loaded[:2] == [1, 0] and loaded[4], loaded
    # the setting is back as it was, and the loading process started neither pool nor process
    assert loaded[5] == compiled[5]
    assert loaded[2] == 0 and loaded[3] == 0, loaded
