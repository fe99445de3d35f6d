"""recover.mode=auto: the launcher restarts a failed run from its last checkpoint by itself.

One ``python -m arl.launch`` process; a rollout node is killed (SIGKILL) once a checkpoint of
step 2 or later is on disk (a tiny model's step takes a fraction of a second: the run is long
enough for the kill to land mid-run). The launcher sees the node lost, ends every process of
that attempt, starts a fresh cluster, resumes from that checkpoint and finishes: each step is
trained once (one may be logged twice), on the same batches an uninterrupted run would have
taken.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arl.config import apply_overrides
from arl.data.loader import StatefulLoader, load_rows
from arl.node.rollout import data_id
from arl.recipe import load_recipe
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
B, STEPS = 2, 12


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _overrides(run_dir: Path, model: str) -> list[str]:
    return [
        f"experiment.run_dir={run_dir}",
        "experiment.name=sup",
        f"experiment.total_train_steps={STEPS}",
        f"actor.path={model}",
        "actor.dtype=float32",
        "cluster.n_gpus=0",
        f"data.batch_size={B}",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8",
        "rollout.max_head_offpolicyness=1",
        "evaluator.freq_steps=none",
        "recover.mode=auto",
        "recover.freq_steps=1",
        "recover.retries=2",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        "cluster.heartbeat_interval=0.3",
        "cluster.heartbeat_timeout=5",
        "saver.hf_export=false",
        "rollout.batch_order=submitted",
    ]


def _descendants(root: int) -> dict[int, str]:
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True
    ).stdout
    parent, args = {}, {}
    for line in out.splitlines():
        p, pp, a = (line.split(None, 2) + [""])[:3]
        parent[int(p)], args[int(p)] = int(pp), a
    found, frontier = {}, [root]
    while frontier:
        cur = frontier.pop()
        for p, pp in parent.items():
            if pp == cur and p not in found:
                found[p] = args[p]
                frontier.append(p)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_node_is_recovered_by_the_launcher_itself(tmp_path, tiny_model):
    overrides = _overrides(tmp_path, tiny_model)
    cmd = [sys.executable, "-m", "arl.launch", "recipes/arith.py", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A file, not a pipe: nobody reads during the run, and a full pipe would block the launcher.
    log_path = tmp_path / "launcher.err"
    log_file = log_path.open("w")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True
    )
    run_path = tmp_path / "sup" / "trial0"
    latest = run_path / "recover" / "latest"
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 600
        while not (latest.exists() and int(latest.read_text().strip().removeprefix("step")) >= 2):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step-2 checkpoint in time"
            seen.update(_descendants(proc.pid))
            time.sleep(0.05)
        first = {p: a for p, a in _descendants(proc.pid).items() if "arl.node" in a}
        seen.update(first)
        victim = next(p for p, a in first.items() if "--node-id rollout0" in a)
        os.kill(victim, signal.SIGKILL)
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the launcher did not finish"
            seen.update(_descendants(proc.pid))
            time.sleep(0.5)
    finally:
        proc.kill()
        log_file.close()
    err = log_path.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert "node rollout0 was lost" in err and "recovery: restarting" in err, err[-3000:]
    assert err.count("recovery: restarting") == 1, err[-3000:]
    assert "recovery: this attempt stopped: node rollout0 was lost" in err, err[-3000:]
    assert "error: the run stopped" not in err, err[-3000:]  # it did not: it went on
    assert re.search(rf"done: {STEPS} steps \(\d+ in this attempt, resumed from step \d+\)", err)
    # Every process of both attempts is gone, the killed attempt's included.
    assert [p for p in first if p != victim and _alive(p)] == []
    assert [(p, a) for p, a in seen.items() if _alive(p)] == []

    rows = read_jsonl(run_path / "metrics.jsonl")
    steps = [r["step"] for r in rows]
    assert set(steps) == set(range(1, STEPS + 1)), steps
    assert len(steps) - len(set(steps)) <= 1, steps  # at most one step logged twice
    assert steps == sorted(steps), steps
    # With rollout.batch_order=submitted the batches are those of an uninterrupted run: the
    # loader's order, B prompts per step. (The default, finished, takes groups as they finish;
    # tests/integration/test_batch_order.py checks what its checkpoints resume.)
    cfg = apply_overrides(load_recipe(str(REPO / "recipes" / "arith.py")), overrides)
    rows_in = load_rows(cfg, cfg.data.train_split)
    loader = StatefulLoader(rows_in, 1, cfg.data.shuffle, seed=cfg.experiment.seed)
    expected = [data_id(loader.next_batch()[0]) for _ in range(STEPS * B)]
    last = {r["step"]: r for r in rows}
    trained = [i for s in range(1, STEPS + 1) for i in last[s]["batch/data_ids"]]
    assert trained == expected
    assert [last[s]["version"] for s in range(1, STEPS + 1)] == list(range(1, STEPS + 1))
