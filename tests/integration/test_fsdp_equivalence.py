"""FSDP2 training ranks in real processes (gloo, CPU): dp=1 and dp=2 give the same update.

Each rank runs `rank_main(spec)` in its own Python subprocess (``python THIS_FILE SPEC.json``)
and writes its results as safetensors and JSON under ``spec["out"]``; the tests compare those.
`rank_main` is importable so that node daemons can run the same per-rank work later.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
VOCAB = 256
N_SHARDS, GROUP = 4, 4
# rank 1 gets far fewer tokens than rank 0, so the ranks' own micro-batch counts differ and the
# equal-count padding (empty micro-batches) is exercised
DP2_SHARDS = [[0, 1, 2], [3]]


def make_shards(seed: int) -> list[dict[str, torch.Tensor]]:
    """Deterministic prompt groups in the rollout format, with mixed rewards in each group."""
    g = torch.Generator().manual_seed(seed)
    shards = []
    for _ in range(N_SHARDS):
        plen = int(torch.randint(3, 7, (1,), generator=g))
        clens = torch.randint(2, 11, (GROUP,), generator=g).tolist()
        width = plen + max(clens)
        am = torch.tensor([[t < plen + c for t in range(width)] for c in clens])
        lm = am.clone()
        lm[:, :plen] = False
        ids = torch.randint(1, VOCAB, (GROUP, width), generator=g) * am
        # near the log-prob of a random tiny model (-ln 256), so importance weights stay near 1
        behave = -math.log(VOCAB) + 0.1 * torch.randn(GROUP, width, generator=g)
        shards.append(
            {
                "input_ids": ids,
                "attention_mask": am,
                "loss_mask": lm,
                "logprobs": torch.where(lm, behave, 0.0).float(),
                "versions": torch.where(lm, 0, -1).int(),
                "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0])[torch.randperm(GROUP, generator=g)],
            }
        )
    return shards


def four_bin_budget(shards: list[dict[str, torch.Tensor]]) -> int:
    """The largest token budget that splits the whole batch into exactly 4 FFD micro-batches."""
    from arl.algo.packing import concat_shards, ffd_bins, seq_lengths

    lens = seq_lengths(concat_shards(shards))
    for budget in range(sum(lens), max(lens) - 1, -1):
        if len(ffd_bins(lens, budget)) == 4:
            return budget
    raise AssertionError(f"no budget gives 4 micro-batches for lengths {lens}")


def rank_main(spec: dict) -> None:
    """One training rank: log-probs, advantages, gradients and one PPO update.

    Writes ``rank{r}.json`` (update statistics) and, on rank 0, ``grads_{budget}.safetensors`` and
    ``weights.safetensors`` (the full updated weights) under ``spec["out"]``.
    """
    from arl.algo.packing import concat_shards
    from arl.config import ActorConfig
    from arl.train.fsdp import FSDPEngine

    torch.set_num_threads(1)
    rank, out = spec["rank"], Path(spec["out"])
    eng = FSDPEngine(
        ActorConfig(**spec["actor"]),
        rank=rank,
        world_size=spec["world_size"],
        init_method=spec["init_method"],
        seed=spec.get("seed", 1),
    )
    shards = make_shards(spec["data_seed"])
    batch = concat_shards([shards[i] for i in spec["shards_of_rank"][rank]])
    if spec.get("prox_pass") or not eng.cfg.prox_in_update():  # as the trainer decides
        batch["prox_logp"] = eng.compute_logp(batch)
    if eng.cfg.kl_ctl > 0:
        batch["ref_logp"] = eng.compute_ref_logp(batch)
    batch = eng.compute_advantages(batch)
    result: dict = {"n_micro_batches": {}}

    for budget in spec.get("grad_budgets", []):
        eng.zero_grad()
        stats = eng.accumulate_gradients(batch, max_tokens_per_mb=budget)
        result["n_micro_batches"][str(budget)] = stats["n_micro_batches"]
        grads = {k: v.contiguous() for k, v in eng.gradients()}
        if rank == 0:
            save_file(grads, str(out / f"grads_{budget}.safetensors"))
    eng.zero_grad()

    result["stats"] = eng.ppo_update(batch)
    result["step"] = eng.get_step()
    weights = {k: v.contiguous() for k, v in eng.state_dict_for_sync()}
    if rank == 0:
        save_file(weights, str(out / "weights.safetensors"))
    if spec.get("save_hf"):
        eng.save_hf(out / "hf")
    if spec.get("nan_step"):
        bad = {**batch, "advantages": torch.full_like(batch["advantages"], math.nan)}
        result["nan_stats"] = eng.ppo_update(bad)
        after = dict(eng.state_dict_for_sync())
        result["nan_unchanged"] = all(torch.equal(after[k], weights[k]) for k in after)
        result["step_after_nan"] = eng.get_step()
        inf = {**batch, "advantages": torch.full_like(batch["advantages"], math.inf)}
        result["inf_stats"] = eng.ppo_update(inf)
        after = dict(eng.state_dict_for_sync())
        result["inf_unchanged"] = all(torch.equal(after[k], weights[k]) for k in after)
        result["step_after_inf"] = eng.get_step()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    eng.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    base: dict, world_size: int, out: Path, timeout: float = 300.0, script: str = __file__
) -> list[dict]:
    """Start ``world_size`` rank processes of ``script`` (a file whose ``__main__`` runs one
    rank on a spec file, this one's by default) on ``base``; wait; return each rank's JSON
    result (``rank{r}.json`` under ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    try:
        for rank in range(world_size):
            spec = {**base, "rank": rank, "world_size": world_size, "init_method": init}
            spec["out"] = str(out)
            path = out / f"spec{rank}.json"
            path.write_text(json.dumps(spec))
            log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, script, str(path)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    log,
                )
            )
        for rank, (p, _) in enumerate(procs):
            rc = p.wait(timeout=timeout)
            if rc != 0:
                tail = (out / f"rank{rank}.log").read_text()[-3000:]
                done = (out / f"rank{rank}.json").exists()
                raise AssertionError(
                    f"rank {rank} exited with {rc} ({'after' if done else 'before'} writing its "
                    f"result):\n{tail}"
                )
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def save_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 64, vocab 256) saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "tokenizer_config.json").write_text("{}")  # model folders must carry a tokenizer
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """dp=1 and dp=2 runs of the same batch (with the KL reference on), run once per module."""
    tmp = tmp_path_factory.mktemp("fsdp")
    model = save_tiny_llama(tmp / "model")
    shards = make_shards(7)
    budget4 = four_bin_budget(shards)
    actor = {
        "path": str(model),
        "lr": 1e-3,
        "kl_ctl": 0.1,
        "kl_estimator": "k3",
        "rejection": "token_mask",
        "max_tokens_per_mb": 4096,
    }
    base = {
        "actor": actor,
        "data_seed": 7,
        "grad_budgets": [4096, budget4],
    }
    dp1 = run_ranks({**base, "shards_of_rank": [[0, 1, 2, 3]], "nan_step": True}, 1, tmp / "dp1")
    dp2 = run_ranks({**base, "shards_of_rank": DP2_SHARDS, "save_hf": True}, 2, tmp / "dp2")
    return {
        "dp1": (tmp / "dp1", dp1),
        "dp2": (tmp / "dp2", dp2),
        "budget4": budget4,
        "model": model,
    }


