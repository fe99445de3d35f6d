"""`sample_rows`: the hf engine's sampler draws from the tempered, truncated distribution it is
asked for, and returns the untruncated log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from arl.engines.hf.sampling import sample_rows

# On CUDA, rows that do not truncate take the Triton kernel (arl.engines.hf.kernels).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]

# Ten tokens: distinct probabilities, two impossible ones (-inf), one between the likely ones.
LOGITS = torch.tensor([2.0, -1.0, 0.5, float("-inf"), 1.5, -0.3, 0.0, float("-inf"), 1.0, -2.0])
V = LOGITS.numel()
N = 40_000  # draws per case: one row each


def draw(temperature=1.0, top_p=1.0, top_k=V, greedy=False, seed=0, device="cpu"):
    logits = LOGITS.to(device).expand(N, V).contiguous()
    gen = torch.Generator(device).manual_seed(seed)
    tokens, logp = sample_rows(
        logits,
        torch.full((N,), temperature, device=device),
        torch.full((N,), greedy, device=device),
        torch.full((N,), 2.0 if top_p >= 1 else top_p, device=device),
        torch.full((N,), top_k, dtype=torch.long, device=device),
        gen,
        all_greedy=False,
        truncate=top_p < 1 or top_k < V,
    )
    return tokens.cpu(), logp.cpu()


def expected(temperature=1.0, top_p=1.0, top_k=V) -> torch.Tensor:
    p = torch.softmax(LOGITS / temperature, dim=-1).double()
    order = p.argsort(descending=True)
    keep = torch.zeros(V, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if rank >= top_k or mass >= top_p:
            break
        keep[i] = True
        mass += p[i].item()
    p = torch.where(keep, p, 0.0)
    return p / p.sum()


def assert_frequencies(tokens: torch.Tensor, p: torch.Tensor) -> None:
    freq = torch.bincount(tokens, minlength=V).double() / N
    assert (freq[p == 0] == 0).all(), f"drew impossible tokens: {freq.tolist()}"
    sigma = (p * (1 - p) / N).sqrt()
    worst = ((freq - p).abs() / sigma.clamp_min(1e-12))[p > 0].max().item()
    assert worst < 5, f"frequencies {freq.tolist()} against {p.tolist()} ({worst:.1f} sigma)"


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_tempered_distribution(device: str) -> None:
    for temperature in (1.0, 0.5, 2.0):
        tokens, logp = draw(temperature=temperature, device=device)
        assert_frequencies(tokens, expected(temperature))
        full = torch.log_softmax(LOGITS / temperature, dim=-1)
        torch.testing.assert_close(logp, full[tokens])


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_and_top_k_truncate_but_log_probs_stay_untruncated(device: str) -> None:
    for top_p, top_k in ((0.6, V), (0.95, V), (1.0, 3), (0.9, 2), (1.0, 1)):
        tokens, logp = draw(top_p=top_p, top_k=top_k, device=device)
        assert_frequencies(tokens, expected(top_p=top_p, top_k=top_k))
        torch.testing.assert_close(logp, torch.log_softmax(LOGITS, dim=-1)[tokens])


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_argmax_beside_sampled_rows(device: str) -> None:
    logits = LOGITS.to(device).expand(6, V).contiguous()
    greedy = torch.tensor([True, False, True, False, True, False], device=device)
    ones = torch.ones(6, device=device)
    for truncate in (False, True):
        tokens, _ = sample_rows(
            logits,
            ones,
            greedy,
            torch.full((6,), 0.9 if truncate else 2.0, device=device),
            torch.full((6,), V, dtype=torch.long, device=device),
            torch.Generator(device).manual_seed(1),
            all_greedy=False,
            truncate=truncate,
        )
        assert tokens[greedy].tolist() == [0, 0, 0]
    tokens, logp = sample_rows(
        logits,
        ones,
        greedy,
        ones,
        torch.full((6,), V, device=device),
        torch.Generator(device),
        all_greedy=True,
        truncate=False,
    )
    assert tokens.tolist() == [0] * 6
    assert math.isclose(logp[0].item(), torch.log_softmax(LOGITS, -1)[0].item(), rel_tol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_seed_reproduces_its_draws(device: str) -> None:
    assert torch.equal(draw(seed=3, device=device)[0], draw(seed=3, device=device)[0])
    assert not torch.equal(draw(seed=3, device=device)[0], draw(seed=4, device=device)[0])
