"""The hf engine's Triton kernels (arl.engines.hf.kernels) against the torch code they replace:
`rope_store` against the fused step's own arithmetic, `sample_plain` against `sample_rows`'
torch path on the same uniform numbers; and the fused step of each family it serves, with the
kernel, against the model's modules."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine, kernels
from arl.engines.hf.fused import _rotate_half

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def reference(qkv, cos, sin, q_norm, k_norm, eps, heads, kv_heads, dim):
    """The fused step's torch arithmetic in float32 (what inductor computes before its one
    rounding): q, and the stacked k and v [n, 2, kv_heads, dim]."""
    n = qkv.shape[0]
    f = qkv.float()
    q = f[:, : heads * dim].view(n, heads, dim)
    k = f[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = f[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
    if q_norm is not None:
        q, k = norm(q, q_norm, eps, qkv.dtype), norm(k, k_norm, eps, qkv.dtype)
    c, s = cos.float().view(n, 1, dim), sin.float().view(n, 1, dim)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    return q, torch.stack((k, v), dim=1)


def norm(x, weight, eps, dtype):
    """`fused._rms` as inductor computes it: float32 statistics, the normalised value cast to
    the model's dtype, times the weight in float32."""
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float()
    return weight.float() * normed


SHAPES = [(9, 3, 64), (4, 2, 16), (12, 2, 128), (6, 6, 80)]  # heads, kv heads, head dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_store_matches_the_torch_step(dtype, shape, with_norm) -> None:
    heads, kv_heads, dim = shape
    gen = torch.Generator("cuda").manual_seed(0)
    dev = "cuda"
    rows, positions = 40, 96
    for n in (1, 37, 300):
        qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen, device=dev).to(dtype)
        pos = torch.randint(0, positions, (n,), generator=gen, device=dev)
        # distinct (row, position) slots, as the engine's steps and prefills write
        slots = torch.randperm(rows * positions, generator=gen, device=dev)[:n]
        row_idx, pos = slots // positions, slots % positions
        angle = pos[:, None].float() * torch.linspace(0.01, 1.0, dim // 2, device=dev)
        angle = torch.cat((angle, angle), dim=-1)
        cos, sin = angle.cos().to(dtype)[:, None, :], angle.sin().to(dtype)[:, None, :]
        q_norm = k_norm = None
        if with_norm:
            q_norm = (1 + 0.3 * torch.randn(dim, generator=gen, device=dev)).to(dtype)
            k_norm = (1 + 0.3 * torch.randn(dim, generator=gen, device=dev)).to(dtype)
        kv = torch.randn(2, rows, kv_heads, positions, dim, generator=gen, device=dev).to(dtype)
        before = kv.clone()
        q = kernels.rope_store(
            qkv, cos, sin, q_norm, k_norm, 1e-6, kv, row_idx, pos, heads, kv_heads, dim
        )
        want_q, want_kv = reference(qkv, cos, sin, q_norm, k_norm, 1e-6, heads, kv_heads, dim)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
        # bf16: within one rounding of the reference (its float32 norm statistics differ)
        torch.testing.assert_close(q, want_q.to(dtype), **tol)
        got = kv[:, row_idx, :, pos]  # [n, 2, kv_heads, dim]
        torch.testing.assert_close(got, want_kv.to(dtype), **tol)
        untouched = torch.ones(rows, positions, dtype=torch.bool, device=dev)
        untouched[row_idx, pos] = False
        by_slot = kv.permute(0, 1, 3, 2, 4)  # [2, rows, positions, kv_heads, dim]
        assert torch.equal(by_slot[:, untouched], before.permute(0, 1, 3, 2, 4)[:, untouched])


def test_sample_plain_draws_the_torch_paths_tokens_from_the_same_uniforms(monkeypatch) -> None:
    """A vocabulary of many kernel blocks: with the same generator state, the kernel picks the
    token the torch path's cumulative sum picks (but where float32 rounding puts a uniform
    number on the other side of a boundary), and the same log-probs."""
    from arl.engines.hf.sampling import sample_rows

    gen = torch.Generator("cuda").manual_seed(1)
    n, vocab = 512, 49_152
    logits = (3 * torch.randn(n, vocab, generator=gen, device="cuda")).to(torch.bfloat16)
    logits[:, 1000:1100] = float("-inf")
    temp = torch.rand(n, generator=gen, device="cuda") + 0.5
    greedy = torch.rand(n, generator=gen, device="cuda") < 0.25
    ones = torch.full((n,), 2.0, device="cuda")
    full = torch.full((n,), vocab, dtype=torch.long, device="cuda")

    def run(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator("cuda").manual_seed(seed)
        return sample_rows(logits, temp, greedy, ones, full, g, all_greedy=False, truncate=False)

    tokens, logp = run(5)
    monkeypatch.setenv(kernels.ENV, "0")
    ref_tokens, ref_logp = run(5)
    same = (tokens == ref_tokens).float().mean().item()
    assert same > 0.995, same
    assert torch.equal(tokens[greedy], ref_tokens[greedy])
    assert not ((tokens >= 1000) & (tokens < 1100)).any()
    expected = torch.log_softmax(logits.float() / temp[:, None], -1).gather(1, tokens[:, None])
    torch.testing.assert_close(logp, expected[:, 0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(logp[tokens == ref_tokens], ref_logp[tokens == ref_tokens])


FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),  # q/k/v biases
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),  # q/k norms
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_decode_with_the_kernels_gives_the_modules_tokens(family: str, tmp_path: Path):
    """Compiled fused step with `rope_store` (prefill and decode, in CUDA graphs) against the
    model's modules, fp32, rows joining mid-decode: the same greedy tokens and log-probs."""
    cls, config_cls = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=512,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
    )
    model = cls(config).eval()
    with torch.no_grad():  # biases and norm weights away from their init, so they count
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (int(k),), generator=gen).tolist() for k in range(2, 60, 3)]
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    kw = dict(device="cuda", dtype="float32", max_batch_size=8, max_seq_len=128)

    async def run(engine: HFEngine) -> list:
        return await asyncio.gather(*(engine.agenerate(p, sp) for p in prompts))

    with HFEngine(str(tmp_path), fused_decode=False, **kw) as engine:
        expected = asyncio.run(run(engine))
    with HFEngine(str(tmp_path), warm_up_len=64, **kw) as engine:
        results = asyncio.run(run(engine))
        health = asyncio.run(engine.health())
        assert engine._fused is not None and engine._fused.rope_kernel
    assert health["fused_decode"] and health["cuda_graphs"] and health["last_error"] is None
    for res, ref in zip(results, expected, strict=True):
        assert res.output_ids == ref.output_ids
        torch.testing.assert_close(res.logprobs, ref.logprobs, atol=1e-4, rtol=0)
