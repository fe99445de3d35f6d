"""`arl.train.lora` on a tiny Llama in one process: the fp32 adapters a rank trains, their
bf16 compute, the reference with adapters bypassed and the merged state."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.engines.lora import is_lora_name
from arl.train.lora import (
    adapters_disabled,
    compute_adapters_in,
    inject_adapters,
    merged_state,
)

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"]}


def _tiny(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _randomise_b(model: torch.nn.Module) -> None:
    """B starts at zero (the adapter adds nothing); give it values so that it does."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)


IDS = torch.tensor([[3, 17, 99, 5, 64, 2, 8]])


def test_injected_adapters_are_the_only_trainable_params_and_fp32_on_a_bf16_base():
    model = _tiny(torch.bfloat16)
    params = inject_adapters(model, LORA)
    named = dict(model.named_parameters())
    assert {n for n, p in named.items() if p.requires_grad} == {n for n in named if is_lora_name(n)}
    assert len(params) == 2 * 7 * 2 and all(p.dtype == torch.float32 for p in params)
    assert {p.dtype for n, p in named.items() if not is_lora_name(n)} == {torch.bfloat16}


def test_no_matching_target_module_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match="target_modules"):
        inject_adapters(_tiny(), {**LORA, "target_modules": ["no_such_proj"]})


def test_bf16_compute_of_fp32_adapters_equals_bf16_adapters():
    ours = _tiny(torch.bfloat16)
    inject_adapters(ours, LORA)
    _randomise_b(ours)
    # peft's own path with adapters held in bf16: the numbers a bf16 adapter computes
    theirs = copy.deepcopy(ours)
    for name, p in theirs.named_parameters():
        if is_lora_name(name):
            p.data = p.data.bfloat16()
    assert compute_adapters_in(ours, torch.bfloat16) == 14
    out = ours(input_ids=IDS).logits
    ref = theirs(input_ids=IDS).logits
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    out.float().square().mean().backward()
    ref.float().square().mean().backward()
    mine, peft_ = dict(ours.named_parameters()), dict(theirs.named_parameters())
    for name, p in mine.items():
        if is_lora_name(name):
            assert p.grad.dtype == torch.float32, name
            assert torch.equal(p.grad.bfloat16(), peft_[name].grad), name
    assert any(p.grad.abs().max() > 0 for n, p in mine.items() if ".lora_A." in n)


def test_adapters_disabled_gives_the_base_and_restores_them():
    base = _tiny()
    model = copy.deepcopy(base)
    inject_adapters(model, LORA)
    _randomise_b(model)
    with torch.no_grad():
        want = base(input_ids=IDS).logits
        adapted = model(input_ids=IDS).logits
        with adapters_disabled(model) as m:
            got = m(input_ids=IDS).logits
        again = model(input_ids=IDS).logits
    assert torch.equal(got, want)
    assert not torch.allclose(adapted, want, atol=1e-3)  # the adapters do change the output
    assert torch.equal(again, adapted)
    assert all(p.requires_grad for n, p in model.named_parameters() if is_lora_name(n))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with adapters_disabled(base):
            pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_state_loads_into_the_plain_model_and_computes_the_adapted_output(dtype):
    model = _tiny(dtype)
    inject_adapters(model, LORA)
    _randomise_b(model)
    state = merged_state(model.state_dict().items(), LORA)
    plain = _tiny(dtype)
    assert set(state) == set(plain.state_dict())
    assert {t.dtype for t in state.values()} == {dtype}
    plain.load_state_dict(state)
    with torch.no_grad():
        if dtype == torch.float32:
            assert torch.allclose(
                plain(input_ids=IDS).logits, model(input_ids=IDS).logits, atol=1e-5
            )
        # W + (alpha / r) B A, computed in fp32
        sd = model.state_dict()
        pre = "model.layers.1.mlp.down_proj"
        a, b = sd[f"{pre}.lora_A.default.weight"], sd[f"{pre}.lora_B.default.weight"]
        w = sd[f"{pre}.base_layer.weight"].float() + 2.0 * (b.float() @ a.float())
        assert torch.equal(state[f"{pre}.weight"], w.to(dtype))


def test_merged_state_refuses_half_an_adapter():
    model = _tiny()
    inject_adapters(model, LORA)
    named = [(n, t) for n, t in model.state_dict().items() if "q_proj.lora_B" not in n]
    with pytest.raises(ValueError, match="both A and B"):
        merged_state(named, LORA)