def test_dp1_and_dp2_give_the_same_updated_weights(runs):
    d1, (r1,) = runs["dp1"]
    d2, (r2a, r2b) = runs["dp2"]
    w1 = load_file(str(d1 / "weights.safetensors"))
    w2 = load_file(str(d2 / "weights.safetensors"))
    w0 = load_file(str(runs["model"] / "model.safetensors"))
    assert set(w1) == set(w2)
    for k in w1:
        assert torch.allclose(w1[k], w2[k], rtol=0, atol=2e-6), k
    # not vacuous: the step moved the weights well beyond the tolerance
    assert max((w1[k] - w0[k]).abs().max().item() for k in w0) > 5e-4
    assert r1["stats"]["loss"] == pytest.approx(r2a["stats"]["loss"], abs=1e-6)
    assert r2a["stats"] == r2b["stats"]  # every rank reports the global numbers
    assert r1["stats"]["n_tokens"] == r2a["stats"]["n_tokens"]
    assert r1["stats"]["kl"] == pytest.approx(r2a["stats"]["kl"], abs=1e-6)
    assert r1["stats"]["grad_norm"] == pytest.approx(r2a["stats"]["grad_norm"], rel=1e-5)
    assert r1["step"] == r2a["step"] == 1


def test_one_or_four_micro_batches_give_the_same_gradients(runs):
    d1, (r1,) = runs["dp1"]
    d2, (r2a, r2b) = runs["dp2"]
    b4 = runs["budget4"]
    assert r1["n_micro_batches"] == {"4096": 1.0, str(b4): 4.0}
    # the ranks agreed on one count although rank 1 holds a quarter of the tokens
    assert r2a["n_micro_batches"] == r2b["n_micro_batches"]
    g_one = load_file(str(d1 / "grads_4096.safetensors"))
    g_four = load_file(str(d1 / f"grads_{b4}.safetensors"))
    g_dp2 = load_file(str(d2 / f"grads_{b4}.safetensors"))
    for k in g_one:
        scale = g_one[k].abs().max().item()
        assert scale > 0, k
        assert torch.allclose(g_one[k], g_four[k], rtol=1e-5, atol=1e-6 * scale), k
        assert torch.allclose(g_one[k], g_dp2[k], rtol=1e-5, atol=1e-6 * scale), k


