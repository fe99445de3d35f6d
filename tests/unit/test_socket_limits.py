"""A zmq context from `new_context` holds more sockets than libzmq's default 1,023 and raises a
low open-file soft limit, so a node can pull from many shard owners (three sockets each)."""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = r"""
import json, resource, sys
import zmq
from arl.wire.sockets import new_context
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
def fill(ctx, n):
    socks = []
    try:
        for _ in range(n):
            socks.append(ctx.socket(zmq.PAIR))
        return len(socks), ""
    except zmq.ZMQError as exc:
        return len(socks), str(exc)
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
plain = fill(zmq.Context(), int(sys.argv[1]))
sized = fill(new_context(), int(sys.argv[1]))
print(json.dumps({"plain": plain, "sized": sized,
                  "soft": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "hard": hard}))
"""


def test_new_context_holds_more_sockets_than_the_default_and_raises_the_soft_limit() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, "1500"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if got["hard"] != -1 and got["hard"] < 4000:
        import pytest

        pytest.skip(f"this machine's hard open-file limit is {got['hard']}")
    assert got["plain"][0] < 1500 and got["plain"][1], got  # libzmq's default cap stops it
    assert got["sized"] == [1500, ""], got
    assert got["soft"] > 1024, got
