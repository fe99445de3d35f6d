"""The whole loop on CPU with real nodes: rollout and training on separate processes."""

from __future__ import annotations

import asyncio
import logging

import pytest

from arl.run import run
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_three_steps_eta1_weights_synced_versions_recorded(tmp_path, tiny_model, caplog, capsys):
    caplog.set_level(logging.INFO, logger="arl")
    cfg = tiny_run_config(tmp_path, tiny_model, "stats.tensorboard=true")
    asyncio.run(run(cfg))
    # The run ending its own nodes is no loss; its last lines say what ran and where it went.
    assert not [r.getMessage() for r in caplog.records if " lost" in r.getMessage()]
    out = capsys.readouterr().out
    assert "done: 3 steps in " in out and "last step: reward " in out
    for name in ("metrics.jsonl", "tensorboard", "trace.json", "checkpoints"):
        assert str(cfg.run_path / name) in out
    assert f"python -m arl.stats.plot {cfg.run_path / 'metrics.jsonl'}" in out
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
    model = AutoModelForCausalLM.from_pretrained(export, dtype="float32")
    # Each tensor crossed once: the tied output layer is the embedding's, on both sides.
    assert model.config.tie_word_embeddings
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {r["sync/bytes"] for r in rows} == {unique}
