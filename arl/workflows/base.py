"""The `Workflow` protocol: how one dataset row becomes one trajectory shard.

A workflow runs on a rollout node, next to its engine; the node builds it as a `WorkflowFactory`
(the class named by ``rollout.workflow``) and calls ``arun_episode`` for training with the
workflow's own sampling and group size, and for evaluation with the evaluator's. It returns a
prompt group as a `Trajectory` (arl.protocol.report) holding a dict of tensors (the layout below)
and the side data that stays on the node, or a plain dict of those tensors; it rejects the row by
returning ``None`` or raising `EpisodeRejected`. Every tensor is right-padded to the group's
longest sequence:

- ``input_ids`` int64 [n, L], ``attention_mask`` bool [n, L]
- ``loss_mask`` bool [n, L]: True on generated tokens
- ``logprobs`` float32 [n, L]: sampling log-prob of token t at position t (0 on the prompt)
- ``versions`` int32 [n, L]: policy version that produced token t (-1 on the prompt)
- ``rewards`` float32 [n]

Other tensors (``turn_ids`` of agent workflows) travel with the shard. The trajectory's side data
stays on the node: ``texts`` (for logs), ``episode_rewards`` and ``failed_samples`` (when rows are
not episodes, as with multi-turn agents).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from arl.engines.base import Engine, SamplingParams
from arl.protocol.report import TRAJECTORY_KEYS as TRAJECTORY_KEYS  # the layout's keys
from arl.protocol.report import Trajectory

if TYPE_CHECKING:
    import torch


class EpisodeRejected(Exception):
    """A workflow rejects a row (no trajectory); ``failed_samples`` of its episodes failed."""

    def __init__(self, reason: str, failed_samples: int = 0):
        super().__init__(reason)
        self.failed_samples = failed_samples


def group_score(group: Trajectory | dict | None) -> float:
    """Mean episode reward of a group (failed episodes count 0; a rejected group scores 0)."""
    return 0.0 if group is None else Trajectory.of(group).score()


@runtime_checkable
class Workflow(Protocol):
    """Turns a dataset row into a trajectory using an engine."""

    async def arun_episode(
        self,
        engine: Engine,
        data: dict[str, Any],
        sampling: SamplingParams | None = None,
        n_samples: int | None = None,
    ) -> Trajectory | dict | None:
        """Run one prompt group of ``n_samples`` episodes under ``sampling`` (None: the
        workflow's own; evaluation passes its greedy sampling); ``None`` rejects the row."""
        ...


class WorkflowFactory(Protocol):
    """What ``rollout.workflow`` names: called once per rollout node to build its workflow.

    ``reward_fn(text, data)`` is ``rollout.reward``; ``sampling`` and ``n_samples`` are the
    training defaults. A workflow with settings of its own takes them as further keyword
    arguments beyond these (the agent workflow's ``agent``, ``trajectory``, ``turn_discount``,
    from ``rollout.agent*``); the node passes them only to that workflow.
    """

    def __call__(
        self,
        tokenizer: Any,
        reward_fn: Callable[[str, dict[str, Any]], Awaitable[float]],
        sampling: SamplingParams,
        *,
        n_samples: int,
        max_prompt_len: int,
        prompt_overflow: str,
    ) -> Workflow: ...


def pack_group(
    prompts: list[list[int]],
    outputs: list[list[int]],
    logprobs: list[list[float]],
    versions: list[list[int]],
    rewards: list[float],
) -> dict[str, torch.Tensor]:
    """Build the padded group tensors of the layout above from per-sample lists."""
    import torch  # here: the launcher imports workflows to check them, and must not wait for it

    n = len(prompts)
    if not n or not len(outputs) == len(logprobs) == len(versions) == len(rewards) == n:
        raise ValueError(
            f"a group needs equal, non-zero counts; got {n} prompts, "
            f"{len(outputs)} outputs, {len(rewards)} rewards"
        )
    lengths = [len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)]
    L = max(lengths)
    out = {
        "input_ids": torch.zeros(n, L, dtype=torch.int64),
        "attention_mask": torch.zeros(n, L, dtype=torch.bool),
        "loss_mask": torch.zeros(n, L, dtype=torch.bool),
        "logprobs": torch.zeros(n, L, dtype=torch.float32),
        "versions": torch.full((n, L), -1, dtype=torch.int32),
        "rewards": torch.tensor(rewards, dtype=torch.float32),
    }
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        if len(logprobs[i]) != len(o) or len(versions[i]) != len(o):
            raise ValueError(
                f"sample {i}: {len(o)} tokens but {len(logprobs[i])} log-probs and "
                f"{len(versions[i])} versions"
            )
        P, T = len(p), len(p) + len(o)
        out["input_ids"][i, :T] = torch.tensor(p + o, dtype=torch.int64)
        out["attention_mask"][i, :T] = True
        out["loss_mask"][i, P:T] = True
        out["logprobs"][i, P:T] = torch.tensor(logprobs[i], dtype=torch.float32)
        out["versions"][i, P:T] = torch.tensor(versions[i], dtype=torch.int32)
    return out
