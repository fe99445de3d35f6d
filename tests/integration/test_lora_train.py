"""LoRA training ranks in real processes (gloo, CPU) against peft alone on the same batch.

One rank and two (FSDP2) each run a `TrainWorker` with ``actor.lora`` on a tiny Llama: the
gradients of one pass, then two PPO updates, the KL reference (the base, its adapters bypassed),
what a weight sync would move, and an export with the merged model. The test process repeats
the two updates with `peft.get_peft_model` on the same base, the same initial A and B, the same
batch (each rank's share, with the advantages the ranks computed) and `ppo_loss` with the
engine's settings, then compares. Each rank runs `rank_main` in its own Python subprocess.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.integration.test_fsdp_equivalence import (
    DP2_SHARDS,
    make_shards,
    run_rank_from_argv,
    run_ranks,
)

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"]}
ACTOR = {
    "lr": 1e-2,
    "kl_ctl": 0.1,
    "grad_clip": 0.1,  # below the first step's norm: the clip is part of what is compared
    "max_tokens_per_mb": 4096,
    "lora": LORA,
}
N_UPDATES = 2
PROBE = list(range(3, 40))
BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "prox_logp", "advantages")


def _full(named) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in named}


def rank_main(spec: dict) -> None:
    """One LoRA rank (on CPU, or with ``spec["cuda"]`` on GPU ``rank``): writes the initial and
    updated adapters, its batch share, the first pass's gradients, the base after the updates,
    the sync views and the export."""
    from arl.algo.packing import concat_shards
    from arl.engines.hf import checksum_named_tensors
    from arl.engines.lora import is_lora_name
    from arl.node.train import TrainWorker
    from arl.train.sharding import full_tensor

    torch.set_num_threads(1)
    rank, out = spec["rank"], Path(spec["out"])
    w = TrainWorker(
        spec["actor"],
        rank=rank,
        world_size=spec["world_size"],
        init_method=spec["init_method"],
        device=f"cuda:{rank}" if spec.get("cuda") else "cpu",
        seed=spec["seed"],
    )
    eng = w.engine
    result: dict = {"ref_is_copy": eng.ref is not None}
    init = _full(eng.state_dict_for_sync())
    shards = make_shards(spec["data_seed"])
    batch = concat_shards([shards[i] for i in spec["shards_of_rank"][rank]])
    batch["prox_logp"] = eng.compute_logp(batch)
    batch["ref_logp"] = eng.compute_ref_logp(batch)
    # B = 0: the policy is its base, so the reference (adapters bypassed) gives the same numbers
    result["ref_equals_policy_at_start"] = bool(torch.equal(batch["ref_logp"], batch["prox_logp"]))
    batch = eng.compute_advantages(batch)
    save_file({k: batch[k].contiguous() for k in BATCH_KEYS}, str(out / f"batch{rank}.safetensors"))

    eng.zero_grad()
    eng.accumulate_gradients(batch)
    grads = _full(eng.gradients())
    eng.zero_grad()
    result["stats"] = [eng.ppo_update(batch) for _ in range(N_UPDATES)]
    result["optimizer_state"] = sorted(
        name for name, p in eng.model.named_parameters() if p in eng.optimizer.state
    )
    result["trainable"] = sorted(n for n, p in eng.model.named_parameters() if p.requires_grad)
    after = _full(eng.state_dict_for_sync())
    base = {
        n: full_tensor(t).detach().cpu().contiguous()
        for n, t in eng.model.state_dict().items()
        if not is_lora_name(n)
    }
    # the reference after the updates: still the base, whatever the adapters learned
    ref_after = eng.compute_ref_logp(batch)
    policy_after = eng.compute_logp(batch)
    result["score"] = w.score(PROBE)  # what weight_sync.verify compares with the engines'

    # what a weight sync moves, in the engines' dtype
    w.set_sync_dtype("bfloat16")
    specs = w.weight_specs()
    synced = [(n, t.clone()) for n, t in w.full_state()]
    sources = w.weight_sources()
    result["specs"] = [[n, list(s), str(d)] for n, s, d in specs]
    result["synced"] = [[n, str(t.dtype)] for n, t in synced]
    result["sources"] = None if sources is None else [n for n, _ in sources]
    result["tied"] = w.tied_weights()
    checksum = w.weights_checksum()
    result["checksum_matches"] = rank != 0 or checksum == checksum_named_tensors(synced)
    w.set_sync_dtype(None)
    w.save_hf(str(out / "hf"), merged=True)

    if rank == 0:
        save_file(init, str(out / "init.safetensors"))
        save_file(after, str(out / "after.safetensors"))
        save_file(grads, str(out / "grads.safetensors"))
        save_file(base, str(out / "base.safetensors"))
        save_file({k: v.float().cpu() for k, v in synced}, str(out / "synced.safetensors"))
    save_file(
        {"ref": ref_after.contiguous(), "policy": policy_after.contiguous()},
        str(out / f"logp{rank}.safetensors"),
    )
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    w.close()


def _run(tmp: Path, name: str, world: int, model: Path, shards_of_rank) -> tuple[Path, list]:
    spec = {
        "actor": {**ACTOR, "path": str(model)},
        "data_seed": 7,
        "seed": 3,
        "shards_of_rank": shards_of_rank,
    }
    results = run_ranks(spec, world, tmp / name, script=__file__)
    return tmp / name, results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A one-rank and a two-rank LoRA run of the same batch, once per module."""
    from tests.integration.test_fsdp_equivalence import save_tiny_llama

    tmp = tmp_path_factory.mktemp("lora")
    model = save_tiny_llama(tmp / "model", seed=2)
    dp1 = _run(tmp, "dp1", 1, model, [[0, 1, 2, 3]])
    dp2 = _run(tmp, "dp2", 2, model, DP2_SHARDS)
    return {"dp1": dp1, "dp2": dp2, "model": model}


