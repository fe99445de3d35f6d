"""``python -m arl.bench transport``: the control plane's cost, beside its floor and its peer.

Measured in one run on this machine:

- RPC round trip: sequential empty calls from a `Controller` to a real ``arl-node`` (an async
  method, run on the node's event loop, and a blocking one, run on its engine thread); p50/p99.
- Bulk transfer, controller -> node, one way: a call whose argument is the tensor and whose reply
  is its byte count, at 1, 16 and 256 MiB.
- The floors: an in-process memcpy of the same bytes into a preallocated buffer (``Tensor.copy_``),
  and for round trips plain synchronous pyzmq (no auth, no event loop) echoing an arl header.
- The event-loop adapter alone: the same pyzmq round trips with the caller's side driven by arl's
  `LoopSocket`, and by ``zmq.asyncio`` (what arl used before), on the same loop.
- The peer: HTTP + pickle, a stdlib ``http.server`` in a subprocess that unpickles a tensor
  POSTed with ``http.client`` (keep-alive, Nagle off). Pickle lives here and nowhere else in arl.
- CPU per round trip, both processes with all their threads (Linux ``/proc``): on a loaded
  machine a sequential round trip costs about the CPU its two sides spend, one after the other.

Targets (issue 2): p50 <= 200 us; tcp bulk >= 5x HTTP+pickle.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
import zmq
import zmq.asyncio

from arl.bench import MIB, positive_int, size_list_mib
from arl.control.controller import Controller
from arl.control.launcher import LocalNodes
from arl.event_loop import loop_name, run_loop
from arl.protocol.proxy import proxy
from arl.wire.codec import Message, encode_message
from arl.wire.sockets import LoopSocket, Security, new_secret

P50_TARGET_US = 200.0
HTTP_RATIO_TARGET = 5.0


class Sink:
    """Created on the node: takes calls and tensors and answers with something small."""

    async def noop(self) -> None:
        """An empty call served on the node's event loop."""

    def noop_blocking(self) -> None:
        """An empty call served on the node's engine thread."""

    async def take(self, t: torch.Tensor) -> int:
        """Receive a tensor; answer with its size in bytes."""
        return t.numel() * t.element_size()


@attrs.define
class Latency:
    """Round-trip times of one kind of call, in microseconds, and the CPU each call took."""

    name: str
    samples_us: list[float]
    cpu_us: float = math.nan  # CPU per call, both processes (all their threads) together

    def pct(self, q: float) -> float:
        """The q-th percentile (0-100)."""
        s = sorted(self.samples_us)
        return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


@attrs.define
class Bulk:
    """One path at one size: per-transfer seconds."""

    path: str
    nbytes: int
    seconds: list[float]

    @property
    def gbps(self) -> float:
        """One-way throughput of the median transfer, in GB/s (1e9 bytes per second)."""
        return self.nbytes / statistics.median(self.seconds) / 1e9


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) has used; nan without /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _CpuMeter:
    """CPU used by the two processes of a round trip from now on, per call."""

    def __init__(self, *pids: int):
        self.pids = pids
        self.start = [_cpu_seconds(p) for p in pids]

    def per_call_us(self, calls: int) -> float:
        used = sum(_cpu_seconds(p) - s for p, s in zip(self.pids, self.start, strict=True))
        return used / calls * 1e6


# ---- arl: a Controller and one real node ----------------------------------------------------


