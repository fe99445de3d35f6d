"""The embedded hf engine on CUDA: log-probs against a teacher-forced pass, a 64-request batch,
the length-aware decode attentions (flex, triton) against SDPA."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine
from arl.engines.hf.attention import cache_kwarg
from arl.engines.hf.graphs import buckets, row_bucket

MEDIUM = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def save_model(path: Path, **overrides: int) -> str:
    torch.manual_seed(0)
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    sizes.update(overrides)
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **sizes)
    model = LlamaForCausalLM(config)
    # No eos: every request runs to its length, whatever the random weights emit.
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return str(path)


def teacher_forced(
    model: LlamaForCausalLM, prompt: list[int], out: list[int], temperature: float
) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt + out], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(out) - 1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
    return picked.cpu(), logits.argmax(-1).tolist()


def random_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 60, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


async def staggered(engine: HFEngine, prompts: list[list[int]], sp: SamplingParams) -> list:
    """Half the requests start together; the rest join one by one while the batch decodes."""
    tasks = []
    for i, prompt in enumerate(prompts):
        if i >= len(prompts) // 2:
            start = (await engine.health())["steps"]
            while (health := await engine.health())["steps"] < start + 1 and health["running"]:
                await asyncio.sleep(0.0005)
        tasks.append(asyncio.ensure_future(engine.agenerate(prompt, sp)))
    return await asyncio.gather(*tasks)


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_pass_cuda(
    tmp_path: Path, temperature: float, cuda_graphs: bool
) -> None:
    path = save_model(tmp_path / "m")
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = random_prompts(12, 256, seed=1)
    sp = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=0.9)
    with HFEngine(path, device="cuda", dtype="float32", seed=2, cuda_graphs=cuda_graphs) as engine:
        results = asyncio.run(staggered(engine, prompts, sp))
        assert asyncio.run(engine.health())["cuda_graphs"] == cuda_graphs  # no silent fallback
    for prompt, res in zip(prompts, results, strict=True):
        assert len(res.output_ids) == 24 and res.finish_reason == "length"
        expected, _ = teacher_forced(model, prompt, res.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(res.logprobs), expected, atol=1e-4, rtol=0)


def test_64_request_batch_bf16(tmp_path: Path) -> None:
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    prompts = random_prompts(64, vocab, seed=3)
    sp = SamplingParams(max_new_tokens=48, temperature=1.0)
    with HFEngine(path, device="cuda", max_batch_size=64) as engine:
        assert engine.dtype == torch.bfloat16
        results = asyncio.run(staggered(engine, prompts, sp))
        health = asyncio.run(engine.health())
    assert health["running"] == 0 and health["generated_tokens"] == 64 * 48
    assert health["cuda_graphs"] and health["last_error"] is None
    diffs = []
    for prompt, res in zip(prompts, results, strict=True):
        assert len(res.output_ids) == len(res.logprobs) == 48 and res.finish_reason == "length"
        assert all(0 <= t < vocab for t in res.output_ids)
        expected, _ = teacher_forced(model, prompt, res.output_ids, 1.0)
        diffs.append((torch.tensor(res.logprobs) - expected).abs())
    diff = torch.cat(diffs)
    # bf16: batched decode and a full forward round differently; the error stays small.
    assert diff.max().item() < 0.05 and diff.mean().item() < 0.01


def test_64_greedy_requests_match_argmax_cuda(tmp_path: Path) -> None:
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = random_prompts(64, vocab, seed=4)
    sp = SamplingParams(max_new_tokens=32, greedy=True)
    with HFEngine(path, device="cuda", dtype="float32", max_batch_size=64) as engine:
        results = asyncio.run(staggered(engine, prompts, sp))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == teacher_forced(model, prompt, res.output_ids, 1.0)[1]


@pytest.mark.parametrize("attention, widths", [("sdpa", 2), ("flex", 1), ("triton", 1)])
def test_warm_up_captures_graphs_and_decodes_the_same_cuda(
    tmp_path: Path, attention: str, widths: int
) -> None:
    """``warm_up_len``: every graph up to that length exists before the first request, the
    first generations capture none, and they decode what the teacher-forced pass says."""
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = random_prompts(96, vocab, seed=5)  # 96 rows run in the 128-row graph
    sp = SamplingParams(max_new_tokens=40, greedy=True)
    kw = dict(device="cuda", dtype="float32", max_batch_size=200, warm_up_len=120)
    with HFEngine(path, decode_attention=attention, **kw) as engine:
        before = asyncio.run(engine.health())
        # rows 2..64 (6 buckets), 128, 192 and 200 (the cap); sdpa's widths 64 and 128, flex's
        # and triton's one width (the cache's whole width)
        assert before["decode_attention"] == attention
        assert len(buckets(200, row_bucket)) == 9
        assert before["decode_graphs"] == 9 * widths and before["warm_up_s"] > 0
        results = asyncio.run(staggered(engine, prompts, sp))
        after = asyncio.run(engine.health())
    assert after["decode_graphs"] == before["decode_graphs"] and after["last_error"] is None
    for prompt, res in zip(prompts, results, strict=True):
        assert res.output_ids == teacher_forced(model, prompt, res.output_ids, 1.0)[1]


def continued_from_old_cache(
    old: LlamaForCausalLM, new: LlamaForCausalLM, prompt: list[int], out: list[int], switch: int
) -> list[int]:
    """The argmax at each position of ``out[switch:]`` when ``new`` decodes on from the KV cache
    ``old`` filled with the prompt and ``out[: switch - 1]``."""
    cache = {cache_kwarg(old.forward): DynamicCache()}  # filled in place by both passes
    with torch.no_grad():
        old(torch.tensor([prompt + out[: switch - 1]], device="cuda"), use_cache=True, **cache)
        ids = torch.tensor([out[switch - 1 : -1]], device="cuda")
        return new(ids, use_cache=True, **cache).logits[0].argmax(-1).tolist()


def test_pause_in_place_keeps_graph_decoded_rows_across_a_weight_update_cuda(
    tmp_path: Path,
) -> None:
    """Rows decoding in CUDA graphs stop at a step, keep their cache rows through an in-place
    `update_weights`, and decode on under the new weights without a prefill."""
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    old = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    torch.manual_seed(9)
    new = LlamaForCausalLM(old.config).cuda().eval()
    prompts = random_prompts(24, vocab, seed=6)
    sp = SamplingParams(max_new_tokens=64, greedy=True)

    async def run(engine: HFEngine) -> list:
        tasks = [asyncio.ensure_future(engine.agenerate(p, sp)) for p in prompts]
        while (await engine.health())["running"] < len(prompts):
            await asyncio.sleep(0.0005)
        start = (await engine.health())["generated_tokens"]
        while (await engine.health())["generated_tokens"] < start + 4 * len(prompts):
            await asyncio.sleep(0.0005)
        await engine.pause(in_place=True)
        before = await engine.health()
        assert before["held"] == len(prompts) and not any(t.done() for t in tasks)
        named = [(n, t.detach()) for n, t in new.state_dict().items()]
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, engine.update_weights, named) == len(named)
        engine.set_version(1)
        await engine.resume()
        results = await asyncio.gather(*tasks)
        after = await engine.health()
        assert after["prefills"] == before["prefills"]  # continued from the cache
        assert after["cuda_graphs"] and after["last_error"] is None
        return results

    with HFEngine(path, device="cuda", dtype="float32", max_batch_size=32) as engine:
        results = asyncio.run(asyncio.wait_for(run(engine), 120))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.finish_reason == "length" and len(res.output_ids) == 64
        switch = res.versions.index(1)
        assert 0 < switch < 64 and res.versions == [0] * switch + [1] * (64 - switch)
        head = res.output_ids[:switch]
        assert head == teacher_forced(old, prompt, head, 1.0)[1]
        assert res.output_ids[switch:] == continued_from_old_cache(
            old, new, prompt, res.output_ids, switch
        )


@pytest.mark.parametrize("attention", ["flex", "triton"])
@pytest.mark.parametrize("warm_up_len", [0, 400])
def test_length_aware_decode_in_cuda_graphs_gives_sdpas_greedy_tokens_cuda(
    tmp_path: Path, warm_up_len: int, attention: str
) -> None:
    """``decode_attention="flex"`` (compiled) and ``"triton"`` (the split-KV kernel), replayed
    from CUDA graphs at the cache's whole width, decode the tokens and log-probs of SDPA for
    rows of lengths from 2 to ~340, some admitted mid-decode; with a warm-up, one graph per row
    bucket and none captured later."""
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    gen = torch.Generator().manual_seed(8)
    long = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (130, 200, 257, 300)]
    prompts = random_prompts(36, vocab, seed=7) + long
    sp = SamplingParams(max_new_tokens=40, greedy=True)
    kw = dict(device="cuda", dtype="float32", max_batch_size=48, warm_up_len=warm_up_len)
    with HFEngine(path, **kw) as engine:
        expected = asyncio.run(staggered(engine, prompts, sp))
    with HFEngine(path, decode_attention=attention, **kw) as engine:
        before = asyncio.run(engine.health())
        results = asyncio.run(staggered(engine, prompts, sp))
        after = asyncio.run(engine.health())
    assert after["decode_attention"] == attention  # no silent fallback
    assert after["cuda_graphs"] and after["last_error"] is None
    if warm_up_len:
        assert before["decode_graphs"] == len(buckets(48, row_bucket))  # one width
        assert after["decode_graphs"] == before["decode_graphs"]
    for res, ref in zip(results, expected, strict=True):
        assert res.output_ids == ref.output_ids
        torch.testing.assert_close(res.logprobs, ref.logprobs, atol=1e-4, rtol=0)


def test_triton_decode_attention_needs_no_compiled_blocks_cuda(tmp_path: Path) -> None:
    """``decode_attention="triton"`` with ``compile_blocks=False`` (nothing torch.compiled)
    still decodes with the Triton kernel, from CUDA graphs, SDPA's greedy tokens."""
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    prompts = random_prompts(12, vocab, seed=11)
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    kw = dict(device="cuda", dtype="float32", max_batch_size=16, compile_blocks=False)
    with HFEngine(path, decode_attention="sdpa", **kw) as engine:
        expected = asyncio.run(staggered(engine, prompts, sp))
    with HFEngine(path, decode_attention="triton", **kw) as engine:
        results = asyncio.run(staggered(engine, prompts, sp))
        health = asyncio.run(engine.health())
    assert health["decode_attention"] == "triton" and health["cuda_graphs"]
    assert health["last_error"] is None
    for res, ref in zip(results, expected, strict=True):
        assert res.output_ids == ref.output_ids
        torch.testing.assert_close(res.logprobs, ref.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["triton", "flex", "sdpa"])
