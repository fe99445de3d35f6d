"""CUDA graphs of the hf engine's decode step, one per (batch bucket, KV-length bucket).

Per-step host overhead, not the GPU, bounds an eager decode step of a small model, so on CUDA
the step is replayed from a captured graph. Graphs read the KV cache's buffers by address:
when the cache reallocates (its ``generation`` changes) every graph is stale and is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import torch

from arl.engines.hf.kv_cache import SlotKVCache

logger = logging.getLogger(__name__)


def bucket(n: int, floor: int, cap: int) -> int:
    """The power of two >= max(n, floor), at most ``cap`` (n <= cap)."""
    return min(cap, max(floor, 1 << (n - 1).bit_length()))


@attrs.define
class DecodeGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, vocab], written by each replay


class DecodeGraphs:
    """The captured decode graphs of one engine; they share one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self._generation = -1
        self._pool: Any = None

    def get(
        self,
        rows: int,
        width: int,
        cache: SlotKVCache,
        forward: Callable[[int, int], torch.Tensor],
    ) -> DecodeGraph:
        """The graph of ``forward(rows, width)``, captured on first use or after ``cache`` grew."""
        graph = self._graphs.get((rows, width))
        if graph is None or self._generation != cache.generation:
            graph = self._capture(rows, width, cache, forward)
        return graph

    def clear(self) -> None:
        """Drop every graph and the memory pool they share."""
        self._graphs.clear()
        self._pool = None

    def _capture(
        self,
        rows: int,
        width: int,
        cache: SlotKVCache,
        forward: Callable[[int, int], torch.Tensor],
    ) -> DecodeGraph:
        # Warm-up runs eagerly: it grows the cache if needed (which makes older graphs stale)
        # and writes exactly the keys/values this step's replay writes again.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(rows, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._generation != cache.generation:
            # Destroying the graphs releases their memory pool; its handle cannot be reused.
            self._graphs.clear()
            self._pool = None
            self._generation = cache.generation
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = forward(rows, width)
        self._graphs[(rows, width)] = captured = DecodeGraph(graph, logits)
        logger.debug("captured a decode graph for %d rows x %d positions", rows, width)
        return captured
