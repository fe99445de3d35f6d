"""Weights of the hf engine: the checksum trainer and engine compare, and safetensors reading."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch


def checksum_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of each tensor, in sorted name order.

    Trainer and engine compute it the same way to check that they hold identical weights; the
    dtype is part of the hash, so cast both sides to the same dtype first.
    """
    items: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in items:
            raise ValueError(f"checksum_named_tensors: tensor name {name!r} appears twice")
        items[name] = tensor
    digest = hashlib.sha256()
    for name in sorted(items):
        t = items[name].detach()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().data)
    return digest.hexdigest()


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files under {str(path)!r}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
