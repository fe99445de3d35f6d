"""CUDA graphs of the hf engine's decode step, one per (batch bucket, KV-length bucket); with
length-aware decode attention (flex, triton) the width is the cache's whole width, so one per
batch bucket. And `PrefillGraphs`: its prefills through the fused functions, one per (rows,
width) bucket.

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


def bucket(n: int, floor: int, cap: int, step: int | None = None) -> int:
    """The power of two >= max(n, floor), at most ``cap`` (n <= cap); above ``step`` (a power
    of two) the next multiple of ``step`` instead, so a large batch pads by less than ``step``
    rather than up to twice its size."""
    n = max(n, floor)
    if step is not None and n > step:
        return min(cap, -(-n // step) * step)
    return min(cap, 1 << (n - 1).bit_length())


# Rows: powers of two from 2 up to 64, then multiples of 64 (293 rows run as 320, not 512).
# One row runs as two: compiled code specialises a size of 1, so a bucket of one row would
# compile every fused function once more (seconds at start-up) for steps that cost the same.
ROW_FLOOR, ROW_STEP = 2, 64
# KV positions: powers of two from 64 up to 512, then multiples of 256. A decode step reads the
# whole KV width of every row, so the width's padding costs bandwidth in proportion.
WIDTH_FLOOR, WIDTH_STEP = 64, 256


def row_bucket(n: int, cap: int) -> int:
    """The rows a decode graph runs for ``n`` active rows."""
    return bucket(n, ROW_FLOOR, cap, ROW_STEP)


def width_bucket(n: int, cap: int) -> int:
    """The KV positions a decode graph attends to for a longest row of ``n``."""
    return bucket(n, WIDTH_FLOOR, cap, WIDTH_STEP)


def buckets(cap: int, bucket_of: Callable[[int, int], int]) -> list[int]:
    """Every distinct bucket ``bucket_of`` gives for 1..cap, ascending."""
    out, n = [], 1
    while n <= cap:
        b = bucket_of(n, cap)
        out.append(b)
        n = b + 1
    return out


def warm_up_widths(length: int, max_seq_len: int) -> list[int]:
    """The KV widths of the SDPA decode graphs of rows up to ``length`` positions long."""
    return buckets(width_bucket(length, max_seq_len), width_bucket)


def warm_up_shapes(max_rows: int, widths: list[int]) -> list[tuple[int, int]]:
    """The (rows, KV width) of every decode graph a warm-up captures: every row bucket up to
    ``max_rows`` (the rows the engine may hold at once, which the trainer sizes to the rows
    in flight for it) at each width of ``widths``: each is the shape of some decode step (a
    test holds it to the steps the engine can run, no more and no fewer)."""
    rows = buckets(max_rows, row_bucket)
    return [(r, w) for w in widths for r in rows]


@attrs.define
class DecodeGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, vocab], a view of the shared output, written by each replay


class DecodeGraphs:
    """The captured decode graphs of one engine; they share one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._graphs: dict[tuple[int, int], DecodeGraph] = {}
        self._generation = -1
        self._pool: Any = None
        # Every graph copies its logits into this one buffer, so a graph's own output is a
        # temporary of the shared pool: many graphs cost one [rows, vocab] output, not one each.
        self._out: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def items(self) -> list[tuple[tuple[int, int], DecodeGraph]]:
        """The captured graphs as ``((rows, width), graph)`` pairs."""
        return list(self._graphs.items())

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
        self._out = None

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
                eager = forward(rows, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._out is None:  # outside the pool, sized for every row bucket (rows <= max_rows)
            shape = (cache.max_rows, eager.shape[-1])
            self._out = torch.empty(shape, dtype=eager.dtype, device=self.device)
        del eager
        if self._generation != cache.generation:
            # Destroying the graphs releases their memory pool; its handle cannot be reused.
            self._graphs.clear()
            self._pool = None
            self._generation = cache.generation
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        out = self._out[:rows]
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out.copy_(forward(rows, width))
        self._graphs[(rows, width)] = captured = DecodeGraph(graph, out)
        logger.debug("captured a decode graph for %d rows x %d positions", rows, width)
        return captured


# Prefill graphs: rows a power of two up to 64, then multiples of 64; KV widths as decode's.
# A graph holds at most twice the engine's prefill chunk (``max_prefill_tokens``), padding
# included, so that every chunk's bucket has one: its activations stay in the graphs' pool.
# That pool holds the activations of the largest bucket captured: its tokens are also bounded
# so that it stays about this size (a small model's prefills, which are bound by their host
# work, fit whole; a large model's host work hides behind its GPU work).
PREFILL_GRAPH_BYTES = 512 << 20


def prefill_token_bytes(config: Any, dtype: torch.dtype) -> int:
    """About the activation bytes one prefill token holds at once in a fused layer (its
    residual, q/k/v, the attention's repeated keys and values, the MLP's halves)."""
    return 2 * dtype.itemsize * (4 * config.hidden_size + 3 * config.intermediate_size)


def prefill_shape(
    rows: int, width: int, max_rows: int, max_width: int, max_tokens: int
) -> tuple[int, int] | None:
    """The (rows, width) of the prefill graph that serves ``rows`` prompts of up to ``width``
    tokens in a cache of ``max_rows`` free rows x ``max_width`` positions, or None where none
    does (the padded shape leaves the cache or passes ``max_tokens``)."""
    r = bucket(rows, 1, max_tokens, ROW_STEP)
    w = bucket(width, WIDTH_FLOOR, max_tokens, WIDTH_STEP)
    fits = r <= max_rows and w <= max_width and r * w <= max_tokens
    return (r, w) if fits else None


@attrs.define
class PrefillGraph:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [rows, width] token ids, right-padded with 0
    rows_at: torch.Tensor  # [rows] the cache rows written
    base: torch.Tensor  # [rows] 0..rows-1


class PrefillGraphs:
    """Captured prefills of one engine, one per (rows, width) bucket, sharing one memory pool.

    A prefill of a small model through the fused functions is bound by its host work (~35 ms
    on an H100 for any prompts up to a few thousand tokens: ~60 compiled calls and ~300
    kernels, against ~1-4 ms of GPU work); replayed from a graph it costs a few copies. A
    prefill of a new shape runs eagerly at the bucket's shape (that run is the prefill, and
    pays any first-size compilation), then is captured for the next prefill of that shape.
    Padded rows write their keys and values into free cache rows after the prefill's own, and
    padded positions past a prompt's length: a prefill or decode step overwrites or masks them
    (as for the eager prefill's padding). Every graph reads the cache's buffers by address:
    when they are reallocated (``cache.generation``) every graph is dropped.
    """

    @classmethod
    def for_model(
        cls, device: torch.device, config: Any, dtype: torch.dtype, max_prefill_tokens: int
    ) -> PrefillGraphs:
        """The graphs of an engine whose prefill chunks hold ``max_prefill_tokens``: buckets of
        at most twice that, and of at most `PREFILL_GRAPH_BYTES` of activations."""
        per_token = prefill_token_bytes(config, dtype)
        return cls(device, min(2 * max_prefill_tokens, PREFILL_GRAPH_BYTES // per_token))

    def __init__(self, device: torch.device, max_tokens: int) -> None:
        self.device, self.max_tokens = device, max_tokens
        self._graphs: dict[tuple[int, int], PrefillGraph] = {}
        self._generation = -1
        self._pool: Any = None
        self.replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and the memory pool they share."""
        self._graphs.clear()
        self._pool = None

    def run(
        self,
        ids: torch.Tensor,
        row0: int,
        cache: SlotKVCache,
        prefill: Callable[[torch.Tensor, torch.Tensor], None],
    ) -> bool:
        """Prefill ``ids`` [rows, width] (on the device) into cache rows ``row0..`` through
        ``prefill(ids, rows_at)``: by replaying its shape's graph, or eagerly at that shape and
        then capturing it. False (nothing run) where no graph shape fits the cache now."""
        rows, width = ids.shape
        free = cache.row_capacity - row0
        shape = prefill_shape(rows, width, free, cache.seq_capacity, self.max_tokens)
        if shape is None or not cache.allocated:
            return False
        if self._generation != cache.generation:
            # Destroying the graphs releases their memory pool; its handle cannot be reused.
            self.clear()
            self._generation = cache.generation
        graph = self._graphs.get(shape)
        buffers = graph if graph is not None else self._buffers(*shape)
        buffers.ids.zero_()
        buffers.ids[:rows, :width].copy_(ids)
        torch.add(buffers.base, row0, out=buffers.rows_at)
        if graph is not None:
            graph.graph.replay()
            self.replays += 1
            return True
        prefill(buffers.ids, buffers.rows_at)  # this prefill, and its shape's warm-up
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured, pool=self._pool, capture_error_mode="thread_local"):
            prefill(buffers.ids, buffers.rows_at)
        self._graphs[shape] = attrs.evolve(buffers, graph=captured)
        logger.debug("captured a prefill graph for %d rows x %d positions", *shape)
        return True

    def _buffers(self, rows: int, width: int) -> PrefillGraph:
        ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        base = torch.arange(rows, device=self.device)
        return PrefillGraph(None, ids, torch.empty_like(base), base)  # type: ignore[arg-type]
