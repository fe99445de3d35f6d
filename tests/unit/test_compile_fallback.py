"""Compiled decoder layers are on by default (CUDA): a model torch.compile fails on runs its
layers eagerly instead (`FSDPEngine.prime`). The two helpers it rests on, on CPU: telling a
compile failure from an error of the computation, and returning compiled modules to eager."""

from __future__ import annotations

import pytest
import torch

from arl.train.sharding import compile_failed, uncompile_layers


def _refusing_backend(gm, example_inputs):
    raise RuntimeError("this backend compiles nothing")


class _Block(torch.nn.Module):  # a decoder layer's stand-in (Dynamo skips torch.nn's own)
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.proj(x)) + x


def test_a_compile_failure_is_told_from_an_error_of_the_computation_and_undone():
    torch._dynamo.reset()
    model = torch.nn.Sequential(_Block(), torch.nn.ReLU(), _Block())
    for layer in (model[0], model[2]):
        layer.compile(backend=_refusing_backend)
    x = torch.ones(3, 4)
    with pytest.raises(Exception) as failed:
        model(x)
    assert compile_failed(failed.value)
    assert not compile_failed(RuntimeError("CUDA out of memory"))
    assert not compile_failed(ValueError("bad input"))

    assert uncompile_layers(model) == 2
    assert uncompile_layers(model) == 0
    torch.testing.assert_close(model(x), model[2](model[1](model[0].forward(x))))
    torch._dynamo.reset()


