"""The embedded hf engine on a tiny random Llama (CPU, fp32)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from arl.engines.base import Engine, SamplingParams, generate_to_completion
from arl.engines.hf import (
    EngineClosedError,
    EngineNotPausedError,
    HFEngine,
    HFEngineError,
    UnknownWeightError,
    checksum_named_tensors,
)
from arl.engines.hf.attention import cache_kwarg

torch.set_num_threads(1)

# The decode loop with and without overlap (each step launched before the one before it is read
# back): the same tokens, finish reasons, pauses and cancellations either way.
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])

PROMPTS = [[5, 6, 7], [3, 1, 4, 1, 5], [10, 20, 30, 40], [7, 7, 7], [11, 12], [42], [9] * 9]
PROMPTS += [[100 + i for i in range(13)], [200, 3, 200, 3, 17, 18]]


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def save_model(path: Path, seed: int, eos: int | list[int] | None = None) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config()).eval()
    if eos is not None:
        model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("tiny_llama")
    return str(path), save_model(path, seed=0)


def teacher_forced(
    model: LlamaForCausalLM, prompt: list[int], out: list[int], temperature: float
) -> tuple[list[float], list[int]]:
    """Log-probs of ``out`` under log_softmax(logits / T) and the argmax at each position."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(out) - 1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(1, torch.tensor(out)[:, None])[:, 0].tolist(), logits.argmax(-1).tolist()


async def wait_for(engine: HFEngine, key: str, at_least: int) -> None:
    """Yield to the engine until its health counter ``key`` reaches ``at_least``."""
    for _ in range(100_000):
        if (await engine.health())[key] >= at_least:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"engine never reached {key} >= {at_least}")


def test_engine_satisfies_protocol(tiny: tuple[str, LlamaForCausalLM]) -> None:
    with HFEngine(tiny[0]) as engine:
        assert isinstance(engine, Engine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@OVERLAP
def test_logprobs_match_teacher_forced_pass(
    overlap: bool, tiny: tuple[str, LlamaForCausalLM], temperature: float
) -> None:
    path, model = tiny
    # Some rows truncate with top-p/top-k: their log-probs are still the untruncated ones.
    params = [
        SamplingParams(max_new_tokens=16, temperature=temperature),
        SamplingParams(max_new_tokens=12, temperature=temperature, top_p=0.8),
        SamplingParams(max_new_tokens=16, temperature=temperature, top_k=20),
        SamplingParams(max_new_tokens=10, temperature=temperature, greedy=True),
    ]

    async def run(engine: HFEngine) -> list:
        tasks = []
        for i, prompt in enumerate(PROMPTS):
            # Each request joins a batch that has already taken some decode steps.
            await wait_for(engine, "steps", 2 * i)
            sp = params[i % len(params)]
            tasks.append(asyncio.ensure_future(engine.agenerate(prompt, sp)))
        return await asyncio.gather(*tasks)

    with HFEngine(path, overlap=overlap, seed=3) as engine:
        results = asyncio.run(run(engine))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.output_ids and len(res.logprobs) == len(res.output_ids)
        assert res.versions == [0] * len(res.output_ids)
        expected, _ = teacher_forced(model, prompt, res.output_ids, temperature)
        torch.testing.assert_close(res.logprobs, expected, atol=1e-4, rtol=0)


@OVERLAP
def test_concurrent_greedy_equals_one_at_a_time(
    overlap: bool, tiny: tuple[str, LlamaForCausalLM]
) -> None:
    path, model = tiny
    sp = SamplingParams(max_new_tokens=24, greedy=True)

    async def concurrent(engine: HFEngine) -> list:
        tasks = []
        for i, prompt in enumerate(PROMPTS):
            await wait_for(engine, "steps", 3 * i)
            tasks.append(asyncio.ensure_future(engine.agenerate(prompt, sp)))
        return await asyncio.gather(*tasks)

    async def sequential(engine: HFEngine) -> list:
        return [await engine.agenerate(prompt, sp) for prompt in PROMPTS]

    # max_batch_size=4 also exercises queueing beyond the batch
    with HFEngine(path, overlap=overlap, max_batch_size=4) as engine:
        together = asyncio.run(concurrent(engine))
        alone = asyncio.run(sequential(engine))
    for prompt, a, b in zip(PROMPTS, together, alone, strict=True):
        assert a.output_ids == b.output_ids
        assert a.finish_reason == b.finish_reason
        _, argmax = teacher_forced(model, prompt, a.output_ids, 1.0)
        assert a.output_ids == argmax  # greedy really is the argmax of the model


@pytest.mark.parametrize("budget", [8192, len(PROMPTS[8]) - 1])
def test_a_groups_shared_prompt_is_prefilled_once(
    tiny: tuple[str, LlamaForCausalLM], budget: int
) -> None:
    """Samples of one prompt admitted together share one prefill (their cache rows are copies),
    also when the prefill budget holds that prompt only once: greedy continuations and log-probs
    match the teacher-forced model, sampled ones differ."""
    path, model = tiny
    group, other = PROMPTS[8], PROMPTS[1]
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0)

    async def run(engine: HFEngine) -> tuple[list, list, dict]:
        await engine.pause()  # hold the requests so that one admission takes them all
        tasks = [engine.agenerate(group, greedy) for _ in range(3)]
        tasks += [engine.agenerate(group, sampled) for _ in range(3)]
        tasks += [engine.agenerate(other, greedy), engine.agenerate([7], greedy)]
        futs = [asyncio.ensure_future(t) for t in tasks]
        await asyncio.sleep(0.01)
        await engine.resume()
        res = await asyncio.gather(*futs)
        return res[:3], res[3:6], await engine.health()

    with HFEngine(path, max_prefill_tokens=budget) as engine:
        same, draws, health = asyncio.run(run(engine))
    assert health["prefills"] == (1 if budget == 8192 else 2)  # the group's, then the other
    assert health["prefill_tokens"] == (len(group) - 1) + (len(other) - 1)  # not 6 x the group's
    want_lp, want = teacher_forced(model, group, same[0].output_ids, 1.0)
    for r in same:
        assert r.output_ids == same[0].output_ids == want
        torch.testing.assert_close(r.logprobs, want_lp, atol=1e-5, rtol=0)
    for r in draws:
        lp, _ = teacher_forced(model, group, r.output_ids, 1.0)
        torch.testing.assert_close(r.logprobs, lp, atol=1e-5, rtol=0)
    assert len({tuple(r.output_ids) for r in draws}) > 1


