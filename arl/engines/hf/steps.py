"""A decode step's way back to the host, one step behind the device (the hf engine's overlap).

Without overlap each decode step ends in a blocking copy of its tokens to the host, and the GPU
waits while the host appends them to their requests, checks the stop conditions and compacts
finished rows: at ~300 rows that host work is a third of the step. With overlap the engine
launches step k+1 (its inputs, the sampled tokens, are already on the device) before it reads
step k back, so the host's bookkeeping for k runs while the device computes k+1.

The price is one extra step for a row that finishes at step k: step k+1 was launched before the
host knew, so it computes (and samples, drawing the generator) a token nobody reads. Its cache
write stays in bounds: a row finishes on length once it holds ``max_seq_len - 1`` positions, so
the extra step writes position ``max_seq_len - 1``.

Host-to-device copies in the overlapped path go through pinned memory without blocking
(`upload`): PyTorch's blocking copy from pageable memory waits for the stream, that is for the
step in flight, which would undo the overlap at every admission and compaction.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from arl.engines.hf.request import Request


@attrs.define(eq=False)
class Launched:
    """A decode step on its way: the rows it ran (in their order then), their tokens and
    log-probs (on the host once ``ready``), and the policy version it ran with."""

    rows: list[Request]
    out: torch.Tensor  # [2, rows]: float64 token ids (exact) and log-probs
    ready: torch.cuda.Event | None  # None: ``out`` is already on the host
    version: int


class StepOutputs:
    """Two pinned host buffers and events, used in turn: step k+1 copies into one while the
    host reads step k from the other. On a CPU device the outputs are on the host already."""

    def __init__(self, device: torch.device, max_rows: int):
        self.device = device
        self._turn = 0
        if device.type == "cuda":
            # Flat, so that a step's [2, rows] view is contiguous: a copy into a strided host
            # view goes through a pageable temporary, which blocks.
            self._bufs = [
                torch.empty(2 * max_rows, dtype=torch.float64, pin_memory=True) for _ in range(2)
            ]
            self._events = [torch.cuda.Event() for _ in range(2)]

    def launch(
        self, rows: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor, version: int
    ) -> Launched:
        """Start copying a step's tokens and log-probs to the host; returns at once on CUDA."""
        both = torch.stack([tokens.double(), logprobs.double()])
        if self.device.type != "cuda":
            return Launched(rows, both, None, version)
        i, self._turn = self._turn, 1 - self._turn
        out = self._bufs[i][: 2 * len(rows)].view(2, len(rows))
        out.copy_(both, non_blocking=True)
        self._events[i].record()
        return Launched(rows, out, self._events[i], version)

    @staticmethod
    def wait(step: Launched) -> tuple[list[list[float]], float]:
        """The step's [tokens, log-probs] as lists, and the seconds spent waiting for them."""
        t0 = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
        waited = time.perf_counter() - t0
        return step.out.tolist(), waited


def upload(
    values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` on ``device`` without waiting for the device's stream: through pinned memory
    on CUDA, so a copy issued behind a step in flight does not block on it."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
