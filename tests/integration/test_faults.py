"""Faults during a real run: a node killed with SIGKILL, or stopped with SIGSTOP (alive, but its
heartbeats stop), stops the run with a clear error naming it and what it was doing, and no
process of the run is left behind (the stopped one included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _children(pid: int) -> dict[int, str]:
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True
    ).stdout
    procs = {}
    for line in out.splitlines():
        p, pp, args = line.split(None, 2)
        if int(pp) == pid:
            procs[int(p)] = args
    return procs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize(
    ("victim", "sig"),
    [("rollout0", signal.SIGKILL), ("train0", signal.SIGKILL), ("train0", signal.SIGSTOP)],
    ids=["kill-rollout0", "kill-train0", "stop-train0"],
)
def test_lost_node_stops_the_run_naming_it(tmp_path, tiny_model, victim, sig):
    cmd = [
        sys.executable,
        "-m",
        "arl.launch",
        "recipes/arith.py",
        f"experiment.run_dir={tmp_path}",
        "experiment.total_train_steps=1000",
        f"actor.path={tiny_model}",
        "actor.dtype=float32",
        "cluster.n_gpus=0",
        "data.batch_size=2",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8",
        "evaluator.freq_steps=none",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        "cluster.heartbeat_interval=0.2",
        "cluster.heartbeat_timeout=10",
        "saver.hf_export=false",
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    metrics = tmp_path / "arith-grpo" / "trial0" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run made no step"
            time.sleep(0.1)
        nodes = {pid: args for pid, args in _children(proc.pid).items() if "arl.node" in args}
        assert len(nodes) == 2, nodes
        target = next(pid for pid, args in nodes.items() if f"--node-id {victim}" in args)
        os.kill(target, sig)  # mid-run: the loop is always rolling out or training
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert f"error: the run stopped: node {victim} was lost while running" in err, err[-3000:]
    if sig == signal.SIGSTOP:
        assert "no heartbeat for" in err, err[-3000:]
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in nodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in nodes if _alive(p)], "a node outlived the run"
