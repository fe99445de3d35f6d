"""The hf engine's fused decode step (fused.py) against the model's own modules, on tiny random
models of each family it serves (CPU, fp32): the same greedy tokens and log-probs."""

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
from arl.engines.hf import HFEngine
from arl.engines.hf.fused import FusedDecoder, unsupported_reason
from arl.engines.hf.graphs import buckets, row_bucket

torch.set_num_threads(1)

SHAPE = dict(
    vocab_size=256,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE)),  # q/k/v biases
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=16)),  # q/k norms, own head_dim
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    cls, cfg = FAMILIES[request.param]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # biases and norm weights away from their init, so they count
        for name, p in model.named_parameters():
            if name.endswith(("bias", "norm.weight", "layernorm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path)


PROMPTS = [[5, 6, 7], [3, 1, 4, 1, 5, 9, 2, 6], [42], list(range(100, 170)), [7] * 20]


def _generate(path: str, **options) -> tuple[list, dict]:
    sp = SamplingParams(max_new_tokens=12, greedy=True)

    async def run(engine: HFEngine) -> list:
        return await asyncio.gather(*(engine.agenerate(p, sp) for p in PROMPTS))

    with HFEngine(path, max_batch_size=4, max_seq_len=256, **options) as engine:
        results = asyncio.run(run(engine))
        return results, asyncio.run(engine.health())


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_fused_decode_gives_the_modules_tokens_and_logprobs(model_dir: str, attention: str) -> None:
    """More prompts than rows, so rows join and leave mid-decode; each family, each attention."""
    expected, ref_health = _generate(model_dir, decode_attention=attention, fused_decode=False)
    results, health = _generate(model_dir, decode_attention=attention)
    assert not ref_health["fused_decode"] and health["fused_decode"]
    assert health["last_error"] is None
    for res, ref in zip(results, expected, strict=True):
        assert res.output_ids == ref.output_ids
        torch.testing.assert_close(res.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_parameters_share_the_fused_buffers(model_dir: str) -> None:
    """A weight sync copies into the model's Parameters; the fused step must read those bytes."""
    with HFEngine(model_dir, max_batch_size=2, max_seq_len=64) as engine:
        attn = engine._model.model.layers[0].self_attn
        qkv, _ = engine._fused._qkv[0]
        assert attn.q_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
        assert attn.v_proj.weight.data_ptr() == qkv[-attn.v_proj.weight.shape[0] :].data_ptr()


def test_a_weight_update_reaches_the_fused_step(model_dir: str, tmp_path: Path) -> None:
    """Greedy tokens after `update_weights` with another model's weights are that model's."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    other.save_pretrained(tmp_path)
    expected, _ = _generate(str(tmp_path), fused_decode=False)
    sp = SamplingParams(max_new_tokens=12, greedy=True)

    async def run(engine: HFEngine) -> list:
        await engine.pause()
        engine.update_weights(other.state_dict().items())
        await engine.resume()
        return await asyncio.gather(*(engine.agenerate(p, sp) for p in PROMPTS))

    with HFEngine(model_dir, max_batch_size=4, max_seq_len=256) as engine:
        results = asyncio.run(run(engine))
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]


def test_sleep_without_weights_then_wake_and_sync_decodes_as_before(model_dir: str) -> None:
    sp = SamplingParams(max_new_tokens=12, greedy=True)

    async def run(engine: HFEngine) -> tuple[list, list]:
        before = await asyncio.gather(*(engine.agenerate(p, sp) for p in PROMPTS))
        weights = {k: v.clone() for k, v in engine._model.state_dict().items()}
        await engine.sleep(drop_weights=True)
        assert not engine._fused.bound
        await engine.wake()
        engine.update_weights(weights.items())
        await engine.resume()
        after = await asyncio.gather(*(engine.agenerate(p, sp) for p in PROMPTS))
        return before, after

    with HFEngine(model_dir, max_batch_size=4, max_seq_len=256) as engine:
        before, after = asyncio.run(run(engine))
    assert [r.output_ids for r in after] == [r.output_ids for r in before]


def test_unsupported_models_decode_through_their_modules(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with HFEngine(str(tmp_path), max_batch_size=1, max_seq_len=32) as engine:
        assert engine._fused is None
        assert "model_type 'gpt2'" in unsupported_reason(engine._model)
    with pytest.raises(ValueError, match="fused_decode=True, but model_type 'gpt2'"):
        HFEngine(str(tmp_path), max_batch_size=1, max_seq_len=32, fused_decode=True)


def test_compaction_moves_every_layer_in_one_copy(model_dir: str) -> None:
    """The fused families keep all layers' keys and values in one buffer, so moving rows is one
    copy; each layer's buffer is a slice of it, and moved rows land in every layer."""
    with HFEngine(model_dir, max_batch_size=4, max_seq_len=64) as engine:
        cache = engine._cache
        cache.reserve(4, 16)
        fused = engine._fused
        for layer in range(len(fused.layers)):
            k, v = cache.layer(layer, fused.kv_heads, fused.dim, torch.float32, torch.device("cpu"))
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
            # The block the compiled attn_in writes in place: contiguous (a strided view would
            # make inductor copy it whole on every call), holding this layer's keys and values.
            kv = cache.layer_kv(layer, fused.kv_heads, fused.dim, torch.float32, k.device)
            assert kv.is_contiguous() and kv.shape == (2, *k.shape)
            assert kv[0].data_ptr() == k.data_ptr() and kv[1].data_ptr() == v.data_ptr()
        before = {i: (cache.keys[i].clone(), cache.values[i].clone()) for i in cache.keys}
        cache.move_rows(torch.tensor([0, 1]), torch.tensor([3, 2]), 10)
        for i, (k, v) in before.items():
            assert (
                cache.keys[i].untyped_storage().data_ptr() == cache._kv.untyped_storage().data_ptr()
            )
            torch.testing.assert_close(cache.keys[i][[0, 1], :, :10], k[[3, 2], :, :10])
            torch.testing.assert_close(cache.values[i][[0, 1], :, :10], v[[3, 2], :, :10])
            torch.testing.assert_close(cache.keys[i][:2, :, 10:], k[:2, :, 10:])  # past kv_len


def test_the_engine_shortens_the_thread_switch_interval(model_dir: str) -> None:
    import sys

    from arl.engines.hf.engine import SWITCH_INTERVAL_S

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        _generate(model_dir)
        assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(old)


def _prefilled_cache(path: str, prompts: list[list[int]], **options) -> tuple[list, list]:
    """Each layer's keys and values of ``prompts`` right after one prefill (rows 0..n-1, each
    up to its prompt's length less the last token, which decode feeds), and the engine's rows."""
    with HFEngine(path, max_batch_size=len(prompts), max_seq_len=64, **options) as engine:
        loop = asyncio.new_event_loop()
        try:
            sp = SamplingParams(max_new_tokens=4, greedy=True)
            chunk = [engine._make_request(p, sp, loop) for p in prompts]
            calls = []
            engine._model.register_forward_pre_hook(lambda *a: calls.append(1))
            with engine._cv, engine._model_lock:
                engine._prefill(chunk)
                order = [list(r.prompt) for r in engine._rows]
                layers = [
                    [
                        (engine._cache.keys[i][row, :, : r.pos], engine._cache.values[i][row])
                        for row, r in enumerate(engine._rows)
                    ]
                    for i in sorted(engine._cache.keys)
                ]
                layers = [[(k.clone(), v[:, : k.shape[1]].clone()) for k, v in ls] for ls in layers]
                engine._rows = []
            assert bool(calls) == (options.get("fused_decode") is False)  # fused: no modules
            return order, layers
        finally:
            loop.close()


@pytest.mark.parametrize(
    "prompts",
    [
        [[5, 6, 7, 8], list(range(100, 130)), [5, 6, 7, 8], [42], [9, 9, 9, 1, 2, 3, 4]],
        [[3, 4]],  # one token to prefill, which runs padded to two
    ],
    ids=["mixed", "one-token"],
)
def test_fused_prefill_writes_the_modules_keys_and_values(
    model_dir: str, prompts: list[list[int]]
) -> None:
    """One prefill of prompts of mixed lengths, a GRPO-style repeat (a copied row) and a
    one-token prompt (no prefill), or of one token alone: the fused path caches what the
    modules cache."""
    order, ref = _prefilled_cache(model_dir, prompts, fused_decode=False)
    fused_order, got = _prefilled_cache(model_dir, prompts)
    assert fused_order == order
    assert len(got) == len(ref) == SHAPE["num_hidden_layers"]
    for layer_got, layer_ref in zip(got, ref, strict=True):
        for (k, v), (k_ref, v_ref) in zip(layer_got, layer_ref, strict=True):
            torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


def test_each_fused_function_compiles_once_for_every_step_and_prefill(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Start-up pays one compilation per fused function, not one per batch bucket or per kind
    of call: decode at every row bucket and prefills of one token, of one row and of many rows
    all run on the first compilation (dynamo's tracing, with its eager backend here, decides
    what recompiles; inductor on CUDA compiles the same graphs)."""
    compile_ = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"})
    )
    torch._dynamo.reset()
    rows = 64
    with HFEngine(model_dir, max_batch_size=rows, max_seq_len=64, decode_attention="sdpa") as e:
        e._fused = FusedDecoder(e._model, compiled=True)
        e._cache.reserve(rows, 64)
        with torch.no_grad():
            # A prefill first, as an engine runs them: its inputs set the first guards.
            assert e._fused_prefill(0, torch.randint(0, 200, (3, 5)))
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            for n in buckets(rows, row_bucket):
                e._pos[:n] = torch.arange(n) % 8
                assert e._fused_decode(n, 64).shape[0] == n
            for shape in ((1, 1), (1, 9), (5, 7), (16, 33)):
                assert e._fused_prefill(0, torch.randint(0, 200, shape))
    torch._dynamo.reset()