def test_an_admission_of_mixed_lengths_prefills_short_and_long_prompts_apart(
    tiny: tuple[str, LlamaForCausalLM],
) -> None:
    """Short and long prompts arriving interleaved are prefilled shortest first, the long ones
    in a chunk of their own (one chunk would be mostly padding); greedy continuations match the
    teacher-forced model, whatever row each prompt took."""
    path, model = tiny
    gen = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(0, 256, (30 if i % 2 else 500,), generator=gen).tolist() for i in range(8)
    ]
    sp = SamplingParams(max_new_tokens=6, greedy=True)

    async def run(engine: HFEngine) -> tuple[list, dict]:
        await engine.pause()  # one admission takes them all
        futs = [asyncio.ensure_future(engine.agenerate(p, sp)) for p in prompts]
        await asyncio.sleep(0.01)
        await engine.resume()
        return await asyncio.gather(*futs), await engine.health()

    with HFEngine(path, max_prefill_tokens=100_000, max_seq_len=1024) as engine:
        results, health = asyncio.run(run(engine))
    assert health["prefills"] == 2
    assert health["prefill_tokens"] == sum(len(p) - 1 for p in prompts)
    for prompt, res in zip(prompts, results, strict=True):
        want_lp, want = teacher_forced(model, prompt, res.output_ids, 1.0)
        assert res.output_ids == want
        torch.testing.assert_close(res.logprobs, want_lp, atol=1e-5, rtol=0)


