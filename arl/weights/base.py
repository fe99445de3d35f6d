"""The weight-sync plug-in protocol: new policy weights from the train ranks into every engine.

A mode is one module of `arl.weights` holding both of its halves:

- a `WeightSync` subclass on the controller: `setup` (once), `stage` (per sync, while rollout
  still generates), `transfer` (per sync, rollout paused) and `cleanup` (per sync, after
  resume); it inherits its plan side from the mode's rule in `arl.weights.rules` (can this mode
  run on the placement plan? `check_plan` raises `ConfigError` naming what to change), which
  the launcher reads without importing the mode's module (they import torch);
- `NodePart` subclasses, created by `WeightSync.place` on the nodes beside their worker (the
  ``train`` or ``rollout`` object, which the node hands in as ``host``) under the name
  ``weights``, that move the bytes.

The sequence is written once, in `WeightSync.sync`::

    setup (first sync) -> stage -> pause rollout -> transfer -> version + 1 -> resume -> cleanup

The pause keeps in-flight generations in their engines (``weight_sync.in_place``, where the
engine's ``pause_in_place`` allows) or aborts them for resubmission; both continue after resume.

What the node halves use of their worker is declared in `arl.protocol.weight_hooks`: a train
worker is a `WeightSource` (its rank, device, full state, specs, sources and tied weights), a
rollout worker a `WeightSink` (``update_weights``, ``weights_device``,
``update_weights_from_disk``). What each engine accepts is declared in its
``weight_targets`` (`arl.engines.base.WeightTarget`); `arl.weights.rules` checks a plan by it.

On the controller a mode works with a `SyncContext`, whose cluster, workers and rollout control
are typed by what it uses of them (`arl.protocol.handles`): arl.weights never imports
arl.control, which builds the context and implements those protocols.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from arl.config import WeightSyncConfig
from arl.protocol.proxy import proxy
from arl.protocol.remote import RolloutWorkerAPI, TrainWorkerAPI
from arl.protocol.weight_hooks import WeightSink, WeightSource
from arl.weights.rules import ModeRule
from arl.wire.addresses import is_loopback

if TYPE_CHECKING:
    from arl.protocol.handles import ClusterView, PlacedNodeView, RemotePart, RolloutPause


log = logging.getLogger("arl.weights")

N = TypeVar("N", bound="NodePart")


class WeightSyncError(RuntimeError):
    """The weight sync cannot run as configured (e.g. engines disagree on their dtype)."""


@attrs.frozen(kw_only=True)
class SyncContext:
    """What a weight sync works with: the cluster, the workers, rollout control, its config."""

    cluster: ClusterView
    train: list[RemotePart]  # train workers, rank order
    rollout_workers: list[RemotePart]
    rollout: RolloutPause
    config: WeightSyncConfig
    run_path: Path
    free: Callable[[list], Awaitable[None]]  # frees shard refs on every node


class WeightSync(ModeRule):
    """Controller half of a mode; `sync` runs the pause -> transfer -> version -> resume dance.
    Its plan side (`mode`, `auto_rank`, `run_dirs`, `check_plan`, `suits`) is the mode's rule in
    `arl.weights.rules`, which it inherits."""

    def __init__(self, ctx: SyncContext) -> None:
        self.ctx = ctx
        self.ready = False
        self._placed: list[list[RemotePart]] = []  # one list per `place` call

    # ---- one sync ---------------------------------------------------------------------------
    async def sync(self, version: int) -> dict:
        """Stage, pause rollout, transfer, resume at ``version``, clean up; returns stats."""
        t0 = time.monotonic()
        if not self.ready:
            await self.setup()
            self.ready = True
        stats = dict(await self.stage(version) or {})
        t1 = time.monotonic()
        async with self.ctx.rollout.paused(version, self.ctx.config.in_place):
            stats.update(await self.transfer(version) or {})
        t2 = time.monotonic()
        await self.cleanup(version)
        nbytes = stats.get("sync/bytes")
        if nbytes:
            stats["sync/gb_per_s"] = nbytes / max(t2 - t1, 1e-9) / 1e9
        return {"sync/stage_s": t1 - t0, "sync/paused_s": t2 - t1, **stats}

    async def setup(self) -> None:
        """Once, before the first sync: by default, tell the train ranks the engines' dtype."""
        await match_engine_dtype(self.ctx.train, self.ctx.rollout_workers)

    async def stage(self, version: int) -> dict | None:
        """Per sync, rollout still running: get the weights ready to move."""
        return None

    async def transfer(self, version: int) -> dict | None:
        """Per sync, rollout paused: move the weights into every engine."""
        raise NotImplementedError

    async def cleanup(self, version: int) -> None:
        """Per sync, after resume: drop what the transfer no longer needs."""

    async def close(self) -> None:
        """End the node halves this sync placed, the last placed first (receivers let go of
        what senders share before the senders free it)."""
        placed, self._placed = self._placed, []
        for parts in reversed(placed):
            done = await asyncio.gather(
                *(p.destroy() for p in parts if not p.node.lost), return_exceptions=True
            )
            for e in done:  # the run is ending: say so, and let the other halves close
                if isinstance(e, Exception):
                    log.warning("closing a weight-sync part failed: %s", e)

    # ---- helpers ----------------------------------------------------------------------------
    async def place(self, part: type[N], nodes: Sequence[PlacedNodeView], host: str) -> list[N]:
        """Create the node half ``part`` (a `NodePart` class of the mode's module) on each of
        ``nodes`` as ``weights``, beside the worker named ``host`` ("train" or "rollout"),
        which the node hands to it; returns them typed by that class (`arl.protocol.proxy`:
        its public methods, called on the node); they are destroyed by `close`."""
        target = f"{part.__module__}:{part.__qualname__}"
        made = await asyncio.gather(
            *(p.handle.create(target, name="weights", hosted={"host": host}) for p in nodes)
        )
        self._placed.append(list(made))
        return [proxy(part, r) for r in made]


