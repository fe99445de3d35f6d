"""Typed remote interfaces of the workers: what the controller may call, and what comes back.

`TrainWorkerAPI` lists the methods of ``arl.node.train:TrainWorker`` that the controller calls,
`RolloutWorkerAPI` those of ``arl.node.rollout:RolloutWorker``, each with the caller's view of
the signature (tests check that the workers implement them with the same parameter names). The
callers are generated from them (`arl.protocol.proxy`): `train_ranks` runs a method on every
rank at once, results in rank order; `rollout_worker` is one rollout worker. Replies are decoded
by each method's return annotation (`LoadedBatch`, `StepStats`, or a checked plain type), and a
name that is not on the API is refused at the caller (`UnknownRemoteMethod`) before anything is
sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from arl.protocol import wire
from arl.protocol.proxy import FanOut, FanOutCall, UnknownRemoteMethod, api_methods, fan_out, proxy
from arl.protocol.rtensor import RTensor
from arl.protocol.wire import WireStruct, WireStructError

__all__ = [
    "LoadedBatch",
    "RolloutWorkerAPI",
    "StatsError",
    "StepStats",
    "TrainRanks",
    "TrainWorkerAPI",
    "UnknownRemoteMethod",
    "api_methods",
    "rollout_worker",
    "train_ranks",
]


class StatsError(WireStructError):
    """A train rank's statistics of the wrong shape."""


@runtime_checkable
class TrainWorkerAPI(Protocol):
    """One FSDP2 rank, as the trainer drives it (every rank runs each call together)."""

    def info(self) -> dict:
        """The layout this rank resolved and the seconds of its load, priming and warm-up."""
        ...

    def warm_up(self) -> float:
        """Pay the first passes' one-time costs; returns seconds spent."""
        ...

    def load_batch(self, shards: RTensor) -> LoadedBatch:
        """This rank's part of the batch: the caller sends an RTensor, the node pulls its shards
        and hands the worker the tensors; returns ``{n_seqs, n_tokens}``."""
        ...

    def compute_logp(self) -> None:
        """Proximal log-probs of the loaded batch."""
        ...

    def compute_ref_logp(self) -> None:
        """Reference-model log-probs of the loaded batch."""
        ...

    def compute_advantages(self) -> dict:
        """Advantages of the loaded batch; returns reward statistics."""
        ...

    def ppo_update(self) -> StepStats:
        """The PPO update; returns this rank's statistics."""
        ...

    def arm_profile(self, step: int, path: str) -> None:
        """Record a torch profile of train step ``step``, written under ``path`` later."""
        ...

    def write_profile(self) -> bool:
        """Write the recorded profile (after the run); whether there was one."""
        ...

    def end_step(self) -> None:
        """Drop the step's batch."""
        ...

    def set_sync_dtype(self, dtype: str | None) -> None:
        """The engines' weight dtype: weights are sent, and checksummed, in it."""
        ...

    def weights_checksum(self) -> str:
        """Checksum of the weights as the engines receive them."""
        ...

    def score(self, token_ids: list[int], weights_dtype: str | None = None) -> list[float]:
        """Log-probs of ``token_ids[1:]`` under the current policy (its weights rounded to
        ``weights_dtype`` first, when given)."""
        ...

    def save_hf(self, path: str, merged: bool = False) -> None:
        """Export the policy as an HF folder (with LoRA the adapter, and with ``merged`` the
        merged model under ``merged/``)."""
        ...

    def save_state(self, path: str) -> int:
        """Trainable weights, optimizer and RNG state under ``path`` (data only); bytes."""
        ...

    def load_state(self, path: str, step: int) -> None:
        """Restore `save_state`'s files, written at ``step``."""
        ...


@attrs.frozen
class LoadedBatch(WireStruct):
    """What a rank loaded for a step."""

    wire_error = StatsError

    n_seqs: int = attrs.field(validator=attrs.validators.ge(0))
    n_tokens: int = attrs.field(validator=attrs.validators.ge(0))


@attrs.frozen
class StepStats(WireStruct):
    """One rank's statistics of a PPO update, by name (NaN travels as the text ``"nan"``).

    Its wire form is the map ``values`` itself, not empty (hooks registered below).
    """

    wire_error = StatsError

    values: dict[str, float] = attrs.field(hash=False)

    def __getitem__(self, name: str) -> float:
        return self.values[name]


def _stats_from_map(d: Any, _: Any) -> StepStats:
    if isinstance(d, Mapping) and not d:
        raise StatsError("StepStats: ppo_update must answer a non-empty map, got {}")
    return StepStats(wire.converter.structure(d, dict[str, wire.NanFloat]))


wire.converter.register_structure_hook(StepStats, _stats_from_map)
wire.converter.register_unstructure_hook(
    StepStats, lambda s: wire.converter.unstructure(s.values, dict[str, wire.NanFloat])
)


TrainRanks = FanOut["TrainWorkerAPI"]  # every train rank at once: see `train_ranks`


def train_ranks(call: FanOutCall, n_ranks: int) -> TrainRanks:
    """Every train rank at once through `TrainWorkerAPI`'s methods; each returns the decoded
    replies in rank order (``call(method, per_rank_args)`` runs one call on every rank)."""
    return fan_out(TrainWorkerAPI, call, n_ranks)


@runtime_checkable
class RolloutWorkerAPI(Protocol):
    """A rollout node's worker (``arl.node.rollout:RolloutWorker``), as the controller drives it."""

    async def setup(self) -> dict:
        """Load the engine and the workflow; returns the engine's health."""
        ...

    async def run_group(self, key: str, data: dict) -> Any:
        """Run one prompt group into the shard store; returns its report's wire map (checked
        by `arl.protocol.report.report_from_wire`, whose errors name the node)."""
        ...

    async def evaluate(
        self,
        rows: list[dict],
        n_samples: int = 1,
        temperature: float = 0.0,
        max_new_tokens: int | None = None,
    ) -> list[float]:
        """Mean reward per row under evaluation sampling."""
        ...

    async def pause(self, in_place: bool = False) -> None:
        """Stop generation, keeping in-flight requests in the engine with ``in_place`` where
        it can (they continue after resume)."""
        ...

    async def resume(self) -> None:
        """Let generation continue."""
        ...

    async def set_version(self, version: int) -> None:
        """Stamp tokens generated from now on with ``version``."""
        ...

    async def sleep(self, drop_weights: bool = False) -> int:
        """Pause (abort) and free the engine's GPU memory; returns the bytes freed."""
        ...

    async def wake(self) -> None:
        """Reallocate what `sleep` freed (the engine stays paused)."""
        ...

    async def weights_checksum(self) -> str | None:
        """The engine's weight checksum, or None where it cannot compute one."""
        ...

    async def score(self, token_ids: list[int]) -> list[float]:
        """A server engine's log-probs of ``token_ids[1:]``."""
        ...

    async def health(self) -> dict:
        """The engine's health plus the worker's counters."""
        ...


def rollout_worker(remote: Any) -> RolloutWorkerAPI:
    """One rollout worker through `RolloutWorkerAPI`'s methods; ``remote`` is its handle (any
    object with ``node`` and ``async call(method, *args)``, e.g. a RemoteObject)."""
    return proxy(RolloutWorkerAPI, remote)
