"""``python -m arl.bench rtensor``: shard pull throughput beside its physical floors.

One owner process serves one shard per size on its data plane; this process pulls it
(same host through shared memory, and over tcp), and measures in the same run an in-process
memcpy of the same bytes and a raw TCP transfer between two processes (``sendall`` /
``recv_into`` a reused buffer). The consumer touches every byte: the shared-memory pull copies
the mapped tensor into a tensor it owns; the tcp pull writes every byte into its own memory.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import statistics
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import torch
import zmq
import zmq.asyncio

from arl.bench import MIB, positive_int, size_mib
from arl.node.data_plane import DEFAULT_CHUNK_BYTES, DataPlaneClient, DataPlaneServer
from arl.node.shard_store import ShardStore
from arl.protocol.rtensor import ShardRef
from arl.wire.sockets import Authenticator, Security, bind_tcp, make_socket, new_secret


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m arl.bench rtensor", description=__doc__)
    p.add_argument("--sizes-mib", type=positive_int, nargs="+", default=[16, 256])
    p.add_argument(
        "--reps", type=positive_int, default=5, help="timed pulls per size (median reported)"
    )
    p.add_argument(
        "--chunk-mib",
        type=size_mib,
        nargs="+",
        default=[DEFAULT_CHUNK_BYTES / MIB],
        help="tcp chunk sizes to compare (one tcp row each)",
    )
    p.add_argument(
        "--copy-threads",
        type=positive_int,
        default=1,
        help="torch threads for the memcpy floor and the consumer's copy (1: a plain memcpy)",
    )
    p.add_argument("--serve", nargs=3, metavar=("RUN_ID", "SIZES", "CHUNK"), help=argparse.SUPPRESS)
    p.add_argument("--raw-send", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- child processes -------------------------------------------------------------------------
async def _serve(run_id: str, sizes: list[int], chunk_bytes: int) -> None:
    """Owner: one bfloat16 shard per size, served until stdin closes."""
    ctx = zmq.asyncio.Context()
    security = Security(os.environ["ARL_SECRET"])
    auth = Authenticator(ctx, security)
    store = ShardStore(run_id, "owner")
    for size in sizes:
        x = torch.randint(-(2**15), 2**15, (size // 2,), dtype=torch.int16).view(torch.bfloat16)
        store.put(f"s{size}", {"x": x})
    in_shm = all(store.entry(f"s{size}").segment is not None for size in sizes)
    sock = make_socket(ctx, zmq.ROUTER, security, server=True)
    addr = bind_tcp(sock, "127.0.0.1")
    server = DataPlaneServer(store, sock, chunk_bytes=chunk_bytes)
    server.start()
    print(addr, int(in_shm), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.close()
    sock.close(0)
    auth.stop()
    ctx.term()
    store.close()


def _raw_send() -> None:
    """Raw socket peer: answers each 8-byte size request with that many bytes."""
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    buf = bytearray()
    while True:
        head = conn.recv(8, socket.MSG_WAITALL)
        if len(head) < 8:
            return
        (n,) = struct.unpack("<Q", head)
        if len(buf) < n:
            buf = bytearray(os.urandom(MIB)) * (n // MIB + 1)
        conn.sendall(memoryview(buf)[:n])


def _spawn(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "arl.bench.rtensor", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline().decode().strip()
    if not line:
        proc.kill()
        raise RuntimeError(f"benchmark helper {args[0]} exited with {proc.wait()} before starting")
    return proc, line


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- measurements ----------------------------------------------------------------------------
def _median_gbps(nbytes: int, run: Callable[[], None], reps: int) -> float:
    run()  # warm-up: connections, page tables, allocator
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def memcpy_gbps(size: int, reps: int) -> float:
    """In-process copy of ``size`` bytes into a preallocated buffer (the floor)."""
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _median_gbps(size, lambda: dst.copy_(src), reps)


def raw_tcp_gbps(sizes: list[int], reps: int) -> dict[int, float]:
    """Raw TCP between two processes on loopback: sendall / recv_into a reused buffer."""
    proc, port = _spawn(["--raw-send"])
    out = {}
    try:
        with socket.create_connection(("127.0.0.1", int(port))) as conn:
            for size in sizes:
                view = memoryview(bytearray(size))

                def run(size: int = size, view: memoryview = view) -> None:
                    conn.sendall(struct.pack("<Q", size))
                    got = 0
                    while got < size:
                        got += conn.recv_into(view[got:], size - got)

                out[size] = _median_gbps(size, run, reps)
    finally:
        _end(proc)
    return out


async def _pull_rates(
    addr: str, secret: str, sizes: list[int], reps: int, force_tcp: bool
) -> dict[int, float]:
    ctx = zmq.asyncio.Context()
    store = ShardStore(f"bench{uuid.uuid4().hex[:6]}", "consumer")
    client = DataPlaneClient(store, ctx=ctx, security=Security(secret), force_tcp=force_tcp)
    out = {}
    try:
        for size in sizes:
            ref = ShardRef("owner", f"s{size}", size, 0)
            mine = torch.empty(size // 2, dtype=torch.bfloat16)
            times = []
            for rep in range(reps + 1):  # the first pull warms the connection up
                t0 = time.perf_counter()
                x = (await client.pull_shards([ref], {"owner": addr}))[ref.key]["x"]
                if not force_tcp:
                    mine.copy_(x)  # a mapping alone touches nothing: read every byte
                dt = time.perf_counter() - t0
                del x
                store.free([ref.key])
                if rep:
                    times.append(dt)
            out[size] = size / statistics.median(times) / 1e9
    finally:
        await client.close()
        store.close()
        ctx.destroy(linger=0)
    return out


def pull_gbps(sizes: list[int], reps: int, chunk_bytes: int, force_tcp: bool) -> dict[int, float]:
    """Pull each size from an owner process: same host through shm, or tcp when forced."""
    secret = new_secret()
    run_id = f"bench{uuid.uuid4().hex[:6]}"
    spec = ",".join(str(s) for s in sizes)
    proc, line = _spawn(["--serve", run_id, spec, str(chunk_bytes)], {"ARL_SECRET": secret})
    addr, in_shm = line.split()
    if not force_tcp and in_shm != "1":
        print("warning: /dev/shm had no room for the shards; the same-host row went over tcp")
    try:
        return asyncio.run(_pull_rates(addr, secret, sizes, reps, force_tcp))
    finally:
        _end(proc)


# ---- report ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table; returns the exit code."""
    a = _parse(argv)
    if a.serve:
        run_id, spec, chunk = a.serve
        asyncio.run(_serve(run_id, [int(s) for s in spec.split(",")], int(chunk)))
        return 0
    if a.raw_send:
        _raw_send()
        return 0
    sizes = [s * MIB for s in a.sizes_mib]
    torch.set_num_threads(a.copy_threads)  # the floor and the shm consumer copy the same way
    memcpy = {s: memcpy_gbps(s, a.reps) for s in sizes}
    raw = raw_tcp_gbps(sizes, a.reps)
    rows = [("memcpy, preallocated (floor)", memcpy, None), ("raw tcp socket", raw, None)]
    shm = pull_gbps(sizes, a.reps, DEFAULT_CHUNK_BYTES, False)
    rows.append(("pull, same host (shm + copy)", shm, memcpy))
    for chunk in a.chunk_mib:
        rate = pull_gbps(sizes, a.reps, int(chunk * MIB), True)
        rows.append((f"pull, tcp ({chunk:g} MiB chunks)", rate, raw))

    head = f"{'path':<34}" + "".join(f"{f'{s // MIB} MiB':>22}" for s in sizes)
    print(f"arl rtensor pulls: median of {a.reps}, GB/s (ratio to its floor)")
    print(f"{os.cpu_count()} cpus, copies on {a.copy_threads} thread(s), loopback")
    print(head)
    print("-" * len(head))
    for name, rates, floor in rows:
        cells = ""
        for s in sizes:
            ratio = f" ({rates[s] / floor[s]:.2f}x)" if floor else ""
            cells += f"{f'{rates[s]:.2f}{ratio}':>22}"
        print(f"{name:<34}{cells}")
    cmd = ["python", "-m", "arl.bench", "rtensor", "--sizes-mib", *map(str, a.sizes_mib)]
    cmd += ["--reps", str(a.reps), "--copy-threads", str(a.copy_threads)]
    cmd += ["--chunk-mib", *(f"{c:g}" for c in a.chunk_mib)]
    print(f"\nreproduce: {shlex.join(cmd)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
