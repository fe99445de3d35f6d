"""A workflow written only to `arl.workflows.base.Workflow` and `WorkflowFactory`.

It uses nothing of arl's own workflows: the engine protocol (`generate_to_completion`) and
`pack_group`. Its rewards say which sampling and group size each caller passed: every sample
scores 1/n under greedy sampling (evaluation) and 0.5 otherwise (training).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from arl.engines.base import Engine, SamplingParams, generate_to_completion
from arl.workflows.base import pack_group


class ProtocolWorkflow:
    """Generates ``n_samples`` completions of the row's chat prompt; rewards as above."""

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: Callable[[str, dict[str, Any]], Awaitable[float]],
        sampling: SamplingParams,
        *,
        n_samples: int,
        max_prompt_len: int,
        prompt_overflow: str,
    ) -> None:
        self.tokenizer, self.sampling, self.n_samples = tokenizer, sampling, n_samples

    async def arun_episode(
        self,
        engine: Engine,
        data: dict[str, Any],
        sampling: SamplingParams | None = None,
        n_samples: int | None = None,
    ) -> dict | None:
        sampling = sampling or self.sampling
        n = n_samples or self.n_samples
        text = self.tokenizer.apply_chat_template(
            data["messages"], add_generation_prompt=True, tokenize=False
        )
        prompt = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        results = await asyncio.gather(
            *(generate_to_completion(engine, prompt, sampling) for _ in range(n))
        )
        reward = 1.0 / n if sampling.greedy else 0.5
        return pack_group(
            [prompt] * n,
            [r.output_ids for r in results],
            [r.logprobs for r in results],
            [r.versions for r in results],
            [reward] * n,
        )
