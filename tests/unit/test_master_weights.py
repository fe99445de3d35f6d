"""`MasterWeights`: one rank's fp32 masters beside a compute-dtype copy, and their gradients
held in two flat buffers for CUDA graphs."""

from __future__ import annotations

import torch

from arl.train.master import MasterWeights


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(37, 24)
        self.mid = torch.nn.Linear(24, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 37, bias=False)
        self.head.weight = self.emb.weight  # tied, as SmolLM2's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.mid(self.emb(ids)))))


def _backward(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(ids).float().logsumexp(-1).sum().backward()


def _grads(mw: MasterWeights, held: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    batches = [torch.randint(0, 37, (3, 5)) for _ in range(3)]
    if held:
        mw.hold_grads()
    for ids in batches:
        _backward(mw.forward, ids)
        mw.accumulate_grads()
    return {n: p.grad.clone() for n, p in mw.master.named_parameters()}


def test_held_gradients_are_views_of_two_flat_buffers_and_accumulate_as_per_parameter():
    torch.manual_seed(1)
    base = _Tied()
    free = MasterWeights(_Tied().requires_grad_(), torch.bfloat16)
    free.master.load_state_dict(base.state_dict())
    free.publish()
    held = MasterWeights(_Tied().requires_grad_(), torch.bfloat16)
    held.master.load_state_dict(base.state_dict())
    held.publish()

    ref = _grads(free, held=False)
    assert free.flat is None
    assert all(f.grad is None for _, f in free.pairs)  # dropped after each accumulation

    got = _grads(held, held=True)
    master_flat, copy_flat = held.flat
    assert master_flat.dtype == torch.float32 and copy_flat.dtype == torch.bfloat16
    assert len(held.pairs) == 5  # the tied weight once
    for m, f in held.pairs:
        # Every gradient lies inside its flat buffer, so backward added into it in place.
        assert m.grad.untyped_storage().data_ptr() == master_flat.untyped_storage().data_ptr()
        assert f.grad.untyped_storage().data_ptr() == copy_flat.untyped_storage().data_ptr()
        assert (m.grad.data_ptr() - master_flat.data_ptr()) % 256 == 0
    assert not copy_flat.any()  # the copy's gradients are zeroed after each accumulation
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0)

    # Zeroing keeps the buffers: the next backward adds into the same memory.
    before = [f.grad.data_ptr() for _, f in held.pairs]
    _backward(held.forward, torch.randint(0, 37, (2, 4)))
    assert copy_flat.any()
    held.zero_grads()
    assert not copy_flat.any()
    assert [f.grad.data_ptr() for _, f in held.pairs] == before