class NodePart:
    """Node half of a mode: lives on a node beside the worker it serves, ``host``, which the
    node hands in when it builds the part (`WeightSync.place`)."""

    def __init__(self, host: Any) -> None:
        self.host = host


class SenderPart(NodePart):
    """A train node's half: its ``host`` is the train rank."""

    host: WeightSource

    def __init__(self, host: WeightSource) -> None:
        super().__init__(host)


class ReceiverPart(NodePart):
    """A rollout node's half: its ``host`` is the rollout worker."""

    host: WeightSink

    def __init__(self, host: WeightSink) -> None:
        super().__init__(host)


def engine_device(host: WeightSink, mode: str) -> Any:
    """The device of the rollout worker's in-process engine; refuses server engines."""
    device = host.weights_device
    if device is None:
        raise WeightSyncError(
            f"weight_sync.mode={mode} copies tensors into an in-process engine; this rollout "
            "worker has none (use the hf engine, or weight_sync.mode=disk)"
        )
    return device


async def match_engine_dtype(train: list[RemotePart], workers: list[RemotePart]) -> None:
    """Tell the train ranks the engines' weight dtype (from their health), if they report one."""
    healths = await asyncio.gather(*(proxy(RolloutWorkerAPI, w).health() for w in workers))
    dtypes = sorted({h["dtype"] for h in healths if h.get("dtype")})
    if len(dtypes) > 1:
        raise WeightSyncError(
            f"the rollout engines hold weights in different dtypes {dtypes}; one weight sync "
            "serves them all, so give every engine the same rollout.dtype"
        )
    if dtypes:
        await asyncio.gather(*(proxy(TrainWorkerAPI, w).set_sync_dtype(dtypes[0]) for w in train))


def rendezvous_host(cluster: ClusterView) -> str:
    """The address of train rank 0's node that the other nodes reach (loopback when local)."""
    if is_loopback(cluster.controller.address):
        return "127.0.0.1"
    return cluster.train[0].handle.info["host"]
