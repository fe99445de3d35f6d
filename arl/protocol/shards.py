"""What a node tells others about tensors it holds in a buffer: shard metadata and tensor slots.

- `ShardMeta`: a stored shard as the controller learns of it (key, bytes, tokens, each tensor's
  shape and dtype; never its bytes). A `ShardRef` is one plus the owner node.
- `TensorSlot`: where one named tensor lies in a contiguous buffer (dtype, shape, byte offset and
  length). A shard store lays a shard out as slots (a pull reply lists them, so the puller views
  the bytes it receives or maps), and a weight bucket is slots in one ``uint8`` buffer.

Both are wire structs (`arl.protocol.wire`); a slot travels as the list
``[name, dtype, shape, offset, nbytes]``, as it is sent once per tensor in every pull reply.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from arl.protocol.dtypes import dtype_of
from arl.protocol.wire import WireStruct


def _non_negative(inst: Any, a: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"'{a.name}' must be >= 0, got {value}")


@attrs.frozen
class ShardMeta(WireStruct):
    """What the controller learns about a stored shard (never its bytes)."""

    key: str
    nbytes: int = attrs.field(validator=_non_negative)
    n_tokens: int = attrs.field(validator=_non_negative)
    shapes: dict[str, list[int]]
    dtypes: dict[str, str]


@attrs.frozen
class TensorSlot(WireStruct):
    """Where one named tensor lies in a buffer: ``nbytes`` from ``offset`` hold a ``dtype``
    tensor of ``shape`` (``nbytes`` must be what dtype and shape make)."""

    wire_as_list = True

    name: str
    dtype: str  # wire dtype name (arl.wire.codec), e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int = attrs.field(validator=_non_negative)
    nbytes: int

    def __attrs_post_init__(self) -> None:
        itemsize = dtype_of(self.dtype).itemsize  # a ValueError for an unknown dtype
        if any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r} has a bad shape {list(self.shape)}")
        if self.nbytes != math.prod(self.shape) * itemsize:
            raise ValueError(
                f"tensor {self.name!r}: {self.nbytes} bytes do not hold a {self.dtype} tensor "
                f"of shape {list(self.shape)}"
            )

    @classmethod
    def of(cls, name: str, dtype: str, shape: tuple[int, ...], offset: int = 0) -> TensorSlot:
        """The slot of a ``dtype`` tensor of ``shape`` at ``offset`` (its byte count computed)."""
        return cls(name, dtype, shape, offset, math.prod(shape) * dtype_of(dtype).itemsize)
