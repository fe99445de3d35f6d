"""``python -m arl.bench collective``: broadcast bus bandwidth, the floor of ``nccl`` weight sync.

``nccl`` weight sync (DESIGN §6) is a bucketed broadcast from train rank 0 to every inference
rank. Its floor is the broadcast bandwidth of the same group on the same machine, which this
measures with plain ``torch.distributed`` on ``--world`` local processes: NCCL on GPUs (one GPU
per process; ``NCCL_NVLS_ENABLE=0`` is set unless given, as the multi-GPU machines here need),
gloo on CPU (the stand-in that CI runs). For a broadcast, bus bandwidth equals algorithm
bandwidth (bytes / seconds), as in nccl-tests.

Compare its GB/s with ``sync/gb_per_s`` of a run with ``weight_sync.mode=nccl``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from arl.bench import int_at_least, positive_int, size_mib
from arl.wire.addresses import free_port


def _worker(rank: int, world: int, port: int, backend: str, sizes: list[int], reps: int, q) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for nbytes in sizes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if rank == 0:
                buf.fill_(7)
            times = []
            for i in range(reps + 1):
                dist.barrier()
                if backend == "nccl":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                dist.broadcast(buf, src=0)
                if backend == "nccl":
                    torch.cuda.synchronize(device)
                dist.barrier()
                if i:  # the first is a warm-up
                    times.append(time.perf_counter() - t0)
            ok = bool((buf[:: max(1, nbytes // 4096)] == 7).all())
            if rank == 0:
                q.put((nbytes, statistics.median(times), ok))
            elif not ok:
                q.put((nbytes, float("nan"), False))
    finally:
        dist.destroy_process_group()


def measure(world: int, backend: str, sizes: list[int], reps: int) -> list[tuple[int, float, bool]]:
    """[(bytes, median seconds, data arrived intact)] for a broadcast from rank 0."""
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        if torch.cuda.device_count() < world:
            raise SystemExit(
                f"--world {world} with nccl needs {world} GPUs; this machine has "
                f"{torch.cuda.device_count()}"
            )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = mp.start_processes(
        _worker,
        args=(world, free_port(), backend, sizes, reps, q),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    try:
        while not procs.join(timeout=1):
            pass
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    out = []
    while not q.empty():
        out.append(q.get())
    return sorted(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arl.bench collective", description=__doc__)
    p.add_argument(
        "--world",
        type=int_at_least(2),
        default=2,
        help="processes, rank 0 and the ranks it broadcasts to (one GPU each with nccl)",
    )
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    p.add_argument("--sizes-mib", type=size_mib, nargs="+", default=[1, 16, 256])
    p.add_argument("--reps", type=positive_int, default=5)
    args = p.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.device_count() >= args.world else "gloo"
    sizes = [int(m * (1 << 20)) for m in args.sizes_mib]
    rows = measure(args.world, backend, sizes, args.reps)
    print(f"# broadcast from rank 0 to {args.world - 1} ranks, {backend}, median of {args.reps}")
    print("| size | seconds | bus bandwidth | data intact |")
    print("| --- | --- | --- | --- |")
    for nbytes, sec, ok in rows:
        print(f"| {nbytes / (1 << 20):g} MiB | {sec:.5f} | {nbytes / sec / 1e9:.2f} GB/s | {ok} |")
    return 0 if rows and all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
