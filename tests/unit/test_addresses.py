"""Loopback is decided on an address's host part; a free port can be bound."""

from __future__ import annotations

import socket

import pytest

from arl.wire.addresses import free_port, host_of, is_loopback


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("127.0.0.1", True),
        ("tcp://127.0.0.2:5555", True),  # all of 127/8 is loopback
        ("tcp://localhost:5555", True),
        ("LOCALHOST", True),
        ("tcp://[::1]:5555", True),
        ("::1", True),
        ("tcp://10.0.0.5:5555", False),
        ("tcp://node-127.0.0.1.example.org:5555", False),  # contains the text, is not loopback
        ("tcp://notlocalhost:5555", False),
        ("tcp://gpu17:5555", False),
        ("tcp://[2001:db8::1]:5555", False),
    ],
)
def test_is_loopback_reads_the_host_part(address, loopback):
    assert is_loopback(address) is loopback


def test_host_of_strips_scheme_port_and_brackets():
    assert host_of("tcp://gpu17:5555") == "gpu17"
    assert host_of("tcp://[::1]:5555") == "::1"
    assert host_of("gpu17") == "gpu17"


def test_free_port_can_be_bound():
    port = free_port("127.0.0.1")
    assert 0 < port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
