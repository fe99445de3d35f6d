"""GRPO on GSM8K with the rollout written as agent code against an OpenAI-style client.

The run of recipes/gsm8k.py (its make_config and cpu_preset: same model, data, budget, reward
and loss), except that each episode is `arl.agent.examples.math_agent.run(client, data)`: the agent
calls ``client.chat.completions.create(...)`` as it would call OpenAI, arl records what the
policy generated, and the agent's final answer is scored by rollout.reward. ``run_with_calculator``
gives the model a calculator tool (multi-turn; its conversations need a longer prompt budget).

    python -m arl.launch recipes/gsm8k_agent.py
    python -m arl.launch recipes/gsm8k_agent.py \\
        rollout.agent=arl.agent.examples.math_agent:run_with_calculator data.max_prompt_len=1536
"""

from pathlib import Path

from arl.config import Config
from arl.recipe import import_recipe

GSM8K = import_recipe(str(Path(__file__).with_name("gsm8k.py")))
cpu_preset = GSM8K.cpu_preset  # the same small run when the plan has no GPU


def make_config() -> Config:
    """recipes/gsm8k.py's config with the math agent as the workflow."""
    cfg = GSM8K.make_config()
    cfg.experiment.name = "gsm8k-agent"
    cfg.rollout.workflow = "arl.workflows.agent:AgentWorkflow"
    cfg.rollout.agent = "arl.agent.examples.math_agent:run"
    cfg.rollout.agent_trajectory = "concat"  # a conversation's turns train as one sequence
    cfg.rollout.turn_discount = 1.0
    return cfg
