"""MPS client priority probe (session 29): does CUDA_MPS_CLIENT_PRIORITY=1 on one client let the
other's small kernels through?

    python3 s29_mps_priority_probe.py A|B SECONDS

A replays a CUDA graph of 300 small kernels ([256, 576] @ [576, 576], SiLU, scale, add: a
decode-like step); B runs four [8192, 2048] @ [2048, 8192] products per iteration (a
training-like load). Each prints its iterations per second. Run two at once, each as an MPS
client, with and without the variable on one of them (the commands are in docs/results.md).
"""

import sys
import time

import torch


def decode_like() -> object:
    x = torch.randn(256, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, 576, device="cuda", dtype=torch.bfloat16)

    def body() -> torch.Tensor:
        y = x
        for _ in range(300):
            y = torch.nn.functional.silu(y @ w) * 0.5 + x
        return y

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
    torch.cuda.synchronize()
    return graph.replay


def train_like() -> object:
    a = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 8192, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        for _ in range(4):
            torch.relu(a @ b)

    return step


def main() -> None:
    kind, seconds = sys.argv[1], float(sys.argv[2])
    torch.cuda.init()
    step = decode_like() if kind == "A" else train_like()
    time.sleep(1.0)  # both processes ready before either counts
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        step()
        n += 1
        if n % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"{kind} {n / (time.perf_counter() - t0):.1f}/s", flush=True)


if __name__ == "__main__":
    main()
