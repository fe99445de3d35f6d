"""Weights of the hf engine: the checksum trainer and engine compare, and reading a weights
folder (an HF safetensors folder, or a peft adapter folder)."""

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
    """Every tensor of the ``*.safetensors`` files of a folder (or of one file), by name."""
    from safetensors import safe_open

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files under {str(path)!r}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def is_adapter_folder(path: Path) -> bool:
    """Whether ``path`` is a peft adapter folder (it has an ``adapter_config.json``)."""
    return (path / "adapter_config.json").is_file()


def iter_weights_folder(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a weight sync wrote to ``path``: a peft adapter folder's tensors under the
    names the engine's injected adapter has (`arl.engines.lora.load_adapter`), else every
    tensor of its safetensors files."""
    if path.is_dir() and is_adapter_folder(path):
        from arl.engines.lora import load_adapter

        tensors, _ = load_adapter(path)
        yield from tensors.items()
        return
    yield from iter_safetensors(path)
