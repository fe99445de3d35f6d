"""`RefusalLog` logs one line per (host, kind) per window and counts what it left out."""

from __future__ import annotations

import logging

from arl.wire.sockets import RefusalLog


def test_one_line_per_key_per_window_then_the_count_left_out(caplog):
    caplog.set_level(logging.WARNING, logger="arl.wire")
    now = [100.0]
    refusals = RefusalLog(window=0.3, burst=10, clock=lambda: now[0])
    logged = [refusals.note("10.0.0.1 wrong", f"line {i}") for i in range(50)]
    assert logged == [True] + [False] * 49
    assert refusals.note("10.0.0.2 wrong", "other host")  # another host is not held back
    now[0] += 0.35
    assert refusals.note("10.0.0.1 wrong", "after the window")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["line 0", "other host", "after the window (49 more like it not logged)"]
    assert refusals.refused == 52


def test_a_scan_from_many_hosts_is_capped_per_window(caplog):
    caplog.set_level(logging.WARNING, logger="arl.wire")
    refusals = RefusalLog(window=60, burst=5)
    logged = sum(refusals.note(f"10.0.{i // 256}.{i % 256} x", "scan") for i in range(1000))
    assert logged == 5 and refusals.suppressed == 995
