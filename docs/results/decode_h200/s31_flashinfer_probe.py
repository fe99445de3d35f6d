"""FlashInfer's paged decode attention against the engine's flex decode, one layer of
SmolLM2-135M's shape (9 query heads, 3 KV heads, head dim 64, bf16) at batch 256 with the mixed
lengths of `arl.bench gpu`'s decode case, beside the KV read floor measured in the same run.
Session 31 ran it on an H100 with flashinfer-python 0.7.4 (kernels built by its JIT with the
machine's nvcc); its output is s31_h100_flashinfer_probe.log.

The device has no network and takes 64 MiB a call: the 101 MB wheel went as a 30 MB archive of
what the JIT needs (flashinfer's Python files; data/include, data/cutlass/include,
data/cutlass/tools/util/include, data/cccl, data/spdlog, and data/csrc's top-level files),
unpacked onto PYTHONPATH beside the wheels of apache-tvm-ffi, ninja, nvidia-ml-py, einops and
tabulate, with ninja's bin/ on PATH and CUDA_HOME at nvcc's.

Every arm reads the same keys and values (FlashInfer's arms from a paged copy of the flex
arm's cache, pages of a row in order) and is checked against the flex output.
"""

import os
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


bw = copy_bandwidth()
exact_bytes = sum(lens) * KVH * D * 2 * 2
block_bytes = sum(-(-n // KV_BLOCK) * KV_BLOCK for n in lens) * KVH * D * 2 * 2
print(
    f"copy {bw / 1e12:.2f} TB/s; width {width}; floor: exact lengths {1e6 * exact_bytes / bw:.1f}"
    f" us, 64-rounded {1e6 * block_bytes / bw:.1f} us",
    flush=True,
)
floor_us = 1e6 * exact_bytes / bw

torch.manual_seed(0)
q = torch.randn(B, KVH, G, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, KVH, width, D, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
mask = FlexDecodeMask(B, G, dev)
mask.update(torch.tensor(lens, device=dev) - 1)
block_mask = mask.block_mask(B, width)
flex = torch.compile(
    lambda: flex_attention(q, k, v, block_mask=block_mask, scale=D**-0.5), dynamic=False
)
ref = flex().reshape(B, KVH * G, D).float()
us = timed(flex)
print(f"{'flex (engine mask)':34s} {us:7.1f} us  floor/time {floor_us / us:.2f}", flush=True)
us = graphed(flex)
print(f"{'flex, graphed':34s} {us:7.1f} us  floor/time {floor_us / us:.2f}", flush=True)

os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
t0 = time.perf_counter()
import flashinfer  # noqa: E402

print(f"flashinfer {flashinfer.__version__} imported in {time.perf_counter() - t0:.1f} s")
q_fi = q.reshape(B, KVH * G, D).contiguous()
workspace = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)


def arm(name, layout, kv, indptr, indices, last, page, tensor_cores):
    """Plan and time one FlashInfer decode over ``kv`` (a (keys, values) pair of page tables)."""
    try:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, layout, use_tensor_cores=tensor_cores, backend="fa2"
        )
        args = (indptr.to(dev), indices.to(dev), last.to(dev), KVH * G, KVH, D, page)
        kw = {"q_data_type": torch.bfloat16, "kv_data_type": torch.bfloat16}
        t0 = time.perf_counter()
        wrapper.plan(*args, **kw)
        out = wrapper.run(q_fi, kv)
        torch.cuda.synchronize()
        build_s = time.perf_counter() - t0
        err = (out.float() - ref).abs().max().item()
        t0 = time.perf_counter()
        for _ in range(20):
            wrapper.plan(*args, **kw)
        plan_ms = 1e3 * (time.perf_counter() - t0) / 20
        us = timed(lambda: wrapper.run(q_fi, kv))
        print(
            f"{name:40s} {us:7.1f} us  floor/time {floor_us / us:.2f}  max err {err:.4f}"
            f"  plan {plan_ms:.2f} ms (first plan+run {build_s:.1f} s)",
            flush=True,
        )
    except Exception as exc:  # noqa: BLE001 - report and go on to the next arm
        print(f"{name:40s} failed: {str(exc).splitlines()[0][:300]}", flush=True)


def table(page_counts):
    indptr = torch.tensor([0, *torch.tensor(page_counts).cumsum(0).tolist()], dtype=torch.int32)
    return indptr


# 1. FlashInfer's own layout: NHD pages [pages, page, KV heads, D], a row's pages in order.
for page in (16, 64):
    pages = [-(-n // page) for n in lens]
    indptr = table(pages)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages, strict=True)])
    last = last.to(torch.int32)
    kc = torch.zeros(int(indptr[-1]), page, KVH, D, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    for b, n in enumerate(lens):
        s, e = int(indptr[b]), int(indptr[b + 1])
        kk = torch.zeros((e - s) * page, KVH, D, device=dev, dtype=torch.bfloat16)
        vv = torch.zeros_like(kk)
        kk[:n] = k[b, :, :n].transpose(0, 1)
        vv[:n] = v[b, :, :n].transpose(0, 1)
        kc[s:e] = kk.view(e - s, page, KVH, D)
        vc[s:e] = vv.view(e - s, page, KVH, D)
    for tc in (False, True):
        arm(f"fa2 NHD page {page} tc {int(tc)}", "NHD", (kc, vc), indptr, indices, last, page, tc)
    del kc, vc

# 2. The engine's own cache, as it is ([rows, KV heads, width, D] a layer): HND pages of
# ``page`` positions viewed in place (a page's heads ``width * D`` apart), row b's pages
# starting at page b * KVH * width / page; and one page per row (page = width).
for page in (16, 64, width):
    per_row = width // page
    n_pages = ((B - 1) * KVH + 1) * per_row
    kp = k.as_strided((n_pages, KVH, page, D), (page * D, width * D, D, 1))
    vp = v.as_strided((n_pages, KVH, page, D), (page * D, width * D, D, 1))
    pages = [-(-n // page) for n in lens]
    indptr = table(pages)
    indices = torch.cat(
        [b * KVH * per_row + torch.arange(p, dtype=torch.int32) for b, p in enumerate(pages)]
    )
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages, strict=True)])
    last = last.to(torch.int32)
    for tc in (False, True):
        name = f"fa2 engine cache HND page {page} tc {int(tc)}"
        arm(name, "HND", (kp, vp), indptr, indices, last, page, tc)