async def _time_calls(fn: Callable[[], Coroutine[Any, Any, Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


async def measure_arl(
    calls: int, warmup: int, sizes: list[int], reps: dict[int, int]
) -> tuple[list[Latency], list[Bulk]]:
    """Round trips and bulk transfers between a Controller and one local node."""
    security = Security(new_secret())
    async with Controller(security) as ctl:
        async with LocalNodes(ctl.address, security, [{"OMP_NUM_THREADS": "1"}]) as nodes:
            (node,) = await ctl.wait_for_nodes(1, timeout=120)
            pids = os.getpid(), nodes.procs[0].pid
            sink = proxy(Sink, await node.create("arl.bench.transport:Sink"))
            await _time_calls(sink.noop, warmup)
            cpu = _CpuMeter(*pids)
            samples = await _time_calls(sink.noop, calls)
            latencies = [
                Latency("arl call, async method (node loop)", samples, cpu.per_call_us(calls))
            ]
            await _time_calls(sink.noop_blocking, warmup // 4)
            n = max(calls // 4, 100)
            cpu = _CpuMeter(*pids)
            samples = await _time_calls(sink.noop_blocking, n)
            latencies.append(
                Latency("arl call, blocking method (engine thread)", samples, cpu.per_call_us(n))
            )
            bulk = []
            for size in sizes:
                t = torch.empty(size, dtype=torch.uint8).fill_(7)
                got = await sink.take(t)  # warm-up, and a check
                if got != size:
                    raise RuntimeError(f"the node received {got} bytes of {size}")
                times = []
                for _ in range(reps[size]):
                    t0 = time.perf_counter()
                    await sink.take(t)
                    times.append(time.perf_counter() - t0)
                bulk.append(Bulk("arl tcp (zmq, zero-copy frames)", size, times))
                del t
    return latencies, bulk


# ---- the floor of a round trip, and arl's event-loop adapter against zmq.asyncio ---------------

# The peer of the pyzmq rows: a sync DEALER echoing each message (a subprocess importing only zmq).
_ECHO_SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.linger = 0
sock.connect(sys.argv[1])
sock.send(b"ready")
while True:
    sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
"""


@contextlib.contextmanager
def _echo_peer(router: zmq.Socket) -> Iterator[tuple[bytes, int]]:
    """An echo subprocess connected to ``router`` (a sync ROUTER); yields (identity, pid)."""
    address = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    proc = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, address])
    try:
        if not router.poll(120_000):
            raise RuntimeError("the pyzmq echo subprocess did not start within 120 s")
        identity, _ = router.recv_multipart()
        yield identity, proc.pid
    finally:
        proc.kill()
        proc.wait()


async def _async_round_trips(sock: Any, identity: bytes, calls: int, warmup: int) -> list[float]:
    header = encode_message(Message("call", 1, "call", {"obj": "s", "method": "noop"}))
    samples = []
    for i in range(warmup + calls):
        t0 = time.perf_counter_ns()
        await sock.send_multipart([identity, *header])
        await sock.recv_multipart()
        if i >= warmup:
            samples.append((time.perf_counter_ns() - t0) / 1e3)
    return samples


def measure_zmq_one_side(calls: int, warmup: int) -> list[Latency]:
    """Sequential round trips of an arl-sized header to a sync pyzmq echo (no auth, no arl).

    The caller's side is plain sync pyzmq (the floor), then `LoopSocket` and ``zmq.asyncio`` on
    this benchmark's event loop: the difference is what one async side costs per round trip.
    """
    out = []
    for name, wrap in [
        ("plain pyzmq, sync, no auth (floor)", None),
        ("pyzmq + arl LoopSocket, caller side async", LoopSocket),
        ("pyzmq + zmq.asyncio (arl before), caller side async", zmq.asyncio.Socket),
    ]:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.linger = 0
        try:
            with _echo_peer(router) as (identity, pid):
                cpu = _CpuMeter(os.getpid(), pid)  # counts the warm-up calls too
                if wrap is None:
                    samples = _sync_round_trips(router, identity, calls, warmup)
                else:
                    samples = run_loop(_async_round_trips(wrap(router), identity, calls, warmup))
                out.append(Latency(name, samples, cpu.per_call_us(calls + warmup)))
        finally:
            router.close()  # also closes the wrappers (they share the libzmq socket)
            ctx.term()
    return out


def _sync_round_trips(router: zmq.Socket, identity: bytes, calls: int, warmup: int) -> list[float]:
    header = encode_message(Message("call", 1, "call", {"obj": "s", "method": "noop"}))
    samples = []
    for i in range(warmup + calls):
        t0 = time.perf_counter_ns()
        router.send_multipart([identity, *header])
        router.recv_multipart()
        if i >= warmup:
            samples.append((time.perf_counter_ns() - t0) / 1e3)
    return samples


# ---- the peer: HTTP + pickle ----------------------------------------------------------------


def serve_http() -> None:
    """The baseline server (run in a subprocess): unpickles each POSTed body, answers its size."""
    import pickle  # the baseline arl replaces; never used by the runtime
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like requests.Session
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            # Read into one preallocated buffer: rfile.read(n) would join chunks (an extra copy)
            # and make the baseline slower than a good HTTP server.
            body = bytearray(int(self.headers["Content-Length"]))
            view, got = memoryview(body), 0
            while got < len(body):
                n = self.rfile.readinto(view[got:])
                if not n:
                    raise ConnectionError("client closed mid-body")
                got += n
            obj = pickle.loads(body)
            n = obj.numel() * obj.element_size() if isinstance(obj, torch.Tensor) else 0
            out = str(n).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_port, flush=True)
    server.serve_forever()


def measure_http(
    calls: int, warmup: int, sizes: list[int], reps: dict[int, int]
) -> tuple[Latency, list[Bulk]]:
    """Round trips and bulk transfers to the HTTP+pickle server in a subprocess."""
    import pickle

    proc = subprocess.Popen(
        [sys.executable, "-c", "from arl.bench.transport import serve_http; serve_http()"],
        stdout=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.connect()
        assert conn.sock is not None
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def post(obj: Any) -> int:
            conn.request("POST", "/", body=pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            return int(conn.getresponse().read())

        for _ in range(warmup):
            post(None)
        samples = []
        cpu = _CpuMeter(os.getpid(), proc.pid)
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            post(None)
            samples.append((time.perf_counter_ns() - t0) / 1e3)
        latency = Latency("HTTP + pickle, empty POST", samples, cpu.per_call_us(calls))
        bulk = []
        for size in sizes:
            t = torch.empty(size, dtype=torch.uint8).fill_(7)
            if post(t) != size:
                raise RuntimeError(f"the HTTP server did not receive all {size} bytes")
            times = []
            for _ in range(max(1, reps[size] // 2)):  # slow: fewer repetitions
                t0 = time.perf_counter()
                post(t)
                times.append(time.perf_counter() - t0)
            bulk.append(Bulk("HTTP + pickle (http.server)", size, times))
        conn.close()
        return latency, bulk
    finally:
        proc.terminate()
        proc.wait(10)


# ---- the floor: memcpy ----------------------------------------------------------------------


def measure_memcpy(sizes: list[int], reps: dict[int, int]) -> list[Bulk]:
    """Copy the same bytes into a preallocated buffer in this process, on one thread.

    One thread, like one socket stream; it also keeps OpenMP's barrier waits (millisecond
    stalls when another process holds the second core) out of the floor.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_memcpy(size, max(reps[size], 5)) for size in sizes]
    finally:
        torch.set_num_threads(threads)


def _memcpy(size: int, reps: int) -> Bulk:
    src = torch.empty(size, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src).fill_(0)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return Bulk("memcpy in process, 1 thread (floor)", size, times)


# ---- report ---------------------------------------------------------------------------------


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n} B"


def report(
    latencies: list[Latency], memcpy: list[Bulk], arl: list[Bulk], http: list[Bulk], command: str
) -> str:
    """The markdown tables, the targets, and the command that reproduces them."""
    floor = {b.nbytes: b.gbps for b in memcpy}
    peer = {b.nbytes: b.gbps for b in http}
    lines = [
        f"## arl transport ({platform.node()}: {os.cpu_count()} cores, torch {torch.__version__},"
        f" pyzmq {zmq.__version__} / libzmq {zmq.zmq_version()}, loop {loop_name()},"
        f" load average {os.getloadavg()[0]:.1f} at the end)",
        "",
        "| round trip (sequential) | calls | p50 µs | p99 µs | CPU µs/call, both sides |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {lat.name} | {len(lat.samples_us)} | {lat.pct(50):.0f} | {lat.pct(99):.0f}"
        f" | {'-' if math.isnan(lat.cpu_us) else f'{lat.cpu_us:.0f}'} |"
        for lat in latencies
    ]
    lines += [
        "",
        "| path (one way) | size | GB/s | vs memcpy | vs HTTP |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for b in sorted([*memcpy, *arl, *http], key=lambda b: (b.nbytes, -b.gbps)):
        lines.append(
            f"| {b.path} | {_size(b.nbytes)} | {b.gbps:.2f} | {b.gbps / floor[b.nbytes]:.2f}x"
            f" | {b.gbps / peer[b.nbytes]:.1f}x |"
        )
    p50 = latencies[0].pct(50)
    ratios = ", ".join(f"{_size(b.nbytes)} {b.gbps / peer[b.nbytes]:.1f}x" for b in arl)
    ok_ratio = all(b.gbps / peer[b.nbytes] >= HTTP_RATIO_TARGET for b in arl)
    lines += [
        "",
        f"- target p50 <= {P50_TARGET_US:.0f} µs: {'met' if p50 <= P50_TARGET_US else 'MISSED'}"
        f" ({p50:.0f} µs)",
        f"- target tcp bulk >= {HTTP_RATIO_TARGET:.0f}x HTTP+pickle:"
        f" {'met' if ok_ratio else 'MISSED'} ({ratios})",
        "",
        f"reproduce: `{command}`",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables; returns 0 (the targets are reported, not fatal)."""
    p = argparse.ArgumentParser(prog="python -m arl.bench transport", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repetitions (about 4x faster)")
    p.add_argument(
        "--calls", type=positive_int, default=None, help="timed empty calls (default 2000)"
    )
    p.add_argument(
        "--sizes-mib",
        type=size_list_mib,
        default=[1, 16, 256],
        help="bulk sizes in MiB, comma separated (1,16,256)",
    )
    a = p.parse_args(argv)
    sizes = [int(s * MIB) for s in a.sizes_mib]
    calls = a.calls or (500 if a.quick else 2000)
    warmup = calls // 10
    # Repetitions scale down with size: the total stays well under two minutes on 2 cores.
    reps = {s: max(3, min(100, (64 if a.quick else 256) * MIB // s)) for s in sizes}
    torch.manual_seed(0)

    latencies, arl = run_loop(measure_arl(calls, warmup, sizes, reps))
    one_side = measure_zmq_one_side(calls, warmup)
    http_latency, http = measure_http(max(calls // 4, 100), warmup // 4, sizes, reps)
    memcpy = measure_memcpy(sizes, reps)
    command = "python -m arl.bench transport" + (" " + " ".join(argv) if argv else "")
    print(report([*latencies, *one_side, http_latency], memcpy, arl, http, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