def _logp(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, L] log-prob of token t at position t (0 at t = 0), as the engine lays it out."""
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def _peft_reference(model_dir: Path, init: dict, parts: list[dict]) -> tuple[dict, dict]:
    """Gradients of the first pass and adapters after `N_UPDATES` steps of peft alone: the
    engine's loss over every rank's share (divided by the total token count), clip, AdamW."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from arl.algo.losses import ppo_loss
    from arl.config import ActorConfig, converter
    from arl.engines.lora import lora_config

    cfg = converter.structure({**ACTOR, "path": str(model_dir)}, ActorConfig)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, lora_config(LORA))
    named = dict(peft_model.base_model.model.named_parameters())
    with torch.no_grad():
        for name, t in init.items():
            named[name].copy_(t)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    assert len(params) == len(init)
    opt = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    n_tokens = float(sum(p["loss_mask"].sum() for p in parts))
    first_grads = None
    for _ in range(N_UPDATES):
        for part in parts:
            loss, _ = ppo_loss(
                _logp(peft_model, part),
                part["prox_logp"],
                part["advantages"],
                part["loss_mask"],
                eps_clip=cfg.eps_clip,
                eps_clip_higher=cfg.eps_clip_higher,
                c_clip=cfg.c_clip,
                behave_logp=part["logprobs"],
                imp_weight_cap=cfg.behav_imp_weight_cap,
                rejection=cfg.rejection,
                n_tokens=n_tokens,
            )
            loss.backward()
        if first_grads is None:
            first_grads = {n: named[n].grad.clone() for n in init}
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad()
    return first_grads, {n: named[n].detach().clone() for n in init}


