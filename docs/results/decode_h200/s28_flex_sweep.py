"""Flex decode attention alone at batch 256, mixed lengths, on the engine's block mask: kernel
options and row order against the KV read floor (one layer of SmolLM2-135M's shape). Session 28
ran it on an H100; its output is s28_h100_flex_sweep.log."""

import random
import time

import torch
from torch.nn.attention.flex_attention import flex_attention

from arl.bench.gpu import mixed_lengths
from arl.engines.hf.flex import KV_BLOCK, FlexDecodeMask

dev = torch.device("cuda")
B, KVH, G, D = 256, 3, 3, 64
lens = [n + 128 for n in mixed_lengths(B, 64, 1044)]  # mid-generation
random.Random(0).shuffle(lens)  # arrival order
width = -(-max(lens) // KV_BLOCK) * KV_BLOCK


def copy_bandwidth() -> float:
    x = torch.empty(2**28, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 20 * x.numel() / (time.perf_counter() - t)


bw = copy_bandwidth()
floor_bytes = sum(-(-n // KV_BLOCK) * KV_BLOCK for n in lens) * KVH * D * 2 * 2
floor_us = 1e6 * floor_bytes / bw
print(f"copy {bw / 1e12:.2f} TB/s; width {width}; floor (block-rounded lengths) {floor_us:.1f} us")


def timed(fn, *args, iters=200) -> float:
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def setup(order):
    lengths = [lens[i] for i in order]
    q = torch.randn(B, KVH, G, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, KVH, width, D, device=dev, dtype=torch.bfloat16)
    mask = FlexDecodeMask(B, G, dev)
    mask.update(torch.tensor(lengths, device=dev) - 1)
    return q, k, torch.randn_like(k), mask.block_mask(B, width)


def attention(block_mask, options):
    kw = {} if options is None else {"kernel_options": options}

    def run(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, scale=0.125, **kw)

    return run


base = list(range(B))
variants = [("default", None, base, None)]
for warps in (2, 4, 8):
    for stages in (1, 2, 3):
        opts = {"num_warps": warps, "num_stages": stages}
        variants.append((f"warps{warps} stages{stages}", opts, base, None))
for split in (1, 2, 4, 8):
    variants.append((f"SPLIT_KV {split}", {"SPLIT_KV": split}, base, None))
variants.append(("BLOCK_N 32", {"BLOCK_N": 32}, base, None))
variants.append(("rows longest first", None, sorted(base, key=lambda i: -lens[i]), None))
variants.append(("max-autotune", None, base, "max-autotune-no-cudagraphs"))
for name, opts, order, mode in variants:
    try:
        q, k, v, block_mask = setup(order)
        torch._dynamo.reset()
        f = torch.compile(attention(block_mask, opts), dynamic=False, mode=mode)
        t0 = time.perf_counter()
        f(q, k, v)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        us = timed(f, q, k, v)
        print(
            f"{name:24s} {us:7.1f} us  floor/time {floor_us / us:.2f}  (compile {compile_s:.1f} s)",
            flush=True,
        )
    except Exception as exc:  # noqa: BLE001 - an option this torch does not take
        print(f"{name:24s} failed: {str(exc).splitlines()[0][:150]}", flush=True)
