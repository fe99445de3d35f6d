"""`python -m arl.bench startup` on CPU: the arith recipe launched twice (cold, warm) as a user
launches it, on the tiny model, one step each; ~30 s on two cores, hence ``slow``."""

from __future__ import annotations

import json

import pytest

from arl.bench.startup import main
from tests.support.tiny_model import make_tiny_model


@pytest.mark.slow
def test_startup_bench_times_both_launches_phase_by_phase(tmp_path, capsys):
    tiny = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "startup.json"
    argv = ["--steps", "1", "--run-dir", str(tmp_path / "runs"), "--out", str(out)]
    overrides = [f"actor.path={tiny}", "actor.dtype=float32", "cluster.n_gpus=0"]
    assert main([*argv, *overrides, "evaluator.freq_steps=none"]) == 0
    m = json.loads(out.read_text())
    for label in ("cold", "warm"):
        run = m[label]
        assert 0 < run["setup_done_s"] < run["first_step_s"] <= run["launch_to_exit_s"]
        assert set(run["phases"]) == {
            "config_saved",
            "nodes_joined",
            "rollout_setup",
            "engine_ready",
            "train_created",
            "train_ready",
            "train_warm_up",
        }
        assert run["phases"]["engine_ready"]["at_s"] <= run["setup_done_s"] + 0.05
        assert run["phases"]["train_ready"]["at_s"] <= run["setup_done_s"] + 0.05
    assert m["arith.first_step_s_warm"] == round(m["warm"]["first_step_s"], 2)
    assert m["arith.launch_to_exit_s_warm"] == round(m["warm"]["launch_to_exit_s"], 2)
    assert m["floors"]["import_s"] > 0 and m["floors"]["model_load_s"] > 0
    assert not (tmp_path / "runs" / "arl-cache").exists()  # the bench's cache, removed
    assert "| first_step_s: launch to the end of step 1 |" in capsys.readouterr().out
