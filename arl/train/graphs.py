"""CUDA graphs of a training micro-batch's pass, one per bucket of packed sizes (one rank).

A small model's update is bound by the host: each pass launches thousands of short kernels
(forward, loss, backward, gradient sums), and the device idles while Python issues them
(measured on an H200 for SmolLM2-135M and ~10k tokens: ~4,600 kernels, the device busy about a
third of the update). Replaying a captured graph issues them all in one call.

A graph replays fixed shapes and fixed memory, so a micro-batch is packed into the sizes of its
`Bucket` (`arl.train.packed`): its inputs are copied into that bucket's own tensors, and the
pass adds what it computes (gradients, statistics) into tensors that outlive every replay (the
caller's pass must do so: nothing it returns survives a replay). The first micro-batch of a
bucket runs eagerly on the capture stream (it selects kernels and compiles what is compiled),
then the same pass is captured, which runs nothing; every later one of the bucket is a replay.
All graphs allocate from one memory pool, so together they hold about what the largest needs.

If a capture fails (a pass that reads a value back to the host cannot be captured), graphs are
switched off for the rest of the run with one warning, and passes run eagerly as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from arl.train.packed import Bucket, PackedMicroBatch

log = logging.getLogger(__name__)


class MicroBatchGraphs:
    """Captured passes by bucket, for micro-batches of at most ``max_tokens`` tokens."""

    def __init__(self, device: torch.device, max_tokens: int) -> None:
        self.device, self.max_tokens = device, max_tokens
        self.enabled = True
        self.captures = self.replays = 0
        # Micro-batches run eagerly beside the graphs: their mini-batch had one over the cap (or
        # a capture failed).
        self.eager = 0
        self.capture_s = 0.0
        self._graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, PackedMicroBatch]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)

    def summary(self) -> dict:
        """What the graphs did so far: on (False after a failed capture), the token cap,
        captures and their seconds, replays, and micro-batches run eagerly beside them."""
        return {
            "enabled": self.enabled,
            "max_tokens": self.max_tokens,
            "captures": self.captures,
            "replays": self.replays,
            "eager": self.eager,
            "capture_s": self.capture_s,
        }

    def takes(self, bucket: Bucket) -> bool:
        """Whether a micro-batch of ``bucket`` runs as a graph."""
        return self.enabled and bucket.tokens <= self.max_tokens

    def run(
        self,
        bucket: Bucket,
        fill: Callable[[PackedMicroBatch | None], PackedMicroBatch],
        body: Callable[[PackedMicroBatch], None],
    ) -> None:
        """One micro-batch: ``fill(row)`` writes it into ``row`` (None: new tensors) and returns
        the row; ``body(row)`` is the pass. Replays the bucket's graph, capturing it first."""
        entry = self._graphs.get(bucket)
        if entry is not None:
            graph, row = entry
            fill(row)
            graph.replay()
            self.replays += 1
            return
        t0 = time.perf_counter()
        row = fill(None)  # the bucket's own tensors, outside the graphs' pool
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            body(row)  # this micro-batch's real pass, and the warm-up of the capture
        current.wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                body(row)
        except Exception as exc:  # the pass is done (eagerly above); only the graph is lost
            self.enabled = False
            self._graphs.clear()
            log.warning(
                "capturing the training pass as a CUDA graph failed (%s: %s); passes run "
                "eagerly from now on (actor.cuda_graphs=false skips the attempt)",
                type(exc).__name__,
                (str(exc).splitlines() or [""])[0][:300],
            )
            return
        self._graphs[bucket] = (graph, row)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
