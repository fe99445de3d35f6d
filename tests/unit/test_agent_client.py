"""The OpenAI-shaped agent client over a real hf engine (tiny random Llama, SmolLM2 tokenizer),
what it records, and how recorded completions become trajectory rows."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arl.agent.chat_format import ChatFormat, MessageError, normalize_message
from arl.agent.client import ChatClient, CompletionRecord
from arl.agent.examples.math_agent import calculate, call_tool
from arl.agent.trajectory import (
    RewardError,
    discounted_returns,
    episode_rows,
    immediate_rewards,
    pack_rows,
)
from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine
from arl.filters import no_failed_samples, nonconstant_reward
from arl.protocol.report import report_from_wire
from arl.workflows.agent import AgentWorkflow
from arl.workflows.base import EpisodeRejected, group_score
from arl.workflows.rlvr import PromptTooLong
from tests.support.agents import always_fails, every_other_fails, plain_def_agent
from tests.support.tiny_model import make_tiny_model

torch.set_num_threads(1)
T = 0.7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny)


class SpyEngine(HFEngine):
    """The real engine, with every request and answer it handled written down."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    async def agenerate(self, input_ids, sampling):
        res = await super().agenerate(input_ids, sampling)
        self.seen.append((list(input_ids), res, sampling))
        return res


def sampling(tok, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 10), stop_token_ids=[2], **kw)


@pytest.fixture(scope="module")
def conversation(tiny, tok):
    """Two turns of one conversation (the second extends the first) and one fresh call."""

    async def main():
        with SpyEngine(tiny, seed=3) as spy:
            spy.set_version(5)
            client = ChatClient(spy, tok, sampling(tok))
            msgs = [{"role": "user", "content": "Say something."}]
            first = await client.chat.completions.create(messages=msgs, temperature=T)
            msgs += [first.choices[0].message, {"role": "user", "content": "And more?"}]
            second = await client.chat.completions.create(messages=msgs, temperature=T)
            fresh = await client.chat.completions.create(
                messages=[{"role": "user", "content": "Unrelated."}], temperature=T, max_tokens=4
            )
            return client, spy, msgs, (first, second, fresh)

    return asyncio.run(main())


