"""GRPO on generated multiplication, "What is a * b?" (a: 10-99, b: 2-9), answer in \\boxed{}.

The same machinery as recipes/gsm8k.py on a task where SmolLM2-135M-Instruct starts at 11-16%
sampled accuracy and 22-31% greedy (a dense enough reward for GRPO to show learning on a small
model). Rewards by math-verify; held-out pairs are never trained on.

Without a GPU in the placement plan the launcher applies `cpu_preset`, a run of a few minutes
on two cores (the README's quick start); on GPUs the recipe runs as `make_config` writes it.

    python -m arl.launch recipes/arith.py
    python -m arl.launch recipes/arith.py cluster.n_gpus=1 experiment.total_train_steps=100
"""

from arl.config import Config


def make_config() -> Config:
    """Arith GRPO defaults; change any of them with key=value on the command line."""
    cfg = Config()
    cfg.experiment.name = "arith-grpo"
    cfg.experiment.total_train_steps = 20
    cfg.data.loader = "arl.data.arith:load_arith"
    cfg.data.path = "arith"  # generated; the loader ignores it
    cfg.data.batch_size = 16  # prompt groups per step
    cfg.data.max_prompt_len = 128
    cfg.gconfig.n_samples = 8  # group size
    cfg.gconfig.max_new_tokens = 64
    cfg.rollout.max_head_offpolicyness = 2
    cfg.rollout.reward = "arl.rewards.arith:arith_reward"
    cfg.actor.path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg.actor.lr = 1e-5
    cfg.actor.reward_bias = -0.5
    cfg.actor.reward_scaling = 10.0
    cfg.evaluator.freq_steps = 10
    cfg.evaluator.max_questions = 144  # the whole held-out split
    cfg.evaluator.temperature = 1.0  # sampled accuracy, as the goal is stated
    return cfg


def cpu_preset(cfg: Config) -> None:
    """Applied by the launcher when the placement plan has no GPU: a few minutes on two cores."""
    cfg.experiment.total_train_steps = 6
    cfg.data.batch_size = 2
    cfg.gconfig.n_samples = 4
    cfg.gconfig.max_new_tokens = 48
    # Every 6 steps and after the last (arl.config.EvaluatorConfig.due): once for these 6 steps,
    # and a run shortened with experiment.total_train_steps=N still ends with one.
    cfg.evaluator.freq_steps = 6
    cfg.evaluator.max_questions = 16
