"""What an object hosted on a node gets from the node, declared rather than probed.

A node builds objects on ``create`` {name, target, args, kwargs, hosted}. Two things it may
hand a new object, each declared:

- the node itself, as a `NodeContext` (its id, import prefixes, shard store, ``stop``): to a
  class that subclasses `UsesNode`, as its ``node`` keyword argument;
- objects the node already hosts: the caller names them in ``hosted`` ({keyword: object name});
  a weight-sync node half gets the worker it serves this way (`arl.protocol.weight_hooks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class ShardPut(Protocol):
    """The part of a node's shard store (``arl.node.shard_store:ShardStore``) hosted objects use."""

    def put(self, key: str, shard: Mapping[str, torch.Tensor]) -> Any:
        """Keep ``shard`` under ``key``; returns its metadata (``to_wire()`` for the reply)."""
        ...

    def stats(self) -> dict[str, int]:
        """The store's gauges (``bytes_held``, ``n_shards``)."""
        ...


class NodeContext(Protocol):
    """The node, as an object it hosts sees it."""

    node_id: str

    @property
    def allowed_prefixes(self) -> tuple[str, ...]:
        """Module prefixes the node may import engines, workflows and rewards from."""
        ...

    @property
    def store(self) -> ShardPut:
        """The node's shard store (served to peers by its data plane)."""
        ...

    def stop(self, reason: str = "stopped") -> None:
        """End the node (e.g. its engine died), with ``reason`` for the controller."""
        ...


class UsesNode:
    """Base of a hosted class that uses its node: the node passes its `NodeContext` as the
    ``node`` keyword argument when it builds one (built elsewhere, e.g. in a test, the caller
    passes it, or None)."""
