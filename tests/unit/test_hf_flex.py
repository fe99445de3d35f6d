"""The hf engine's length-aware decode attention (``decode_attention="flex"``) on CPU: the flex
kernel against SDPA with the additive mask, blocks past a row's length never read, and the
engine decoding the same greedy tokens and log-probs as with SDPA."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from arl.config import Config, ConfigError, apply_overrides
from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine, flex
from arl.engines.hf.attention import grouped_decode_attention
from arl.engines.hf.flex import (
    FlexDecodeMask,
    _compiled_flex,
    _eager_flex,
    _run_compiled,
    flex_decode_attention,
)
from arl.engines.hf.kv_cache import SlotKVCache
from arl.engines.hf.split_decode import splits_for
from tests.support.tiny_model import make_tiny_model

torch.set_num_threads(1)

LENGTHS = [3, 70, 129, 300]  # positions each row attends to (its new token's included)
HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's attention
WIDTH = 384


class _Attention:
    num_key_value_groups = HEADS // KV_HEADS


def _decode_inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rows = len(LENGTHS)
    q = torch.randn(rows, HEADS, 1, DIM, generator=g)
    k = torch.randn(rows, KV_HEADS, WIDTH, DIM, generator=g)
    v = torch.randn(rows, KV_HEADS, WIDTH, DIM, generator=g)
    return q, k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The engine's SDPA decode: the additive mask over the whole width."""
    allowed = torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None]
    mask = torch.zeros(()).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask = mask[:, None, None, :]
    out, _ = grouped_decode_attention(_Attention(), q, k, v, mask, scaling=DIM**-0.5)
    return out


def _flex(q, k, v, mask: FlexDecodeMask, attend) -> torch.Tensor:
    block_mask = mask.block_mask(len(LENGTHS), WIDTH)
    out, _ = flex_decode_attention(
        _Attention(), q, k, v, block_mask, scaling=DIM**-0.5, flex_attend=attend
    )
    return out


