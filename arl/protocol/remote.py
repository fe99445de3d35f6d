"""Typed remote interfaces of the train ranks: what the trainer may call, and what comes back.

`TrainWorkerAPI` lists the methods of ``arl.node.train:TrainWorker`` that the controller calls,
with the node-side signatures (a test checks that TrainWorker satisfies it). `TrainRanks` is the
caller's side: one async method per call, run on every rank at once, with the results decoded
into `LoadedBatch` and `StepStats`. Underneath, the wire stays a method-name call (``call``
{obj, method, args}); a name that is not on the API is refused at the caller
(`UnknownRemoteMethod`) before anything is sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from arl.protocol import wire
from arl.protocol.rtensor import RTensor
from arl.protocol.wire import WireStruct, WireStructError


class UnknownRemoteMethod(AttributeError):
    """A remote call of a method that the remote interface does not declare."""


class StatsError(WireStructError):
    """A train rank's statistics of the wrong shape."""


@runtime_checkable
class TrainWorkerAPI(Protocol):
    """One FSDP2 rank, as the trainer drives it (every rank runs each call together)."""

    def warm_up(self) -> float:
        """Pay the first passes' one-time costs; returns seconds spent."""
        ...

    def load_batch(self, shards: Any) -> dict:
        """This rank's part of the batch: the caller sends an RTensor, the node pulls its shards
        and hands the worker the tensors; returns ``{n_seqs, n_tokens}`` (`LoadedBatch`)."""
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

    def ppo_update(self) -> dict:
        """The PPO update; returns this rank's statistics (`StepStats`)."""
        ...

    def end_step(self) -> None:
        """Drop the step's batch."""
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


def api_methods(api: type) -> frozenset[str]:
    """The public method names a Protocol class declares."""
    return frozenset(
        name
        for klass in api.__mro__
        if klass not in (object, Protocol) and klass.__name__ != "Generic"
        for name, v in vars(klass).items()
        if callable(v) and not name.startswith("_")
    )


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


# ``call(method, per_rank_args)``: one call on every rank at once, results in rank order.
FanOut = Callable[[str, "list[list] | None"], Awaitable[list]]


class TrainRanks:
    """Every train rank at once, through `TrainWorkerAPI`'s methods (results in rank order)."""

    api = TrainWorkerAPI

    def __init__(self, fan_out: FanOut, n_ranks: int):
        self._fan_out, self.n_ranks = fan_out, n_ranks
        self._methods = api_methods(self.api)

    async def call(self, method: str, per_rank: Sequence[Sequence] | None = None) -> list:
        """Run ``method`` of the API on every rank (``per_rank[i]``: rank i's arguments)."""
        if method not in self._methods:
            raise UnknownRemoteMethod(
                f"{method!r} is not a method of {self.api.__name__}; it declares "
                f"{sorted(self._methods)} (add it there and on the worker first)"
            )
        if per_rank is not None and len(per_rank) != self.n_ranks:
            raise ValueError(f"{method}: {len(per_rank)} argument lists for {self.n_ranks} ranks")
        return await self._fan_out(
            method, None if per_rank is None else [list(a) for a in per_rank]
        )

    def _same(self, *args: Any) -> list[list]:
        return [list(args)] * self.n_ranks

    async def warm_up(self) -> list[float]:
        """Every rank's warm-up seconds."""
        return [float(s) for s in await self.call("warm_up")]

    async def load_batch(self, parts: Sequence[RTensor]) -> list[LoadedBatch]:
        """Rank i pulls and loads ``parts[i]``."""
        replies = await self.call("load_batch", [[p.to_wire()] for p in parts])
        return [LoadedBatch.from_wire(r) for r in replies]

    async def compute_logp(self) -> None:
        """Proximal log-probs on every rank."""
        await self.call("compute_logp")

    async def compute_ref_logp(self) -> None:
        """Reference log-probs on every rank."""
        await self.call("compute_ref_logp")

    async def compute_advantages(self) -> list[dict]:
        """Advantages on every rank; each rank's reward statistics."""
        return await self.call("compute_advantages")

    async def ppo_update(self) -> list[StepStats]:
        """The PPO update on every rank; each rank's statistics."""
        return [StepStats.from_wire(r) for r in await self.call("ppo_update")]

    async def end_step(self) -> None:
        """Every rank drops its batch."""
        await self.call("end_step")

    async def weights_checksum(self) -> list[str]:
        """Every rank's weight checksum."""
        return [str(c) for c in await self.call("weights_checksum")]

    async def score(
        self, token_ids: list[int], weights_dtype: str | None = None
    ) -> list[list[float]]:
        """Every rank's log-probs of ``token_ids[1:]`` (weights rounded to ``weights_dtype``)."""
        return await self.call("score", self._same(token_ids, weights_dtype))

    async def save_hf(self, path: str, merged: bool = False) -> None:
        """Export the policy under ``path`` (``merged``: with LoRA, also the merged model)."""
        await self.call("save_hf", self._same(path, merged))

    async def save_state(self, path: str) -> list[int]:
        """Every rank saves its state under ``path``; the bytes each wrote."""
        return [int(n) for n in await self.call("save_state", self._same(path))]

    async def load_state(self, path: str, step: int) -> None:
        """Restore the state saved under ``path`` at ``step``."""
        await self.call("load_state", self._same(path, step))


