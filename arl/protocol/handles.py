"""The started cluster as the plug-ins below control/ use it: just the parts they touch.

`arl.control` implements these (`NodeHandle`, `RemoteObject`, `PlacedNode`, `Cluster`,
`RolloutController`); `arl.weights` is written against them, so it never imports control/ and
a test can hand it stand-ins. Each Protocol lists only what a weight sync reads or calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from arl.protocol.plan import NodeSpec


class RemoteNode(Protocol):
    """One live node: its hello ``info`` (``host``, ...), ``lost`` (why, once lost), and calls
    of its node-level methods (``free_port``, ``create``, ...)."""

    info: dict
    lost: str

    async def call(self, op: str, args: dict | None = None, timeout: float | None = None) -> Any:
        """Run a node-level method."""
        ...

    async def create(self, target: str, *args: Any, name: str = "", **kwargs: Any) -> RemotePart:
        """Build ``target`` ("pkg.module:Class") on the node; a handle to it."""
        ...


class RemotePart(Protocol):
    """An object on a node (a worker, or a weight sync's node half); its methods are called
    through a typed proxy of its class (`arl.protocol.proxy`), or by name with `call`."""

    node: RemoteNode

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` of the object on its node."""
        ...

    async def destroy(self) -> bool:
        """Close and drop the object on its node."""
        ...


class PlacedNodeView(Protocol):
    """A live node and the plan entry it fills."""

    @property
    def handle(self) -> RemoteNode: ...

    @property
    def spec(self) -> NodeSpec: ...


class ControllerAddress(Protocol):
    """The controller, as far as the nodes' rendezvous needs it: the address it bound."""

    address: str


class ClusterView(Protocol):
    """The controller's address and the run's live nodes by role (rank order)."""

    @property
    def controller(self) -> ControllerAddress: ...

    @property
    def rollout(self) -> Sequence[PlacedNodeView]: ...

    @property
    def train(self) -> Sequence[PlacedNodeView]: ...


class RolloutPause(Protocol):
    """Rollout control, as a weight transfer needs it."""

    def paused(self, version: int, in_place: bool = False) -> AbstractAsyncContextManager[None]:
        """Generation held for the block; resumed at ``version`` whatever happens."""
        ...
