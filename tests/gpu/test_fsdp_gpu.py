"""The FSDP2 engine on one CUDA device: one bf16 update over NCCL, and training tokens/s.

The model has SmolLM2-135M's architecture (30 layers, hidden 576, vocab 49152) with random
weights, which trains at the same speed as the real weights and needs no download. Run with
``pytest -s -m gpu tests/gpu/test_fsdp_gpu.py`` to see the throughput line.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.bench.gpu import SMOLLM2_135M, synthetic_train_batch
from arl.config import ActorConfig
from arl.train.fsdp import FSDPEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_bf16_update_on_one_gpu(tmp_path: Path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")  # a folder needs one
    cfg = ActorConfig(path=str(tmp_path / "model"), lr=1e-5, max_tokens_per_mb=8192)
    eng = FSDPEngine(
        cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
    )
    try:
        assert eng.compute_dtype == torch.bfloat16
        batch = synthetic_train_batch(SMOLLM2_135M["vocab_size"], 16, 4, 128, 384)
        before = {k: v.float().cpu() for k, v in eng.state_dict_for_sync()}

        def step() -> tuple[dict[str, float], float, float]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            b = dict(batch, prox_logp=eng.compute_logp(batch))
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            stats = eng.ppo_update(eng.compute_advantages(b))
            torch.cuda.synchronize()
            return stats, t1 - t0, time.perf_counter() - t1

        stats, _, _ = step()  # the first step includes CUDA/NCCL warm-up
        assert torch.isfinite(torch.tensor(stats["loss"])) and stats["skipped"] == 0.0
        assert 0 < stats["grad_norm"] < float("inf")
        after = {k: v.float().cpu() for k, v in eng.state_dict_for_sync()}
        moved = max((after[k] - before[k]).abs().max().item() for k in before)
        assert moved > 0, "the update did not change the weights"

        stats, t_logp, t_update = step()
        tokens = int(batch["attention_mask"].sum())
        print(
            f"\nFSDP2 bf16, SmolLM2-135M architecture, {tokens} tokens in "
            f"{stats['n_micro_batches']:.0f} micro-batches of <= {cfg.max_tokens_per_mb}, "
            f"{torch.cuda.get_device_name()}: compute_logp {t_logp:.3f} s "
            f"({tokens / t_logp:,.0f} tokens/s); advantages + ppo_update {t_update:.3f} s "
            f"({tokens / t_update:,.0f} tokens/s); whole step {tokens / (t_logp + t_update):,.0f}"
            " tokens/s"
        )
    finally:
        eng.destroy()


def test_packed_varlen_rows_give_the_padded_log_probs(tmp_path: Path):
    """Packed rows (varlen flash attention, no mask) against padded rows (sdpa with a mask):
    the same log-probs up to bf16 rounding, and one micro-batch sized from free memory."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")  # a folder needs one
    batch = synthetic_train_batch(SMOLLM2_135M["vocab_size"], 8, 4, 64, 128)
    logps = {}
    for layout in ("packed", "padded"):
        cfg = ActorConfig(path=str(tmp_path / "model"), layout=layout)
        eng = FSDPEngine(
            cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
        )
        try:
            assert eng.layout == layout
            assert len(eng._micro_batches(batch, eng._token_budget(batch))) == 1
            logps[layout] = eng.compute_logp(batch)
        finally:
            eng.destroy()
    mask = batch["attention_mask"].bool()
    diff = (logps["packed"] - logps["padded"]).abs()[mask]
    assert torch.isfinite(logps["packed"][mask]).all()
    assert float(diff.max()) < 0.1 and float(diff.mean()) < 0.01, (diff.max(), diff.mean())


