"""Optimizer offload on one rank (`arl.train.offload`, ``actor.offload=optimizer``): the same
gradients, clipping and update as the one-rank mixed-precision path, with the masters and the
AdamW state on the host and weight sync reading the forward copy."""

from __future__ import annotations

import socket

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.config import ActorConfig
from arl.train.fsdp import FSDPEngine
from arl.train.master import MasterWeights
from arl.train.offload import HostMasterWeights

torch.set_num_threads(1)


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(37, 24)
        self.mid = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 37, bias=False)
        self.head.weight = self.emb.weight  # tied, as SmolLM2's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_host_masters_accumulate_clip_and_publish_as_master_weights_do():
    torch.manual_seed(1)
    base = _Tied()
    ref = MasterWeights(_Tied(), torch.bfloat16)
    ref.master.load_state_dict(base.state_dict())
    ref.publish()
    off_master = _Tied()
    off_master.load_state_dict(base.state_dict())
    off = HostMasterWeights(off_master, torch.bfloat16, torch.device("cpu"))
    assert off.forward.head.weight is off.forward.emb.weight  # the copy stays tied
    assert off.forward.mid.weight.data_ptr() != off.master.mid.weight.data_ptr()
    for mw in (ref, off):
        for m, f in mw.pairs:
            assert torch.equal(f, m.to(torch.bfloat16))
    torch.manual_seed(0)
    for ids in [torch.randint(0, 37, (3, 5)) for _ in range(3)]:
        for mw in (ref, off):
            mw.forward(ids).float().logsumexp(-1).sum().backward()
            mw.accumulate_grads()
    params = [m for m, _ in ref.pairs]
    want = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    got = off.clip(0.5)
    assert got == pytest.approx(want, rel=1e-5) and got > 0.5  # so the clip did scale
    # The streamed step hands each chunk the clipped gradients: SGD with lr 1 moves each
    # master by exactly its gradient (the reference's, clipped by torch).
    before = [m.detach().clone() for m, _ in off.pairs]
    off.step(torch.optim.SGD(off.param_groups(), lr=1.0))
    for (m_ref, _), (m_off, _), b in zip(ref.pairs, off.pairs, before, strict=True):
        assert m_off.device.type == "cpu" and m_off.grad is None
        torch.testing.assert_close(b - m_off.detach(), m_ref.grad, rtol=1e-5, atol=1e-6)
    for m, f in off.pairs:  # each chunk was published as it stepped
        assert torch.equal(f, m.to(torch.bfloat16))
    off.zero_grads()
    assert off._sums is None and all(f.grad is None for _, f in off.pairs)
    with torch.no_grad():
        off.master.mid.weight.add_(0.25)
    off.publish()
    assert torch.equal(off.forward.mid.weight, off.master.mid.weight.to(torch.bfloat16))


def test_the_step_streams_chunks_of_whole_parameters_through_two_host_buffers():
    torch.manual_seed(3)
    base = _Tied()
    whole = HostMasterWeights(_Tied(), torch.bfloat16, torch.device("cpu"))
    # 900-element chunks: the 888-element embedding alone, then the small tensors together.
    small = HostMasterWeights(_Tied(), torch.bfloat16, torch.device("cpu"), chunk_elements=900)
    assert len(whole.chunks) == 1 and len(small.chunks) > 1
    assert max(len(b) for b in small._host_grads) < sum(len(b) for b in whole._host_grads) / 2
    opts = []
    batches = [torch.randint(0, 37, (3, 5)) for _ in range(2)]
    for mw in (whole, small):
        mw.master.load_state_dict(base.state_dict())
        mw.publish()
        opt = torch.optim.AdamW(mw.param_groups(), lr=0.1)
        for ids in batches:
            mw.forward(ids).float().logsumexp(-1).sum().backward()
            mw.accumulate_grads()
            mw.clip(1.0)
            mw.step(opt)
            mw.zero_grads()
        opts.append(opt)
    for (a, fa), (b, fb) in zip(whole.pairs, small.pairs, strict=True):
        assert torch.equal(a, b) and torch.equal(fa, fb)
    assert len(opts[1].param_groups) == len(small.chunks)  # restored after each step


