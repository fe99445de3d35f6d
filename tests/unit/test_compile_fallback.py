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
