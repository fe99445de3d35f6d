"""The engine's split-KV Triton decode kernel (`arl.engines.hf.split_decode`) against compiled
flex attention on the engine's block mask, one layer of SmolLM2-135M's shape (9 query heads,
3 KV heads, head dim 64, bf16), beside the KV read floor measured in the same run.

Cases: batch 256 with `arl.bench gpu`'s mixed lengths (the `decode.b256_tokens_per_s` case),
batch 256 at 128+64 positions, and small batches of long rows (where a row's positions are split
over several programs). Each arm is checked against flex's output, and timed from a CUDA graph
of 20 calls. The kernel's settings (splits, warps, stages) are swept at each case; "auto" is
the engine's own choice (`splits_for`, 4 warps, 2 stages).

Also times the first call of each (compile), flex per new batch size against the kernel's.
"""

import random
import sys
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from arl.bench.gpu import mixed_lengths
from arl.bench.sync import copy_bandwidth
from arl.engines.hf.flex import KV_BLOCK, FlexDecodeMask
from arl.engines.hf.split_decode import split_decode_attention, splits_for

dev = torch.device("cuda")
KVH, G, D = 3, 3, 64
SMS = torch.cuda.get_device_properties(dev).multi_processor_count


def timed(fn, iters=300) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def graphed(fn, iters=300) -> float:
    """Time ``fn`` replayed from a CUDA graph of 20 calls (no launch cost in the figure)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return timed(graph.replay, iters=iters // 20) / 20


bw = 2 * copy_bandwidth("cuda", 1 << 30)  # bytes read and written
print(f"{torch.cuda.get_device_name()}; {SMS} SMs; copy {bw / 1e12:.2f} TB/s", flush=True)

cases = {
    "b256 mixed": [n + 128 for n in mixed_lengths(256, 64, 1044)],
    "b256 uniform 192": [192] * 256,
    "b64 mixed": [n + 128 for n in mixed_lengths(64, 64, 1044)],
    "b16 long 1000-1800": list(range(1000, 1800, 50)),
    "b4 long 1800": [1800] * 4,
}
if len(sys.argv) > 1:
    cases = {k: v for k, v in cases.items() if k in sys.argv[1:]}


def run_case(name: str, lens: list[int], full_sweep: bool) -> None:
    random.Random(0).shuffle(lens)
    B = len(lens)
    width = -(-max(lens) // KV_BLOCK) * KV_BLOCK
    floor_us = 1e6 * sum(lens) * KVH * D * 2 * 2 / bw
    torch.manual_seed(0)
    q = torch.randn(B, KVH, G, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, KVH, width, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = FlexDecodeMask(B, G, dev)
    mask.update(torch.tensor(lens, device=dev) - 1)
    block_mask = mask.block_mask(B, width)
    print(f"\n## {name}: width {width}, read floor {floor_us:.1f} us", flush=True)
    flex = torch.compile(
        lambda: flex_attention(q, k, v, block_mask=block_mask, scale=D**-0.5), dynamic=False
    )
    t0 = time.perf_counter()
    ref = flex().float()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    us = graphed(flex)
    print(
        f"{'flex, graphed':40s} {us:7.1f} us  floor/time {floor_us / us:.2f}  first {first:.1f} s"
    )
    auto = splits_for(B, KVH, width, SMS)
    arms = [("auto", None, 4, 2, 64)]
    for splits in sorted({1, 2, 4, 8, 16, auto}):
        # The whole sweep at the first case; the splits alone at the others.
        for warps in (2, 4, 8) if full_sweep else (4,):
            for stages in (1, 2, 3) if full_sweep else (2,):
                label = f"splits {splits} warps {warps} stages {stages}"
                arms.append((label, splits, warps, stages, 64))
    if full_sweep:
        for block in (32, 128):
            for stages in (2, 3):
                arms.append(
                    (f"splits {auto} stages {stages} block {block}", auto, 4, stages, block)
                )
    for label, splits, warps, stages, block in arms:
        try:

            def call(splits=splits, warps=warps, stages=stages, block=block):
                return split_decode_attention(
                    q, k, v, mask.lens, D**-0.5, splits, warps, stages, block
                )

            t0 = time.perf_counter()
            out = call().float()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            err = (out - ref).abs().max().item()
            us = graphed(call)
            label = f"triton {label}" + (f" (= splits {auto})" if splits is None else "")
            print(
                f"{label:40s} {us:7.1f} us  floor/time {floor_us / us:.2f}  max err {err:.4f}"
                f"  first {first:.2f} s",
                flush=True,
            )
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{label:40s} failed: {str(exc).splitlines()[0][:200]}", flush=True)


for i, (name, lens) in enumerate(cases.items()):
    run_case(name, lens, full_sweep=i == 0)
