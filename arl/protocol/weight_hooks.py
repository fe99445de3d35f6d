"""The worker hooks a weight sync's node halves call, one Protocol per side (DESIGN §6).

A mode's node halves (`arl.weights.base.NodePart`) are built beside the worker they serve; the
node hands that worker in at creation (``hosted={"host": "train" | "rollout"}``), typed as the
side's hooks below. ``arl.node.train:TrainWorker`` is a `WeightSource` and
``arl.node.rollout:RolloutWorker`` a `WeightSink` (a test checks both).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class WeightSource(Protocol):
    """A train rank, as the senders read its weights."""

    rank: int

    @property
    def weights_device(self) -> torch.device:
        """The device the rank's weights live on (CUDA IPC buffers are made there)."""
        ...

    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full named weights in the sync dtype, yielded on rank 0; every rank iterates to the
        end (the gathers are collective)."""
        ...

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every synced weight, in `full_state`'s order."""
        ...

    def weight_sources(self) -> list[tuple[str, torch.Tensor]] | None:
        """One rank's weights as views (no gather), or None where they are sharded."""
        ...

    def tied_weights(self) -> dict[str, str]:
        """Tied weights: alias -> the name that holds the tensor."""
        ...


class WeightSink(Protocol):
    """A rollout worker, as the receivers load weights into its engine (engine paused)."""

    @property
    def weights_device(self) -> torch.device | None:
        """The device of an engine that takes tensors; None for one that does not (a server)."""
        ...

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy named tensors into the engine; returns how many."""
        ...

    async def update_weights_from_disk(self, path: str) -> None:
        """Reload the engine's weights from an HF folder (or a LoRA adapter folder)."""
        ...