class _Layer(torch.nn.Module):  # a decoder layer's stand-in: weights of its own, one forward
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(8, 8, generator=g) / 3)
        self.norm = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = torch.nn.functional.silu(x @ self.w) * scale
        return x + self.norm * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def _run(layers: torch.nn.ModuleList, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    layers.zero_grad(set_to_none=False)  # gradients held, as a trainer's CUDA graphs hold them
    x = x * 1  # not a leaf: as the embeddings' output is, the same for every layer
    for layer in layers:
        x = layer(x, scale=0.5)
    x.pow(2).mean().backward()
    return x.detach(), [p.grad.clone() for p in layers.parameters()]


def test_compiled_forwards_are_kept_loaded_by_a_later_model_and_undone(tmp_path, monkeypatch):
    """`compile_forwards`: one compiled function for the layers of a class, outside their
    hooks; its forward and backward match eager; a later model (another run's) loads it from
    ARL_CACHE without tracing, gradients held or not when it was compiled; `uncompile_layers`
    returns the layers to eager."""
    from torch._dynamo.utils import counters

    from arl.train.sharding import compile_forwards, compiled_layers, kept_functions

    monkeypatch.setenv("ARL_CACHE", str(tmp_path))
    monkeypatch.delenv("ARL_PRECOMPILE", raising=False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    want = _run(torch.nn.ModuleList(_Layer(i) for i in range(3)), x)
    for loaded in (0, 1):
        counters.clear()
        layers = torch.nn.ModuleList(_Layer(i) for i in range(3))
        for p in layers.parameters():  # held before the first (compiling) pass
            p.grad = torch.zeros_like(p)
        compile_forwards(list(layers))
        assert compiled_layers(layers) == 3
        got = _run(layers, x)
        torch.testing.assert_close(got[0], want[0])
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b)
        kept = layers[0].forward.__func__
        assert (kept.loaded, kept.compiled) == (loaded, 1 - loaded)  # one for the three layers
        assert kept is layers[2].forward.__func__
        assert counters["stats"]["unique_graphs"] == 1 - loaded
        assert kept_functions(layers, torch.device("cpu")) == (loaded, 1 - loaded)
    assert uncompile_layers(layers) == 3 and compiled_layers(layers) == 0
    assert "forward" not in layers[0].__dict__
    torch.testing.assert_close(_run(layers, x)[0], want[0])


def test_a_transformers_decoder_layer_is_kept_and_loaded_with_the_same_gradients(
    tmp_path, monkeypatch
):
    """The real layer class: its forward behind transformers' deprecate_kwarg, and with the
    `kernels` package installed, a class made inside a function for its rotary embedding
    (named for torch by `arl.precompile`). Logits and gradients as eager; a later model loads
    the layers' compiled function without tracing."""
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    from arl.train.sharding import compile_forwards, compiled_layers
    from tests.support.tiny_model import make_tiny_model

    monkeypatch.setenv("ARL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ARL_PRECOMPILE", raising=False)
    path = make_tiny_model(tmp_path / "tiny")
    ids = torch.randint(0, 1000, (1, 23), generator=torch.Generator().manual_seed(0))

    def run(model: torch.nn.Module) -> tuple[torch.Tensor, list]:
        model.zero_grad()
        logits = model(input_ids=ids, use_cache=False).logits
        logits.pow(2).mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    want = run(LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa"))
    for loaded in (0, 1):
        counters.clear()
        model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa")
        compile_forwards(list(model.model.layers))
        assert compiled_layers(model) == 2
        got = run(model)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        kept = model.model.layers[0].forward.__func__
        assert (kept.loaded, kept.compiled) == (loaded, 1 - loaded)
        assert counters["stats"]["unique_graphs"] == 1 - loaded


def test_with_gradient_checkpointing_the_checkpointing_wrapper_stays(tmp_path, monkeypatch):
    """Gradient checkpointing on: where transformers checkpoints inside a wrapper of forward,
    that wrapper is compiled with it (plainly: torch cannot load a function that holds another),
    and the gradients are eager's."""
    from transformers import LlamaForCausalLM

    from arl.precompile import Precompiled
    from arl.train.sharding import compile_forwards
    from tests.support.tiny_model import make_tiny_model

    monkeypatch.setenv("ARL_CACHE", str(tmp_path / "cache"))
    path = make_tiny_model(tmp_path / "tiny")
    ids = torch.randint(0, 1000, (1, 19), generator=torch.Generator().manual_seed(1))

    def run(model: torch.nn.Module) -> list:
        model.zero_grad()
        model(input_ids=ids, use_cache=False).logits.pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    def load() -> torch.nn.Module:
        model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    want = run(load())
    model = load()
    compile_forwards(list(model.model.layers), checkpointing=True)
    compiled = model.model.layers[0].forward.__func__
    outer = type(model.model.layers[0]).forward.__code__.co_name  # transformers' version decides
    assert isinstance(compiled, Precompiled) is (outer != "forward_with_checkpointing")
    for a, b in zip(run(model), want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_engines_norm_and_mlp_blocks_are_kept_and_loaded(tmp_path, monkeypatch):
    """The hf engine's blocks where it decodes through the model's modules (LoRA, other
    families): one compiled forward per block class, compiled at the probe's shapes into
    ARL_CACHE; a later model loads them all and traces nothing; outputs as eager."""
    from torch._dynamo.utils import counters
    from transformers import LlamaForCausalLM

    from arl.engines.hf.attention import compile_norm_and_mlp
    from tests.support.tiny_model import make_tiny_model

    monkeypatch.setenv("ARL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ARL_PRECOMPILE", raising=False)
    path = make_tiny_model(tmp_path / "tiny")
    x = torch.randn(2, 3, 64)
    counts = []
    for _ in range(2):
        counters.clear()
        model = LlamaForCausalLM.from_pretrained(path).eval()
        layer = model.model.layers[0]
        with torch.no_grad():
            want = [layer.mlp(x), layer.input_layernorm(x)]
            assert compile_norm_and_mlp(model) == 7  # two MLPs, five norms
            got = [layer.mlp(x), layer.input_layernorm(x)]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        mlp = layer.mlp.forward.__func__
        assert mlp is model.model.layers[1].mlp.forward.__func__  # one per class
        counts.append((mlp.loaded > 0, mlp.compiled > 0, counters["stats"]["unique_graphs"] > 0))
    assert counts == [(False, True, True), (True, False, False)]