@runtime_checkable
class RolloutWorkerAPI(Protocol):
    """A rollout node's worker (``arl.node.rollout:RolloutWorker``), as the controller drives it."""

    async def setup(self) -> dict:
        """Load the engine and the workflow; returns the engine's health."""
        ...

    async def run_group(self, key: str, data: dict) -> dict:
        """Run one prompt group into the shard store; returns its report's wire map."""
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


class RolloutWorkerClient:
    """One rollout worker through `RolloutWorkerAPI`'s methods; ``remote`` is its handle (any
    object with ``node`` and ``async call(method, *args)``, e.g. a RemoteObject)."""

    api = RolloutWorkerAPI

    def __init__(self, remote: Any):
        self.remote, self.node = remote, remote.node
        self._methods = api_methods(self.api)

    def __repr__(self) -> str:
        return f"RolloutWorkerClient({self.remote!r})"

    async def call(self, method: str, *args: Any) -> Any:
        """Run ``method`` of the API on the worker; other names are refused here."""
        if method not in self._methods:
            raise UnknownRemoteMethod(
                f"{method!r} is not a method of {self.api.__name__}; it declares "
                f"{sorted(self._methods)}"
            )
        return await self.remote.call(method, *args)

    async def setup(self) -> dict:
        """Load the engine and the workflow; returns the engine's health."""
        return await self.call("setup")

    async def run_group(self, key: str, data: dict) -> Any:
        """The report's wire map (`arl.protocol.report.report_from_wire` checks it)."""
        return await self.call("run_group", key, data)

    async def evaluate(
        self, rows: list[dict], n_samples: int = 1, temperature: float = 0.0
    ) -> list[float]:
        """Mean reward per row; raises StatsError unless it is one number per row."""
        scores = await self.call("evaluate", rows, n_samples, temperature)
        ok = isinstance(scores, list) and len(scores) == len(rows)
        if not ok or not all(isinstance(s, int | float) for s in scores):
            raise StatsError(f"evaluate must answer one number per row ({len(rows)}): {scores!r}")
        return [float(s) for s in scores]

    async def pause(self, in_place: bool = False) -> None:
        """Stop generation (``in_place``: keep in-flight requests where the engine can)."""
        await self.call("pause", in_place)

    async def resume(self) -> None:
        """Let generation continue."""
        await self.call("resume")

    async def set_version(self, version: int) -> None:
        """Stamp new tokens with ``version``."""
        await self.call("set_version", version)

    async def sleep(self, drop_weights: bool = False) -> int:
        """Pause (abort) and free the engine's GPU memory; returns the bytes freed."""
        freed = await self.call("sleep", drop_weights)
        if not isinstance(freed, int) or isinstance(freed, bool):
            raise StatsError(f"sleep must answer the bytes freed (an int), got {freed!r}")
        return freed

    async def wake(self) -> None:
        """Reallocate what `sleep` freed (the engine stays paused)."""
        await self.call("wake")

    async def weights_checksum(self) -> str | None:
        """The engine's weight checksum, or None where it cannot compute one."""
        got = await self.call("weights_checksum")
        if got is not None and not isinstance(got, str):
            raise StatsError(f"weights_checksum must answer a string or None, got {got!r}")
        return got

    async def health(self) -> dict:
        """The engine's health plus the worker's counters."""
        got = await self.call("health")
        if not isinstance(got, dict):
            raise StatsError(f"health must answer a map, got {type(got).__name__}")
        return got

    async def score(self, token_ids: list[int]) -> list[float]:
        """A server engine's log-probs of ``token_ids[1:]``."""
        return await self.call("score", token_ids)
