"""The engine's split-KV Triton decode attention (arl.engines.hf.split_decode) against the
attention it computes, in float64 on the rows' own lengths: every dtype, head group and head
dim the families use, one split or several, and replayed from a CUDA graph whose lengths
change between replays."""

from __future__ import annotations

import pytest
import torch

from arl.engines.hf.split_decode import split_decode_attention, splits_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def attention(q, k, v, lens, scale) -> torch.Tensor:
    """Each row's query heads against its first ``lens[b]`` positions, float64."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens.tolist()[: q.shape[0]]):
        s = torch.einsum("hgd,hnd->hgn", q[b].double(), k[b, :, :n].double()) * scale
        out[b] = torch.einsum("hgn,hnd->hgd", s.softmax(-1), v[b, :, :n].double())
    return out


def cache(rows: int, kv_heads: int, width: int, dim: int, dtype) -> tuple[torch.Tensor, ...]:
    """Keys and values as the engine passes them: a view of ``rows`` rows and ``width``
    positions of a larger cache (its row and position strides are the cache's)."""
    full = torch.randn(2, rows + 3, kv_heads, width + 128, dim, dtype=dtype, device="cuda")
    return full[0, :rows, :, :width], full[1, :rows, :, :width]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows, kv_heads, group, dim, width",
    [
        (5, 3, 3, 64, 320),
        (3, 2, 6, 128, 256),
        (7, 4, 1, 80, 192),
        (2, 2, 16, 64, 640),
        (3, 1, 32, 128, 256),  # one KV head for 32 query heads
    ],
)
@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_split_decode_attends_to_each_rows_own_length(
    dtype, rows, kv_heads, group, dim, width, splits
) -> None:
    torch.manual_seed(rows * dim + group)
    q = torch.randn(rows, kv_heads, group, dim, dtype=dtype, device="cuda")
    k, v = cache(rows, kv_heads, width, dim, dtype)
    # A length of one, one of a whole block, one past a block, the whole width, random ones.
    lens = torch.randint(1, width + 1, (rows + 2,), dtype=torch.int32)
    lens[: min(rows, 4)] = torch.tensor([1, 64, 65, width])[: min(rows, 4)]
    lens = lens.cuda()
    out = split_decode_attention(q, k, v, lens, dim**-0.5, splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    want = attention(q, k, v, lens, dim**-0.5)
    torch.testing.assert_close(out.double(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_graph_of_the_call_follows_the_lengths_written_before_each_replay() -> None:
    rows, kv_heads, group, dim, width = 48, 3, 3, 64, 1024
    q = torch.randn(rows, kv_heads, group, dim, dtype=torch.bfloat16, device="cuda")
    k, v = cache(rows, kv_heads, width, dim, torch.bfloat16)
    lens = torch.full((rows,), 8, dtype=torch.int32, device="cuda")
    assert splits_for(rows, kv_heads, width, 132) > 1  # the graph holds the merge kernel too
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        split_decode_attention(q, k, v, lens, dim**-0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_decode_attention(q, k, v, lens, dim**-0.5)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        lens.copy_(torch.randint(1, width + 1, (rows,), generator=gen, dtype=torch.int32))
        graph.replay()
        want = attention(q, k, v, lens, dim**-0.5)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
