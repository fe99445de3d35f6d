"""The hf engine with LoRA adapters equals a peft-wrapped model; sleep/wake frees and restores
what it says (CPU, fp32, a tiny random Llama)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.engines.base import SamplingParams
from arl.engines.hf import EngineAsleepError, HFEngine, UnknownWeightError, checksum_named_tensors
from arl.engines.lora import lora_config, lora_tensors, save_adapter

torch.set_num_threads(1)

LORA = {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["all-linear"]}
PROMPTS = [[5, 6, 7], [3, 1, 4, 1, 5], [10, 20, 30, 40], [42]]
GREEDY = SamplingParams(max_new_tokens=8, greedy=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_lora_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def trained_adapter(engine: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    """Random adapter tensors of the engine's shapes (B nonzero, so the adapter changes the
    output, as a trained one does)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: 0.3 * torch.randn(t.shape, generator=gen) for n, t in lora_tensors(engine._model)}


def peft_model(path: str, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The reference: the plain HF model wrapped by peft, holding ``adapter``."""
    from peft import get_peft_model

    model = get_peft_model(LlamaForCausalLM.from_pretrained(path), lora_config(LORA)).eval()
    missing = model.load_state_dict(
        {f"base_model.model.{n}": t for n, t in adapter.items()}, strict=False
    )
    assert not missing.unexpected_keys
    return model


def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


async def load(engine: HFEngine, named: dict[str, torch.Tensor]) -> None:
    await engine.pause()
    assert engine.update_weights(named.items()) == len(named)
    await engine.resume()


async def generate_all(engine: HFEngine) -> list[list[int]]:
    results = await asyncio.gather(*(engine.agenerate(p, GREEDY) for p in PROMPTS))
    return [r.output_ids for r in results]


# flex-compiled: the C++ flex kernel through torch.compile with the peft layers in the model.
@pytest.mark.parametrize("attention", ["sdpa", "flex", "flex-compiled"])
def test_engine_with_an_adapter_generates_and_scores_as_the_peft_model(
    tiny: str, attention: str
) -> None:
    async def main() -> None:
        options = {"decode_attention": attention.removesuffix("-compiled"), "lora": LORA}
        if attention == "flex-compiled":
            options["compile_blocks"] = True
        with HFEngine(tiny, dtype="float32", max_batch_size=8, **options) as engine:
            adapter = trained_adapter(engine, seed=1)
            await load(engine, adapter)
            ref = peft_model(tiny, adapter)
            got = await generate_all(engine)
            want = [reference_greedy(ref, p, GREEDY.max_new_tokens) for p in PROMPTS]
            assert got == want
            ids = PROMPTS[1] + got[1]
            assert await engine.score(ids) == pytest.approx(reference_logprobs(ref, ids), abs=1e-5)
            # The adapter changes the output: the base model alone scores differently.
            base = LlamaForCausalLM.from_pretrained(tiny).eval()
            assert reference_logprobs(base, ids) != pytest.approx(await engine.score(ids), abs=1e-3)
            assert (await engine.health())["lora_rank"] == LORA["rank"]
            want_attention = options["decode_attention"]
            assert (await engine.health())["decode_attention"] == want_attention

    asyncio.run(main())


def test_an_adapter_folder_loads_by_name_and_the_checksum_covers_the_adapter(
    tiny: str, tmp_path: Path
) -> None:
    async def main() -> None:
        with HFEngine(tiny, dtype="float32", lora=LORA) as engine:
            adapter = trained_adapter(engine, seed=2)
            folder = save_adapter(tmp_path / "v1", adapter.items(), LORA)
            await engine.pause()
            await engine.update_weights_from_disk(str(folder))
            await engine.resume()
            assert await engine.weights_checksum() == checksum_named_tensors(adapter.items())
        with HFEngine(tiny, dtype="float32") as plain:
            await plain.pause()
            with pytest.raises(UnknownWeightError, match="engine option lora"):
                await plain.update_weights_from_disk(str(folder))

    asyncio.run(main())


def test_sleep_drops_weights_and_cache_and_wake_serves_again(tiny: str) -> None:
    async def main() -> None:
        with HFEngine(tiny, dtype="float32", max_batch_size=8) as engine:
            before = await generate_all(engine)
            weights = {n: p.detach().clone() for n, p in engine._model.named_parameters()}
            params = dict(engine._model.named_parameters())
            cache_bytes = sum(t.nbytes for t in engine._cache.keys.values()) * 2
            assert cache_bytes > 0
            freed = await engine.sleep(drop_weights=True)
            assert freed == cache_bytes + sum(t.nbytes for t in weights.values())
            health = await engine.health()
            assert health["asleep"] and health["sleep_freed_bytes"] == freed
            assert all(p.numel() == 0 for p in params.values())
            # A request sent while asleep waits; resume is refused until wake.
            waiting = asyncio.ensure_future(engine.agenerate(PROMPTS[0], GREEDY))
            await asyncio.sleep(0.2)
            assert not waiting.done() and (await engine.health())["waiting"] == 1
            with pytest.raises(EngineAsleepError, match="wake"):
                await engine.resume()
            with pytest.raises(EngineAsleepError, match="wake"):
                engine.update_weights(weights.items())
            await engine.wake()
            assert dict(engine._model.named_parameters()) == params  # the same objects
            assert engine.update_weights(weights.items()) == len(weights)
            await engine.resume()
            assert (await waiting).output_ids == before[0]
            assert await generate_all(engine) == before
            assert not (await engine.health())["asleep"]

    asyncio.run(main())


def test_sleep_with_lora_keeps_the_base(tiny: str) -> None:
    async def main() -> None:
        with HFEngine(tiny, dtype="float32", max_batch_size=8, lora=LORA) as engine:
            adapter = trained_adapter(engine, seed=3)
            await load(engine, adapter)
            before = await generate_all(engine)
            freed = await engine.sleep(drop_weights=True)
            kept = [n for n, p in engine._model.named_parameters() if p.numel() > 0]
            assert kept and all(".lora_" not in n for n in kept)
            assert freed >= sum(t.nbytes for t in adapter.values())
            await engine.wake()
            engine.update_weights(adapter.items())  # the sync after wake: the adapter alone
            await engine.resume()
            assert await generate_all(engine) == before

    asyncio.run(main())
