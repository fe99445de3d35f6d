"""Packed micro-batches: the bucket ladder, the host layout, and on one CPU rank the packed
update against the padded one, padding to a bucket included (what a CUDA graph replays)."""

from __future__ import annotations

import socket

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.algo.packing import concat_shards, seq_lengths
from arl.config import ActorConfig
from arl.train.fsdp import FSDPEngine
from arl.train.packed import Bucket, bucket_for, host_layout, pack_micro_batch

torch.set_num_threads(1)


@pytest.mark.parametrize(
    ("tokens", "seqs", "longest", "want"),
    [
        (1, 1, 1, Bucket(1024, 128, 16)),  # 1,023 padding tokens in 64 sequences of <= 16
        (1024, 4, 16, Bucket(1024, 8, 16)),
        (1025, 4, 17, Bucket(1280, 16, 32)),  # 255 padding tokens in 8 sequences of <= 32
        (10_000, 128, 192, Bucket(10240, 256, 256)),
        (16_384, 256, 256, Bucket(16384, 256, 256)),
        (16_385, 256, 256, Bucket(20480, 512, 256)),
    ],
)
def test_bucket_ladder(tokens: int, seqs: int, longest: int, want: Bucket) -> None:
    got = bucket_for(tokens, seqs, longest)
    assert got == want
    assert got.tokens >= tokens and got.max_len >= longest
    assert got.tokens <= max(1024, 1.25 * tokens)  # at most a quarter of padding


def test_bucket_refuses_an_empty_micro_batch() -> None:
    with pytest.raises(ValueError, match="> 0"):
        bucket_for(0, 1, 1)


def test_host_layout_of_rows_and_of_their_padding() -> None:
    # Rows 2 and 0 of a [3, 6] batch, 3 and 5 tokens long.
    lay, total, n_seqs, max_len, n_real = host_layout([5, 4, 3], [2, 0], 6, None)
    index, pos, seq, cu = lay.split([total, total, total, n_seqs + 1])
    assert (total, n_seqs, max_len, n_real) == (8, 2, 5, 8)
    assert index.tolist() == [12, 13, 14, 0, 1, 2, 3, 4]
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert seq.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert cu.tolist() == [0, 3, 8]

    lay, total, n_seqs, max_len, n_real = host_layout([5, 4, 3], [2, 0], 6, Bucket(16, 8, 8))
    index, pos, seq, cu = lay.split([total, total, total, n_seqs + 1])
    assert (total, n_seqs, max_len, n_real) == (16, 8, 8, 8)
    # 8 padding tokens: one sequence of 8 (the bucket's max length), then empty sequences.
    assert pos.tolist()[8:] == list(range(8))
    assert seq.tolist()[8:] == [2] * 8
    assert index.tolist()[8:] == [0] * 8
    assert cu.tolist() == [0, 3, 8, 16, 16, 16, 16, 16, 16]
    with pytest.raises(ValueError, match="too small"):
        host_layout([5, 4, 3], [2, 0], 6, Bucket(16, 8, 4))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("m")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")
    return str(path)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shards = []
    for _ in range(3):
        lens = torch.randint(3, 12, (4,), generator=g)
        width = int(lens.max())
        am = torch.arange(width)[None] < lens[:, None]
        lm = am & (torch.arange(width)[None] >= 2)
        shards.append(
            {
                "input_ids": torch.randint(1, 64, (4, width), generator=g) * am,
                "attention_mask": am,
                "loss_mask": lm,
                # far from the model's own log-probs: importance weights beyond the cap, so
                # seq_mask rejects some sequences and keeps others
                "logprobs": torch.where(lm, -4.2 + 0.5 * torch.randn(4, width, generator=g), 0.0),
                "versions": torch.where(lm, 0, -1).int(),
                "rewards": torch.tensor([1.0, 0.0, 0.0, 1.0]),
            }
        )
    return concat_shards(shards)


def _engine(model_dir: str, layout: str, **actor) -> FSDPEngine:
    cfg = ActorConfig(path=model_dir, layout=layout, behav_imp_weight_cap=2.0, **actor)
    return FSDPEngine(cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_port()}")


def _grads(eng: FSDPEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.gradients()}


@pytest.mark.parametrize("rejection", ["none", "seq_mask"])
def test_packed_update_gives_the_padded_gradients_and_stats(model_dir: str, rejection: str):
    batch = _batch()
    results = []
    for layout in ("padded", "packed"):
        eng = _engine(model_dir, layout, rejection=rejection, max_tokens_per_mb=40)
        try:
            b = eng.compute_advantages(dict(batch, prox_logp=eng.compute_logp(batch)))
            stats = eng.accumulate_gradients(b)
            results.append((stats, _grads(eng)))
        finally:
            eng.destroy()
    (padded, g_padded), (packed, g_packed) = results
    assert packed["n_micro_batches"] == padded["n_micro_batches"] > 1
    if rejection == "seq_mask":
        assert 0 < padded["rejected_frac"] < 1  # the case is not vacuous
    for k in ("loss", "entropy", "clip_frac", "imp_weight_mean", "rejected_frac", "n_tokens"):
        assert packed[k] == pytest.approx(padded[k], rel=1e-5, abs=1e-7), k
    for name, g in g_padded.items():
        torch.testing.assert_close(g_packed[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_padding_a_packed_row_to_its_bucket_changes_nothing(model_dir: str):
    """The padding that makes micro-batches share a CUDA graph's shapes: extra sequences,
    masked out, changing no real token's gradient or statistic."""
    batch = _batch()
    eng = _engine(model_dir, "packed")
    try:
        b = eng.compute_advantages(dict(batch, prox_logp=eng.compute_logp(batch)))
        lens = seq_lengths(b)
        rows = list(range(len(lens)))
        fields = ("loss_mask", "advantages", "logprobs", "prox_logp")
        got = []
        for bucket in (None, bucket_for(sum(lens), len(rows), max(lens))):
            eng.zero_grad()
            eng._stats.reset()
            eng._n_global.fill_(float(b["loss_mask"].sum()))
            mb = pack_micro_batch(b, rows, lens, fields, bucket)
            eng._packed_pass(mb)
            got.append((mb, eng._stats.sums.clone(), _grads(eng)))
        (exact, s_exact, g_exact), (padded, s_padded, g_padded) = got
        assert padded.input_ids.shape[1] == 1024 > exact.input_ids.shape[1] == sum(lens)
        assert not padded.fields["loss_mask"][0, sum(lens) :].any()
        torch.testing.assert_close(s_padded, s_exact, rtol=1e-6, atol=1e-9)
        for name, g in g_exact.items():
            torch.testing.assert_close(g_padded[name], g, rtol=1e-5, atol=1e-7, msg=name)
        # Writing another micro-batch into the same bucket's tensors leaves none of the old one.
        again = pack_micro_batch(b, rows[:5], lens, fields, bucket, padded)
        assert again is padded and padded.input_ids.shape[1] == 1024
        assert int(padded.fields["loss_mask"].sum()) == int(b["loss_mask"][:5].sum())
    finally:
        eng.destroy()
