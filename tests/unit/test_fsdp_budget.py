"""Micro-batch token budgets and the layout of one FSDP rank on CPU (gloo, world size 1)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.config import ActorConfig, ConfigError
from arl.train.fsdp import FSDPEngine
from arl.train.logp import resolve_layout
from arl.train.sharding import full_tensor

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("m")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    # A model folder is refused without a tokenizer (arl.engines.model.validate_model_dir).
    (path / "tokenizer_config.json").write_text("{}")
    return str(path)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_defaults_to_padded_rows_and_an_8192_token_budget(model_dir):
    eng = FSDPEngine(
        ActorConfig(path=model_dir), rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_port()}"
    )
    try:
        assert eng.layout == "padded"  # no varlen kernel on CPU: packing would need a dense mask
        am = torch.arange(9000)[None] < torch.tensor([[9000], [10]])
        batch = {"input_ids": torch.zeros_like(am, dtype=torch.long), "attention_mask": am}
        assert eng._token_budget(batch) == 9000  # never below the longest row
        assert eng._token_budget({k: v[1:, :10] for k, v in batch.items()}) == 8192
        eng.cfg.max_tokens_per_mb = 512
        assert eng._token_budget(batch) == 512  # an explicit budget is kept as given
    finally:
        eng.destroy()


def test_layout_resolution():
    assert resolve_layout("auto", torch.device("cpu")) == "padded"
    assert resolve_layout("packed", torch.device("cpu")) == "packed"
    with pytest.raises(ConfigError, match="actor.layout must be auto, packed or padded"):
        resolve_layout("dense", torch.device("cpu"))


@pytest.mark.parametrize(
    ("overrides", "modes"),
    [
        ({}, [True]),  # the update's forward gives the proximal log-probs: no pass without grad
        ({"prox_logp": "pass"}, [True, False]),
        ({"kl_ctl": 0.1}, [True, False]),  # the reference's log-probs: a pass without grad
    ],
)
def test_cpu_warm_up_runs_one_tiny_pass_and_leaves_no_gradients(model_dir, overrides, modes):
    eng = FSDPEngine(
        ActorConfig(path=model_dir, **overrides),
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{_port()}",
    )
    passes: list[tuple[int, bool]] = []
    hook = eng.model.register_forward_pre_hook(
        lambda _m, args, kwargs: passes.append(
            (kwargs["input_ids"].numel(), torch.is_grad_enabled())
        ),
        with_kwargs=True,
    )
    try:
        before = [full_tensor(p.detach()).clone() for p in eng.model.parameters()]
        assert eng.prime_s == 0.0  # nothing to prime on CPU: no passes when it was built
        assert eng.warm_up() == eng.warm_up_s > 0
        # Nothing compiles on CPU: the warm-up's passes are only compute that the first rollout
        # would lose, so they are one tiny batch (with backward, and without it only where the
        # run makes such passes), not real shapes.
        assert [grad for _, grad in passes] == modes
        assert sum(n for n, _ in passes) <= 8 * len(modes)
        assert all(p.grad is None for p in eng.model.parameters())
        after = [full_tensor(p.detach()) for p in eng.model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    finally:
        hook.remove()
        eng.destroy()


def test_a_train_process_hides_torchs_non_leaf_grad_warning_from_its_guards_and_nothing_else():
    """The train rank's modules filter the one warning torch's guard code raises (about its own
    read of a non-leaf tensor's ``.grad``); the same text from elsewhere, and another warning
    from the guards, still show. A fresh process, as a train node imports them."""
    script = textwrap.dedent(
        """
        import warnings
        import arl.train.fsdp  # what a train node imports

        text = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed."
        for message, module in [
            (text, "torch._dynamo.guards"),
            (text + " (elsewhere)", "my.module"),
            ("another warning", "torch._dynamo.guards"),
        ]:
            warnings.warn_explicit(message, UserWarning, "f.py", 1, module=module, registry={})
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    shown = [line for line in out.stderr.splitlines() if "UserWarning" in line]
    assert len(shown) == 2, out.stderr
    assert "(elsewhere)" in shown[0] and "another warning" in shown[1], shown
