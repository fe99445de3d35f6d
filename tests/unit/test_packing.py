"""Shard concatenation, FFD micro-batches, equal-count padding, packed vs padded forward."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.algo.losses import ppo_loss
from arl.algo.packing import (
    agree_count,
    balanced_partition,
    concat_shards,
    ffd_bins,
    micro_batches,
    pack_rows,
    select_rows,
    seq_lengths,
    unpack_values,
)
from arl.train.logp import forward_logp

T, F = True, False


def _shard(n: int, length: int, lens: list[int]) -> dict[str, torch.Tensor]:
    am = torch.tensor([[t < k for t in range(length)] for k in lens])
    lm = am.clone()
    lm[:, 0] = False
    return {
        "input_ids": torch.arange(n * length).view(n, length) % 7 * am,
        "attention_mask": am,
        "loss_mask": lm,
        "logprobs": torch.where(lm, -0.5, 0.0),
        "versions": torch.where(lm, 3, -1).int(),
        "rewards": torch.arange(n).float(),
    }


def test_concat_shards_pads_and_numbers_groups():
    b = concat_shards([_shard(2, 3, [3, 2]), _shard(1, 5, [5])])
    assert b["input_ids"].shape == (3, 5)
    assert b["group_ids"].tolist() == [0, 0, 1]
    assert b["versions"][0].tolist() == [-1, 3, 3, -1, -1]  # padding carries version -1
    assert b["attention_mask"][1].tolist() == [T, T, F, F, F]
    assert b["rewards"].tolist() == [0.0, 1.0, 0.0]
    assert seq_lengths(b) == [3, 2, 5]


def test_concat_shards_rejects_mismatched_keys():
    bad = _shard(1, 3, [3])
    del bad["versions"]
    with pytest.raises(ValueError, match="keys"):
        concat_shards([_shard(1, 3, [3]), bad])


def test_ffd_hand_case():
    # longest first: 8 -> bin0; 5 -> bin1; 4 -> bin1 (9); 3 -> bin2; 2 -> bin0 (10)
    assert ffd_bins([5, 3, 8, 2, 4], budget=10) == [[2, 3], [0, 4], [1]]


def test_over_budget_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match=r"sequence 1 has 12 tokens.*max_tokens_per_mb=10"):
        ffd_bins([5, 12], budget=10)


def test_micro_batches_padded_to_a_common_count():
    mbs = micro_batches([5, 3, 8, 2, 4], budget=10, n_min=5)
    assert mbs == [[2, 3], [0, 4], [1], [], []]
    assert micro_batches([], budget=10, n_min=2) == [[], []]
    assert agree_count(3) == 3  # no process group: this rank's count


def test_balanced_micro_batches_share_the_load_in_as_many_bins():
    # FFD: [8, 2] [5, 4] [3] (loads 10, 9, 3); balanced into 3: [8] [5, 2] [4, 3] (8, 7, 7)
    lens = [5, 3, 8, 2, 4]
    assert micro_batches(lens, budget=10, balanced=True) == [[2], [0, 3], [1, 4]]
    # as many bins as the ranks agreed on, each under the budget
    assert micro_batches(lens, budget=10, n_min=4, balanced=True) == [[2], [0], [4], [1, 3]]
    # where the even split would pass the budget (5, 4 | 5, 3, 3 = 11), the FFD bins
    assert balanced_partition([5, 5, 4, 3, 3], 2) == [[0, 2], [1, 3, 4]]
    assert micro_batches([5, 5, 4, 3, 3], budget=10, balanced=True) == [[0, 1], [2, 3, 4]]
    assert micro_batches([], budget=10, n_min=2, balanced=True) == [[], []]


def test_balanced_partition():
    # 8 -> p0, 5 -> p1, 4 -> p1 (9), 3 -> p0 (11), 2 -> p1 (11)
    assert balanced_partition([5, 3, 8, 2, 4], 2) == [[1, 2], [0, 3, 4]]
    assert balanced_partition([4], 3) == [[0], [], []]


def test_pack_and_unpack_round_trip():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    am = ids != 0
    row = pack_rows(ids, am)
    assert row.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert row.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert torch.equal(unpack_values(row.input_ids[0], am), ids)
    sub = select_rows({"input_ids": ids, "attention_mask": am}, [1])
    assert sub["input_ids"].tolist() == [[4, 5]]


def test_packing_with_host_lengths_gives_the_same_row():
    """Lengths known on the host (no read-back of sizes from a GPU) pack and unpack alike."""
    g = torch.Generator().manual_seed(1)
    lens = [5, 1, 9, 3]
    am = torch.arange(9)[None] < torch.tensor(lens)[:, None]
    ids = torch.randint(1, 100, (4, 9), generator=g) * am
    plain, hosted = pack_rows(ids, am), pack_rows(ids, am, lens)
    for a, b in zip(plain, hosted, strict=True):
        assert torch.equal(a, b)
    vals = torch.randn(sum(lens), generator=g)
    assert torch.equal(unpack_values(vals, am, hosted.index), unpack_values(vals, am))
    assert (unpack_values(vals, am, hosted.index)[~am] == 0).all()


def _tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def test_packed_and_padded_forward_give_the_same_logp_and_loss():
    torch.set_num_threads(1)
    model = _tiny_model()
    g = torch.Generator().manual_seed(3)
    lens = [7, 3, 11, 5]
    am = torch.tensor([[t < k for t in range(11)] for k in lens])
    ids = torch.randint(1, 256, (4, 11), generator=g) * am
    lm = am.clone()
    lm[:, :2] = False
    with torch.no_grad():
        packed, ent_p = forward_logp(model, ids, am, temperature=0.7, layout="packed")
        padded, ent_d = forward_logp(model, ids, am, temperature=0.7, layout="padded")
        # one sequence alone: packing must not let sequences attend to each other
        alone, _ = forward_logp(model, ids[2:3], am[2:3], temperature=0.7, layout="padded")
    assert torch.allclose(packed, padded, atol=1e-5)
    assert torch.allclose(ent_p, ent_d, atol=1e-5)
    assert torch.allclose(packed[2:3], alone, atol=1e-5)
    assert (packed[~am] == 0).all() and (packed[:, 0] == 0).all()
    old = packed + 0.1 * torch.randn(packed.shape, generator=g)
    adv = torch.randn(4, 1, generator=g).expand(4, 11)
    loss_p, _ = ppo_loss(packed, old, adv, lm, eps_clip=0.2)
    loss_d, _ = ppo_loss(padded, old, adv, lm, eps_clip=0.2)
    assert loss_p.item() == pytest.approx(loss_d.item(), abs=1e-6)