@OVERLAP
def test_stop_tokens_max_new_tokens_and_finish_reasons(
    overlap: bool, tiny: tuple[str, LlamaForCausalLM], tmp_path: Path
) -> None:
    path, _ = tiny
    prompt = PROMPTS[0]

    async def run(engine: HFEngine, sp: SamplingParams):
        return await engine.agenerate(prompt, sp)

    with HFEngine(path, overlap=overlap, max_seq_len=12) as engine:
        ref = asyncio.run(run(engine, SamplingParams(max_new_tokens=9, greedy=True)))
        assert (len(ref.output_ids), ref.finish_reason) == (9, "length")
        stop_tok = ref.output_ids[4]
        first = ref.output_ids.index(stop_tok)
        res = asyncio.run(run(engine, SamplingParams(9, greedy=True, stop_token_ids=[stop_tok])))
        assert res.output_ids == ref.output_ids[: first + 1]
        assert res.finish_reason == "stop"
        res = asyncio.run(run(engine, SamplingParams(max_new_tokens=3, greedy=True)))
        assert (res.output_ids, res.finish_reason) == (ref.output_ids[:3], "length")
        # prompt (3) + output may not exceed max_seq_len (12)
        res = asyncio.run(run(engine, SamplingParams(max_new_tokens=50, greedy=True)))
        assert (len(res.output_ids), res.finish_reason) == (9, "length")
        res = asyncio.run(run(engine, SamplingParams(max_new_tokens=0)))
        assert (res.output_ids, res.finish_reason) == ([], "length")

    # The model's own eos ids (generation_config) stop generation by default.
    eos_dir = tmp_path / "eos_model"
    save_model(eos_dir, seed=0, eos=[255, ref.output_ids[2]])
    with HFEngine(str(eos_dir), overlap=overlap) as engine:
        res = asyncio.run(run(engine, SamplingParams(max_new_tokens=9, greedy=True)))
    assert res.output_ids == ref.output_ids[: ref.output_ids.index(ref.output_ids[2]) + 1]
    assert res.finish_reason == "stop"


def test_top_k_one_equals_greedy(tiny: tuple[str, LlamaForCausalLM]) -> None:
    async def run(engine: HFEngine) -> tuple[list, list]:
        greedy = SamplingParams(max_new_tokens=16, greedy=True)
        top1 = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=1)
        return await asyncio.gather(
            *[engine.agenerate(p, greedy) for p in PROMPTS[:4]],
            *[engine.agenerate(p, top1) for p in PROMPTS[:4]],
        )

    with HFEngine(tiny[0]) as engine:
        results = asyncio.run(run(engine))
    for g, k in zip(results[:4], results[4:], strict=True):
        assert k.output_ids == g.output_ids
        torch.testing.assert_close(k.logprobs, g.logprobs, atol=1e-5, rtol=0)


def test_sampling_is_reproducible_with_seed(tiny: tuple[str, LlamaForCausalLM]) -> None:
    sp = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.95)

    def sample(seed: int) -> list[int]:
        with HFEngine(tiny[0], seed=seed) as engine:
            return asyncio.run(engine.agenerate(PROMPTS[1], sp)).output_ids

    assert sample(5) == sample(5)
    assert sample(5) != sample(6)


@OVERLAP
def test_pause_interrupts_and_resume_continues_under_new_version(
    overlap: bool,
    tiny: tuple[str, LlamaForCausalLM],
) -> None:
    prompt, other = PROMPTS[0], PROMPTS[3]
    sp = SamplingParams(max_new_tokens=100, greedy=True)

    async def run(engine: HFEngine) -> None:
        ref = await engine.agenerate(prompt, sp)
        ref_other = await engine.agenerate(other, sp)
        assert ref.finish_reason == "length"
        start = (await engine.health())["generated_tokens"]
        whole = asyncio.ensure_future(generate_to_completion(engine, prompt, sp))
        raw = asyncio.ensure_future(engine.agenerate(other, sp))
        await wait_for(engine, "generated_tokens", start + 6)
        await engine.pause()
        interrupted = await raw
        assert interrupted.finish_reason == "abort"
        assert 0 < len(interrupted.output_ids) < len(ref_other.output_ids)
        assert interrupted.output_ids == ref_other.output_ids[: len(interrupted.output_ids)]
        engine.set_version(1)
        held = asyncio.ensure_future(engine.agenerate(other, sp))
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert not held.done() and not whole.done()  # nothing runs while paused
        assert (await engine.health())["paused"]
        await engine.resume()
        res, again = await asyncio.gather(whole, held)
        assert res.output_ids == ref.output_ids and res.finish_reason == "length"
        switch = res.versions.index(1)
        assert 0 < switch < len(res.versions)
        assert res.versions == [0] * switch + [1] * (len(res.versions) - switch)
        assert again.output_ids == ref_other.output_ids and set(again.versions) == {1}

    with HFEngine(tiny[0], overlap=overlap) as engine:
        asyncio.run(run(engine))


