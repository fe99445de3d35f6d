"""Agents for the agent-workflow tests, and a tiny model taught one tool-using conversation.

`make_tool_model` trains the tiny random Llama (SmolLM2 tokenizer) until greedy decoding
replays a calculator conversation: asked "What is 6 * 7?" with the calculator offered, it
answers with a ``<tool_call>``; given the tool's "42" it answers ``\\boxed{42}``. The engine, the
client and the template are all real; only the weights were taught.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from arl.agent.chat_format import ChatFormat, normalize_message
from arl.agent.examples.math_agent import CALCULATOR
from arl.workflows.agent import AgentWorkflow
from arl.workflows.base import EpisodeRejected

QUESTION = "What is 6 * 7? Put your final answer within \\boxed{}."
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
FINAL = "The calculator says 42, so the answer is \\boxed{42}."
ROW = {
    "question": "What is 6 * 7?",
    "answer": "42",
    "messages": [{"role": "user", "content": QUESTION}],
}


def conversation_ids(fmt: ChatFormat) -> tuple[list[int], list[list[int]]]:
    """The whole taught conversation as token ids, and the two answers' ids (eos included)."""
    tools = [CALCULATOR]
    user = normalize_message(ROW["messages"][0])
    call = normalize_message(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'},
                }
            ],
        }
    )
    tool = normalize_message({"role": "tool", "tool_call_id": "call_0", "content": "42"})
    eos = fmt.tokenizer.eos_token_id
    prompt1 = fmt.encode(fmt.render([user], tools, add_generation_prompt=True))
    answer1 = fmt.encode(CALL) + [eos]
    before = fmt.render([user, call], tools, add_generation_prompt=False)
    after = fmt.render([user, call, tool], tools, add_generation_prompt=True)
    middle = fmt.encode(fmt.closing(answer1) + after[len(before) :])
    answer2 = fmt.encode(FINAL) + [eos]
    return prompt1 + answer1 + middle + answer2, [answer1, answer2]


def make_tool_model(base: str, path: Path, max_steps: int = 300) -> str:
    """Teach the tiny model at ``base`` the conversation (until greedy decoding replays both
    answers); save it at ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    ids, answers = conversation_ids(ChatFormat(tok))
    positions: list[int] = []  # the answers' token positions: what the model must produce
    start = 0
    for answer in answers:
        start = next(i for i in range(start, len(ids)) if ids[i : i + len(answer)] == answer)
        positions += range(start, start + len(answer))
        start += len(answer)
    pos = torch.tensor(positions)
    x = torch.tensor([ids])
    target = x[0, pos]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        logits = model.lm_head(model.model(input_ids=x).last_hidden_state[0, pos - 1])
        loss = torch.nn.functional.cross_entropy(logits, target)
        if (logits.argmax(-1) == target).all() and loss.item() < 0.05:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        raise RuntimeError(f"the tiny model did not learn the conversation (loss {loss.item()})")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---- agents the node tests import (tests. is an allowed prefix there) ------------------------


_episodes = itertools.count()


async def every_other_fails(client: Any, data: dict) -> float:
    """Answers once; every other episode this process runs raises after its answer (episodes
    of a group start in order, so each group of two has exactly one failure)."""
    fail = next(_episodes) % 2 == 0
    response = await client.chat.completions.create(messages=data["messages"], max_tokens=4)
    if fail:
        raise ValueError("every_other_fails: this episode fails by design")
    return float(len(response.choices[0].message.content or ""))


async def always_fails(client: Any, data: dict) -> float:
    """Raises before calling the model."""
    raise RuntimeError("always_fails: broken agent")


def load_tool_rows(path: str, split: str, on_bad_row: str) -> tuple[list[dict], dict]:
    """A data loader (`data.loader`) of eight copies of the taught question."""
    return [dict(ROW) for _ in range(8)], {"skipped": 0}


class NotedAgentWorkflow(AgentWorkflow):
    """A user's subclass of the agent workflow with a keyword of its own (``rollout.workflow_args``
    reaches it): ``note`` ends the reason of every group it rejects."""

    def __init__(self, *args: Any, note: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.note = note

    async def arun_episode(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().arun_episode(*args, **kwargs)
        except EpisodeRejected as e:
            raise EpisodeRejected(f"{e} ({self.note})", e.failed_samples) from None


def plain_def_agent(client: Any, data: dict[str, Any]) -> float:
    """An agent written as a plain function: it returns without awaiting the client."""
    return 1.0
