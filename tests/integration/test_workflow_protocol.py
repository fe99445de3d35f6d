"""A workflow written only to the `Workflow` protocol runs through training and evaluation.

The protocol declares what the rollout node passes (``sampling``, ``n_samples``); a workflow
with exactly that signature trains and is evaluated in a real run (real nodes, the tiny model).
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from arl.run import run
from arl.stats.logger import read_jsonl
from arl.workflows.base import Workflow, WorkflowFactory
from tests.support.protocol_workflow import ProtocolWorkflow
from tests.support.tiny_model import make_tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _params(fn) -> list[tuple[str, object, object]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != "self"]


def test_the_test_workflow_has_exactly_the_protocols_signatures():
    assert _params(ProtocolWorkflow.arun_episode) == _params(Workflow.arun_episode)
    assert _params(ProtocolWorkflow.__init__) == _params(WorkflowFactory.__call__)


def test_protocol_workflow_trains_and_is_evaluated(tmp_path, tiny_model):
    cfg = tiny_run_config(
        tmp_path,
        tiny_model,
        "rollout.workflow=tests.support.protocol_workflow:ProtocolWorkflow",
        "cluster.allowed_import_prefixes=[arl.,tests.support.]",
        "experiment.total_train_steps=2",
        "weight_sync.verify=false",
        "evaluator.freq_steps=1",
        "evaluator.n_samples=4",
        "evaluator.max_questions=3",
    )
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # Training: the workflow's own sampling and group size (2 groups x 2 samples).
        assert r["rollout/reward_mean"] == pytest.approx(0.5)
        assert r["batch/n_seqs"] == 4
        # Evaluation: the evaluator's greedy sampling and its 4 samples per question.
        assert r["eval/accuracy"] == pytest.approx(0.25)
        assert r["eval/n"] == 3