def continued_from_old_cache(
    old: LlamaForCausalLM, new: LlamaForCausalLM, prompt: list[int], out: list[int], switch: int
) -> tuple[list[float], list[int]]:
    """Log-probs (T = 1) of ``out[switch:]`` and the argmax at each position when ``new``
    decodes on from the KV cache that ``old`` filled: the prompt and ``out[: switch - 1]``
    (the last old token is fed by the first step under the new weights)."""
    cache = {cache_kwarg(old.forward): DynamicCache()}  # filled in place by both passes
    with torch.no_grad():
        old(torch.tensor([prompt + out[: switch - 1]]), use_cache=True, **cache)
        logits = new(torch.tensor([out[switch - 1 : -1]]), use_cache=True, **cache).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, torch.tensor(out[switch:])[:, None])[:, 0]
    return chosen.tolist(), logp.argmax(dim=-1).tolist()


@OVERLAP
def test_pause_in_place_keeps_rows_and_their_cache_across_a_weight_update(
    overlap: bool, tiny: tuple[str, LlamaForCausalLM], tmp_path: Path
) -> None:
    path, model = tiny
    new_model = save_model(tmp_path / "v1", seed=7)
    prompts = [PROMPTS[0], PROMPTS[3]]
    sp = SamplingParams(max_new_tokens=100, greedy=True)

    async def run(engine: HFEngine) -> None:
        refs = [await engine.agenerate(p, sp) for p in prompts]  # the old model, uninterrupted
        start = (await engine.health())["generated_tokens"]
        raw = [asyncio.ensure_future(engine.agenerate(p, sp)) for p in prompts]
        await wait_for(engine, "generated_tokens", start + 12)
        await engine.pause(in_place=True)
        health = await engine.health()
        assert health["pause_mode"] == "in_place" and health["held"] == 2
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert not any(r.done() for r in raw)  # kept, not aborted
        await engine.update_weights_from_disk(str(tmp_path / "v1"))
        assert (await engine.health())["steps"] == health["steps"]  # nothing decoded meanwhile
        engine.set_version(1)
        await engine.resume()
        results = await asyncio.gather(*raw)
        after = await engine.health()
        assert after["prefills"] == health["prefills"]  # continued from the cache: no re-prefill
        assert after["pause_mode"] is None and after["held"] == 0
        for prompt, ref, res in zip(prompts, refs, results, strict=True):
            # The new weights may reach the eos (2) before the length limit, depending on the
            # step the pause landed on; the tokens are checked against the new model below.
            if res.finish_reason == "stop":
                assert res.output_ids[-1] == 2 and len(res.output_ids) <= len(ref.output_ids)
            else:
                assert res.finish_reason == "length"
                assert len(res.output_ids) == len(ref.output_ids)
            switch = res.versions.index(1)
            assert 0 < switch < len(res.versions)
            assert res.versions == [0] * switch + [1] * (len(res.versions) - switch)
            assert res.output_ids[:switch] == ref.output_ids[:switch]
            assert res.logprobs[:switch] == pytest.approx(ref.logprobs[:switch], abs=1e-5)
            # After the switch: the new weights over the old weights' cache of the prefix.
            logprobs, argmax = continued_from_old_cache(
                model, new_model, prompt, res.output_ids, switch
            )
            assert res.output_ids[switch:] == argmax
            assert res.logprobs[switch:] == pytest.approx(logprobs, abs=1e-4)

    with HFEngine(path, overlap=overlap) as engine:
        asyncio.run(run(engine))


