"""Every listening socket of a local run is on loopback, the torch rendezvous included (issue 19,
item 3: train rank 0's TCPStore listened on every interface, unauthenticated).

A real run (controller here, rollout node and two FSDP train ranks as `arl-node` processes) is
watched from /proc while it trains: each listening TCP socket of this process and its descendants
is recorded with its address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from pathlib import Path

import pytest

from arl.run import run
from tests.support.tiny_model import make_tiny_model, tiny_run_config


def _listening() -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket on this host."""
    out = {}
    for name, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hex_addr, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            out[int(f[9])] = (str(ipaddress.ip_address(raw)), int(hex_port, 16))
    return out


def _tree(root: int) -> list[int]:
    """``root`` and all its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _sockets_of(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def snapshot() -> set[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket of this process tree."""
    listen = _listening()
    return {
        (pid, *listen[i]) for pid in _tree(os.getpid()) for i in _sockets_of(pid) if i in listen
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_every_listening_socket_of_a_local_run_is_on_loopback(tmp_path, tiny_model):
    cfg = tiny_run_config(
        tmp_path, tiny_model, "actor.backend=fsdp:d2", "experiment.total_train_steps=1"
    )
    seen: set[tuple[int, str, int]] = set()

    async def main():
        async def watch():
            while True:
                seen.update(snapshot())
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch())
        try:
            await run(cfg)
        finally:
            watcher.cancel()

    asyncio.run(main())
    pids = {pid for pid, _, _ in seen}
    # The controller (here) and the three nodes each listen; train rank 0 also for the store.
    assert len(pids) >= 4, seen
    assert len(seen) >= 5, seen
    wide = {s for s in seen if not ipaddress.ip_address(s[1]).is_loopback}
    assert not wide, f"listening beyond loopback: {sorted(wide)}"
