"""Recovery: kill the launcher after step 2, restart, and continue at step 3 as if uninterrupted.

With ``rollout.batch_order=submitted`` the resumed run trains the batches of an uninterrupted
one; with ``finished`` (the default; batches depend on timing) it never trains a group twice.
"""

from __future__ import annotations

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
B, ETA = 2, 1


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _command(run_dir: Path, model: str, steps: int, order: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "arl.launch",
        "recipes/arith.py",
        f"experiment.run_dir={run_dir}",
        "experiment.name=rec",
        f"experiment.total_train_steps={steps}",
        f"actor.path={model}",
        "actor.dtype=float32",
        "actor.lr=1e-3",
        "cluster.n_gpus=0",
        f"data.batch_size={B}",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8",
        f"rollout.max_head_offpolicyness={ETA}",
        "evaluator.freq_steps=none",
        "recover.mode=auto",
        "recover.freq_steps=1",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        "cluster.heartbeat_timeout=30",
        "saver.hf_export=false",
        f"rollout.batch_order={order}",
    ]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "rec" / "trial0" / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []


@pytest.mark.parametrize("order", ["submitted", "finished"])
def test_killed_launcher_resumes_at_next_step_with_same_batches(tmp_path, tiny_model, order):
    ref_dir, rec_dir = tmp_path / "ref", tmp_path / "rec"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if order == "submitted":  # the uninterrupted reference run
        cmd = _command(ref_dir, tiny_model, 4, order)
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=600)
        ref = _metrics(ref_dir)
        assert [r["step"] for r in ref] == [1, 2, 3, 4]

    # The same run, killed (SIGKILL: no cleanup at all) once step 2's checkpoint is on disk.
    proc = subprocess.Popen(
        _command(rec_dir, tiny_model, 4, order), cwd=REPO, env=env, start_new_session=True
    )
    latest = rec_dir / "rec" / "trial0" / "recover" / "latest"
    deadline = time.monotonic() + 600
    while not (latest.exists() and latest.read_text().strip() == "step2"):
        assert proc.poll() is None, "the run ended before step 2 was checkpointed"
        assert time.monotonic() < deadline, "no step-2 checkpoint in time"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

    # Restart: it continues at step 3.
    cmd = _command(rec_dir, tiny_model, 4, order)
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=600)
    rows = _metrics(rec_dir)
    steps = [(r["run_id"], r["step"]) for r in rows]
    killed = [step for run_id, step in steps if run_id == rows[0]["run_id"]]
    restarted = [step for run_id, step in steps if run_id != rows[0]["run_id"]]
    # The kill lands once step 2's checkpoint is on disk: before step 3's line, or after it
    # when this process was slow to look; the restart continues at step 3 either way.
    assert killed in ([1, 2], [1, 2, 3]) and restarted == [3, 4], steps
    resumed = {r["step"]: r for r in rows}  # a step logged twice keeps its last line
    assert set(resumed) == {1, 2, 3, 4}
    trained = [i for step in (1, 2, 3, 4) for i in resumed[step]["batch/data_ids"]]
    assert len(trained) == 4 * B and len(set(trained)) == len(trained), trained
    if order == "submitted":
        for step in (1, 2, 3, 4):
            assert resumed[step]["batch/data_ids"] == ref[step - 1]["batch/data_ids"], step
    # No burst: the staleness counters were restored, so by the end of step 3 (version 3) the
    # restarted rollout started at most (eta + 3 + 1) * B groups minus the 2 * B already trained;
    # fresh counters would have allowed 2 * B more.
    assert resumed[3]["rollout/submitted"] <= (ETA + 3 + 1) * B - 2 * B
    assert resumed[3]["version"] == 3
    # Each checkpoint's seconds reach the next step's row (recover.freq_steps=1: every step).
    assert resumed[4]["ckpt/save_s"] > 0
