"""The PPO/GRPO loop (DESIGN §4), on a started cluster; `arl.run.run` starts one and runs it.

Rollout runs all the time in the background (`RolloutController`); each training step:

1. takes ``data.batch_size`` accepted prompt groups (the first to finish, by default) as an
   RTensor (metadata only);
2. splits it across the train ranks by token count; each rank pulls its shards from the
   rollout nodes directly;
3. advantages and the PPO update; proximal log-probs come from the update's own forward, or
   from a pass before it where they differ (more minibatches, KL; `ActorConfig.prox_in_update`),
   as do reference log-probs with KL;
4. syncs weights into the rollout engines (pause -> transfer -> version + 1 -> resume);
5. logs metrics, evaluates and checkpoints when due, and frees the step's shards everywhere.

A stop (`arl.ckpt.stop.StopRequest`: SIGTERM, a first Ctrl-C) ends the loop after the step in
progress (a wait for a batch is abandoned), writes a recovery checkpoint and raises
`RunStopped`; `setup` resumes from such a checkpoint, or from any with ``recover.mode=auto``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from pathlib import Path

from arl.ckpt.recovery import RecoveryState, Saver, check_resume, checkpoint_due, resume_keys
from arl.ckpt.stop import StopRequest, stop_with_checkpoint, unless_stopped
from arl.config import Config
from arl.control.cluster import Cluster
from arl.control.controller import RemoteObject
from arl.control.dispatch import dispatch
from arl.control.rollout import RolloutController
from arl.control.workers import (
    call_all,
    evaluate,
    free_shards,
    gpu_turn,
    node_gauges,
    raise_node_loss,
    sharing_gpu,
    start_rollout,
    start_rollout_workers,
    start_train_workers,
    start_weight_sync,
)
from arl.data.loader import load_data
from arl.protocol.errors import ErrorKind, RemoteError
from arl.protocol.proxy import per_rank
from arl.protocol.remote import TrainRanks, train_ranks
from arl.protocol.rtensor import RTensor
from arl.stats.logger import StatsLogger
from arl.stats.progress import ProgressBar, rollout_metrics, say_if_slow, summary, trace_step
from arl.stats.trace import Tracer
from arl.weights import WeightSync
from arl.weights.verify import WeightVerifier

log = logging.getLogger("arl.trainer")


class PPOTrainer:
    """Composes rollout, training, weight sync, metrics and checkpoints into one loop; the parts
    live apart: start-up and fan-outs in `arl.control.workers`, the weight checks in
    `arl.weights.verify`, the metrics rows, progress bar and summary in `arl.stats.progress`."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        run_id: str | None = None,
        stop: StopRequest | None = None,
    ):
        self.cfg, self.cluster = cfg, cluster
        self.free = functools.partial(free_shards, cluster)  # a step's shards, on every node
        self.stop = stop  # a stop asked for by a signal: checkpoint and end (`_stop`)
        self._carry: dict = {}  # `resume_keys` of this run, recorded in every checkpoint
        self._step_state: dict | None = None  # rollout.state_dict() at the last step's end
        self._last_save = 0.0  # monotonic time of the last recovery checkpoint (or the start)
        self._save_s: float | None = None  # the last checkpoint's seconds, for the next row
        self.version = 0
        self.step = 0
        self.resumed_from: int | None = None  # the recovery checkpoint's step, when resumed
        self.train_workers: list[RemoteObject] = []
        self.rollout_workers: list[RemoteObject] = []
        self.stats = StatsLogger(
            cfg.run_path, jsonl=cfg.stats.jsonl, tensorboard=cfg.stats.tensorboard, run_id=run_id
        )
        self.saver = Saver(cfg.run_path)
        self.rollout: RolloutController | None = None
        self.weight_sync: WeightSync | None = None
        self.progress = ProgressBar(cfg.stats.progress_bar)
        self.last_metrics: dict = {}
        self.last_eval: tuple[int, dict] | None = None  # (step, eval metrics)
        self.tracer = Tracer(cfg.run_path / "trace.json" if cfg.stats.trace else None)
        self.model_path = ""  # resolved in setup
        self.verifier: WeightVerifier | None = None  # with weight_sync.verify (setup)
        self._sharing: list[int] = []  # rollout workers on a train rank's GPU (setup)

    # ---- setup ------------------------------------------------------------------------------
    async def setup(self, data: tuple[list[dict], list[dict]] | None = None) -> None:
        """Resolve the model, start engines and train ranks, restore a checkpoint if asked;
        ``data`` is `load_data`'s (train, eval) rows, loaded here when not given."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.model_path = model_path = await loop.run_in_executor(None, self.resolve_model)
        if data is None:
            data = await loop.run_in_executor(None, load_data, cfg)
        rows, self.eval_rows = data
        # Hashing the rows' ids takes a while for a large dataset: off the event loop.
        n_train = len(self.cluster.train)
        self._carry = await loop.run_in_executor(None, resume_keys, cfg, n_train, rows)
        state = self.saver.latest()
        if state and not state.resumes(cfg.recover.mode, cfg.experiment.total_train_steps):
            state = None
        if state is not None:  # the launcher checked this before any node started
            await loop.run_in_executor(None, check_resume, state, self._carry)
        await self._start_workers(model_path)
        self.rollout = start_rollout(cfg, self.cluster, self.rollout_workers, rows, self.free)
        workers = (self.train_workers, self.rollout_workers)
        self.weight_sync = start_weight_sync(cfg, self.cluster, workers, self.rollout, self.free)
        self._sharing = sharing_gpu(cfg, self.cluster)
        self.rollout.tracer = self.tracer
        self.tracer.declare("trainer", *(p.handle.node_id for p in self.cluster.nodes))
        if cfg.weight_sync.verify:
            pairs = zip(self.cluster.rollout, self.rollout.workers, strict=True)
            engines = [(p.spec.engine, p.handle.node_id, w) for p, w in pairs]
            self.verifier = WeightVerifier(self.ranks, engines, model_path, cfg)
            # Before any sync, a recovery's included: both sides hold the model's weights.
            await self.verifier.measure_floor()
        if state is not None:
            await self._restore(state)
        gc.freeze()  # the imports' long-lived objects: full collections would stall the loop

    def resolve_model(self) -> str:
        """The local HF folder of ``actor.path`` (checked: config, tokenizer, weights)."""
        from arl.engines.model import resolve_model

        return resolve_model(self.cfg.actor.path)

    async def _start_workers(self, model_path: str) -> None:
        """The rollout workers (engines loaded) and the train ranks, started together."""
        self.rollout_workers, self.train_workers = await asyncio.gather(
            start_rollout_workers(self.cfg, self.cluster, model_path),
            start_train_workers(self.cfg, self.cluster, model_path),
        )

    # ---- the loop ---------------------------------------------------------------------------
    async def train(self) -> None:
        """Run training steps until ``experiment.total_train_steps``."""
        cfg = self.cfg
        total = cfg.experiment.total_train_steps
        self.rollout.start()
        self.progress.open(total, self.step)
        # The train ranks' one-time costs (and compilation) run while the first batch generates.
        warm = asyncio.ensure_future(self.ranks.warm_up())
        try:
            await self._loop(total, warm)
        finally:
            if not warm.done():
                warm.cancel()
            await asyncio.gather(warm, return_exceptions=True)
        if self.stop is not None and self.stop.requested:
            if self.step < total:
                await self._stop()
            self.stop.done()  # it came with the last step: the run is complete
        self.saver.settle(self.step)  # an older checkpoint is spent: never resumed again
        if cfg.saver.hf_export:
            t0 = time.monotonic()
            path = await self.save_hf()
            say_if_slow(f"exporting the model to {path}", time.monotonic() - t0)

    async def _loop(self, total: int, warm: asyncio.Future) -> None:
        cfg = self.cfg
        if self.stop is not None:
            self.stop.arm()
        self._last_save = time.monotonic()
        while self.step < total and not (self.stop is not None and self.stop.requested):
            t0 = time.monotonic()
            got = await unless_stopped(
                self.rollout.prepare_batch(cfg.data.batch_size, self.version), self.stop
            )
            if got is None:  # stopped while waiting for the batch: nothing of it was trained
                return
            batch, infos = got
            await warm  # done after the first step
            t_rollout = time.monotonic() - t0
            try:
                async with gpu_turn(cfg, self.rollout, self._sharing):
                    metrics = await self.train_step(batch)
                    t1 = time.monotonic()
                    metrics.update(await self.weight_sync.sync(self.version + 1))
            except RemoteError as err:
                # A rank that failed because a node it pulled from is gone: that node's loss is
                # the cause the run reports and the supervisor judges (rollout's error first).
                if err.kind is ErrorKind.PEER_LOST:
                    await raise_node_loss(err, self.cluster, self.rollout.check, cfg.cluster)
                self.rollout.check()
                raise
            self.version += 1
            if self.verifier is not None:
                metrics.update(await self.verifier.verify(self.version))
            self.step += 1
            t2 = time.monotonic()
            await self.free(list(batch.refs))
            metrics.update(rollout_metrics(infos, self.version, self.rollout.stats))
            metrics.update(
                {
                    "time/wait_rollout_s": t_rollout,
                    "time/train_s": t1 - t0 - t_rollout,
                    "time/sync_s": t2 - t1,
                    "time/step_s": time.monotonic() - t0,
                    "version": self.version,
                }
            )
            metrics.update(await node_gauges(self.cluster))
            if self._save_s is not None:  # the recovery checkpoint written after the last row
                metrics["ckpt/save_s"], self._save_s = self._save_s, None
            self._step_state = self.rollout.state_dict()
            train_rows = [p.handle.node_id for p in self.cluster.train]
            trace_step(self.tracer, self.step, self.version, train_rows, t0, t0 + t_rollout, t1, t2)
            if cfg.evaluator.due(self.step, total):
                ev = await evaluate(self.rollout.workers, self.eval_rows, cfg.evaluator)
                self.last_eval = (self.step, ev)
                metrics.update(self.last_eval[1])
            self.last_metrics = metrics
            # Logged before the checkpoint: a crash in between repeats this step's line after
            # recovery rather than losing it.
            self.stats.log(self.step, metrics)
            self.progress.update(metrics, self.version)
            if cfg.saver.due(self.step):
                await self.save_hf()
            since = time.monotonic() - self._last_save
            rc = cfg.recover
            due = checkpoint_due(self.step, since, rc.freq_steps, rc.freq_secs)
            if rc.mode == "auto" and (due or self.step == total):  # the last: to train further
                await self.save_recovery()

    async def _stop(self) -> None:
        """Write the stop's recovery checkpoint (unless this step has one) and raise
        `RunStopped` (`stop_with_checkpoint`)."""
        latest = self.saver.latest()
        written = latest.path if latest is not None and latest.step == self.step else None
        save = functools.partial(self.save_recovery, stopped=True)
        grace = self.cfg.recover.stop_grace_s
        await stop_with_checkpoint(self.stop, self.step, written, save, grace)

    async def train_step(self, batch: RTensor) -> dict:
        """One PPO update over ``batch`` on every train rank; returns averaged statistics."""
        cfg = self.cfg
        t0 = time.monotonic()
        parts, _ = dispatch(batch, len(self.train_workers))
        loaded = await self.ranks.load_batch(per_rank(parts))
        t1 = time.monotonic()
        if cfg.actor.use_decoupled_loss and not cfg.actor.prox_in_update():
            await self.ranks.compute_logp()
        if cfg.actor.kl_ctl > 0:
            await self.ranks.compute_ref_logp()
        t2 = time.monotonic()
        await self.ranks.compute_advantages()
        rank_stats = await self.ranks.ppo_update()
        await self.ranks.end_step()
        n = len(rank_stats)
        out = {f"train/{k}": sum(r[k] for r in rank_stats) / n for k in rank_stats[0].values}
        out["batch/n_tokens"] = sum(r.n_tokens for r in loaded)
        out["batch/n_seqs"] = sum(r.n_seqs for r in loaded)
        # The phases of train_s: pulling and concatenating the shards, the log-prob passes
        # (proximal where not in the update, and reference), advantages plus the update.
        out["time/load_batch_s"] = t1 - t0
        out["time/logp_s"] = t2 - t1
        out["time/update_s"] = time.monotonic() - t2
        if out.get("train/skipped"):  # every rank skips together: the norm is global
            log.warning(
                "step %d: %d of %d optimizer steps skipped, the gradient norm was not finite "
                "(a NaN or inf loss); the weights were left unchanged (metric train/skipped)",
                self.step + 1,
                int(out["train/skipped"]),
                cfg.actor.ppo_n_minibatches,
            )
        return out

    @property
    def ranks(self) -> TrainRanks:
        """Every train rank at once, through the typed `TrainWorkerAPI` calls."""
        return train_ranks(self._all, len(self.train_workers))

    async def _all(self, method: str, args: list[list] | None = None) -> list:
        """`call_all` of ``method`` on the train ranks, within ``actor.call_timeout``."""
        return await call_all(
            self.train_workers,
            method,
            args,
            self.cfg.actor.call_timeout,
            wrap=lambda w, call: self.tracer.timed(w.node.node_id, method, call, lane="main"),
        )

    # ---- checkpoints and the end ------------------------------------------------------------
    async def save_hf(self) -> Path:
        """Export the policy as an HF folder loadable by from_pretrained."""
        path = self.cfg.run_path / "checkpoints" / f"step{self.step}"
        path.parent.mkdir(parents=True, exist_ok=True)
        await self.ranks.save_hf(str(path), self.cfg.saver.lora_merged)
        return path

    async def save_recovery(self, stopped: bool = False) -> tuple[Path, float]:
        """The train ranks' state (data only: `arl.ckpt.rank_state`) plus the loop state at the
        end of the last step, written atomically; returns (its folder, seconds it took)."""
        rollout = self._step_state if self._step_state is not None else self.rollout.state_dict()
        state = RecoveryState(self.step, self.version, rollout, stopped=stopped, carry=self._carry)
        final, seconds = await self.saver.save(state, self.ranks.save_state)
        self._last_save, self._save_s = time.monotonic(), seconds
        return final, seconds

    async def _restore(self, state: RecoveryState) -> None:
        how = "a stop's checkpoint" if state.stopped else "its recovery checkpoint"
        print(f"resuming from step {state.step} ({how}: {state.path})", flush=True)
        log.warning("recovering from step %d (version %d)", state.step, state.version)
        await self.ranks.load_state(str(state.path / "model"), state.step)
        self.step, self.version = state.step, state.version
        self.resumed_from = state.step
        self.rollout.load_state_dict(state.rollout)
        # The engines start from the original weights: sync the recovered ones in.
        await self.weight_sync.sync(self.version)
        if self.verifier is not None:
            await self.verifier.verify(self.version)

    def summary(self, wall_s: float) -> str:
        """The run's last lines: steps, wall time, final reward and accuracy, and its files."""
        return summary(
            wall_s,
            self.step,
            self.cfg.run_path,
            resumed_from=self.resumed_from,
            last_metrics=self.last_metrics,
            last_eval=self.last_eval,
            metrics_path=self.stats.jsonl_path,
            trace_path=self.tracer.path,
        )

    async def close(self) -> None:
        """Stop rollout, end the weight sync's node halves, close the loggers (the cluster
        ends the processes)."""
        if self.rollout is not None:
            await self.rollout.stop()
        if self.weight_sync is not None:
            await self.weight_sync.close()
        self.progress.close()
        self.stats.close()
        self.tracer.close()
