"""A full disk while checkpointing leaves the previous recovery checkpoint valid.

The run test puts the run's ``recover/`` folder on a real tmpfs big enough for one checkpoint
but not two, so the train rank's second save fails with ENOSPC (the rank checks the free space
before writing and names the bytes needed and free). It needs root and a mount(2) the container
allows; elsewhere it is skipped with the reason, and the
`Saver` tests below still fail its write with a real ENOSPC ``OSError`` raised from inside the
write (where the train ranks' error surfaces).
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arl.ckpt.recovery import CheckpointError, RecoveryState, Saver
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


def _save(saver: Saver, step: int, model_bytes: bytes = b"w" * 1000, fail: bool = False) -> None:
    async def go():
        async with saver.write(RecoveryState(step, step, {"at": step})) as tmp:
            (tmp / "model").mkdir()
            (tmp / "model" / "weights.bin").write_bytes(model_bytes)
            if fail:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "model"))

    asyncio.run(go())


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    saver = Saver(tmp_path)
    _save(saver, 1, b"first")
    with pytest.raises(CheckpointError) as info:
        _save(saver, 2, b"second", fail=True)
    message = str(info.value)
    assert f"step 2 to {tmp_path / 'recover' / 'step2.tmp'}" in message
    assert "No space left on device" in message
    assert f"{tmp_path / 'recover' / 'step1'} is still the latest" in message
    latest = saver.latest()
    assert latest.step == 1 and latest.rollout == {"at": 1}
    assert (latest.path / "model" / "weights.bin").read_bytes() == b"first"
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["latest", "step1"]
    # The next save goes through and replaces it.
    _save(saver, 3, b"third")
    assert saver.latest().step == 3
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["latest", "step3"]


def test_the_latest_checkpoint_is_never_overwritten(tmp_path):
    saver = Saver(tmp_path)
    _save(saver, 4, b"kept")
    with pytest.raises(CheckpointError, match="never overwritten"):
        _save(saver, 4, b"new")
    assert (saver.latest().path / "model" / "weights.bin").read_bytes() == b"kept"


def _mount_tmpfs(path: Path, size: int) -> str:
    """Mount a tmpfs of ``size`` bytes at ``path``; returns why not, or "" when mounted."""
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs"
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    return "" if res.returncode == 0 else f"mount refused here: {res.stderr.strip()}"


def test_run_with_a_full_disk_stops_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    model = make_tiny_model(tmp_path / "model")
    run_path = tmp_path / "runs" / "disk" / "trial0"
    recover = run_path / "recover"
    recover.mkdir(parents=True)
    # One checkpoint is the weights and AdamW's two moments: ~3x the fp32 model file (4x with
    # tied embeddings saved twice). 5x holds one, not two.
    size = 5 * (Path(model) / "model.safetensors").stat().st_size
    why = _mount_tmpfs(recover, size)
    if why:
        pytest.skip(why)
    try:
        cmd = [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/arith.py",
            f"experiment.run_dir={tmp_path / 'runs'}",
            "experiment.name=disk",
            "experiment.total_train_steps=3",
            f"actor.path={model}",
            "actor.dtype=float32",
            "cluster.n_gpus=0",
            "data.batch_size=2",
            "gconfig.n_samples=2",
            "gconfig.max_new_tokens=8",
            "evaluator.freq_steps=none",
            "recover.mode=auto",
            "recover.freq_steps=1",
            "stats.tensorboard=false",
            "stats.progress_bar=false",
            "saver.hf_export=false",
            "actor.call_timeout=300",  # a call left unanswered fails the test, not hangs it
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        err = res.stderr
        assert res.returncode == 1, err[-3000:]
        assert (
            f"error: the run stopped: writing the recovery checkpoint of step 2 to "
            f"{recover / 'step2.tmp'} failed" in err
        ), err[-3000:]
        assert "no space left on device" in err.lower(), err[-3000:]
        assert f"{recover / 'step1'} is still the latest" in err, err[-3000:]
        # A full disk is not worth a restart: the launcher says so and stops.
        assert "recovery: not restarting" in err and "recovery: restarting" not in err, err[-3000:]
        latest = Saver(run_path).latest()
        assert latest.step == 1 and latest.version == 1
        assert sorted(p.name for p in recover.iterdir()) == ["latest", "step1"]
        # The rank checks the free space first and names both sizes.
        assert "recovery state needs " in err and " bytes and " in err, err[-3000:]
        from safetensors.torch import load_file

        params = load_file(str(latest.path / "model" / "params-rank0.safetensors"))
        optim = load_file(str(latest.path / "model" / "optim-rank0.safetensors"))
        assert params and {k.rpartition("/")[2] for k in optim} == {"step", "exp_avg", "exp_avg_sq"}
        assert [r["step"] for r in read_jsonl(run_path / "metrics.jsonl")] == [1, 2]
    finally:
        subprocess.run(["umount", "-l", str(recover)], check=False)
