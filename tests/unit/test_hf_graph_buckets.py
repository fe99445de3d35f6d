"""The decode-graph buckets of the hf engine: every size maps to a bucket that holds it, and
large batches pad by less than one step instead of up to twice their size."""

from arl.engines.hf.graphs import ROW_STEP, WIDTH_STEP, buckets, row_bucket, width_bucket


def test_buckets_hold_their_sizes_and_pad_by_less_than_a_step():
    for cap in (1, 3, 64, 100, 384, 512):
        for n in range(1, cap + 1):
            b = row_bucket(n, cap)
            assert n <= b <= cap
            if n > ROW_STEP:
                assert b - n < ROW_STEP
    for cap in (64, 2048, 4100):
        for n in range(1, cap + 1):
            w = width_bucket(n, cap)
            assert min(max(n, 64), cap) <= w <= cap
            if n > WIDTH_STEP:
                assert w - n < WIDTH_STEP


def test_buckets_lists_each_bucket_once_in_order():
    assert buckets(384, row_bucket) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384]
    assert buckets(2048, width_bucket)[:5] == [64, 128, 256, 512, 768]
    assert buckets(100, row_bucket)[-1] == 100
    every = {row_bucket(n, 384) for n in range(1, 385)}
    assert sorted(every) == buckets(384, row_bucket)