@pytest.mark.parametrize("run", ["dp1", "dp2"])
def test_lora_update_equals_peft_alone(runs, run):
    out, results = runs[run]
    init = load_file(str(out / "init.safetensors"))
    parts = [load_file(str(out / f"batch{r}.safetensors")) for r in range(len(results))]
    ref_grads, ref_after = _peft_reference(runs["model"], init, parts)
    grads = load_file(str(out / "grads.safetensors"))
    after = load_file(str(out / "after.safetensors"))
    assert set(grads) == set(after) == set(init) == set(ref_after)
    assert len(init) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
    # B = 0 at the start: A gets no gradient, B does
    assert max(ref_grads[n].abs().max().item() for n in init if ".lora_B." in n) > 1e-3
    for n in init:
        scale = max(ref_grads[n].abs().max().item(), 1e-6)
        assert torch.allclose(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5 * scale), n
        # Adam's second step divides by sqrt(v): entries with gradients near eps amplify
        # rounding (measured: <= 3e-6 against steps of 7e-3 to 2e-2)
        assert torch.allclose(after[n], ref_after[n], rtol=0, atol=1e-5), n
    # not vacuous: the steps moved A and B well beyond the tolerance
    for part in (".lora_A.", ".lora_B."):
        moved = max((after[n] - init[n]).abs().max().item() for n in init if part in n)
        assert moved > 1e-3, part
    assert results[0]["stats"][0]["grad_norm"] > ACTOR["grad_clip"]  # the clip acted


def test_dp1_and_dp2_agree(runs):
    (d1, (r1,)), (d2, (r2a, r2b)) = runs["dp1"], runs["dp2"]
    a1, a2 = load_file(str(d1 / "after.safetensors")), load_file(str(d2 / "after.safetensors"))
    for n in a1:
        assert torch.allclose(a1[n], a2[n], rtol=0, atol=1e-5), n
    for s1, s2 in zip(r1["stats"], r2a["stats"], strict=True):
        assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)
        assert s1["grad_norm"] == pytest.approx(s2["grad_norm"], rel=1e-5)
    assert r2a["stats"] == r2b["stats"]


@pytest.mark.parametrize("run", ["dp1", "dp2"])
def test_only_adapters_train_and_the_base_stays(runs, run):
    from arl.engines.lora import is_lora_name

    out, results = runs[run]
    base = load_file(str(out / "base.safetensors"))
    original = load_file(str(runs["model"] / "model.safetensors"))
    assert {n.replace(".base_layer.", ".") for n in base} == set(original)
    for n, t in base.items():
        assert torch.equal(t, original[n.replace(".base_layer.", ".")]), n
    for r in results:
        assert r["optimizer_state"] == r["trainable"]
        assert len(r["trainable"]) == 28 and all(is_lora_name(n) for n in r["trainable"])


@pytest.mark.parametrize("run", ["dp1", "dp2"])
def test_reference_is_the_base_without_a_second_copy(runs, run):
    from transformers import AutoModelForCausalLM

    out, results = runs[run]
    base = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32)
    for r, res in enumerate(results):
        assert not res["ref_is_copy"] and res["ref_equals_policy_at_start"]
        part = load_file(str(out / f"batch{r}.safetensors"))
        got = load_file(str(out / f"logp{r}.safetensors"))
        mask = part["loss_mask"].bool()  # the positions the engine's log-probs are for
        with torch.no_grad():
            want = _logp(base, part)
        assert torch.allclose(got["ref"][mask], want[mask], atol=1e-5)
        # and the trained policy differs from it
        assert (got["policy"][mask] - want[mask]).abs().max() > 1e-3


@pytest.mark.parametrize("run", ["dp1", "dp2"])
def test_sync_moves_the_adapter_only(runs, run):
    out, results = runs[run]
    after = load_file(str(out / "after.safetensors"))
    for r, res in enumerate(results):
        names = [n for n, _, _ in res["specs"]]
        assert sorted(names) == sorted(after) and len(names) == len(set(names))
        assert {d for _, _, d in res["specs"]} == {"torch.bfloat16"}
        assert [list(after[n].shape) for n in names] == [s for _, s, _ in res["specs"]]
        assert res["tied"] == {}
        assert res["checksum_matches"]
        if r == 0:
            assert res["synced"] == [[n, "torch.bfloat16"] for n in names]
        assert res["sources"] == (names if run == "dp1" else None)
    synced = load_file(str(out / "synced.safetensors"))
    for n, t in after.items():
        assert torch.equal(synced[n], t.to(torch.bfloat16).float()), n


