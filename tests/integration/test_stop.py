"""A stop is a checkpoint: SIGTERM mid-run saves where the run is, and the same command resumes.

Real launcher processes on the tiny model with default recovery settings (``recover.mode``
disabled): SIGTERM after step 2 of 6 exits 143 with a recovery checkpoint; a rerun with another
batch size is refused before any node starts, naming the key; the same command resumes and
trains only the remaining steps, on the data ids of an uninterrupted run
(``rollout.batch_order=submitted``), and ends 0; a third run is refused as finished. A first
Ctrl-C stops the same way (exit 130); SIGKILL inside a checkpoint write leaves the previous one
loadable.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _command(run_dir: Path, model: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "arl.launch",
        "recipes/arith.py",
        f"experiment.run_dir={run_dir}",
        "experiment.name=stop",
        f"experiment.total_train_steps={STEPS}",
        f"actor.path={model}",
        "actor.dtype=float32",
        "actor.lr=1e-3",
        "cluster.n_gpus=0",
        "data.batch_size=2",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8",
        "evaluator.freq_steps=none",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        "saver.hf_export=false",
        "rollout.batch_order=submitted",
        *extra,
    ]


def _run(run_dir: Path, model: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(run_dir, model, *extra),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "stop" / "trial0" / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


def _signal_after_step(cmd: list[str], run_dir: Path, step: int, signum: int) -> tuple[int, str]:
    """Start ``cmd``, send ``signum`` once ``step`` steps are logged; (exit status, stderr)."""
    # As from a terminal: a shell's background job (a CI harness run with `&`) starts its
    # children with SIGINT ignored, which the launcher rightly leaves alone.
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 600
        while len(_rows(run_dir)) < step:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, f"no step {step} in time"
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, err


def test_sigterm_saves_and_the_same_command_resumes_on_the_same_data(tmp_path, tiny_model):
    ref = _run(tmp_path / "ref", tiny_model)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = [r["batch/data_ids"] for r in _rows(tmp_path / "ref")]
    assert len(want) == STEPS

    run_dir = tmp_path / "run"
    returncode, err = _signal_after_step(_command(run_dir, tiny_model), run_dir, 2, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    recover = run_dir / "stop" / "trial0" / "recover"
    state = json.loads((recover / (recover / "latest").read_text() / "state.json").read_text())
    stopped_at = state["step"]
    # The signal lands once step 2 is logged: the step then in progress is finished or, while
    # it waits for its batch, abandoned.
    assert stopped_at in (2, 3) and state["stopped"], state
    assert f"stopped by SIGTERM after step {stopped_at}: the recovery checkpoint was " in err
    assert f"written to {recover / f'step{stopped_at}'} in " in err, err[-3000:]
    assert "run the same command to resume from it" in err
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, stopped_at + 1))

    # What a resume cannot carry is refused before any node starts, naming the key.
    other = _run(run_dir, tiny_model, "data.batch_size=4")
    assert other.returncode == 2, other.stderr[-3000:]
    errors = [line for line in other.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "data.batch_size 2 -> 4" in errors[0], errors[0]
    assert "arl.node" not in other.stderr and "node train0" not in other.stderr

    again = _run(run_dir, tiny_model)  # what a Slurm requeue runs
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from step {stopped_at}" in again.stdout + again.stderr
    rows = _rows(run_dir)
    first_id = rows[0]["run_id"]
    assert [r["step"] for r in rows if r["run_id"] != first_id] == list(
        range(stopped_at + 1, STEPS + 1)
    )
    assert [r["batch/data_ids"] for r in rows] == want

    finished = _run(run_dir, tiny_model)  # the run is complete: not resumed a second time
    assert finished.returncode == 2, finished.stderr[-3000:]
    assert "already holds a run" in finished.stderr and "cannot continue" in finished.stderr


def test_a_first_ctrl_c_is_a_stop_too(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    cmd = _command(run_dir, tiny_model, "experiment.total_train_steps=50")
    returncode, err = _signal_after_step(cmd, run_dir, 1, signal.SIGINT)
    assert returncode == 130, err[-3000:]
    assert "Ctrl-C: stopping after this step with a recovery checkpoint" in err, err[-3000:]
    assert "stopped by Ctrl-C after step " in err and "Traceback" not in err, err[-3000:]
    recover = run_dir / "stop" / "trial0" / "recover"
    state = json.loads((recover / (recover / "latest").read_text() / "state.json").read_text())
    assert state["stopped"] and state["step"] >= 1
    assert sorted(p.name for p in (recover / f"step{state['step']}" / "model").iterdir()) == [
        "optim-rank0.safetensors",
        "params-rank0.safetensors",
        "rank0.json",
        "rng-rank0.bin",
    ]


def test_a_stop_past_its_grace_period_ends_without_the_checkpoint(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    cmd = _command(run_dir, tiny_model, "experiment.total_train_steps=50")
    returncode, err = _signal_after_step(
        [*cmd, "recover.stop_grace_s=0.001"], run_dir, 1, signal.SIGTERM
    )
    assert returncode == 128 + signal.SIGTERM, err[-3000:]
    assert (
        "stopped by SIGTERM: the run and its nodes were ended without a checkpoint: it was not "
        "written within recover.stop_grace_s=0.001s" in err
    ), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    recover = run_dir / "stop" / "trial0" / "recover"
    assert not recover.exists() or list(recover.iterdir()) == []  # no partial folder left


# Writes a stop checkpoint of step 1, then starts step 2's and waits inside the write (its
# rank state on disk, not yet committed) for the SIGKILL.
_KILLED_WRITER = """
import asyncio, sys, time
from pathlib import Path
import torch
from safetensors.torch import save_file
from arl.ckpt.rank_state import save_rank_state
from arl.ckpt.recovery import RecoveryState, Saver

run = Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)

def step():
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()

async def main():
    saver = Saver(run)
    step()
    async with saver.write(RecoveryState(1, 1, {"at": 1}, stopped=True)) as tmp:
        save_rank_state(tmp / "model", 0, 1, model, opt)
    save_file({"weight": model.weight.detach().clone()}, str(run / "want.safetensors"))
    step()
    async with saver.write(RecoveryState(2, 2, {"at": 2}, stopped=True)) as tmp:
        save_rank_state(tmp / "model", 0, 1, model, opt)
        (run / "writing").touch()
        time.sleep(600)

asyncio.run(main())
"""


def test_sigkill_during_the_stop_checkpoint_write_leaves_the_previous_loadable(tmp_path):
    import torch
    from safetensors.torch import load_file

    from arl.ckpt.rank_state import load_rank_state
    from arl.ckpt.recovery import RecoveryState, Saver, read_latest

    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None, "the writer ended early"
            assert time.monotonic() < deadline, "the writer never reached step 2's write"
            time.sleep(0.05)
        assert (tmp_path / "recover" / "step2.tmp" / "model" / "rank0.json").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    latest = read_latest(tmp_path)
    assert (latest.step, latest.stopped, latest.rollout) == (1, True, {"at": 1})
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    load_rank_state(latest.path / "model", 0, 1, model, opt)
    assert torch.equal(model.weight, load_file(str(tmp_path / "want.safetensors"))["weight"])
    assert set(opt.state[model.weight]) == {"step", "exp_avg", "exp_avg_sq"}

    async def save_again() -> None:  # the leftover partial folder is no obstacle
        async with Saver(tmp_path).write(RecoveryState(2, 2, {"at": 2})) as tmp:
            (tmp / "model").mkdir()

    asyncio.run(save_again())
    assert read_latest(tmp_path).step == 2
    assert sorted(p.name for p in (tmp_path / "recover").iterdir()) == ["latest", "step2"]