def test_graphed_updates_capture_once_per_bucket_and_train_as_eager_ones(tmp_path: Path):
    """Two updates whose micro-batches share a bucket: the first is run eagerly and captured,
    the second replays the graph with its own inputs; statistics and weights match an engine
    without graphs up to bf16 rounding (the graph's row is padded, so its matmuls differ)."""
    from arl.algo.packing import seq_lengths
    from arl.train.packed import bucket_for

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    vocab = SMOLLM2_135M["vocab_size"]
    # 5,930 and 5,341 tokens: one bucket (6,144 tokens, 64 sequences of <= 256)
    batches = [
        synthetic_train_batch(vocab, 9, 4, 64, 128),
        synthetic_train_batch(vocab, 8, 4, 64, 128),
    ]
    buckets = {bucket_for(sum(lens), len(lens), max(lens)) for lens in map(seq_lengths, batches)}
    assert len(buckets) == 1, buckets  # the test's premise: one bucket, two token counts
    runs = {}
    for graphs in (True, False):
        cfg = ActorConfig(path=str(tmp_path / "model"), lr=1e-5, cuda_graphs=graphs)
        eng = FSDPEngine(
            cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
        )
        try:
            assert (eng.graphs is not None) == graphs
            out = []
            for batch in batches:
                stats = eng.ppo_update(eng.compute_advantages(batch))
                weights = {k: v.float().cpu() for k, v in eng.state_dict_for_sync()}
                out.append((stats, weights))
            if graphs:
                assert (eng.graphs.captures, eng.graphs.replays) == (1, 1)
            runs[graphs] = out
        finally:
            eng.destroy()
    start = {
        k: v.float()
        for k, v in LlamaForCausalLM.from_pretrained(tmp_path / "model").state_dict().items()
    }
    for (g_stats, g_w), (e_stats, e_w) in zip(runs[True], runs[False], strict=True):
        assert g_stats["n_tokens"] == e_stats["n_tokens"]
        assert g_stats["entropy"] == pytest.approx(e_stats["entropy"], rel=1e-3)
        assert g_stats["grad_norm"] == pytest.approx(e_stats["grad_norm"], rel=2e-2)
        assert g_stats["skipped"] == e_stats["skipped"] == 0.0
        # Adam's first steps move each weight by about lr: where a tiny gradient's sign differs
        # between the two, the weights differ by up to 2 lr.
        diff = max((g_w[k] - e_w[k]).abs().max().item() for k in e_w)
        moved = max((g_w[k] - start[k]).abs().max().item() for k in e_w if k in start)
        assert diff < 5e-5 and moved > 5e-6, (diff, moved)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_rank_is_primed_when_built_and_its_warm_up_compiles_nothing_more(
    tmp_path: Path, compiled: bool
):
    """The small passes (the head's compilation, kernel selection, and with ``actor.compile`` the
    layers') run when the engine is built, while the engines start; the warm-up overlapped with
    the first rollout is then one large batch, forward with backward (the update gives the
    proximal log-probs: no pass without), that compiles nothing new, neither the head nor the
    layers (`layer_compile_options`: no specialisation on the token count), and leaves the
    weights and gradients as they were."""
    from torch._dynamo.utils import counters

    from arl.train.sharding import kept_functions

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "tokenizer_config.json").write_text("{}")
    cfg = ActorConfig(path=str(tmp_path / "model"), compile=compiled)
    eng = FSDPEngine(
        cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}", device="cuda"
    )
    tokens: list[int] = []
    hook = eng.forward_model.register_forward_pre_hook(
        lambda _m, args, kwargs: tokens.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        assert eng.prime_s > 0
        graphs = counters["stats"]["unique_graphs"]
        kept = kept_functions(eng.forward_model, torch.device("cuda"))
        # the head's chunk kernels were compiled while priming, or loaded from ARL_CACHE
        assert graphs > 0 or sum(kept) > 0, (graphs, kept)
        before = {k: v.float().cpu() for k, v in eng.state_dict_for_sync()}
        assert eng.warm_up() == eng.warm_up_s > 0
        assert len(tokens) == 1 and min(tokens) > 9102, tokens  # above 5 Mi elements / 576
        assert counters["stats"]["unique_graphs"] == graphs
        assert kept_functions(eng.forward_model, torch.device("cuda")) == kept
        after = {k: v.float().cpu() for k, v in eng.state_dict_for_sync()}
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(p.grad is None or not p.grad.any() for p in eng.forward_model.parameters())
    finally:
        hook.remove()
        eng.destroy()


def test_log_prob_head_compiled_on_cuda_matches_the_fp32_logits():
    """`LinearLogp` with its compiled chunk kernels (bf16 logits) against log_softmax of the
    fp32 logits: values and gradients within bf16 rounding, over several chunks."""
    from arl.train.logp import LinearLogp

    g = torch.Generator(device="cuda").manual_seed(0)
    n, hidden, vocab = 3000, 576, 49152
    h = (torch.randn(n, hidden, device="cuda", generator=g) / 8).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) / 24).bfloat16().requires_grad_()
    tgt = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    weight = torch.randn(n, device="cuda", generator=g)
    out = LinearLogp.apply(h, w, None, tgt, 1 / 0.7, 1024)
    (out[:, 0] * weight).sum().backward()
    gh, gw = h.grad.float(), w.grad.float()
    h.grad = w.grad = None
    z = (h.float() @ w.float().t()) / 0.7
    logz = torch.log_softmax(z, -1)
    logp = logz.gather(1, tgt[:, None])[:, 0]
    ent = -(logz.exp() * logz).sum(-1)
    (logp * weight).sum().backward()
    torch.testing.assert_close(out[:, 0], logp.detach(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out[:, 1], ent.detach(), atol=2e-2, rtol=1e-2)
    for got, want in ((gh, h.grad), (gw, w.grad)):
        err = (got - want).norm() / want.norm()
        assert err < 2e-2, err
