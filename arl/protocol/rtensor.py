"""RTensor: the controller's handle on a batch whose bytes stay on the nodes (DESIGN §3).

An RTensor lists shard refs (owner node, key, byte and token counts, per-tensor shapes and
dtypes) plus the batch layout, and where to reach each owner's data plane. Its wire form is a
plain msgpack-able dict, a few hundred bytes per shard whatever the sequence length. Passed as
an argument of a call to a node, it makes that node pull the shards it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from arl.protocol.errors import ErrorKind

WIRE_TAG = "__rtensor__"
LAYOUTS = ("concat",)  # "concat": the batch is the shards' rows, dim 0, in ref order


class RTensorError(ValueError):
    """A malformed RTensor or shard ref (e.g. from the wire)."""

    error_kind = ErrorKind.MALFORMED


@attrs.frozen
class ShardRef:
    """Where one shard lives and what it holds (never its bytes)."""

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

    def to_wire(self) -> dict:
        """Plain msgpack-able dict."""
        return {
            "node": self.node,
            "key": self.key,
            "nbytes": self.nbytes,
            "n_tokens": self.n_tokens,
            "shapes": self.shapes,
            "dtypes": self.dtypes,
            "group_size": self.group_size,
        }

    @classmethod
    def from_wire(cls, d: Any) -> ShardRef:
        """Inverse of ``to_wire``; raises RTensorError naming what is wrong."""
        if not isinstance(d, Mapping):
            raise RTensorError(f"a shard ref must be a map, got {type(d).__name__}")
        try:
            ref = cls(
                str(d["node"]),
                str(d["key"]),
                int(d["nbytes"]),
                int(d["n_tokens"]),
                {str(k): [int(x) for x in v] for k, v in d["shapes"].items()},
                {str(k): str(v) for k, v in d["dtypes"].items()},
                int(d.get("group_size", 1)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RTensorError(f"malformed shard ref {d!r}: {type(e).__name__}: {e}") from None
        if ref.nbytes < 0 or ref.n_tokens < 0 or ref.group_size < 1:
            raise RTensorError(
                f"shard ref {ref.key!r}: nbytes and n_tokens must be >= 0 and group_size >= 1"
            )
        return ref


@attrs.frozen
class RTensor:
    """A batch as shard refs in batch order, its layout, and each owner's data-plane address."""

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

    def to_wire(self) -> dict:
        """Plain msgpack-able dict, tagged so a node recognises it among call arguments."""
        return {
            WIRE_TAG: 1,
            "refs": [r.to_wire() for r in self.refs],
            "layout": self.layout,
            "peers": dict(self.peers),
        }

    @classmethod
    def from_wire(cls, d: Any) -> RTensor:
        """Inverse of ``to_wire``; raises RTensorError on a malformed value."""
        if not is_wire_rtensor(d):
            raise RTensorError(f"not an RTensor wire value (needs the {WIRE_TAG!r} tag)")
        refs = d.get("refs")
        peers = d.get("peers", {})
        if not isinstance(refs, Sequence) or not isinstance(peers, Mapping):
            raise RTensorError("RTensor wire value needs a list 'refs' and a map 'peers'")
        return cls(
            [ShardRef.from_wire(r) for r in refs],
            str(d.get("layout", "concat")),
            {str(k): str(v) for k, v in peers.items()},
        )


def is_wire_rtensor(obj: Any) -> bool:
    """True for the wire form of an RTensor."""
    return isinstance(obj, Mapping) and obj.get(WIRE_TAG) == 1