def test_non_finite_gradient_skips_the_step(runs):
    _, (r1,) = runs["dp1"]
    assert r1["nan_stats"]["skipped"] == 1.0
    assert math.isnan(r1["nan_stats"]["grad_norm"])
    assert r1["nan_unchanged"]
    assert r1["step_after_nan"] == 1
    # An inf loss (inf advantages) is skipped the same way: weights and step count unchanged.
    assert not math.isfinite(r1["inf_stats"]["loss"])
    assert r1["inf_stats"]["skipped"] == 1.0 and not math.isfinite(r1["inf_stats"]["grad_norm"])
    assert r1["inf_unchanged"]
    assert r1["step_after_inf"] == 1


def test_save_hf_reloads_with_the_updated_weights(runs):
    from transformers import AutoModelForCausalLM

    d2, _ = runs["dp2"]
    model = AutoModelForCausalLM.from_pretrained(d2 / "hf")
    weights = load_file(str(d2 / "weights.safetensors"))
    state = model.state_dict()
    for k, v in weights.items():
        assert torch.equal(state[k], v), k


def test_deterministic_step(tmp_path):
    """Fixed seeds, one GRPO update of the tiny model with the default loss settings.

    A change that moves these numbers must say why in its commit message (a new formula, a
    different reduction order, a new transformers init, ...); a refactor must leave them alone.
    The proximal log-probs come from the update's forward (the default ``prox_logp=auto``);
    the separate pass gave the same numbers.
    Recorded with torch 2.13.0 (CPU) and transformers 5.24.0.
    """
    model = save_tiny_llama(tmp_path / "model", seed=0)
    actor = {"path": str(model), "lr": 1e-3}
    (r,) = run_ranks(
        {"actor": actor, "data_seed": 3, "shards_of_rank": [[0, 1, 2, 3]]}, 1, tmp_path / "run"
    )
    st = r["stats"]
    assert st["n_tokens"] == 79.0
    assert st["loss"] == pytest.approx(0.006327033042907715, rel=1e-5, abs=1e-7)
    assert st["grad_norm"] == pytest.approx(1.8276162147521973, rel=1e-5)