@pytest.mark.parametrize("run", ["dp1", "dp2"])
def test_export_round_trips_through_peft_and_the_merged_model(runs, run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, results = runs[run]
    hf = out / "hf"
    assert (hf / "adapter_config.json").is_file() and (hf / "tokenizer_config.json").is_file()
    assert json.loads((hf / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        runs["model"]
    )
    base = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, hf).eval()
    merged = AutoModelForCausalLM.from_pretrained(hf / "merged", dtype=torch.float32).eval()
    assert (hf / "merged" / "tokenizer_config.json").is_file()
    for r in range(len(results)):
        part = load_file(str(out / f"batch{r}.safetensors"))
        trained = load_file(str(out / f"logp{r}.safetensors"))["policy"]
        mask = part["loss_mask"].bool()  # the positions the engine's log-probs are for
        with torch.no_grad():
            via_peft, via_merged = _logp(adapted, part), _logp(merged, part)
        assert torch.allclose(via_peft[mask], trained[mask], atol=1e-5)
        assert torch.allclose(via_merged[mask], trained[mask], atol=1e-4)
    probe = torch.tensor([PROBE])
    with torch.no_grad():
        want = _logp(adapted, {"input_ids": probe, "attention_mask": torch.ones_like(probe)})
    assert torch.allclose(torch.tensor(results[0]["score"]), want[0, 1:], atol=1e-5)


def run_bf16_dp2(tmp: Path, cuda: bool = False) -> None:
    """Two LoRA ranks with a bf16 base (FSDP2's mixed precision: fp32 adapters gathered in
    bf16, gradients reduced in fp32, the frozen bf16 base gathered as it is) on the same batch
    as the fp32 runs; asserts what must hold in any dtype. ``cuda``: GPUs 0 and 1 (NCCL)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.integration.test_fsdp_equivalence import save_tiny_llama

    model = save_tiny_llama(tmp / "model", seed=2)
    actor = {**ACTOR, "path": str(model), "dtype": "bfloat16"}
    spec = {"actor": actor, "data_seed": 7, "seed": 3, "shards_of_rank": DP2_SHARDS}
    out = tmp / "run"
    results = run_ranks({**spec, "cuda": cuda}, 2, out, script=__file__)
    for r in results:
        assert r["optimizer_state"] == r["trainable"] and len(r["trainable"]) == 28
        assert r["ref_equals_policy_at_start"] and not r["ref_is_copy"]
        assert sorted(n for n, _, _ in r["specs"]) == r["trainable"]
        assert r["tied"] == {} and r["checksum_matches"]
        for st in r["stats"]:
            assert st["skipped"] == 0.0 and 0 < st["grad_norm"] < float("inf")
    assert results[0]["stats"] == results[1]["stats"]
    init = load_file(str(out / "init.safetensors"))
    after = load_file(str(out / "after.safetensors"))
    assert max((after[n] - init[n]).abs().max().item() for n in init) > 1e-3
    original = load_file(str(model / "model.safetensors"))
    for n, t in load_file(str(out / "base.safetensors")).items():
        assert t.dtype == torch.bfloat16  # the frozen base in the compute dtype, unchanged
        assert torch.equal(t, original[n.replace(".base_layer.", ".")].bfloat16()), n
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    PeftModel.from_pretrained(base, out / "hf")
    merged = AutoModelForCausalLM.from_pretrained(out / "hf" / "merged")
    assert merged.dtype == torch.bfloat16  # saved in the base's dtype


def test_lora_fsdp_with_a_bf16_base(tmp_path):
    run_bf16_dp2(tmp_path)


if __name__ == "__main__":
    run_rank_from_argv(rank_main)