def teacher_forced(model, ids: list[int], positions: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of ids[p] given ids[:p], for each p in positions."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(logp[p - 1, ids[p]]) for p in positions]


def test_recorded_tokens_are_what_the_engine_saw(conversation, tok):
    client, spy, msgs, responses = conversation
    recs = client.records
    assert len(recs) == len(spy.seen) == 3
    for rec, (seen_prompt, res, sp), resp in zip(recs, spy.seen, responses, strict=True):
        assert rec.prompt_ids == seen_prompt
        assert rec.output_ids == res.output_ids and rec.logprobs == res.logprobs
        assert rec.versions == [5] * len(rec.output_ids)  # the engine's version at the time
        assert sp.temperature == T and not sp.greedy
        assert resp.usage.prompt_tokens == len(rec.prompt_ids)
        assert resp.usage.completion_tokens == len(rec.output_ids)
        assert resp.choices[0].message.content == tok.decode(
            rec.output_ids, skip_special_tokens=True
        )
    assert spy.seen[2][2].max_new_tokens == 4  # max_tokens honoured
    # The second turn reuses the first turn's exact tokens, then the template's text for the
    # new messages: the same text the chat template gives for the whole conversation.
    first, second, fresh = recs
    assert second.parent == (first.index, first.choice) and fresh.parent is None
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == (
        first.prompt_ids + first.output_ids
    )
    templated = tok.apply_chat_template(
        [normalize_message(m) for m in msgs], tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(second.prompt_ids) == templated
    assert (
        first.prompt_ids
        == tok(
            tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )["input_ids"]
    )


def test_logprobs_equal_a_teacher_forced_pass(conversation, tiny):
    client, _, _, _ = conversation
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for rec in client.records:
        ids = rec.prompt_ids + rec.output_ids
        positions = list(range(len(rec.prompt_ids), len(ids)))
        expected = teacher_forced(model, ids, positions, T)
        assert rec.logprobs == pytest.approx(expected, abs=2e-4)
    # The packed conversation row, as the trainer sees it: the recorded log-probs sit where a
    # teacher-forced pass over the whole row puts them (both turns; none elsewhere).
    rewards = immediate_rewards(client.records, 1.0)
    rows = episode_rows(client.records, rewards, "concat", 1.0)
    assert len(rows) == 2  # the two-turn conversation, and the fresh call
    packed = pack_rows(rows)
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        mask = packed["loss_mask"][i, :n]
        positions = torch.nonzero(mask).squeeze(1).tolist()
        expected = teacher_forced(model, row.input_ids, positions, T)
        assert packed["logprobs"][i, positions].tolist() == pytest.approx(expected, abs=2e-4)
        assert (packed["logprobs"][i][~packed["loss_mask"][i]] == 0).all()
        assert (packed["versions"][i, :n][mask] == 5).all()
    two_turns = packed["turn_ids"][0][packed["loss_mask"][0]]
    assert sorted(set(two_turns.tolist())) == [0, 1]


def test_trajectory_styles_and_turn_discount(conversation):
    client, _, _, _ = conversation
    first, second, fresh = client.records
    r = immediate_rewards(client.records, [0.0, 1.0, 2.0])
    assert discounted_returns(r, 0.5) == [0.0 + 0.5 * (1.0 + 0.5 * 2.0), 2.0, 2.0]
    concat = episode_rows(client.records, r, "concat", 0.5)
    assert [row.reward for row in concat] == [1.0, 2.0]  # G of each conversation's first turn
    assert concat[0].input_ids == second.prompt_ids + second.output_ids
    n_mask = sum(concat[0].loss_mask)
    assert n_mask == len(first.output_ids) + len(second.output_ids)
    individual = episode_rows(client.records, r, "individual", 0.5)
    assert [row.reward for row in individual] == [1.0, 2.0, 2.0]
    assert [row.input_ids for row in individual] == [
        rec.prompt_ids + rec.output_ids for rec in client.records
    ]
    assert [max(row.turn_ids) for row in individual] == [0, 1, 0]


def _record(index: int, rid: str, reward: float | None = None) -> CompletionRecord:
    return CompletionRecord(
        id=rid,
        choice=0,
        index=index,
        messages=[],
        tools=None,
        prompt_ids=[1, 2],
        output_ids=[3],
        logprobs=[-0.1],
        versions=[0],
        finish_reason="stop",
        message={"role": "assistant", "content": "x"},
        parent=None,
        reward=reward,
    )


def test_reward_forms_and_their_errors():
    recs = [_record(0, "a"), _record(1, "b", reward=0.5)]
    assert immediate_rewards(recs, 1) == [0.0, 1.0]  # a number: the last completion
    assert immediate_rewards(recs, [0.25, 0.75]) == [0.25, 0.75]
    assert immediate_rewards(recs, {"a": 2.0}) == [2.0, 0.5]
    assert immediate_rewards(recs, None) == [0.0, 0.5]  # set_reward only
    with pytest.raises(RewardError, match="2 completions"):
        immediate_rewards(recs, [1.0])
    with pytest.raises(RewardError, match="finite"):
        immediate_rewards(recs, math.nan)
    with pytest.raises(RewardError, match="no completion of this episode"):
        immediate_rewards(recs, {"zzz": 1.0})
    with pytest.raises(RewardError, match="no completions"):
        immediate_rewards([], 1.0)
    with pytest.raises(RewardError, match="set no reward"):
        immediate_rewards([_record(0, "a")], None)
    with pytest.raises(RewardError, match="returned object"):
        immediate_rewards(recs, object())


def test_tool_calls_parse_in_the_models_format(tok):
    fmt = ChatFormat(tok)
    assert not fmt.native_tools  # SmolLM2's template: tools go in the system prompt
    content, calls = fmt.parse(
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}'
        "</tool_call>"
    )
    assert content == "Let me compute."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculator", {"expression": "2+3"})
    ]
    _, calls = fmt.parse('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b"}]</tool_call>')
    assert [c.function.name for c in calls] == ["a", "b"]
    for broken in ("<tool_call>{not json}</tool_call>", '<tool_call>{"x": 1}</tool_call>'):
        assert fmt.parse(broken) == (broken, [])  # unparsable: plain content, no calls
    assert fmt.parse("<tool_call>{") == ("<tool_call>{", [])  # unterminated
    # An assistant's tool calls are written back in the same format for this template.
    text = fmt.render(
        [
            normalize_message({"role": "user", "content": "q"}),
            normalize_message(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ),
        ],
        [{"type": "function", "function": {"name": "f"}}],
        add_generation_prompt=False,
    )
    assert '<tool_call>{"name": "f", "arguments": {}}</tool_call>' in text
    assert '<tools>\n{"name": "f"}\n</tools>' in text


def test_bad_requests_get_clear_errors(tiny, tok):
    async def main():
        with HFEngine(tiny) as engine:
            client = ChatClient(engine, tok, sampling(tok), max_prompt_len=64)
            create = client.chat.completions.create
            ok = [{"role": "user", "content": "hi"}]
            with pytest.raises(TypeError, match="frequency_penalty"):
                await create(messages=ok, frequency_penalty=0.5)
            with pytest.raises(ValueError, match="stop strings"):
                await create(messages=ok, stop=["\n"])
            with pytest.raises(ValueError, match="tool_choice"):
                await create(messages=ok, tool_choice="required")
            with pytest.raises(MessageError, match="role 'robot'"):
                await create(messages=[{"role": "robot", "content": "x"}])
            with pytest.raises(MessageError, match="tools\\[0\\]"):
                await create(messages=ok, tools=[{"name": "f"}])
            with pytest.raises(PromptTooLong, match="max_prompt_len=64"):
                await create(messages=[{"role": "user", "content": "word " * 100}])
            assert client.records == []  # nothing recorded for refused requests
            r = await create(messages=ok, model="anything", n=2)  # model is ignored
            assert len(r.choices) == 2 and len(client.records) == 2
            client.set_reward(r, 1.0)
            assert [rec.reward for rec in client.records] == [1.0, 1.0]
            with pytest.raises(KeyError, match="no recorded completion"):
                client.set_reward("chatcmpl-nope", 1.0)

    asyncio.run(main())