def test_proximal_log_probs_from_the_update_equal_a_separate_pass(tmp_path):
    """One minibatch, no KL: the update's detached log-probs stand in for compute_logp's."""
    model = save_tiny_llama(tmp_path / "model", seed=0)
    # Rejection on and a tight cap: the importance weights exp(prox - behave) shape the loss.
    actor = {"path": str(model), "lr": 1e-3, "rejection": "token_mask", "behav_imp_weight_cap": 1.2}
    base = {"actor": actor, "data_seed": 5, "shards_of_rank": [[0, 1, 2, 3]]}
    (by_pass,) = run_ranks({**base, "prox_pass": True}, 1, tmp_path / "pass")
    (in_update,) = run_ranks(base, 1, tmp_path / "update")
    a, b = by_pass["stats"], in_update["stats"]
    assert 0 < a["rejected_frac"] < 1 and a["imp_weight_mean"] != 1.0  # not vacuous
    for k in ("loss", "grad_norm", "imp_weight_mean", "rejected_frac", "clip_frac", "n_tokens"):
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    w_pass = load_file(str(tmp_path / "pass" / "weights.safetensors"))
    w_upd = load_file(str(tmp_path / "update" / "weights.safetensors"))
    for k in w_pass:
        assert torch.allclose(w_pass[k], w_upd[k], rtol=0, atol=1e-6), k


def test_update_without_proximal_log_probs_names_the_pass_it_needs(tmp_path):
    """With two minibatches the second starts from moved weights: the pass is required."""
    from arl.algo.packing import concat_shards
    from arl.config import ActorConfig
    from arl.train.fsdp import FSDPEngine

    model = save_tiny_llama(tmp_path / "model", seed=0)
    cfg = ActorConfig(path=str(model), lr=1e-3, ppo_n_minibatches=2)
    assert not cfg.prox_in_update() and ActorConfig(path=str(model)).prox_in_update()
    eng = FSDPEngine(cfg, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    try:
        batch = eng.compute_advantages(concat_shards(make_shards(5)))
        with pytest.raises(KeyError, match=r"prox_logp.*ppo_n_minibatches=2"):
            eng.ppo_update(batch)
        assert eng.get_step() == 0
    finally:
        eng.destroy()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"rejection": "token_mask", "use_decoupled_loss": False}, "use_decoupled_loss"),
        ({"rejection": "seq_mask", "behav_imp_weight_cap": None}, "behav_imp_weight_cap"),
        ({"lr_scheduler": "cosine"}, "total_steps"),
        ({"lora": {"rank": -1}}, "actor.lora needs rank >= 0"),
        ({"lora": {"rank": 8, "dropout": 1.0}}, "dropout < 1"),
    ],
)
def test_bad_settings_fail_before_any_process_group(overrides, match):
    from arl.config import ActorConfig, ConfigError, converter
    from arl.train.fsdp import FSDPEngine

    cfg = converter.structure(overrides, ActorConfig)
    with pytest.raises(ConfigError, match=match):
        FSDPEngine(cfg, rank=0, world_size=1, init_method="tcp://unused:1")
    assert not torch.distributed.is_initialized()


def run_rank_from_argv(main) -> None:
    """A rank script's entry: ``main(spec)`` on the spec file named in argv, then leave as
    arl-node does (`os._exit` once everything is written), without the interpreter's
    finalization: there gloo's C++ worker threads may still be torn down beside Python's, which
    aborted a rank that had finished its work ("terminate called without an active exception")
    on a loaded 2-core CI machine."""
    main(json.loads(Path(sys.argv[1]).read_text()))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run_rank_from_argv(rank_main)