def _mask(block: int) -> FlexDecodeMask:
    mask = FlexDecodeMask(8, HEADS // KV_HEADS, torch.device("cpu"), block=block)
    mask.update(torch.tensor(LENGTHS) - 1)  # a row at position p attends to 0..p
    return mask


@pytest.mark.parametrize("block", [128, 64, 16])
def test_block_tables_follow_each_rows_own_length(block: int) -> None:
    mask = _mask(block)
    rows = len(LENGTHS)
    assert mask.lens[:rows].tolist() == LENGTHS
    assert mask.num_blocks[:rows, 0, 0].tolist() == [-(-n // block) for n in LENGTHS]
    # The dense view of the block mask: row b's blocks 0..ceil(len_b / block) - 1, no others.
    dense = mask.block_mask(rows, WIDTH).to_dense()[:, 0, 0]
    for b, n in enumerate(LENGTHS):
        assert dense[b].tolist() == [int(i < -(-n // block)) for i in range(WIDTH // block)]
    with pytest.raises(ValueError, match="not a multiple of the block"):
        mask.block_mask(rows, WIDTH + 1)


@pytest.mark.parametrize("block", [128, 64, 16])
def test_flex_decode_matches_sdpa_with_the_additive_mask(block: int) -> None:
    q, k, v = _decode_inputs(seed=block)
    expected = _sdpa(q, k, v)
    mask = _mask(block)
    for attend in (_eager_flex, _run_compiled):
        out = _flex(q, k, v, mask, attend)
        assert out.shape == expected.shape == (len(LENGTHS), 1, HEADS, DIM)
        assert (out - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("block", [128, 16])
def test_compiled_flex_never_reads_the_blocks_past_a_rows_length(block: int) -> None:
    """NaN in every KV block past a row's last block: the compiled kernel's result is still
    SDPA's over clean values, while a mask that reaches them (every block) turns it into NaN."""
    q, k, v = _decode_inputs(seed=7)
    expected = _sdpa(q, k, v)
    for b, n in enumerate(LENGTHS):
        end = -(-n // block) * block
        k[b, :, end:] = v[b, :, end:] = float("nan")
    mask = _mask(block)
    out = _flex(q, k, v, mask, _run_compiled)
    assert (out - expected).abs().max().item() < 1e-5
    mask.num_blocks.fill_(WIDTH // block)  # the same lengths, but every block listed
    assert _flex(q, k, v, mask, _run_compiled)[1:].isnan().any()


def test_cache_rows_hold_whole_blocks() -> None:
    cache = SlotKVCache(4, 1000, seq_align=64)
    cache.reserve(2, 130)
    assert cache.seq_capacity == 192  # 130 rounded up to whole blocks
    cache.reserve(2, 999)
    assert cache.seq_capacity == 1024  # past max_seq by less than a block


# ---- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_flex"))


def _prompts(vocab: int) -> list[list[int]]:
    # Rows at very different lengths, several across a 64-position block boundary while decoding.
    g = torch.Generator().manual_seed(0)
    lengths = [3, 60, 70, 129, 5, 200, 64, 1, 120]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


async def _staggered(engine: HFEngine, prompts: list[list[int]], sp: SamplingParams) -> list:
    """The first three start together; each later one joins after two more decode steps."""
    tasks = []
    for i, prompt in enumerate(prompts):
        if i >= 3:
            start = (await engine.health())["steps"]
            while (h := await engine.health())["steps"] < start + 2 and h["running"]:
                await asyncio.sleep(0.001)
        tasks.append(asyncio.ensure_future(engine.agenerate(prompt, sp)))
    return await asyncio.gather(*tasks)


def _generate(path: str, **options) -> tuple[list, dict]:
    sp = SamplingParams(max_new_tokens=24, greedy=True)
    with HFEngine(path, max_batch_size=4, max_seq_len=512, **options) as engine:
        prompts = _prompts(engine._vocab_size)
        results = asyncio.run(_staggered(engine, prompts, sp))
        return results, asyncio.run(engine.health())


@pytest.mark.parametrize("compiled", [False, True])
def test_flex_engine_decodes_what_sdpa_decodes(tiny: str, compiled: bool) -> None:
    """Concurrent rows of different lengths, some admitted mid-decode, more than the batch holds:
    flex (torch's reference, or its compiled CPU kernel) gives SDPA's greedy tokens and
    log-probs."""
    expected, sdpa_health = _generate(tiny)
    options = {"compile_blocks": True} if compiled else {}
    results, health = _generate(tiny, decode_attention="flex", **options)
    assert sdpa_health["decode_attention"] == "sdpa"
    assert health["decode_attention"] == "flex" and health["last_error"] is None
    for res, ref in zip(results, expected, strict=True):
        assert res.output_ids == ref.output_ids and res.finish_reason == ref.finish_reason
        torch.testing.assert_close(res.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_unknown_decode_attention_is_refused(tiny: str) -> None:
    with pytest.raises(ValueError, match=r"decode_attention must be 'sdpa' .*'flex'.*'fast'"):
        HFEngine(tiny, decode_attention="fast")


def test_auto_decode_attention_is_sdpa_off_cuda(tiny: str) -> None:
    """The default: flex only where it is compiled on CUDA; on a CPU, SDPA (flex's reference
    kernel reads every position and is slower)."""
    with HFEngine(tiny, max_batch_size=2, max_seq_len=64) as engine:
        assert engine.decode_attention == "sdpa"


def test_triton_decode_attention_off_cuda_is_refused_naming_the_choices(tiny: str) -> None:
    with pytest.raises(ValueError, match=r"'triton' needs a CUDA device.*'auto', 'flex' or"):
        HFEngine(tiny, decode_attention="triton")


def test_split_decode_fills_the_gpu_and_never_splits_past_the_blocks() -> None:
    """How many programs share a row's positions (`splits_for`): none while (row, KV head)
    pairs fill the GPU, more for fewer rows, a power of two, at most one a 64-position block and
    at most 8."""
    assert splits_for(256, 3, 1088, 132) == 1  # 768 programs: four a multiprocessor
    assert splits_for(48, 3, 1024, 132) == 4
    assert splits_for(4, 2, 2048, 132) == 8  # 8 programs: split to the cap
    assert splits_for(4, 2, 128, 132) == 2  # two blocks of positions, two splits


def test_config_refuses_an_unknown_decode_attention() -> None:
    with pytest.raises(ConfigError, match="choose one of auto, sdpa, flex"):
        apply_overrides(Config(), ["rollout.hf_decode_attention=fast"])
    cfg = apply_overrides(Config(), ["rollout.hf_decode_attention=flex"])
    assert cfg.rollout.hf_decode_attention == "flex"
    cfg = Config()
    cfg.rollout.hf_decode_attention = "Flex"  # type: ignore[assignment]  # a recipe's typo
    with pytest.raises(ConfigError, match="hf_decode_attention='Flex'.*auto, sdpa, flex, triton"):
        cfg.validate()


def test_flex_falls_back_to_sdpa_where_it_cannot_compile(
    tiny: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No working C++ compiler (inductor's own check finds none) and nothing compiled kept: one
    warning at build, then the engine decodes with SDPA and says so."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("ARL_PRECOMPILE", "0")  # kernels kept by earlier tests would load
    monkeypatch.setattr(flex, "_COMPILED", None)
    torch._dynamo.reset()  # kernels compiled by earlier tests would hide the missing compiler
    try:
        no_compiler = {"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False}
        with inductor_config.patch(no_compiler), caplog.at_level(logging.WARNING):
            results, health = _generate(tiny, decode_attention="flex", compile_blocks=True)
    finally:
        torch._dynamo.reset()
    assert health["decode_attention"] == "sdpa"
    assert "torch.compile of flex_attention failed" in caplog.text
    assert "No working C++ compiler" in caplog.text and "decoding with SDPA" in caplog.text
    expected, _ = _generate(tiny)
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]


def test_a_shape_that_fails_to_compile_after_the_build_decodes_eagerly(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build's probe passed, then a new shape cannot compile (no C++ compiler by now): that
    step, and every later one, runs torch's reference with one warning, and rollout goes on."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("ARL_PRECOMPILE", "0")  # a kernel kept by an earlier run would load
    monkeypatch.setattr(flex, "_COMPILED", None)
    monkeypatch.setattr(flex, "_BROKEN", False)
    q, k, v = _decode_inputs(seed=3)
    mask = _mask(64)
    torch._dynamo.reset()
    try:
        no_compiler = {"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False}
        with inductor_config.patch(no_compiler), caplog.at_level(logging.WARNING):
            out = _flex(q, k, v, mask, _compiled_flex)
            again = _flex(q, k, v, mask, _compiled_flex)
    finally:
        torch._dynamo.reset()
    assert flex._BROKEN
    assert caplog.text.count("compiled flex_attention failed") == 1
    for got in (out, again):
        assert (got - _sdpa(q, k, v)).abs().max().item() < 1e-5


def test_the_build_probe_compiles_the_shape_the_first_decode_graph_runs(
    tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flex_decode`'s probe runs the smallest row bucket (two rows: one runs as two) at the
    warm-up's width on the engine's own mask, so the warm-up's first graph reuses what it
    compiled; each further row bucket is a shape of its own. Compilations are counted by a
    backend that runs the traced graph."""

    compiled: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiled.append(len(example_inputs))
        return gm.forward

    torch._dynamo.reset()
    counted = torch.compile(flex._flex_call, dynamic=False, backend=counting)
    monkeypatch.setattr(flex, "_COMPILED", counted)
    monkeypatch.setattr(flex, "_BROKEN", False)
    try:
        with HFEngine(tiny, max_batch_size=16, max_seq_len=2048, decode_attention="flex") as e:
            width = flex.warm_up_width(16, 2048, 193)
            e._flex = flex.flex_decode(e._model, e.device, 16, True, width)
            assert len(compiled) == 1
            e._cache.reserve(16, 193)  # as the warm-up sizes it
            with torch.no_grad():
                e._forward_decode(*e._decode_shape(1, 5))
                assert len(compiled) == 1
                e._forward_decode(*e._decode_shape(2, 5))
                assert len(compiled) == 1
                e._forward_decode(*e._decode_shape(3, 5))
                assert len(compiled) == 2
    finally:
        torch._dynamo.reset()


def test_a_compiler_failure_without_a_message_still_falls_back(
    tiny: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare ``AssertionError()`` from inside torch.compile (torch 2.11's experimental
    precompile loader raised one) gives the same warning and fallback as any compiler failure,
    at the build's probe and at a later shape, rather than an IndexError from its empty
    message."""

    def fails(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError()

    monkeypatch.setattr(flex, "_run_compiled", fails)
    monkeypatch.setattr(flex, "_BROKEN", False)
    with HFEngine(tiny, max_batch_size=4, max_seq_len=256) as e, caplog.at_level(logging.WARNING):
        assert flex.flex_decode(e._model, e.device, 4, True, 64) is None
    assert "torch.compile of flex_attention failed (AssertionError); decoding with SDPA" in (
        caplog.text
    )
    q, k, v = _decode_inputs(seed=4)
    out = _flex(q, k, v, _mask(64), _compiled_flex)
    assert flex._BROKEN
    assert "(AssertionError); eager from here" in caplog.text
    assert (out - _sdpa(q, k, v)).abs().max().item() < 1e-5