@OVERLAP
def test_cancel_while_paused_in_place_frees_the_row_and_stays_parked(
    overlap: bool,
    tiny: tuple[str, LlamaForCausalLM],
) -> None:
    async def run(engine: HFEngine) -> None:
        keep = asyncio.ensure_future(engine.agenerate(PROMPTS[1], SamplingParams(300)))
        gone = asyncio.ensure_future(engine.agenerate(PROMPTS[0], SamplingParams(1500)))
        await wait_for(engine, "running", 2)
        await engine.pause(in_place=True)
        assert (await engine.health())["held"] == 2
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        for _ in range(100_000):
            if (await engine.health())["held"] < 2:
                break
            await asyncio.sleep(0.001)
        health = await engine.health()
        assert health["held"] == 1 and health["running"] == 1 and health["paused"]
        assert engine.update_weights([]) == 0  # still parked: a weight update may run
        await engine.resume()
        res = await keep
        assert res.finish_reason in ("stop", "length") and set(res.versions) == {0}
        assert (await engine.health())["running"] == 0

    with HFEngine(tiny[0], overlap=overlap) as engine:
        asyncio.run(run(engine))


@OVERLAP
def test_an_abort_pause_aborts_rows_kept_by_an_in_place_one(
    overlap: bool,
    tiny: tuple[str, LlamaForCausalLM],
) -> None:
    async def run(engine: HFEngine) -> None:
        raw = asyncio.ensure_future(engine.agenerate(PROMPTS[0], SamplingParams(1500)))
        await wait_for(engine, "running", 1)
        await engine.pause(in_place=True)
        assert not raw.done()
        await engine.pause()
        res = await raw
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 1500
        health = await engine.health()
        assert health["pause_mode"] == "abort" and health["running"] == 0
        assert engine.update_weights([]) == 0  # parked again
        await engine.resume()

    with HFEngine(tiny[0], overlap=overlap) as engine:
        asyncio.run(run(engine))


@OVERLAP
def test_close_while_paused_in_place_fails_the_kept_requests(
    overlap: bool,
    tiny: tuple[str, LlamaForCausalLM],
) -> None:
    engine = HFEngine(tiny[0], overlap=overlap)

    async def run() -> None:
        kept = asyncio.ensure_future(engine.agenerate(PROMPTS[0], SamplingParams(1500)))
        await wait_for(engine, "running", 1)
        await engine.pause(in_place=True)
        assert (await engine.health())["held"] == 1
        await engine.aclose()
        with pytest.raises(EngineClosedError, match="closed during this request"):
            await kept

    # A hang here (the kept request never answered) fails after a minute instead of forever.
    asyncio.run(asyncio.wait_for(run(), 60))
    assert engine._thread is not None and not engine._thread.is_alive()


@OVERLAP
def test_cancelled_request_frees_its_row(overlap: bool, tiny: tuple[str, LlamaForCausalLM]) -> None:
    async def run(engine: HFEngine) -> None:
        task = asyncio.ensure_future(engine.agenerate(PROMPTS[0], SamplingParams(1500)))
        await wait_for(engine, "running", 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100_000):
            if (await engine.health())["running"] == 0:
                break
            await asyncio.sleep(0.001)
        assert (await engine.health())["running"] == 0

    with HFEngine(tiny[0], overlap=overlap) as engine:
        asyncio.run(run(engine))


@OVERLAP
def test_update_weights_only_while_paused_and_checksum(
    overlap: bool, tiny: tuple[str, LlamaForCausalLM], tmp_path: Path
) -> None:
    path, model = tiny
    new_model = save_model(tmp_path / "v1", seed=7)
    source = [(name, p.detach().clone()) for name, p in new_model.named_parameters()]
    sp = SamplingParams(max_new_tokens=8, greedy=True)

    async def run(engine: HFEngine) -> None:
        before = await engine.weights_checksum()
        assert before == checksum_named_tensors(model.named_parameters())
        await engine.agenerate(PROMPTS[0], sp)  # the decode thread is running now
        with pytest.raises(EngineNotPausedError):
            engine.update_weights(source)
        assert await engine.weights_checksum() == before
        await engine.pause()
        with pytest.raises(UnknownWeightError):
            engine.update_weights([("no.such.weight", torch.zeros(1))])
        assert engine.update_weights(source) == len(source)
        after = await engine.weights_checksum()
        assert after != before and after == checksum_named_tensors(source)
        await engine.resume()
        res = await engine.agenerate(PROMPTS[0], sp)
        assert res.output_ids == teacher_forced(new_model, PROMPTS[0], res.output_ids, 1.0)[1]
        # Back to the original weights from an HF folder on disk.
        await engine.pause()
        await engine.update_weights_from_disk(path)
        await engine.resume()
        assert await engine.weights_checksum() == before

    with HFEngine(path, overlap=overlap) as engine:
        with pytest.raises(EngineNotPausedError):  # not paused, even before the thread starts
            engine.update_weights(source)
        asyncio.run(run(engine))


