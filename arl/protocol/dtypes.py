"""The tensor dtypes that may cross a process boundary, by their wire name (each is also the
name of the torch dtype). torch is imported at the first lookup, not with this module: the
launcher imports the wire before its nodes start and never needs a dtype."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

WIRE_DTYPES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)


@functools.cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Wire name -> torch dtype, for every dtype of `WIRE_DTYPES`."""
    import torch

    return {name: getattr(torch, name) for name in WIRE_DTYPES}


@functools.cache
def wire_names() -> dict[torch.dtype, str]:
    """torch dtype -> wire name (the inverse of `torch_dtypes`)."""
    return {dtype: name for name, dtype in torch_dtypes().items()}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name; a ValueError naming it for an unknown one."""
    try:
        return torch_dtypes()[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r} on the wire") from None
