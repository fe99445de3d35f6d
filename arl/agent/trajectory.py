"""Recorded completions of an agent episode -> trajectory rows (pure functions, no engine).

Rewards: what the agent's ``run`` returned is spread over its completions (in call order) as
immediate rewards r_i, then discounted backwards, G_i = r_i + gamma * G_{i+1} (``gamma`` is
``rollout.turn_discount``). Two layouts:

- ``individual``: one row per completion, its prompt and its answer, with reward G_i.
- ``concat``: one row per conversation: completions whose prompt extends an earlier
  completion's prompt and answer (`arl.agent.client` reuses the tokens) share one sequence, the
  loss mask covering each turn's answer and nothing in between (tool results, user turns).
  A conversation's row is its last turn's full sequence, with the reward G of its first turn.

Every row also carries ``turn_ids``: on each answer token, that turn's depth in its
conversation (0 for a call that extends no earlier call); -1 elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from arl.agent.client import CompletionRecord

if TYPE_CHECKING:
    import torch

Style = Literal["individual", "concat"]
STYLES: tuple[str, ...] = ("individual", "concat")


class RewardError(ValueError):
    """What an agent returned cannot be read as its reward(s); the message says why."""


@attrs.define
class Row:
    """One trajectory row before padding."""

    input_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    versions: list[int]
    turn_ids: list[int]
    reward: float


def _number(x: Any, what: str) -> float:
    if isinstance(x, bool | int | float) and math.isfinite(float(x)):
        return float(x)
    raise RewardError(f"{what} must be a finite number, got {x!r}")


def immediate_rewards(records: Sequence[CompletionRecord], result: Any) -> list[float]:
    """Per-completion rewards r_i from ``run``'s return value.

    A number goes to the last completion; a list gives one per completion in call order; a
    dict maps response ids to rewards; None keeps the rewards set with ``client.set_reward``.
    Completions with no reward get 0.
    """
    if not records:
        raise RewardError("the agent made no completions, so there is nothing to train on")
    r = [rec.reward for rec in records]
    if result is None:
        if all(x is None for x in r):
            raise RewardError(
                "the agent returned None and set no reward (client.set_reward); return a "
                "number, one per completion, or a dict of response id -> reward"
            )
    elif isinstance(result, bool | int | float):
        r[-1] = _number(result, "the agent's reward")
    elif isinstance(result, list | tuple):
        if len(result) != len(records):
            raise RewardError(
                f"the agent returned {len(result)} rewards for {len(records)} completions; "
                "return one per completion (in call order) or a single number"
            )
        r = [_number(x, f"reward {i}") for i, x in enumerate(result)]
    elif isinstance(result, dict):
        ids = {rec.id for rec in records}
        for rid, value in result.items():
            if rid not in ids:
                raise RewardError(f"reward for {rid!r}: no completion of this episode has that id")
            for i, rec in enumerate(records):
                if rec.id == rid:
                    r[i] = _number(value, f"reward for {rid!r}")
    else:
        raise RewardError(
            f"the agent returned {type(result).__name__}; return a number, a list of numbers, "
            "a dict of response id -> reward, None (after client.set_reward), or the final "
            "answer as a str (scored by rollout.reward)"
        )
    return [0.0 if x is None else float(x) for x in r]


def discounted_returns(rewards: Sequence[float], discount: float) -> list[float]:
    """G_i = r_i + discount * G_{i+1}, from the last reward back."""
    out, g = [0.0] * len(rewards), 0.0
    for i in range(len(rewards) - 1, -1, -1):
        g = rewards[i] + discount * g
        out[i] = g
    return out


def _chains(records: Sequence[CompletionRecord]) -> tuple[list[list[int]], list[int]]:
    """Root-to-leaf index lists of each conversation, and every record's depth."""
    pos = {(r.index, r.choice): i for i, r in enumerate(records)}
    parent = [pos.get(r.parent) if r.parent is not None else None for r in records]
    depth = []
    for i in range(len(records)):
        d, p = 0, parent[i]
        while p is not None:
            d, p = d + 1, parent[p]
        depth.append(d)
    has_child = {p for p in parent if p is not None}
    chains = []
    for leaf in range(len(records)):
        if leaf in has_child:
            continue
        chain, p = [], leaf
        while p is not None:
            chain.append(p)
            p = parent[p]
        chains.append(chain[::-1])
    return chains, depth


def episode_rows(
    records: Sequence[CompletionRecord], rewards: Sequence[float], style: Style, discount: float
) -> list[Row]:
    """The rows of one episode (see the module docstring)."""
    if style not in STYLES:
        raise ValueError(f"trajectory style {style!r}: use one of {STYLES}")
    returns = discounted_returns(rewards, discount)
    chains, depth = _chains(records)
    rows = []
    if style == "individual":
        chains = [[i] for i in range(len(records))]
    for chain in chains:
        last = records[chain[-1]]
        ids = last.prompt_ids + last.output_ids
        n = len(ids)
        row = Row(ids, [False] * n, [0.0] * n, [-1] * n, [-1] * n, returns[chain[0]])
        for i in chain:
            rec = records[i]
            start, end = len(rec.prompt_ids), len(rec.prompt_ids) + len(rec.output_ids)
            if ids[start:end] != rec.output_ids:  # the client's prefix reuse guarantees this
                raise AssertionError(f"completion {rec.id} is not a prefix of its successor")
            row.loss_mask[start:end] = [True] * len(rec.output_ids)
            row.logprobs[start:end] = rec.logprobs
            row.versions[start:end] = rec.versions
            row.turn_ids[start:end] = [depth[i]] * len(rec.output_ids)
        rows.append(row)
    return rows


def pack_rows(rows: Sequence[Row]) -> dict[str, torch.Tensor]:
    """Right-padded tensors of the trajectory layout (`arl.workflows.base`) plus ``turn_ids``."""
    import torch  # here: the launcher imports the agent workflow to check it (see pack_group)

    if not rows:
        raise ValueError("pack_rows needs at least one row")
    n, width = len(rows), max(len(r.input_ids) for r in rows)
    out = {
        "input_ids": torch.zeros(n, width, dtype=torch.int64),
        "attention_mask": torch.zeros(n, width, dtype=torch.bool),
        "loss_mask": torch.zeros(n, width, dtype=torch.bool),
        "logprobs": torch.zeros(n, width, dtype=torch.float32),
        "versions": torch.full((n, width), -1, dtype=torch.int32),
        "turn_ids": torch.full((n, width), -1, dtype=torch.int32),
        "rewards": torch.tensor([r.reward for r in rows], dtype=torch.float32),
    }
    for i, r in enumerate(rows):
        t = len(r.input_ids)
        out["input_ids"][i, :t] = torch.tensor(r.input_ids, dtype=torch.int64)
        out["attention_mask"][i, :t] = True
        out["loss_mask"][i, :t] = torch.tensor(r.loss_mask, dtype=torch.bool)
        out["logprobs"][i, :t] = torch.tensor(r.logprobs, dtype=torch.float32)
        out["versions"][i, :t] = torch.tensor(r.versions, dtype=torch.int32)
        out["turn_ids"][i, :t] = torch.tensor(r.turn_ids, dtype=torch.int32)
    return out
