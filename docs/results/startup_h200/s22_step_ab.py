"""An hf engine's start-up and its decode step at n live rows, on a GPU.

    PYTHONPATH=TREE python3 docs/results/startup_h200/s22_step_ab.py MODEL ROWS

Builds the engine (warm-up to 1,025 positions, so every row bucket's decode graph is captured),
prints its start-up phases and dynamo's count of compiled graphs, then for each n the mean of 50
replays of the decode graph holding n rows of 100..999 positions. Run once per source tree in
one process each, on the same machine, to compare two trees.
"""

import sys
import time

import torch
import torch._dynamo.utils as dynamo_utils

from arl.engines.hf.engine import HFEngine

model, max_rows = sys.argv[1], int(sys.argv[2])
t0 = time.perf_counter()
engine = HFEngine(
    model,
    device="cuda",
    dtype="bfloat16",
    max_batch_size=max_rows,
    max_seq_len=2048,
    warm_up_len=1025,
)
print(
    f"TOTAL {time.perf_counter() - t0:.2f} load {engine.load_s:.2f} "
    f"compile {engine.compile_s:.2f} graphs {engine.warm_up_s:.2f}",
    flush=True,
)
print("UNIQUE", dict(dynamo_utils.counters["stats"]), flush=True)
g = torch.Generator().manual_seed(0)
out = []
with torch.no_grad():
    for n in (8, 32, 48, 64, 100, 128, 200, 256, 300, 384):
        if n > max_rows:
            continue
        lens = torch.randint(100, 1000, (n,), generator=g)
        engine._pos[:n] = lens.to(engine.device)
        engine._next_tok[:n] = torch.randint(0, 1000, (n,), generator=g).to(engine.device)
        engine._graph_logits(n, int(lens.max()) + 1)  # captures the bucket's graph if need be
        rows, width = engine._decode_shape(n, int(lens.max()) + 1)
        graph = engine._graphs.get(rows, width, engine._cache, engine._forward_decode)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graph.graph.replay()
        start.record()
        for _ in range(50):
            graph.graph.replay()
        end.record()
        torch.cuda.synchronize()
        out.append(f"n={n}:{start.elapsed_time(end) / 50:.3f}ms")
print("STEP", " ".join(out), flush=True)
engine.close()
