"""GRPO on GSM8K grade-school math.

What it runs: prompts from GSM8K; for each, a group of 4 completions sampled by the rollout
engine; reward 1 when math-verify finds the reference answer, else 0; rewards shifted by -0.5,
scaled by 10, normalised within each group, advantages normalised over the batch; decoupled PPO
(clip 0.4) on the actor. Rollout runs ahead of training by at most eta = 2 policy versions.

Data: ``openai/gsm8k`` from the hub (``pip install -e '.[gsm8k]'``), or ``data.path=DIR``, a
directory holding train.jsonl and test.jsonl (keys question, answer).

    python -m arl.launch recipes/gsm8k.py --dry-run
    python -m arl.launch recipes/gsm8k.py data.path=DIR
    python -m arl.launch recipes/gsm8k.py rollout.backend=sglang:d4 actor.backend=fsdp:d4
"""

from arl.config import Config


def make_config() -> Config:
    """The GSM8K GRPO defaults; change any of them with key=value on the command line."""
    cfg = Config()
    cfg.experiment.name = "gsm8k-grpo"
    cfg.data.path = "openai/gsm8k"
    cfg.experiment.total_train_steps = 200
    cfg.data.batch_size = 64  # prompt groups per step
    cfg.gconfig.n_samples = 4  # group size
    cfg.gconfig.max_new_tokens = 1024
    cfg.rollout.max_head_offpolicyness = 2  # eta
    # One GPU for both: under MPS where it runs (4% less time a trained token, docs/results.md)
    cfg.rollout.gpu_sharing = "auto"
    cfg.rollout.workflow = "arl.workflows.rlvr:RLVRWorkflow"
    cfg.rollout.reward = "arl.rewards.gsm8k:gsm8k_reward"
    cfg.actor.path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg.actor.use_decoupled_loss = True
    cfg.actor.eps_clip = 0.4
    cfg.actor.reward_bias = -0.5
    cfg.actor.reward_scaling = 10.0
    cfg.actor.reward_norm_mean = cfg.actor.reward_norm_std = "group"
    cfg.actor.adv_norm_mean = cfg.actor.adv_norm_std = "batch"
    return cfg


def cpu_preset(cfg: Config) -> None:
    """Applied by the launcher when the placement plan has no GPU: three small steps."""
    cfg.experiment.total_train_steps = 3
    cfg.data.batch_size = 2
    cfg.gconfig.max_new_tokens = 128
    cfg.actor.max_tokens_per_mb = 2048  # bounds the fp32 logits of one micro-batch
