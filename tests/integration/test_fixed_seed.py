"""A fixed-seed CPU run gives bit-identical losses and gradient norms to the recorded run.

A refactor must not change what the training step computes: this test runs the tiny model for
3 steps at eta = 0 with a reward that depends on the text alone and compares every step's loss,
gradient norm, entropy and token count with ``tests/golden/fixed_seed_cpu.json`` exactly
(``==`` on floats). A change that means to alter the numbers records a new file with
``ARL_RECORD_GOLDEN=1 python3 -m pytest tests/integration/test_fixed_seed.py`` and says why in
its commit message.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from arl.run import run
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model, tiny_run_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "fixed_seed_cpu.json"
KEYS = ("train/loss", "train/grad_norm", "train/entropy", "train/n_tokens", "train/clip_frac")


def _run(tmp_path: Path, model: str) -> list[dict]:
    cfg = tiny_run_config(
        tmp_path,
        model,
        "rollout.max_head_offpolicyness=0",
        "rollout.reward=tests.support.deterministic:vowel_reward",
        "cluster.allowed_import_prefixes=[arl,tests]",
        "weight_sync.verify=false",
        "experiment.seed=3",
        # One generation at a time: the engine's sampling RNG is drawn in the same order
        # whatever the timing (concurrent requests interleave by when they arrive). One
        # sample per prompt, normalised over the batch, still gives every step an update.
        "rollout.max_concurrent_rollouts=1",
        "gconfig.n_samples=1",
        "actor.reward_norm_mean=batch",
        "actor.reward_norm_std=batch",
    )
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    return [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in rows]


def test_fixed_seed_run_is_bit_identical_to_the_recorded_run(tmp_path):
    model = make_tiny_model(tmp_path / "tiny", seed=0)
    got = _run(tmp_path, model)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert any(r["train/grad_norm"] > 0 for r in got), "a run that does not train proves nothing"
    if os.environ.get("ARL_RECORD_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    assert GOLDEN.exists(), f"no recorded run at {GOLDEN}; record one with ARL_RECORD_GOLDEN=1"
    want = json.loads(GOLDEN.read_text())
    for g, w in zip(got, want, strict=True):
        assert g == w, f"step {w['step']}: got {g}, recorded {w}"