def test_publish_stages_through_two_small_buckets_a_chunk_at_a_time():
    torch.manual_seed(2)
    # 7-element buckets: every tensor (888 elements the largest) crosses them in chunks.
    off = HostMasterWeights(_Tied(), torch.bfloat16, torch.device("cpu"), bucket_elements=7)
    assert [len(b) for b in off._buckets] == [7, 7]
    with torch.no_grad():
        for m, _ in off.pairs:
            m.copy_(torch.randn_like(m))
    off.publish()
    for m, f in off.pairs:
        assert torch.equal(f, m.to(torch.bfloat16))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("m")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")  # a model folder needs a tokenizer
    return str(path)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    lens = [9, 7, 12, 5]
    am = torch.arange(12)[None] < torch.tensor(lens)[:, None]
    lm = am.clone()
    lm[:, :3] = False
    return {
        "input_ids": torch.randint(1, 64, am.shape, generator=g) * am,
        "attention_mask": am,
        "loss_mask": lm,
        "logprobs": torch.where(lm, -4.1 + 0.1 * torch.randn(am.shape, generator=g), 0.0),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
    }


def _step(model_dir: str, offload: str) -> dict:
    """One PPO update on one CPU rank computing in bf16 (fp32 masters)."""
    cfg = ActorConfig(path=model_dir, dtype="bfloat16", lr=1e-3, offload=offload, grad_clip=0.1)
    eng = FSDPEngine(cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_port()}")
    try:
        before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
        stats = eng.ppo_update(eng.compute_advantages(_batch()))
        after = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
        state = [t for s in eng.optimizer.state.values() for t in s.values() if t.dim()]
        fwd = dict(eng.forward_model.named_parameters())
        out = {
            "stats": stats,
            "delta": {n: after[n] - before[n] for n in before},
            "kind": type(eng._master).__name__,
            "state_devices": {t.device.type for t in state},
            "fwd_matches": all(torch.equal(fwd[n], after[n].bfloat16()) for n in after),
            "sync_bf16": eng.weight_sources(torch.bfloat16),
            "sync_fp32": eng.weight_sources(None),
            "fwd": fwd,
            "masters": dict(eng.model.named_parameters()),
        }
    finally:
        eng.destroy()
    return out


def test_offload_gives_the_same_update_as_the_one_rank_path_with_state_on_the_host(model_dir):
    ref = _step(model_dir, "none")
    off = _step(model_dir, "optimizer")
    assert (ref["kind"], off["kind"]) == ("MasterWeights", "HostMasterWeights")
    assert off["stats"]["grad_norm"] == pytest.approx(ref["stats"]["grad_norm"], rel=1e-4)
    assert ref["stats"]["grad_norm"] > 0.1  # clipped: the scale is part of what is compared
    assert off["stats"]["loss"] == pytest.approx(ref["stats"]["loss"], rel=1e-5)
    moved = 0
    for name, d in ref["delta"].items():
        torch.testing.assert_close(off["delta"][name], d, rtol=1e-3, atol=1e-7)
        moved += int(d.abs().max() > 0)
    assert moved == len(ref["delta"])  # every parameter was updated, in both
    assert off["state_devices"] == {"cpu"}  # AdamW's moments live on the host
    assert off["fwd_matches"] and ref["fwd_matches"]
    # A sync in the compute dtype reads the forward copy; as trained (fp32), the masters.
    for name, t in off["sync_bf16"]:
        assert t.dtype == torch.bfloat16 and t.data_ptr() == off["fwd"][name].data_ptr()
    for name, t in off["sync_fp32"]:
        assert t.dtype == torch.float32 and t.data_ptr() == off["masters"][name].data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_offloaded_transfers_go_through_pinned_host_buffers():
    master = _Tied()
    off = HostMasterWeights(master, torch.bfloat16, torch.device("cuda"))
    assert all(m.device.type == "cpu" and f.is_cuda for m, f in off.pairs)
    assert all(b.is_pinned() for b in off._host_grads + off._buckets)  # what DMA goes through


def test_the_memory_plan_counts_the_chunk_the_step_streams():
    from arl.control import memory
    from arl.train import offload

    assert memory._OFFLOAD_CHUNK == offload._CHUNK
