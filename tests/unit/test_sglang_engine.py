"""The sglang engine against the SGLang stand-in (SGLang itself cannot run on CPU machines).

The stand-in serves a tiny random Llama; references come from the same weights loaded here with
transformers, so tokens and log-probs are checked, not just shapes. It rejects request bodies
that stray from SGLang's documented fields, so every successful call also checks a body.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import torch

from arl.engines.base import SamplingParams, generate_to_completion
from arl.engines.server import ServerError, ServerStartError
from arl.engines.sglang import SGLangEngine
from arl.process import process_group_members
from tests.support import LoopThread

REPO = Path(__file__).resolve().parents[2]
STANDIN = [sys.executable, "-m", "tests.support.sglang_standin"]
PROMPT = [5, 17, 42, 99, 3, 64]


def _tiny_llama(path: Path, seed: int) -> None:
    """A 2-layer random Llama with peaked logits (no greedy near-ties) and no EOS token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference greedy continuation: prefill the prompt, then one token at a time."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids, cache, out = list(prompt), None, []
    for _ in range(n):
        res = model(torch.tensor([ids]), use_cache=True, **{name: cache})
        cache = getattr(res, name)
        ids = [int(res.logits[0, -1].argmax())]
        out.append(ids[0])
    return out


@torch.no_grad()
def _teacher_forced(model, prompt: list[int], out: list[int], temperature: float = 1.0):
    """log_softmax(logits / T) of every output token, from one forward pass over everything."""
    logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, -1)
    return logprobs.gather(1, torch.tensor(out)[:, None])[:, 0], logits


def _engine(model_dir: Path, **kwargs) -> SGLangEngine:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"
    return SGLangEngine(str(model_dir), launch_cmd=STANDIN, env=env, start_timeout_s=120, **kwargs)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    _tiny_llama(root / "a", seed=0)
    _tiny_llama(root / "b", seed=1)
    refs = {"ref_a": _load(root / "a"), "ref_b": _load(root / "b")}
    return {"a": root / "a", "b": root / "b", **refs}


@pytest.fixture(scope="module")
def served(models):
    """One stand-in server for the module, driven from a loop thread."""
    loop = LoopThread()
    engine = _engine(models["a"])
    loop.run(engine.start())
    yield loop, engine
    loop.run(engine.aclose())
    loop.close()


async def _tokens_in_flight(engine: SGLangEngine) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(engine.base_url + "/get_load") as resp:
            return sum(rank["num_tokens"] for rank in await resp.json())


async def _pause_when_decoding(engine: SGLangEngine, min_tokens: int) -> None:
    """Pause once the server holds at least ``min_tokens`` tokens of running requests."""
    while await _tokens_in_flight(engine) < min_tokens:
        await asyncio.sleep(0.01)
    await engine.pause()


def test_greedy_tokens_and_logprobs_match_transformers(served, models):
    loop, engine = served
    res = loop.run(engine.agenerate(PROMPT, SamplingParams(max_new_tokens=24, greedy=True)))
    assert res.output_ids == _greedy(models["ref_a"], PROMPT, 24)
    assert res.finish_reason == "length"
    assert len(res.logprobs) == len(res.versions) == 24
    assert res.versions == [0] * 24
    expected, _ = _teacher_forced(models["ref_a"], PROMPT, res.output_ids)
    assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)


def test_stop_token_ends_generation_and_is_returned(served, models):
    loop, engine = served
    greedy = _greedy(models["ref_a"], PROMPT, 10)
    stop = greedy[4]
    first = greedy.index(stop)
    sampling = SamplingParams(max_new_tokens=10, greedy=True, stop_token_ids=[stop])
    res = loop.run(engine.agenerate(PROMPT, sampling))
    assert res.finish_reason == "stop"
    assert res.output_ids == greedy[: first + 1]


def test_sampling_logprobs_are_tempered_and_respect_top_k(served, models):
    loop, engine = served
    sampling = SamplingParams(max_new_tokens=32, temperature=0.7, top_k=5)
    res = loop.run(engine.agenerate(PROMPT, sampling))
    assert len(res.output_ids) == len(res.logprobs) == 32
    expected, logits = _teacher_forced(models["ref_a"], PROMPT, res.output_ids, temperature=0.7)
    assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)
    top5 = logits.topk(5, -1).indices
    assert all(tok in top5[i] for i, tok in enumerate(res.output_ids))
    assert all(math.isfinite(lp) and lp <= 0 for lp in res.logprobs)


def test_pause_aborts_then_resume_continues_under_new_version(served, models):
    loop, engine = served
    n = 200  # long enough to pause mid-way; short enough that greedy near-ties stay unlikely
    sampling = SamplingParams(max_new_tokens=n, greedy=True)

    async def scenario():
        task = asyncio.create_task(generate_to_completion(engine, PROMPT, sampling))
        partial = asyncio.create_task(engine.agenerate(PROMPT, sampling))
        await _pause_when_decoding(engine, 2 * len(PROMPT) + 10)
        aborted = await partial  # a plain agenerate returns what it had
        held = asyncio.create_task(engine.agenerate(PROMPT, SamplingParams(4, greedy=True)))
        await asyncio.sleep(0.2)
        held_while_paused = not held.done()
        engine.set_version(1)
        await engine.resume()
        return await task, aborted, await held, held_while_paused

    full, aborted, held, held_while_paused = loop.run(scenario())
    reference = _greedy(models["ref_a"], PROMPT, n)
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.output_ids) < n
    assert aborted.output_ids == reference[: len(aborted.output_ids)]
    assert set(aborted.versions) == {0}
    # The interrupted request continued after resume: same greedy tokens, versions 0 then 1.
    assert full.finish_reason == "length"
    assert full.output_ids == reference
    switch = full.versions.index(1)
    assert 0 < switch < n
    assert full.versions == [0] * switch + [1] * (n - switch)
    assert held_while_paused and held.versions == [1] * 4


