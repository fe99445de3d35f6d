"""RTensor: the controller's handle on a batch whose bytes stay on the nodes (DESIGN §3).

An RTensor lists shard refs (owner node, key, byte and token counts, per-tensor shapes and
dtypes) plus the batch layout, and where to reach each owner's data plane. Its wire form is a
plain msgpack-able dict (a `WireStruct`), a few hundred bytes per shard whatever the sequence
length. Passed as an argument of a call to a node, it makes that node pull the shards it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from arl.protocol.wire import WireStruct, WireStructError

WIRE_TAG = "__rtensor__"
LAYOUTS = ("concat",)  # "concat": the batch is the shards' rows, dim 0, in ref order


class RTensorError(WireStructError):
    """A malformed RTensor or shard ref (e.g. from the wire)."""


@attrs.frozen
class ShardRef(WireStruct):
    """Where one shard lives and what it holds (never its bytes)."""

    wire_error = RTensorError

    node: str
    key: str
    nbytes: int
    n_tokens: int
    shapes: dict[str, list[int]] = attrs.field(factory=dict, hash=False)
    dtypes: dict[str, str] = attrs.field(factory=dict, hash=False)
    group_size: int = 1

    @classmethod
    def from_meta(cls, node: str, meta: Any, group_size: int = 1) -> ShardRef:
        """A ref to a shard that ``node`` stored (``meta`` is a ShardMeta or its wire dict)."""
        d = meta.to_wire() if hasattr(meta, "to_wire") else meta
        return cls(node, d["key"], d["nbytes"], d["n_tokens"], d["shapes"], d["dtypes"], group_size)

    def __attrs_post_init__(self) -> None:
        if self.nbytes < 0 or self.n_tokens < 0 or self.group_size < 1:
            raise RTensorError(
                f"shard ref {self.key!r}: nbytes and n_tokens must be >= 0 and group_size >= 1"
            )


@attrs.frozen
class RTensor(WireStruct):
    """A batch as shard refs in batch order, its layout, and each owner's data-plane address.

    Its wire map is tagged ``{"__rtensor__": 1}`` so a node recognises it among call arguments.
    """

    wire_error = RTensorError
    wire_tag = (WIRE_TAG, 1)

    refs: tuple[ShardRef, ...] = attrs.field(converter=tuple)
    layout: str = "concat"
    peers: dict[str, str] = attrs.field(factory=dict, hash=False)  # node -> tcp://host:port

    def __attrs_post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise RTensorError(f"unknown RTensor layout {self.layout!r}; expected one of {LAYOUTS}")

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def keys(self) -> list[str]:
        """Shard keys in batch order."""
        return [r.key for r in self.refs]

    @property
    def n_tokens(self) -> int:
        """Tokens in the batch."""
        return sum(r.n_tokens for r in self.refs)

    @property
    def nbytes(self) -> int:
        """Bytes the batch's shards hold on their owners."""
        return sum(r.nbytes for r in self.refs)

    @property
    def nodes(self) -> list[str]:
        """Owner nodes, in order of first appearance."""
        return list(dict.fromkeys(r.node for r in self.refs))

    def select(self, indices: Iterable[int]) -> RTensor:
        """The sub-batch of ``refs[i]`` for ``i`` in ``indices`` (same layout and peers)."""
        return RTensor([self.refs[i] for i in indices], self.layout, self.peers)

    def by_node(self) -> dict[str, list[str]]:
        """Keys grouped by owner node (for pulls and for the free fan-out)."""
        out: dict[str, list[str]] = {}
        for r in self.refs:
            out.setdefault(r.node, []).append(r.key)
        return out


def is_wire_rtensor(obj: Any) -> bool:
    """True for the wire form of an RTensor."""
    return isinstance(obj, Mapping) and obj.get(WIRE_TAG) == 1
