"""Agent code as a workflow: ``async def run(client, data)`` over an OpenAI-shaped client.

Each of a prompt group's ``n_samples`` episodes runs the user's agent with its own
`arl.agent.client.ChatClient` bound to this node's engine. The agent talks to the policy as it
would to OpenAI (multi-turn, tools) and returns its reward: a number (for its last
completion), one per completion, a dict of response id -> reward, None after
``client.set_reward``, or its final answer as a ``str``, which the run's reward function
(``rollout.reward``) scores. The recorded completions become trajectory rows
(`arl.agent.trajectory`: one per completion, or one per conversation; turn discount).

An episode whose agent raises (or returns something unusable) is a rejected sample: logged,
counted in the group's ``failed_samples``, left out of the group; the others train. A group
with no episode left is rejected as a whole (`EpisodeRejected`); rollout goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from arl.agent.chat_format import ChatFormat
from arl.agent.client import ChatClient
from arl.agent.trajectory import STYLES, episode_rows, immediate_rewards, pack_rows
from arl.engines.base import Engine, SamplingParams
from arl.protocol.report import Trajectory
from arl.workflows.base import EpisodeRejected

log = logging.getLogger("arl.agent")

AgentFn = Callable[[ChatClient, dict[str, Any]], Awaitable[Any]]
RewardFn = Callable[[str, dict[str, Any]], Awaitable[float]]

_TRACEBACKS_LOGGED = 3  # full tracebacks for the first few agent errors, one line after


class AgentWorkflow:
    """Runs ``agent(client, data)`` ``n_samples`` times per row; packs what it recorded."""

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: RewardFn | None,
        sampling: SamplingParams,
        *,
        agent: AgentFn,
        n_samples: int = 4,
        max_prompt_len: int = 512,
        prompt_overflow: str = "error",
        trajectory: str = "concat",
        turn_discount: float = 1.0,
    ):
        if not callable(agent):
            raise TypeError(f"agent must be an async function run(client, data), got {agent!r}")
        if trajectory not in STYLES:
            raise ValueError(f"trajectory={trajectory!r}: use one of {STYLES}")
        if not 0.0 <= turn_discount <= 1.0:
            raise ValueError(f"turn_discount={turn_discount}: must be in [0, 1]")
        if prompt_overflow != "error":
            # Truncating a conversation would break the token prefix its turns share.
            raise ValueError(
                f"prompt_overflow={prompt_overflow!r}: agent workflows need 'error' (the client "
                "raises PromptTooLong, which an agent can catch to end its conversation)"
            )
        self.format = ChatFormat(tokenizer)
        self.reward_fn, self.sampling, self.agent = reward_fn, sampling, agent
        self.n_samples, self.max_prompt_len = n_samples, max_prompt_len
        self.trajectory, self.turn_discount = trajectory, turn_discount
        self.failed_samples = 0

    async def arun_episode(
        self,
        engine: Engine,
        data: dict[str, Any],
        sampling: SamplingParams | None = None,
        n_samples: int | None = None,
    ) -> Trajectory:
        """One prompt group: ``n_samples`` agent episodes packed as rows (plus ``turn_ids``)."""
        n = n_samples or self.n_samples
        outcomes = await asyncio.gather(
            *(self._episode(engine, data, sampling or self.sampling, i) for i in range(n))
        )
        episodes = [o for o in outcomes if not isinstance(o, BaseException)]
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if not episodes:
            last = errors[-1]
            raise EpisodeRejected(
                f"all {n} agent episodes failed; the last: {type(last).__name__}: {last}",
                failed_samples=len(errors),
            )
        rows = [row for rows, _, _ in episodes for row in rows]
        return Trajectory(
            pack_rows(rows),
            texts=[text for _, _, text in episodes],
            episode_rewards=[reward for _, reward, _ in episodes],
            failed_samples=len(errors),
        )

    async def _episode(
        self, engine: Engine, data: dict[str, Any], sampling: SamplingParams, i: int
    ) -> tuple[list, float, str] | Exception:
        """(rows, episode reward, final text) of one agent run, or the error it ended with."""
        client = ChatClient(engine, self.format, sampling, max_prompt_len=self.max_prompt_len)
        try:
            started = self.agent(client, data)
            if not inspect.isawaitable(started):  # a plain def: it never talked to the model
                name = getattr(self.agent, "__qualname__", repr(self.agent))
                raise TypeError(
                    f"the agent {name} returned {type(started).__name__} {started!r:.60} without "
                    "being awaited; rollout.agent names an `async def run(client, data)`"
                )
            result = await started
            final = client.records[-1].message.get("content") or "" if client.records else ""
            if isinstance(result, str):
                if self.reward_fn is None:
                    raise TypeError("the agent returned a str but the workflow has no reward_fn")
                final = result
                result = float(await self.reward_fn(result, data))
            rewards = immediate_rewards(client.records, result)
            rows = episode_rows(client.records, rewards, self.trajectory, self.turn_discount)
        except Exception as e:  # the agent is user code: any error rejects only this sample
            self.failed_samples += 1
            first = self.failed_samples <= _TRACEBACKS_LOGGED
            log.warning(
                "agent episode %d failed (rejected sample): %s: %s",
                i,
                type(e).__name__,
                e,
                exc_info=first,
            )
            return e
        return rows, sum(rewards), final