def test_update_weights_from_disk_changes_outputs(served, models):
    loop, engine = served
    sampling = SamplingParams(max_new_tokens=16, greedy=True)

    async def scenario():
        await engine.pause()
        await engine.update_weights_from_disk(str(models["b"]))
        await engine.resume()
        on_b = await engine.agenerate(PROMPT, sampling)
        await engine.pause()
        await engine.update_weights_from_disk(str(models["a"]))
        await engine.resume()
        return on_b, await engine.agenerate(PROMPT, sampling)

    on_b, on_a = loop.run(scenario())
    assert on_b.output_ids == _greedy(models["ref_b"], PROMPT, 16)
    assert on_a.output_ids == _greedy(models["ref_a"], PROMPT, 16)
    assert on_a.output_ids != on_b.output_ids
    with pytest.raises(ServerError, match="update_weights_from_disk"):
        loop.run(engine.update_weights_from_disk(str(models["a"] / "missing")))


def test_standin_rejects_bodies_that_stray_from_sglang(served):
    loop, engine = served
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    with pytest.raises(ServerError, match="unknown field 'rank'"):
        loop.run(engine._request("POST", "/generate", json={**body, "rank": 1}))
    with pytest.raises(ServerError, match="unknown field 'bogus'"):
        loop.run(
            engine._request("POST", "/generate", json={**body, "sampling_params": {"bogus": 1}})
        )


def test_health_and_flush_cache(served):
    loop, engine = served
    info = loop.run(engine.health())
    assert info["engine"] == "sglang" and info["paused"] is False
    assert info["pid"] == engine.server.pid
    loop.run(engine.flush_cache())
    loop.run(engine.pause())
    try:
        assert loop.run(engine.health())["paused"] is True
    finally:
        loop.run(engine.resume())


def test_close_ends_every_server_process(models):
    async def scenario():
        engine = _engine(models["a"])
        await engine.start()
        pid = engine.server.pid
        assert process_group_members(pid)
        await engine.aclose()
        return pid, engine

    pid, engine = asyncio.run(scenario())
    assert process_group_members(pid) == []
    with pytest.raises(ServerError, match="not running"):
        asyncio.run(engine.health())


def test_start_reports_a_server_that_exits(tmp_path):
    engine = SGLangEngine(
        "unused",
        launch_cmd=[sys.executable, "-c", "import sys; sys.exit(3)"],
        start_timeout_s=60,
        log_path=str(tmp_path / "server.log"),
    )
    with pytest.raises(ServerStartError, match="exited with code 3"):
        asyncio.run(engine.start())


def test_start_reports_a_missing_python(tmp_path):
    engine = SGLangEngine("unused", python=str(tmp_path / "no-python"))
    with pytest.raises(ServerStartError, match="cannot run"):
        asyncio.run(engine.start())


def test_start_times_out_and_ends_a_server_that_never_listens(tmp_path):
    engine = SGLangEngine(
        "unused",
        launch_cmd=[sys.executable, "-c", "import time; time.sleep(600)"],
        start_timeout_s=1,
        log_path=str(tmp_path / "server.log"),
    )
    with pytest.raises(ServerStartError, match="not healthy"):
        asyncio.run(engine.start())
    assert process_group_members(engine.server.pid) == []


# The server lifecycle below is the shared `arl.engines.server` code both engines launch through;
# a plain `python -m http.server` stands in for an inference server (its "/" answers 200).
_OWNER = """
import asyncio, sys
from arl.engines.server import ServerProcess, free_port

async def main():
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    server = ServerProcess(argv, host="127.0.0.1", port=port, health_path="/", log_path=sys.argv[2])
    await server.start(60)
    print(server.pid, flush=True)
    if sys.argv[1] == "hang":
        await asyncio.sleep(600)

asyncio.run(main())
"""


def _run_owner(mode: str, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, mode, str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    return owner, int(owner.stdout.readline())


def test_server_ends_when_its_owner_exits_without_closing_it(tmp_path):
    owner, pid = _run_owner("exit", tmp_path)
    assert owner.wait(timeout=60) == 0
    assert process_group_members(pid) == []  # the atexit hook stopped it


def test_server_ends_when_its_owner_is_killed(tmp_path):
    owner, pid = _run_owner("hang", tmp_path)
    assert process_group_members(pid)
    owner.kill()  # no atexit: the kernel's parent-death signal must end the server
    owner.wait(timeout=60)
    deadline = time.monotonic() + 60
    while process_group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert process_group_members(pid) == []


def test_score_gives_the_served_weights_log_probs_of_a_sequence(served, models):
    """`score` is what weight verification compares with the trainer: it follows the weights
    the server holds, so a stale server is told apart from an updated one."""
    loop, engine = served
    seq = PROMPT + [7, 8, 9]
    want_a, _ = _teacher_forced(models["ref_a"], seq[:1], seq[1:])
    want_b, _ = _teacher_forced(models["ref_b"], seq[:1], seq[1:])
    got = loop.run(engine.score(seq))
    assert len(got) == len(seq) - 1
    assert torch.allclose(torch.tensor(got), want_a, atol=1e-4)
    assert not torch.allclose(torch.tensor(got), want_b, atol=1e-2)
    loop.run(engine.pause())
    loop.run(engine.update_weights_from_disk(str(models["b"])))
    loop.run(engine.resume())
    try:
        got = loop.run(engine.score(seq))
        assert torch.allclose(torch.tensor(got), want_b, atol=1e-4)
    finally:
        loop.run(engine.pause())
        loop.run(engine.update_weights_from_disk(str(models["a"])))
        loop.run(engine.resume())
