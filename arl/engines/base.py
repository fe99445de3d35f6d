"""The inference `Engine` protocol every rollout backend (hf, vllm, sglang) implements.

An engine generates from token ids and returns, per generated token, the sampling log-prob and
the policy version that produced it. `pause()` interrupts in-flight requests: they return what
they have with finish reason ``"abort"``; `generate_to_completion` resubmits them after
`resume()` so an interrupted generation continues under the new version. `pause(in_place=True)`
asks instead to stop them at a step boundary and keep them, with their KV cache, until `resume()`
continues them under the new weights (an engine declaring ``pause_in_place = False`` aborts them
as above, so callers need not know which). The protocol is the
whole contract: callers (the rollout worker, the weight-sync modes, the trainer's checks) use
its members only, and read what an engine accepts from its declared `weight_targets`.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch

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


class WeightTarget(enum.Enum):
    """Where an engine takes new weights from; each engine declares its set in
    `Engine.weight_targets`, and the weight-sync modes and their plan checks read it."""

    TENSORS = "tensors"  # `update_weights(named)`: tensors handed over in the engine's process
    DIRECTORY = "directory"  # `update_weights_from_disk(path)`: an HF safetensors folder


class WeightCheck(enum.Enum):
    """How a sync into an engine is verified (``weight_sync.verify``); each engine declares one
    in `Engine.weight_check`, and `arl.weights.verify` picks the check by it."""

    CHECKSUM = "checksum"  # `weights_checksum()` equals the trainer's, exactly
    PROBE = "probe"  # `score()` of a fixed probe sequence stays near the trainer's score of it


@attrs.frozen
class EngineTraits:
    """What an engine class declares about itself (the `Engine` members of the same names).

    Each built-in engine's are in `arl.engines.spec.TRAITS` and its class reads them from there,
    so the launcher checks a plan against them without importing the engine (the hf engine
    imports torch)."""

    weight_targets: frozenset[WeightTarget]
    pause_in_place: bool
    can_sleep: bool
    serves_lora: bool
    weight_check: WeightCheck


class WeightTargetError(TypeError):
    """An engine was handed weights through a target it does not declare."""


def refuse_target(engine: Engine, target: WeightTarget) -> WeightTargetError:
    """The error for ``engine`` handed weights through ``target``, naming what it accepts."""
    accepted = ", ".join(sorted(t.value for t in engine.weight_targets)) or "nothing"
    return WeightTargetError(
        f"the {engine.name} engine does not take weights as {target.value} (it accepts: "
        f"{accepted}); choose a weight_sync.mode that delivers one of those"
    )


@runtime_checkable
class Engine(Protocol):
    """An inference engine hosted on a rollout node: the whole contract its callers use.

    Life: `start` (servers spawn and wait for their process), `aclose` (ends everything it
    started), `wait_failed` (returns the error once the engine died on its own; never after
    `aclose`). Generation: `agenerate` may be called many times concurrently from one event
    loop; blocking work runs off the loop. Pausing: `pause` aborts in-flight requests, or with
    ``in_place`` keeps them where `pause_in_place` says the engine can. Weights: the engine
    declares `weight_targets`; updates through a target happen only while paused, and a target
    not declared raises `WeightTargetError`. `score` and `weights_checksum` let the trainer
    verify a sync, by the check the engine declares in `weight_check`.
    """

    name: ClassVar[str]
    weight_targets: ClassVar[frozenset[WeightTarget]]
    # Whether `pause(in_place=True)` keeps in-flight requests (False: it aborts them).
    pause_in_place: ClassVar[bool]
    # Whether `sleep`/`wake` free and restore the engine's GPU memory (rollout.gpu_sharing=sleep);
    # a server may need more (vLLM: CUDA), which `arl.engines.spec.check_engine_support` says.
    can_sleep: ClassVar[bool]
    # Whether the engine serves a LoRA adapter on its base model (actor.lora.rank > 0).
    serves_lora: ClassVar[bool]
    # How a sync into it is verified: by checksum, or by scoring a probe where it has none.
    weight_check: ClassVar[WeightCheck]
    version: int

    @classmethod
    def from_spec(cls, spec: Any, **options: Any) -> Engine:
        """A new, unstarted engine for a rollout node's `arl.engines.spec.EngineSpec`; ``options``
        are further constructor arguments (`arl.engines.spec.build_engine` calls it). ``spec`` is
        typed in each engine: this module is the protocol that spec builds engines by, and does
        not import it back."""
        ...

    async def start(self) -> None:
        """Make the engine ready to generate (a server engine starts its server here)."""
        ...

    async def aclose(self) -> None:
        """End the engine and everything it started; requests still running fail."""
        ...

    async def wait_failed(self) -> BaseException:
        """Wait until the engine dies on its own and return why (never returns after
        `aclose`): its rollout node then stops with that reason."""
        ...

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        """Generate a continuation of ``input_ids``; stops early with ``"abort"`` on a pause
        that does not keep it in place."""
        ...

    async def pause(self, in_place: bool = False) -> None:
        """Stop in-flight generations at their next step and hold new ones until resume: they
        return ``"abort"``, or with ``in_place`` (where `pause_in_place`) stay in the engine;
        returns once no step runs, so weights may then be updated."""
        ...

    async def resume(self) -> None:
        """Let held, kept and interrupted requests continue."""
        ...

    def set_version(self, version: int) -> None:
        """Set the policy version stamped on tokens generated from now on."""
        ...

    async def sleep(self, drop_weights: bool = False) -> int:
        """Pause in abort mode and free the KV cache (and with ``drop_weights`` the weights a
        sync rewrites) for a train phase; requests sent meanwhile wait until `wake` and
        `resume`. Returns the bytes freed where the engine measures them (else 0)."""
        ...

    async def wake(self) -> None:
        """Reallocate what `sleep` freed; the engine stays paused (sync weights, then
        `resume`)."""
        ...

    async def health(self) -> dict:
        """A small dict describing the engine state; raises if the engine is unusable."""
        ...

    @property
    def weights_device(self) -> torch.device | None:
        """The device `update_weights` copies onto; None without `WeightTarget.TENSORS`."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """`WeightTarget.TENSORS`: copy named tensors in (paused; blocking: call it off the
        event loop); returns how many were copied."""
        ...

    async def update_weights_from_disk(self, path: str) -> None:
        """`WeightTarget.DIRECTORY`: load the HF-format folder ``path`` (paused)."""
        ...

    async def weights_checksum(self) -> str | None:
        """`checksum_named_tensors` of the weights held, or None where the engine cannot
        compute one (a server: verify it with `score`)."""
        ...

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs (temperature 1) of ``token_ids[1:]``, each given the tokens before it,
        under the weights held now."""
        ...


async def generate_to_completion(
    engine: Engine,
    input_ids: list[int],
    sampling: SamplingParams,
    resume_poll_s: float = 0.01,
) -> GenerationResult:
    """Run one request to a real finish, continuing it across pauses (interruptible generation).

    Each time the engine returns ``"abort"`` the tokens so far are appended to the prompt and the
    request is resubmitted for the remaining budget (a pause in place returns nothing, so this
    waits); every token keeps the version it was generated under, so versions switch where the
    pause happened.
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
