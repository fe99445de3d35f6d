"""The inference `Engine` protocol every rollout backend (hf, vllm, sglang) implements.

An engine generates from token ids and returns, per generated token, the sampling log-prob and
the policy version that produced it. `pause()` interrupts in-flight requests: they return what
they have with finish reason ``"abort"``; `generate_to_completion` resubmits them after
`resume()` so an interrupted generation continues under the new version.
"""

from __future__ import annotations

import asyncio
from typing import Literal, Protocol, runtime_checkable

import attrs

FinishReason = Literal["stop", "length", "abort"]


@attrs.define
class SamplingParams:
    """How to sample one request. ``greedy`` overrides temperature/top-p/top-k."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    greedy: bool = False
    stop_token_ids: list[int] = attrs.field(factory=list)


@attrs.define
class GenerationResult:
    """What one `agenerate` call produced: tokens, their sampling log-probs and versions."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason


@runtime_checkable
class Engine(Protocol):
    """An inference engine hosted on a rollout node.

    `agenerate` may be called many times concurrently from one event loop; blocking work runs
    off the loop. Weight updates happen only while paused.
    """

    version: int

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        """Generate a continuation of ``input_ids``; stops early with ``"abort"`` on pause."""
        ...

    async def pause(self) -> None:
        """Interrupt in-flight generations at their next step and hold new ones until resume."""
        ...

    async def resume(self) -> None:
        """Let held and interrupted requests continue."""
        ...

    def set_version(self, version: int) -> None:
        """Set the policy version stamped on tokens generated from now on."""
        ...

    async def health(self) -> dict:
        """A small dict describing the engine state; raises if the engine is unusable."""
        ...


async def generate_to_completion(
    engine: Engine,
    input_ids: list[int],
    sampling: SamplingParams,
    resume_poll_s: float = 0.01,
) -> GenerationResult:
    """Run one request to a real finish, continuing it across pauses (interruptible generation).

    Each time the engine returns ``"abort"`` the tokens so far are appended to the prompt and the
    request is resubmitted for the remaining budget; every token keeps the version it was
    generated under, so versions switch where the pause happened.
    """
    out_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    while True:
        remaining = sampling.max_new_tokens - len(out_ids)
        if remaining <= 0:
            return GenerationResult(out_ids, logprobs, versions, "length")
        step = attrs.evolve(sampling, max_new_tokens=remaining)
        res = await engine.agenerate(list(input_ids) + out_ids, step)
        out_ids += res.output_ids
        logprobs += res.logprobs
        versions += res.versions
        if res.finish_reason != "abort":
            return GenerationResult(out_ids, logprobs, versions, res.finish_reason)
        # Paused: the engine holds new requests until resume(), so resubmitting simply waits.
        await asyncio.sleep(resume_poll_s)
