"""The whole loop on CPU with real nodes: rollout and training on separate processes."""

from __future__ import annotations

import asyncio

import pytest

from arl.config import Config, apply_overrides
from arl.stats.logger import read_jsonl
from arl.trainer import run
from tests.support.tiny_model import make_tiny_model


def tiny_config(tmp_path, model: str, *overrides: str) -> Config:
    """Three steps of arith GRPO on the tiny model, eta=1, hf:d1 + fsdp:d1 on CPU."""
    cfg = apply_overrides(
        Config(),
        [
            f"experiment.run_dir={tmp_path / 'runs'}",
            "experiment.name=e2e",
            "experiment.total_train_steps=3",
            f"actor.path={model}",
            "actor.dtype=float32",
            "data.loader=arl.data.arith:load_arith",
            "data.batch_size=2",
            "data.max_prompt_len=128",
            "rollout.reward=arl.rewards.arith:arith_reward",
            "rollout.max_head_offpolicyness=1",
            "gconfig.n_samples=2",
            "gconfig.max_new_tokens=12",
            "cluster.n_gpus=0",
            "cluster.heartbeat_timeout=30",
            "stats.tensorboard=true",
            "stats.progress_bar=false",
            "weight_sync.verify=true",
            "actor.max_tokens_per_mb=512",
            "actor.lr=1e-3",
            *overrides,
        ],
    )
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_three_steps_eta1_weights_synced_versions_recorded(tmp_path, tiny_model):
    cfg = tiny_config(tmp_path, tiny_model)
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        # After each sync every engine holds exactly the trainer's weights.
        assert r["sync/checksum_match"] is True
        assert r["version"] == r["step"]
        assert r["rollout/staleness_max"] <= 1  # eta = 1
        assert r["train/n_tokens"] > 0
    # Weights moved, so the checksums differ from step to step.
    assert len({r["sync/checksum"] for r in rows}) == 3
    # After the loop the final policy is exported as an HF folder.
    from transformers import AutoModelForCausalLM

    export = cfg.run_path / "checkpoints" / "step3"
    AutoModelForCausalLM.from_pretrained(export)