def test_agent_errors_reject_samples_and_an_all_failed_group(tiny, tok):
    async def main():
        with HFEngine(tiny) as engine:
            flaky = AgentWorkflow(tok, None, sampling(tok), agent=every_other_fails, n_samples=4)
            group = await flaky.arun_episode(
                engine, {"messages": [{"role": "user", "content": "q"}]}
            )
            broken = AgentWorkflow(tok, None, sampling(tok), agent=always_fails, n_samples=3)
            with pytest.raises(EpisodeRejected, match="always_fails: broken agent") as e:
                await broken.arun_episode(engine, {"messages": []})
            return group, e.value

    group, rejected = asyncio.run(main())
    assert group.failed_samples == 2 and group.tensors["input_ids"].shape[0] == 2
    keys = {"input_ids", "loss_mask", "logprobs", "versions", "turn_ids", "rewards"}
    assert set(group.tensors) >= keys
    assert len(group.episode_rewards) == 2
    # Evaluation counts a failed episode as 0.
    assert group_score(group) == pytest.approx(sum(group.episode_rewards) / 4)
    assert rejected.failed_samples == 3


def test_an_agent_written_as_a_plain_def_is_rejected_saying_to_make_it_async(tiny, tok):
    async def main():
        with HFEngine(tiny) as engine:
            agent = AgentWorkflow(tok, None, sampling(tok), agent=plain_def_agent, n_samples=2)
            with pytest.raises(EpisodeRejected) as e:
                await agent.arun_episode(engine, {"messages": []})
            return str(e.value)

    said = asyncio.run(main())
    assert "the agent plain_def_agent returned float 1.0 without being awaited" in said
    assert "rollout.agent names an `async def run(client, data)`" in said


def _report(rewards, episode_rewards=None, failed_samples=0):
    wire = {"key": "g", "meta": {}, "group_size": len(rewards), "rewards": rewards}
    wire.update(n_gen_tokens=1, min_version=0, data_id="d", failed_samples=failed_samples)
    if episode_rewards is not None:
        wire["episode_rewards"] = episode_rewards
    return report_from_wire(wire)


def test_builtin_filters():
    assert nonconstant_reward(_report([0.0, 1.0], [0.0, 1.0]))
    assert not nonconstant_reward(_report([1.0, 1.0]))
    assert not nonconstant_reward(_report([0.0, 1.0], [1.0]))
    assert no_failed_samples(_report([1.0])) and not no_failed_samples(_report([1.0], None, 1))


def test_calculator_tool():
    assert calculate("(12 + 30) * 4 / 2") == "84"
    assert calculate("7 / 2") == "3.5"
    assert calculate("1,000 * 3") == "3000"
    assert calculate("__import__('os')").startswith("error:")
    assert calculate("2 ** 1000").startswith("error:")
    assert calculate("1 / 0").startswith("error:")
    assert call_tool("calculator", '{"expression": "6 * 7"}') == "42"
    assert call_tool("search", "{}").startswith("error: unknown tool")


def test_http_endpoint_speaks_the_same_json_and_records(tiny, tok):
    import aiohttp

    from arl.agent.http import serve_client

    async def main():
        with HFEngine(tiny) as engine:
            client = ChatClient(engine, tok, sampling(tok), max_prompt_len=64)
            async with serve_client(client) as ep, aiohttp.ClientSession() as http:
                url = ep.base_url + "/chat/completions"
                auth = {"Authorization": f"Bearer {ep.api_key}"}
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(url, json=body, headers=auth) as r:
                    ok = (r.status, await r.json())
                async with http.post(url, json=body, headers={"Authorization": "Bearer no"}) as r:
                    denied = (r.status, await r.json())
                async with http.post(url, json={**body, "logit_bias": {}}, headers=auth) as r:
                    bad = (r.status, await r.json())
                long = {"messages": [{"role": "user", "content": "word " * 100}]}
                async with http.post(url, json=long, headers=auth) as r:
                    too_long = (r.status, await r.json())
                async with http.post(url, data=b"{nope", headers=auth) as r:
                    not_json = r.status
            return client, ok, denied, bad, too_long, not_json

    client, ok, denied, bad, too_long, not_json = asyncio.run(main())
    status, body = ok
    assert status == 200 and body["object"] == "chat.completion"
    (rec,) = client.records
    assert body["id"] == rec.id
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["message"]["content"] == tok.decode(
        rec.output_ids, skip_special_tokens=True
    )
    assert body["usage"] == {
        "prompt_tokens": len(rec.prompt_ids),
        "completion_tokens": len(rec.output_ids),
        "total_tokens": len(rec.prompt_ids) + len(rec.output_ids),
    }
    assert denied[0] == 401 and denied[1]["error"]["type"] == "authentication_error"
    assert bad[0] == 400 and "logit_bias" in bad[1]["error"]["message"]
    assert too_long[0] == 400 and too_long[1]["error"]["code"] == "context_length_exceeded"
    assert not_json == 400
