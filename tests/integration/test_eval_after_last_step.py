"""A run shorter than ``evaluator.freq_steps`` still ends with held-out accuracy (real nodes,
the tiny model): the arith CPU preset evaluates every 6 steps, and a 2-step run once, last."""

import asyncio

import pytest

from arl.run import run
from arl.stats.logger import read_jsonl
from tests.support.tiny_model import make_tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_a_run_shorter_than_freq_steps_is_evaluated_after_its_last_step(tmp_path, tiny_model):
    cfg = tiny_run_config(
        tmp_path,
        tiny_model,
        "experiment.total_train_steps=2",
        "weight_sync.verify=false",
        "evaluator.freq_steps=6",
        "evaluator.max_questions=2",
    )
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert "eval/accuracy" not in rows[0]
    assert rows[1]["eval/n"] == 2 and 0 <= rows[1]["eval/accuracy"] <= 1
