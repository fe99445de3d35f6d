"""`arl.bench collective` on CPU: the gloo stand-in of the NCCL broadcast the nccl sync uses."""

from __future__ import annotations

from arl.bench.collective import measure


def test_gloo_broadcast_reaches_every_rank_intact():
    rows = measure(world=3, backend="gloo", sizes=[1 << 16, 1 << 20], reps=2)
    assert [n for n, _, _ in rows] == [1 << 16, 1 << 20]
    assert all(ok and sec > 0 for _, sec, ok in rows)
