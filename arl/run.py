"""The run: a cluster for the placement plan, the PPO trainer on it, to the last step.

``python -m arl.launch`` places the config once and hands the plan here, through
`arl.supervisor.supervise`; an embedding program or a test may call `run` directly (without a
plan it places the config on ``cluster.n_gpus``, or the GPUs visible here). This module never
imports the CLI.
"""

from __future__ import annotations

import asyncio
import time

from arl.ckpt.stop import StopRequest
from arl.config import Config
from arl.control.cluster import start_cluster
from arl.control.placement import place
from arl.data.loader import load_data
from arl.protocol.plan import Plan
from arl.stats.progress import say_if_slow
from arl.trainer import PPOTrainer


async def run(
    cfg: Config,
    plan: Plan | None = None,
    *,
    run_id: str | None = None,
    data: tuple[list[dict], list[dict]] | None = None,
    stop: StopRequest | None = None,
) -> None:
    """Run the whole experiment described by ``cfg`` on the nodes of ``plan``; metrics rows
    carry ``run_id``; ``data`` is `load_data`'s (train, eval) rows when the caller already
    loaded them; ``stop``, once requested, ends it with a checkpoint (`RunStopped`)."""
    t0 = time.monotonic()
    if plan is None:
        plan = place(cfg)
    # The data first: a missing or unreachable dataset fails before any process starts.
    if data is None:
        data = await asyncio.get_running_loop().run_in_executor(None, load_data, cfg)
    async with start_cluster(cfg, plan) as cluster:
        trainer = PPOTrainer(cfg, cluster, run_id=run_id, stop=stop)
        try:
            await trainer.setup(data)
            await trainer.train()
        finally:
            t_end = time.monotonic()
            await trainer.close()
    # The end of a run should be quick: where it is not (an engine slow to stop, a node slow
    # to exit), the user sees what took the time.
    say_if_slow("shutting down (rollout, weight sync, nodes)", time.monotonic() - t_end)
    print(trainer.summary(time.monotonic() - t0), flush=True)  # after the nodes' exit logs
