"""Weight sync on GPUs: the three-step tiny-model run with the engine and trainer on CUDA.

- ``auto`` (which is ``ipc_buffer`` there), ``ipc`` and ``zmq`` with ``cluster.n_gpus=1`` (hf
  engine and FSDP colocated on one GPU);
- ``nccl`` with ``cluster.n_gpus=2`` (engine on GPU 0, trainer on GPU 1), skipped on one GPU;
- CUDA IPC handle fields (msgpack, no pickle) opened in a second process.

The trainer keeps fp32 master weights while the engine holds bf16 (``dtype=auto``): the sync
sends weights in the engine's dtype and the trainer's checksum is taken in it too, so
``sync/checksum_match`` must hold after every step. Run with
``ARL_CACHE=<cache with SmolLM2-135M-Instruct> pytest -s -m gpu tests/gpu/test_weight_sync_gpu.py``
to see the seconds per sync of each mode.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch

from arl.config import Config
from arl.control.placement import plan_placement
from arl.run import run
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model, tiny_run_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def gpu_config(tmp_path, model: str, n_gpus: int, *overrides: str) -> Config:
    """The tiny three-step run (`tiny_run_config`) on ``n_gpus`` GPUs with a bf16 engine and a
    bf16-compute trainer (dtype auto)."""
    return tiny_run_config(
        tmp_path,
        model,
        "experiment.name=sync-gpu",
        "actor.dtype=auto",
        f"cluster.n_gpus={n_gpus}",
        "cluster.heartbeat_timeout=60",
        "saver.hf_export=false",
        # ~6.6 MB of bf16 weights: several buckets, so the one-bucket-in-flight path runs.
        "weight_sync.bucket_bytes=1048576",
        *overrides,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _run_and_check(cfg: Config, mode: str) -> None:
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/checksum_match"] is True, r
        assert r["version"] == r["step"]
    assert len({r["sync/checksum"] for r in rows}) == 3
    paused = [r["sync/paused_s"] for r in rows]
    mb = rows[-1].get("sync/bytes", 0) / 1e6
    print(
        f"\nweight_sync.mode={mode}: {sum(paused) / len(paused):.4f} s per sync paused "
        f"(per step {', '.join(f'{p:.4f}' for p in paused)}; {mb:.1f} MB per sync)"
    )


def test_auto_on_one_gpu_is_the_persistent_ipc_buffer_and_engine_matches_every_step(
    tmp_path, tiny_model
):
    cfg = gpu_config(tmp_path, tiny_model, 1)
    assert cfg.weight_sync.mode == "auto"
    assert plan_placement(cfg, 1).sync_mode == "ipc_buffer"
    _run_and_check(cfg, "auto (ipc_buffer)")


@pytest.mark.parametrize("mode", ["ipc", "zmq"])
def test_colocated_one_gpu_engine_matches_trainer_every_step(tmp_path, tiny_model, mode):
    _run_and_check(gpu_config(tmp_path, tiny_model, 1, f"weight_sync.mode={mode}"), mode)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs two GPUs")
def test_nccl_separate_gpus_engine_matches_trainer_every_step(tmp_path, tiny_model):
    _run_and_check(gpu_config(tmp_path, tiny_model, 2, "weight_sync.mode=nccl"), "nccl")


_RECEIVER = textwrap.dedent(
    """
    import sys, msgpack, torch
    from arl.weights.buckets import open_cuda_buffer
    fields = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
    t = open_cuda_buffer(fields)
    out = {"sum": float(t.double().sum()), "dtype": str(t.dtype), "n": t.numel()}
    t.add_(1)  # the sender sees this write: the same memory
    torch.cuda.synchronize()
    del t
    sys.stdout.buffer.write(msgpack.packb(out))
    """
)


def test_cuda_ipc_fields_open_the_same_memory_in_another_process():
    from arl.weights.buckets import share_cuda_buffer

    buffer = torch.arange(1000, dtype=torch.float32, device="cuda")
    fields = share_cuda_buffer(buffer[10:])
    torch.cuda.synchronize()
    done = subprocess.run(
        [sys.executable, "-c", _RECEIVER],
        input=msgpack.packb(fields, use_bin_type=True),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    got = msgpack.unpackb(done.stdout, raw=False)
    assert got == {"sum": float(sum(range(10, 1000))), "dtype": "torch.float32", "n": 990}
    torch.cuda.synchronize()
    assert torch.equal(buffer[10:].cpu(), torch.arange(10, 1000, dtype=torch.float32) + 1)
    assert torch.equal(buffer[:10].cpu(), torch.arange(10, dtype=torch.float32))


@pytest.mark.skipif(
    shutil.which("nvidia-cuda-mps-control") is None,
    reason="needs NVIDIA's MPS control daemon on PATH",
)
@pytest.mark.parametrize("mode", ["mps", "auto"])
def test_mps_sharing_runs_under_the_runs_own_daemon_and_syncs_every_step(
    tmp_path, tiny_model, mode
):
    """``rollout.gpu_sharing=mps`` (and auto, where the daemon is on PATH): the nodes are
    clients of a daemon the run starts (its logs in the run folder) and ends; CUDA IPC weight
    sync works between the two MPS clients."""
    before = set(Path(tempfile.gettempdir()).glob("arl-mps-*"))
    cfg = gpu_config(tmp_path, tiny_model, 1, f"rollout.gpu_sharing={mode}")
    _run_and_check(cfg, "auto (ipc_buffer) under MPS")
    log = cfg.run_path / "mps" / "daemon.out"  # in the foreground it logs to its stdout
    text = log.read_text() if log.exists() else ""
    assert "Server" in text and "Exit" in text, (
        f"the run's own daemon did not serve and end:\n{text}"
    )
    left = set(Path(tempfile.gettempdir()).glob("arl-mps-*")) - before
    assert not left, f"the daemon's pipe folder was left behind: {left}"