def test_fused_decode_gives_the_modules_tokens_in_cuda_graphs_cuda(
    tmp_path: Path, attention: str
) -> None:
    """The fused decode step (compiled, replayed from CUDA graphs) against the model's own
    modules, fp32: the same greedy tokens and log-probs for rows joining mid-decode."""
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    prompts = random_prompts(40, vocab, seed=9)
    sp = SamplingParams(max_new_tokens=40, greedy=True)
    kw = dict(device="cuda", dtype="float32", max_batch_size=32, decode_attention=attention)
    with HFEngine(path, fused_decode=False, **kw) as engine:
        expected = asyncio.run(staggered(engine, prompts, sp))
    with HFEngine(path, warm_up_len=200, **kw) as engine:
        results = asyncio.run(staggered(engine, prompts, sp))
        # Which prefills the joiners share depends on timing: one prompt twice, one after the
        # other, prefills one bucket twice, so the second replays its graph.
        again = [asyncio.run(engine.agenerate(prompts[0], sp)) for _ in range(2)]
        health = asyncio.run(engine.health())
    assert health["fused_decode"] and health["cuda_graphs"] and health["last_error"] is None
    assert health["prefill_replays"] > 0
    for res, ref in zip(results + again, expected + expected[:1] * 2, strict=True):
        assert res.output_ids == ref.output_ids
        torch.testing.assert_close(res.logprobs, ref.logprobs, atol=1e-4, rtol=0)


