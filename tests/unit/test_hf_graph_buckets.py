"""The decode-graph buckets of the hf engine: every size maps to a bucket that holds it, and
large batches pad by less than one step instead of up to twice their size."""

from arl.engines.hf.graphs import (
    ROW_STEP,
    WIDTH_STEP,
    buckets,
    row_bucket,
    warm_up_shapes,
    warm_up_widths,
    width_bucket,
)


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
    # No bucket of one row (compiled code specialises a size of 1) unless one row is all.
    assert buckets(384, row_bucket) == [2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384]
    assert buckets(1, row_bucket) == [1]
    assert buckets(2048, width_bucket)[:5] == [64, 128, 256, 512, 768]
    assert buckets(100, row_bucket)[-1] == 100
    every = {row_bucket(n, 384) for n in range(1, 385)}
    assert sorted(every) == buckets(384, row_bucket)


def test_warm_up_captures_every_shape_a_decode_step_can_run_and_no_other():
    """The SDPA warm-up's graphs are exactly the (rows, width) buckets of the steps an engine of
    ``max_rows`` rows runs for requests up to ``length`` positions: none missing (it would be
    captured mid-rollout), none wasted (captured at start for nothing)."""
    for max_rows, length, max_seq_len in ((384, 193, 2048), (100, 1537, 2048), (3, 64, 64)):
        shapes = warm_up_shapes(max_rows, warm_up_widths(length, max_seq_len))
        reachable = {
            (row_bucket(n, max_rows), width_bucket(kv, max_seq_len))
            for n in range(1, max_rows + 1)
            for kv in range(1, length + 1)
        }
        assert len(shapes) == len(set(shapes)) and set(shapes) == reachable
    # arith on one engine: 48 groups x 8 samples in flight, 128 + 64 + 1 positions.
    assert len(warm_up_shapes(384, warm_up_widths(193, 2048))) == 11 * 3


def test_a_prefill_runs_at_its_bucket_while_that_fits_the_cache_and_the_token_cap():
    from arl.engines.hf.graphs import prefill_shape

    cap = 8192
    assert prefill_shape(1, 5, 32, 128, cap) == (1, 64)
    assert prefill_shape(3, 17, 32, 128, cap) == prefill_shape(4, 64, 32, 128, cap) == (4, 64)
    assert prefill_shape(3, 65, 32, 256, cap) == (4, 128)
    assert prefill_shape(70, 40, 256, 128, cap) == (128, 64)  # rows above 64: multiples of 64
    assert prefill_shape(3, 600, 32, 1024, cap) == (4, 768)  # widths above 512: of 256
    # a bucket past the cache's free rows or positions, or past the token cap, has no graph
    assert prefill_shape(5, 10, 7, 128, cap) is None
    assert prefill_shape(2, 100, 32, 64, cap) is None
    assert prefill_shape(64, 200, 320, 1024, cap) is None  # 64 x 256 tokens
    assert prefill_shape(64, 200, 320, 1024, 2 * cap) == (64, 256)
