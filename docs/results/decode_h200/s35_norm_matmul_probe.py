"""`kernels.norm_matmul` against what it replaces (the compiled residual add + RMSNorm +
projection, and + SwiGLU), one call timed from a CUDA graph of 50, bf16, at decode's row counts
and the shapes of SmolLM2-135M, Qwen2.5-1.5B and Qwen2.5-7B; then a sweep of its tile settings.

    python3 s35_norm_matmul_probe.py [sweep]

`kernels.norm_matmul` is not in arl: apply ``s35_norm_matmul.diff`` (beside this file) first,
``git apply docs/results/decode_h200/s35_norm_matmul.diff``.
"""

import functools
import itertools
import sys

import torch
import torch.nn.functional as F

from arl.engines.hf import kernels
from arl.engines.hf.fused import _rms

EPS = 1e-5
SHAPES = {  # hidden, q/k/v columns, MLP width
    "135M": (576, 960, 1536),
    "1.5B": (1536, 2048, 8960),
    "7B": (3584, 4608, 18944),
}


def graph_us(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best


def proj(x, d, nw, w):
    h = x + d
    return h, F.linear(_rms(h, nw, EPS), w)


def mlp_in(x, d, nw, w):
    h = x + d
    g = F.linear(_rms(h, nw, EPS), w)
    half = g.shape[-1] // 2
    return h, F.silu(g[:, :half]) * g[:, half:]


def main() -> None:
    sweep = "sweep" in sys.argv[1:]
    dev, dt = "cuda", torch.bfloat16
    cproj = torch.compile(proj, dynamic=True)
    cmlp = torch.compile(mlp_in, dynamic=True)
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, (k, nqkv, inter) in SHAPES.items():
        nw = torch.rand(k, device=dev, dtype=dt) + 0.5
        wq = torch.randn(nqkv, k, device=dev, dtype=dt) / k**0.5
        wg = torch.randn(2 * inter, k, device=dev, dtype=dt) / k**0.5
        for m in (16, 64, 256, 512):
            x = torch.randn(m, k, device=dev, dtype=dt)
            d = torch.randn(m, k, device=dev, dtype=dt)
            for what, w, ref, sw in (("qkv", wq, cproj, False), ("gate_up", wg, cmlp, True)):
                h0, y0 = ref(x, d, nw, w)
                h1, y1 = kernels.norm_matmul(x, d, nw, w, None, EPS, swiglu=sw)
                err = (y1.float() - y0.float()).abs().max().item()
                scale = y0.float().abs().max().item()
                call = functools.partial(kernels.norm_matmul, x, d, nw, w, None, EPS, swiglu=sw)
                t_ref = graph_us(functools.partial(ref, x, d, nw, w))
                t_new = graph_us(call)
                wbytes = w.numel() * 2
                print(
                    f"{name:5s} {what:7s} m={m:4d}: compiled {t_ref:7.1f} us, norm_matmul "
                    f"{t_new:7.1f} us (weights at 4.8 TB/s {wbytes / 4.8e6:6.1f} us), h equal "
                    f"{torch.equal(h0, h1)}, max diff {err:.3g} of {scale:.3g}",
                    flush=True,
                )
                if not sweep or m not in (64, 256):
                    continue
                best = None
                for bm, bn, bk, warps, stages in itertools.product(
                    (16, 64, 128), (64, 128), (64, 128), (4, 8), (2, 4)
                ):
                    if bm > max(16, m):
                        continue
                    orig = kernels._norm_matmul_tiles
                    kernels._norm_matmul_tiles = lambda m, c=(bm, bn, bk, warps, stages): c
                    try:
                        t = graph_us(call)
                    except Exception as exc:  # out of shared memory, registers
                        t = float("inf")
                        print("   ", bm, bn, bk, warps, stages, str(exc).splitlines()[0][:80])
                    finally:
                        kernels._norm_matmul_tiles = orig
                    if best is None or t < best[0]:
                        best = (t, bm, bn, bk, warps, stages)
                print(
                    f"      best {best[0]:.1f} us at bm, bn, bk, warps, stages = {best[1:]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
