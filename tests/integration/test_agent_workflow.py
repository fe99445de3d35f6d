"""Agent workflows on real nodes: a tool-using conversation becomes trajectories, failing agents
and filters are counted without stalling rollout, and the whole loop trains an agent."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoTokenizer

from arl.agent.chat_format import ChatFormat
from arl.agent.examples.math_agent import run_with_calculator
from arl.control.rollout import RolloutController, RolloutFailed
from arl.control.staleness import StalenessSemaphore
from arl.data.arith import make_arith
from arl.data.loader import StatefulLoader
from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine
from arl.filters import nonconstant_reward
from arl.protocol.remote import rollout_worker
from arl.rewards.arith import arith_reward
from arl.run import run
from arl.stats.logger import read_jsonl
from arl.workflows.agent import AgentWorkflow
from tests.support.agents import CALL, FINAL, ROW, conversation_ids, make_tool_model
from tests.support.cluster import local_cluster
from tests.support.tiny_model import make_tiny_model, tiny_run_config

HANG_GUARD_S = 300  # only against a hang; the tests assert outcomes, not times


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tiny) -> str:
    return make_tool_model(tiny, tmp_path_factory.mktemp("model") / "tool")


def test_two_turn_tool_conversation_becomes_the_expected_trajectories(tool_model):
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(tool_model)
    greedy = SamplingParams(max_new_tokens=40, greedy=True, stop_token_ids=[tok.eos_token_id])

    async def main():
        with HFEngine(tool_model) as engine:
            out = {}
            for style, discount in (("concat", 1.0), ("individual", 0.5)):
                wf = AgentWorkflow(
                    tok,
                    arith_reward,
                    greedy,
                    agent=run_with_calculator,
                    n_samples=2,
                    trajectory=style,
                    turn_discount=discount,
                )
                out[style] = await wf.arun_episode(engine, ROW)
            return out

    groups = asyncio.run(main())
    full, (answer1, answer2) = conversation_ids(ChatFormat(tok))
    # concat: each episode is one row, the whole conversation (prompt, the model's tool call,
    # the tool's "42", the final answer), trained on the two answers only.
    concat = groups["concat"].tensors
    assert concat["input_ids"].shape == (2, len(full))
    assert groups["concat"].texts == (FINAL, FINAL)  # the final answer, scored by the reward
    assert concat["rewards"].tolist() == [1.0, 1.0]
    assert groups["concat"].episode_rewards == (1.0, 1.0)
    for i in range(2):
        assert concat["input_ids"][i].tolist() == full
        lm, turns = concat["loss_mask"][i], concat["turn_ids"][i]
        assert concat["input_ids"][i][lm].tolist() == answer1 + answer2
        assert turns[lm].tolist() == [0] * len(answer1) + [1] * len(answer2)
        assert (turns[~lm] == -1).all() and (concat["versions"][i][~lm] == -1).all()
        text = tok.decode(concat["input_ids"][i].tolist())
        assert CALL in text and "<|im_start|>tool\n42<|im_end|>" in text
    # individual: one row per completion; the first turn's reward is discounted once.
    ind = groups["individual"].tensors
    assert ind["rewards"].tolist() == [0.5, 1.0, 0.5, 1.0]
    assert groups["individual"].episode_rewards == (1.0, 1.0)
    first = ind["input_ids"][0][ind["attention_mask"][0]].tolist()
    assert first == full[: len(first)] and first[-len(answer1) :] == answer1
    assert ind["input_ids"][1][ind["loss_mask"][1]].tolist() == answer2
    assert ind["turn_ids"][1][ind["loss_mask"][1]].unique().tolist() == [1]


def _worker_kwargs(model: str, agent: str, **more) -> dict:
    return {
        "model_path": model,
        "workflow": "arl.workflows.agent:AgentWorkflow",
        "agent": agent,
        **more,
        "reward": "arl.rewards.arith:arith_reward",
        "sampling": {"max_new_tokens": 4},
        "n_samples": 2,
    }


def test_failing_agents_and_filters_are_counted_and_never_stall_rollout(tiny):
    rows = make_arith(16, seed=0, split="train")

    async def main():
        async with local_cluster(1) as (_, (node,), _):
            flaky = await node.create(
                "arl.node.rollout:RolloutWorker",
                **_worker_kwargs(tiny, "tests.support.agents:every_other_fails"),
            )
            # A user's subclass of the agent workflow, with a keyword of its own.
            broken = await node.create(
                "arl.node.rollout:RolloutWorker",
                **_worker_kwargs(
                    tiny,
                    "tests.support.agents:always_fails",
                    workflow="tests.support.agents:NotedAgentWorkflow",
                    workflow_kwargs={"note": "noted by the subclass"},
                ),
            )
            # One at a time: transformers' lazy imports race in threads.
            await rollout_worker(flaky).setup()
            await rollout_worker(broken).setup()
            direct = await rollout_worker(broken).run_group("direct", rows[0])

            async def free(refs):
                await node.call("free", {"keys": [r.key for r in refs]})

            def controller(worker, tag, **kw) -> RolloutController:
                rc = RolloutController(
                    [worker],
                    StatefulLoader(rows, 1, shuffle=False),
                    StalenessSemaphore(2, 0, 4),
                    peers={node.node_id: node.info["data_addr"]},
                    free=free,
                    **kw,
                )
                rc.run_tag = tag
                return rc

            async def take(rc: RolloutController):
                rc.start()
                try:
                    return await asyncio.wait_for(rc.prepare_batch(2, 0), HANG_GUARD_S)
                finally:
                    await rc.stop()

            # An agent that raises in one episode of each group: the other episode trains.
            goes_on = controller(flaky, "a")
            batch, infos = await take(goes_on)
            # A filter that rejects everything (each group keeps one episode, so its rewards
            # never differ): a clear error after 3 rejections in a row, not a hang.
            picky = controller(flaky, "f", accept=nonconstant_reward, max_consecutive_rejections=3)
            with pytest.raises(RolloutFailed) as filtered:
                await take(picky)
            # A workflow that rejects every group (all its episodes fail): the same bound.
            rejecting = controller(broken, "w", max_consecutive_rejections=3)
            with pytest.raises(RolloutFailed) as refused:
                await take(rejecting)
            return direct, batch, infos, goes_on, picky, rejecting, filtered, refused

    direct, batch, infos, goes_on, picky, rejecting, filtered, refused = asyncio.run(main())
    assert direct["rejected"] and direct["failed_samples"] == 2 and "meta" not in direct
    assert "always_fails: broken agent" in direct["reason"]
    assert direct["reason"].endswith("(noted by the subclass)")

    assert len(batch.refs) == 2
    assert [i.group_size for i in infos] == [1, 1]
    assert [i.failed_samples for i in infos] == [1, 1]
    assert goes_on.stats.rejected_samples >= 2 and goes_on.stats.rejected == 0

    assert "3 prompt groups in a row were rejected" in str(filtered.value)
    assert "nonconstant_reward" in str(filtered.value)
    assert picky.stats.rejected >= 3 and picky.stats.accepted == 0
    assert "the workflow rejected it: all 2 agent episodes failed" in str(refused.value)
    assert rejecting.stats.rejected >= 3 and rejecting.stats.rejected_samples >= 6
    # Rejected groups release their staleness slots: nothing is left running.
    for rc in (picky, rejecting):
        assert rc.sem.running == 0 and rc.sem.accepted == 0


def test_trainer_runs_the_tool_agent_multi_turn(tmp_path, tool_model):
    max_new = 40
    cfg = tiny_run_config(
        tmp_path,
        tool_model,
        "experiment.total_train_steps=2",
        "cluster.allowed_import_prefixes=[arl.,tests.]",
        "data.loader=tests.support.agents:load_tool_rows",
        "data.max_prompt_len=512",
        f"gconfig.max_new_tokens={max_new}",
        # Sampling cool enough that the taught conversation replays; a small step keeps it.
        "gconfig.temperature=0.1",
        "actor.temperature=0.1",
        "actor.lr=1e-5",
        "actor.max_tokens_per_mb=1024",
        "rollout.workflow=arl.workflows.agent:AgentWorkflow",
        "rollout.agent=arl.agent.examples.math_agent:run_with_calculator",
        "rollout.agent_trajectory=concat",
        "evaluator.freq_steps=2",
        "evaluator.max_questions=2",
    )
    asyncio.run(run(cfg))
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sync/checksum_match"] is True
        assert r["train/n_tokens"] > 0
        assert r["rollout/rejected"] == 0
    # Rows longer (in trained tokens) than one completion can be: conversations of several
    # turns were trained as one sequence each.
    assert max(r["train/gen_len_mean"] for r in rows) > max_new
    assert rows[-1]["eval/accuracy"] == 1.0  # greedy: the taught conversation, answer 42
