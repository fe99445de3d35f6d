"""The chunked log-prob head and the layouts of `forward_logp` against the plain logits path."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.algo.losses import token_logp_entropy
from arl.train.logp import ChunkedLogpHead, forward_logp

torch.set_num_threads(1)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([9, 4, 13, 7])
    am = torch.arange(13)[None] < lens[:, None]
    return torch.randint(1, 97, (4, 13), generator=g) * am, am


def reference(model, ids, am, temperature):
    """Log-probs and entropy from the whole fp32 logits of the padded rows."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits
    logp, ent = token_logp_entropy(logits, ids, pos, temperature)
    return torch.where(am, logp, 0.0), torch.where(am, ent, 0.0)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_chunked_head_gives_the_logits_path_values_and_gradients(layout: str) -> None:
    ids, am = rows()
    plain, chunked = tiny_model(), tiny_model()
    # 5-token chunks: every row spans several chunks and chunks cross sequence boundaries.
    ChunkedLogpHead(chunked.lm_head, chunk_tokens=5)
    want_logp, want_ent = reference(plain, ids, am, 0.7)
    logp, ent = forward_logp(chunked, ids, am, 0.7, layout)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    assert not ent.requires_grad
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    (want_logp * weights).sum().backward()
    (logp * weights).sum().backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_needed_positions_alone_give_the_same_values_and_gradients() -> None:
    """Given the loss mask, the padded layout's head computes those positions only: their
    values and the gradients of a loss that reads them are the full head's; the others are 0."""
    ids, am = rows()
    needed = am.clone()
    needed[:, :3] = False  # a prompt of 3 tokens
    needed[1, 3] = False  # a row with its first completion token out of the loss
    full, some = tiny_model(), tiny_model()
    for model in (full, some):
        ChunkedLogpHead(model.lm_head, chunk_tokens=5)
    want_logp, want_ent = forward_logp(full, ids, am, 0.7, "padded")
    logp, ent = forward_logp(some, ids, am, 0.7, "padded", needed=needed)
    torch.testing.assert_close(logp[needed], want_logp[needed], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent[needed], want_ent[needed], atol=1e-6, rtol=1e-6)
    assert not logp[~needed].any() and not ent[~needed].any()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    (torch.where(needed, want_logp, 0.0) * weights).sum().backward()
    (torch.where(needed, logp, 0.0) * weights).sum().backward()
    for (name, p), q in zip(full.named_parameters(), some.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)
    # A micro-batch with no position in its loss: nothing computed, no gradient, no error.
    none = torch.zeros_like(am)
    logp, _ = forward_logp(some, ids, am, 0.7, "padded", needed=none)
    assert not logp.any()


def test_head_outside_targets_is_the_plain_linear() -> None:
    model = tiny_model()
    ids, _ = rows()
    want = model(input_ids=ids).logits
    ChunkedLogpHead(model.lm_head, chunk_tokens=3)
    torch.testing.assert_close(model(input_ids=ids).logits, want)
    assert set(model.state_dict()) == set(tiny_model().state_dict())


def test_head_refuses_a_non_positive_temperature() -> None:
    model = tiny_model()
    ChunkedLogpHead(model.lm_head, chunk_tokens=3)
    ids, am = rows()
    with pytest.raises(ValueError, match="temperature must be positive"):
        forward_logp(model, ids, am, 0.0, "padded")


def test_models_that_rescale_logits_keep_the_plain_head() -> None:
    from arl.train.logp import transforms_logits

    assert not transforms_logits(tiny_model().config)
    cfg = tiny_model().config
    cfg.final_logit_softcapping = 30.0  # Gemma-2 caps the logits after the output layer
    assert transforms_logits(cfg)


def test_chunk_slices_cover_the_positions_and_never_leave_one_alone():
    from arl.train.logp import chunk_slices

    for n in range(1, 40):
        for chunk in (3, 5, 8):
            sl = chunk_slices(n, chunk)
            assert [i for s in sl for i in range(s.start, s.stop)] == list(range(n))
            assert all(s.stop - s.start <= chunk for s in sl)
            assert n == 1 or all(s.stop - s.start >= 2 for s in sl), (n, chunk, sl)
    with pytest.raises(ValueError, match="chunk must be >= 3"):
        chunk_slices(10, 2)


def test_compiled_chunk_kernels_compile_once_for_every_batch_size(monkeypatch):
    """Dynamo specialises sizes and storage offsets of 0 and 1 and the views it is given: the
    head hands its compiled kernels fresh chunks of >= 2 positions, so the first (small) pass
    compiles each once and no later batch, of one chunk or several, with or without gradient,
    compiles again (guards are Dynamo's: the eager backend shows them without a C compiler)."""
    from torch._dynamo.utils import counters

    import arl.train.logp as L

    torch._dynamo.reset()
    counters.clear()
    kernels = tuple(
        torch.compile(fn, dynamic=True, backend="eager")
        for fn in (L.chunk_logp_stats, L.chunk_logit_grad)
    )
    monkeypatch.setitem(L._KERNELS, "cpu", kernels)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 16, generator=g, requires_grad=True)

    def run(t: int, grad: bool) -> None:
        ids = torch.randint(0, 64, (1, t), generator=g)
        hidden = torch.randn(1, t, 16, generator=g, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            out = L.LinearLogp.apply(
                hidden[:, :-1].reshape(-1, 16), w, None, ids[:, 1:].reshape(-1), 1.0, 40
            )
            if grad:
                out[:, 0].sum().backward()

    run(20, True)  # one chunk: what a rank's priming passes give
    run(33, False)
    assert counters["stats"]["unique_graphs"] == 2
    for t in (200, 41, 42, 82, 3, 121, 81):
        run(t, True)
        run(t, False)
    assert counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()
