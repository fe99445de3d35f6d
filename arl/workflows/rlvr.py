"""RLVR: reinforcement learning with verifiable rewards (chat template -> generate -> reward).

One episode is a prompt group: the row's chat ``messages`` are templated and tokenized once,
``n_samples`` completions are generated concurrently (each continued across weight-sync pauses,
so its tokens may carry several versions), each completion is scored by the reward function,
and the group is packed into the trajectory layout of `arl.workflows.base`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from arl.agent.chat_format import PromptTooLong as PromptTooLong  # raised here, re-exported
from arl.engines.base import Engine, SamplingParams, generate_to_completion
from arl.protocol.report import Trajectory
from arl.workflows.base import pack_group

RewardFn = Callable[[str, dict[str, Any]], Awaitable[float]]


class RLVRWorkflow:
    """Generate ``n_samples`` answers per prompt and score each with ``reward_fn``."""

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: RewardFn,
        sampling: SamplingParams,
        *,
        n_samples: int = 4,
        max_prompt_len: int = 512,
        prompt_overflow: str = "error",
    ):
        if prompt_overflow not in ("error", "truncate"):
            raise ValueError(f"prompt_overflow={prompt_overflow!r}: use 'error' or 'truncate'")
        self.tokenizer, self.reward_fn, self.sampling = tokenizer, reward_fn, sampling
        self.n_samples, self.max_prompt_len = n_samples, max_prompt_len
        self.prompt_overflow = prompt_overflow
        self.truncated_prompts = 0

    def prompt_ids(self, data: dict[str, Any]) -> list[int]:
        """Token ids of the row's chat prompt, with the generation prompt appended."""
        if "messages" not in data:
            raise KeyError(
                f"dataset row has no 'messages' (keys: {sorted(data)}); the data "
                "loader must build the chat prompt"
            )
        ids = self.tokenizer.apply_chat_template(
            data["messages"], add_generation_prompt=True, tokenize=True
        )
        if hasattr(ids, "keys"):  # newer tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        ids = list(ids)
        if len(ids) > self.max_prompt_len:
            if self.prompt_overflow == "error":
                raise PromptTooLong(
                    f"prompt of {len(ids)} tokens exceeds data.max_prompt_len="
                    f"{self.max_prompt_len}; raise it or set data.prompt_overflow=truncate"
                )
            self.truncated_prompts += 1
            ids = ids[-self.max_prompt_len :]
        return ids

    async def arun_episode(
        self,
        engine: Engine,
        data: dict[str, Any],
        sampling: SamplingParams | None = None,
        n_samples: int | None = None,
    ) -> Trajectory:
        """One prompt group as padded tensors (see `arl.workflows.base`), with its texts."""
        sampling = sampling or self.sampling
        n = n_samples or self.n_samples
        prompt = self.prompt_ids(data)
        results = await asyncio.gather(
            *(generate_to_completion(engine, prompt, sampling) for _ in range(n))
        )
        texts = [self.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]
        rewards = await asyncio.gather(*(self.reward_fn(t, data) for t in texts))
        group = pack_group(
            [prompt] * n,
            [r.output_ids for r in results],
            [r.logprobs for r in results],
            [r.versions for r in results],
            [float(x) for x in rewards],
        )
        return Trajectory(group, texts=texts)  # texts stay on the node: for logs