def test_checksum_is_order_independent_and_sensitive() -> None:
    a = [("x", torch.arange(4.0)), ("y", torch.ones(2, 2))]
    assert checksum_named_tensors(a) == checksum_named_tensors(reversed(a))
    assert checksum_named_tensors(a) != checksum_named_tensors([a[0], ("y", torch.zeros(2, 2))])
    assert checksum_named_tensors(a) != checksum_named_tensors([(n, t.double()) for n, t in a])
    with pytest.raises(ValueError, match="twice"):
        checksum_named_tensors([a[0], a[0]])


def test_invalid_requests_and_close(tiny: tuple[str, LlamaForCausalLM]) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        HFEngine(tiny[0], cuda_graphs=True)
    engine = HFEngine(tiny[0], max_seq_len=8)

    async def run() -> dict:
        with pytest.raises(ValueError, match="empty"):
            await engine.agenerate([], SamplingParams())
        with pytest.raises(ValueError, match="max_seq_len"):
            await engine.agenerate(list(range(8)), SamplingParams())
        with pytest.raises(ValueError, match="token ids"):
            await engine.agenerate([256], SamplingParams())
        with pytest.raises(ValueError, match="top_p"):
            await engine.agenerate([1], SamplingParams(top_p=0.0))
        await engine.agenerate([1, 2], SamplingParams(max_new_tokens=2))
        return await engine.health()

    health = asyncio.run(run())
    assert health["device"] == "cpu" and health["version"] == 0 and health["steps"] >= 2
    thread = engine._thread
    engine.close()
    assert thread is not None and not thread.is_alive()
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.agenerate([1], SamplingParams()))


def test_score_is_the_models_log_probs_and_follows_weight_updates(
    tiny: tuple[str, LlamaForCausalLM], tmp_path: Path
) -> None:
    path, model = tiny
    new_model = save_model(tmp_path / "v1", seed=7)
    seq = PROMPTS[1] + PROMPTS[2]

    async def run(engine: HFEngine) -> tuple[list[float], list[float]]:
        before = await engine.score(seq)
        await engine.pause()
        await engine.update_weights_from_disk(str(tmp_path / "v1"))
        await engine.resume()
        return before, await engine.score(seq)

    with HFEngine(path) as engine:
        before, after = asyncio.run(run(engine))
    want_before, _ = teacher_forced(model, seq[:1], seq[1:], 1.0)
    want_after, _ = teacher_forced(new_model, seq[:1], seq[1:], 1.0)
    assert before == pytest.approx(want_before, abs=1e-5)
    assert after == pytest.approx(want_after, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-2


def test_wait_failed_returns_when_the_decode_thread_dies(
    tiny: tuple[str, LlamaForCausalLM],
) -> None:
    engine = HFEngine(tiny[0])

    def broken_serve() -> None:
        raise RuntimeError("a bug in the decode loop")

    engine._serve = broken_serve  # the thread's body: what a bug there would do

    async def run() -> BaseException:
        watch = asyncio.create_task(engine.wait_failed())
        with pytest.raises(HFEngineError, match="decode thread died"):
            await engine.agenerate([1, 2], SamplingParams(max_new_tokens=2))
        return await asyncio.wait_for(watch, 30)

    failure = asyncio.run(run())
    assert isinstance(failure, RuntimeError) and "a bug in the decode loop" in str(failure)
    engine.close()


def test_wait_failed_never_returns_after_close(tiny: tuple[str, LlamaForCausalLM]) -> None:
    async def run() -> bool:
        engine = HFEngine(tiny[0])
        await engine.start()
        watch = asyncio.create_task(engine.wait_failed())
        await engine.agenerate([1, 2], SamplingParams(max_new_tokens=2))
        await engine.aclose()
        await asyncio.sleep(0.2)
        done = watch.done()
        watch.cancel()
        return done

    assert asyncio.run(run()) is False
