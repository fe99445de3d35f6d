"""A reward module beside the recipe, named by ``rollout.reward``: the launcher (which
validates the import) and the nodes (which import it) both find it, from any working directory,
as ``python recipe.py`` would (real `python -m arl.launch`, real nodes, the tiny model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_a_reward_module_beside_the_recipe_is_found_by_the_nodes(tmp_path, tiny_model):
    folder = tmp_path / "myexp"
    folder.mkdir()
    (folder / "arl_test_beside_reward.py").write_text(
        "async def score(completion, data):\n    return 0.5\n"
    )
    (folder / "r.py").write_text(
        "from arl.config import Config\n\n\ndef make_config():\n"
        "    c = Config()\n"
        "    c.data.loader = 'arl.data.arith:load_arith'\n"
        "    c.rollout.reward = 'arl_test_beside_reward:score'\n"
        "    c.cluster.allowed_import_prefixes = ['arl.', 'arl_test_beside_reward']\n"
        "    return c\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "arl.launch",
        str(folder / "r.py"),
        f"experiment.run_dir={tmp_path / 'runs'}",
        f"actor.path={tiny_model}",
        "actor.dtype=float32",
        "experiment.total_train_steps=1",
        "data.batch_size=2",
        "gconfig.n_samples=2",
        "gconfig.max_new_tokens=4",
        "data.max_prompt_len=128",
        "actor.max_tokens_per_mb=512",
        "cluster.n_gpus=0",
        "evaluator.freq_steps=none",
        "stats.tensorboard=false",
        "stats.progress_bar=false",
        "saver.hf_export=false",
    ]
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "done: 1 step in " in res.stdout, res.stdout[-2000:]
    assert "reward 0.500" in res.stdout, res.stdout[-2000:]