def test_a_prefill_replayed_from_its_graph_writes_what_an_eager_prefill_writes_cuda(
    tmp_path: Path,
) -> None:
    """Prefills of shapes sharing a bucket replay one CUDA graph at any first row: the prompt
    rows get the keys and values of an eager fused prefill (fp32), the rows before them are
    untouched, and a shape of another bucket captures a graph of its own."""
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    gen = torch.Generator().manual_seed(3)
    kw = dict(device="cuda", dtype="float32", max_batch_size=32, max_seq_len=256)
    with HFEngine(path, **kw) as e, e._model_lock, torch.no_grad():
        assert e._prefill_graphs is not None and e._fused is not None
        e._cache.reserve(32, 128)
        layers = range(MEDIUM["num_hidden_layers"])

        def cache() -> torch.Tensor:  # [layers, 2, rows, kv_heads, positions, dim]
            return torch.stack([e._layer_kv(i) for i in layers])

        def ids(rows: int, width: int) -> torch.Tensor:
            return torch.randint(0, vocab, (rows, width), generator=gen).cuda()

        assert e._fused_prefill(0, ids(8, 5))  # the first fused call runs eagerly
        graphs, replays = len(e._prefill_graphs), e._prefill_graphs.replays
        for row0, (rows, width) in ((0, (3, 17)), (5, (3, 30)), (9, (2, 40)), (20, (4, 9))):
            x = ids(rows, width)
            before = cache().clone()
            assert e._fused_prefill(row0, x)
            got = cache().clone()
            e._fused.prefill(x, torch.arange(row0, row0 + rows, device="cuda"), e._layer_kv)
            want = cache()
            span = slice(row0, row0 + rows)
            torch.testing.assert_close(got[:, :, span, :, :width], want[:, :, span, :, :width])
            assert torch.equal(got[:, :, :row0], before[:, :, :row0])
        # (3, 17), (3, 30) and (4, 9) run as 4 x 64 (captured, replayed twice); (2, 40) as 2 x 64
        assert len(e._prefill_graphs) == graphs + 2
        assert e._prefill_graphs.replays == replays + 2


def test_fused_decode_bf16_logprobs_match_a_teacher_forced_pass_cuda(tmp_path: Path) -> None:
    vocab = 4096
    path = save_model(tmp_path / "m", vocab_size=vocab, **MEDIUM)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = random_prompts(48, vocab, seed=10)
    sp = SamplingParams(max_new_tokens=48, temperature=1.0)
    with HFEngine(path, device="cuda", dtype="bfloat16", max_batch_size=48) as engine:
        results = asyncio.run(staggered(engine, prompts, sp))
        assert asyncio.run(engine.health())["fused_decode"]
    diffs = []
    for prompt, res in zip(prompts, results, strict=True):
        expected, _ = teacher_forced(model, prompt, res.output_ids, 1.0)
        diffs.append((torch.tensor(res.logprobs) - expected).abs())
    diff = torch.cat(diffs)
    assert diff.max().item() < 0.05 and diff.mean().item() < 0.01
