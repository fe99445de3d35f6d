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
import contextlib
import gc
import logging
import time
from pathlib import Path
from typing import Any

import attrs

from arl.ckpt.recovery import (
    RecoveryState,
    Saver,
    check_resume,
    checkpoint_due,
    resume_keys,
)
from arl.ckpt.stop import RunStopped, StopRequest, signal_name
from arl.config import Config
from arl.control.cluster import Cluster
from arl.control.controller import NodeLost, RemoteObject
from arl.control.dispatch import dispatch
from arl.control.placement import shares_gpu
from arl.control.rollout import RolloutController
from arl.control.staleness import StalenessSemaphore
from arl.data.loader import StatefulLoader
from arl.engines.spec import SERVER_ENGINES, engine_spec
from arl.protocol.errors import ErrorKind, RemoteError
from arl.protocol.imports import resolve_import
from arl.protocol.remote import TrainRanks
from arl.protocol.report import GroupReport
from arl.protocol.rtensor import RTensor, ShardRef
from arl.stats.logger import StatsLogger
from arl.stats.trace import Tracer
from arl.weights import SyncContext, WeightSync, WeightSyncError, make_weight_sync
from arl.weights.base import rendezvous_host

log = logging.getLogger("arl.trainer")

# What server engines and the trainer both score after a sync (`PPOTrainer.verify_weights`).
PROBE_MESSAGES = [
    {"role": "user", "content": "What is 12 * 7? Put the answer in \\boxed{}."},
    {"role": "assistant", "content": "12 * 7 = 84, so the answer is \\boxed{84}."},
]


def probe_gap(got: list[float], want: list[float]) -> tuple[float, float]:
    """(shift, spread) of per-token log-prob differences d = got - want: mean(d), mean(|d|).

    bf16 numerics make each d random-signed (SmolLM2-135M in bf16 against fp32, same weights,
    the 71-token probe: spread 0.054, shift 0.008), so they mostly cancel in the shift, while
    stale weights move the whole sequence's likelihood; the spread catches stale weights on
    engines whose numerics match the trainer's (spread 0 before any sync).
    """
    if len(got) != len(want) or not want:
        raise WeightSyncError(
            f"the probe was scored on {len(got)} tokens by the engine and {len(want)} by the "
            "trainer; both must score the same sequence"
        )
    diffs = [a - b for a, b in zip(got, want, strict=True)]
    return sum(diffs) / len(diffs), sum(abs(d) for d in diffs) / len(diffs)


def load_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """The training rows, and the evaluation rows (none without ``evaluator.freq_steps``)."""
    rows = load_rows(cfg, cfg.data.train_split)
    if not cfg.evaluator.freq_steps:
        return rows, []
    return rows, load_rows(cfg, cfg.data.eval_split)[: cfg.evaluator.max_questions or None]


def load_rows(cfg: Config, split: str) -> list[dict]:
    """Dataset rows of ``split`` through ``data.loader`` (rows carry chat ``messages``)."""
    loader = resolve_import(cfg.data.loader, tuple(cfg.cluster.allowed_import_prefixes))
    rows, stats = loader(cfg.data.path, split, cfg.data.on_bad_row)
    skipped = stats.skipped if hasattr(stats, "skipped") else stats.get("skipped", 0)
    if skipped:
        log.warning("%s/%s: skipped %d malformed rows", cfg.data.path, split, skipped)
    return rows


class CallTimeout(TimeoutError):
    """Calls ran past their deadline on nodes that still answer heartbeats (slow or stuck)."""

    def __init__(self, nodes: list[str], call: str, seconds: float, setting: str):
        self.nodes, self.call = nodes, call
        super().__init__(
            f"{call} on node {', '.join(nodes)} ran longer than {setting}={seconds:g}s; the "
            f"node still answers heartbeats, so it is slow or stuck in {call}"
        )


async def call_all(
    workers: list[RemoteObject],
    method: str,
    args: list[list] | None = None,
    timeout: float | None = None,
    *,
    setting: str = "actor.call_timeout",
    wrap: Any = None,
) -> list:
    """Call ``method`` on every worker at once; results in order.

    The first failure cancels the rest and is raised (a rank blocked in a collective with a
    failed one would otherwise wait forever); calls still running after ``timeout`` seconds
    raise `CallTimeout` naming their nodes.
    """
    calls = [w.call(method, *(args[i] if args else [])) for i, w in enumerate(workers)]
    if wrap is not None:
        calls = [wrap(w, c) for w, c in zip(workers, calls, strict=True)]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, pending = await asyncio.wait(
            tasks, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
        )
    finally:
        for t in tasks:
            t.cancel()  # no-op for finished ones
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:  # in rank order, so the error is the same whatever finished first
        if t in done and t.exception() is not None:
            raise t.exception()
    if pending:
        slow = [w for w, t in zip(workers, tasks, strict=True) if t in pending]
        raise CallTimeout(
            [w.node.node_id for w in slow], f"{slow[0].name}.{method}", timeout, setting
        )
    return [t.result() for t in tasks]


class PPOTrainer:
    """Composes rollout, training, weight sync, metrics and checkpoints into one loop."""

    def __init__(
        self,
        cfg: Config,
        cluster: Cluster,
        run_id: str | None = None,
        stop: StopRequest | None = None,
    ):
        self.cfg, self.cluster = cfg, cluster
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
        self.progress: Any = None
        self.last_metrics: dict = {}
        self.last_eval: tuple[int, dict] | None = None  # (step, eval metrics)
        self.tracer = Tracer(cfg.run_path / "trace.json" if cfg.stats.trace else None)
        self.model_path = ""  # resolved in setup
        self._probe: list[int] | None = None  # verify_weights' probe sequence
        self._probe_floor: tuple[float, float] | None = None  # its (shift, spread) at the start
        self._sharing: list[int] = []  # rollout workers on a train rank's GPU (setup)

    # ---- setup ------------------------------------------------------------------------------
    async def setup(self, data: tuple[list[dict], list[dict]] | None = None) -> None:
        """Resolve the model, start engines and train ranks, restore a checkpoint if asked;
        ``data`` is `load_data`'s (train, eval) rows, loaded here when not given."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        model_path = await loop.run_in_executor(None, self.resolve_model)
        self.model_path = model_path
        if data is None:
            data = await loop.run_in_executor(None, load_data, cfg)
        rows, self.eval_rows = data
        # Hashing the rows' ids takes a while for a large dataset: off the event loop.
        n_train = len(self.cluster.train)
        self._carry = await loop.run_in_executor(None, resume_keys, cfg, n_train, rows)
        state = self.saver.latest()
        if state is not None and not state.resumes(
            cfg.recover.mode, cfg.experiment.total_train_steps
        ):
            state = None
        if state is not None:  # the launcher checked this before any node started
            await loop.run_in_executor(None, check_resume, state, self._carry)
        await asyncio.gather(
            self._start_rollout_workers(model_path), self._start_train_workers(model_path)
        )
        sem = StalenessSemaphore(
            cfg.data.batch_size, cfg.rollout.max_head_offpolicyness, cfg.max_concurrent_rollouts
        )
        loader = StatefulLoader(rows, 1, shuffle=cfg.data.shuffle, seed=cfg.experiment.seed)
        peers = {p.handle.node_id: p.handle.info["data_addr"] for p in self.cluster.rollout}
        self.rollout = RolloutController(
            self.rollout_workers,
            loader,
            sem,
            peers=peers,
            free=self.free,
            stale_policy=cfg.rollout.stale_sample_policy,
            order=cfg.rollout.batch_order,
            accept=self._filter(),
            max_consecutive_rejections=cfg.rollout.max_consecutive_rejections,
            stall_log_s=cfg.rollout.stall_log_s,
        )
        self.weight_sync = self._make_weight_sync()
        # Rollout workers whose engine shares a GPU with a train rank (rollout.gpu_sharing).
        train = [p.spec for p in self.cluster.train]
        self._sharing = [i for i, p in enumerate(self.cluster.rollout) if shares_gpu(p.spec, train)]
        if cfg.rollout.gpu_sharing != "concurrent" and not self._sharing:
            log.warning(
                "rollout.gpu_sharing=%s has no effect here: no rollout engine shares a GPU "
                "with a train rank",
                cfg.rollout.gpu_sharing,
            )
        self.rollout.tracer = self.tracer
        self.tracer.declare("trainer", *(p.handle.node_id for p in self.cluster.nodes))
        if cfg.weight_sync.verify:
            # Before any sync, a recovery's included: both sides hold the model's weights.
            await self._measure_probe_floor()
        if state is not None:
            await self._restore(state)
        gc.freeze()  # the imports' long-lived objects: full collections would stall the loop

    def resolve_model(self) -> str:
        """The local HF folder of ``actor.path`` (checked: config, tokenizer, weights)."""
        from arl.engines.model import resolve_model

        return resolve_model(self.cfg.actor.path)

    async def _start_rollout_workers(self, model_path: str) -> None:
        cfg = self.cfg
        sampling = {k: v for k, v in attrs.asdict(cfg.gconfig).items() if k != "n_samples"}

        agent = {"workflow_kwargs": dict(cfg.rollout.workflow_args)}
        if cfg.rollout.agent:  # the agent workflow (arl.workflows.agent)
            trajectory = {"trajectory": cfg.rollout.agent_trajectory}
            discount = {"turn_discount": cfg.rollout.turn_discount}
            agent = {"agent": cfg.rollout.agent, "workflow_kwargs": {**trajectory, **discount}}
            agent["workflow_kwargs"].update(cfg.rollout.workflow_args)

        n_engines = max(1, len(self.cluster.rollout))

        async def one(p: Any) -> RemoteObject:
            spec = engine_spec(cfg, p.spec, model_path, p.device)
            options = {}
            if not spec.is_server:
                # Room for every sequence the staleness semaphore lets run at once, split over
                # the engines (its default 64 rows would serialise gsm8k's 768 concurrent
                # samples), up to 1,024 rows: SmolLM2's KV cache for 1,024 rows of gsm8k's
                # 1,537 positions is 36 GB (the engine grows it lazily where that does not fit).
                per_engine = -(-cfg.max_concurrent_rollouts * cfg.gconfig.n_samples // n_engines)
                # The cache grows on demand up to max_seq_len; agent turns can outgrow prompt +
                # new tokens.
                longest = cfg.data.max_prompt_len + cfg.gconfig.max_new_tokens + 1
                options = {"max_batch_size": max(1, min(1024, per_engine))}
                options["max_seq_len"] = max(2048, longest)
                # Decode graphs for every batch size up to that length are captured at start, with
                # the cache at its full size (rows x length; lazily grown if that does not fit).
                options["warm_up_len"] = longest
                options["decode_attention"] = cfg.rollout.hf_decode_attention
                if cfg.actor.lora.rank > 0:  # the trainer's adapters, served on the base
                    options["lora"] = attrs.asdict(cfg.actor.lora)
            w = await p.handle.create(
                "arl.node.rollout:RolloutWorker",
                name="rollout",
                model_path=model_path,
                engine=spec.to_wire(),
                engine_options=options,
                workflow=cfg.rollout.workflow,
                reward=cfg.rollout.reward,
                sampling=sampling,
                n_samples=cfg.gconfig.n_samples,
                max_prompt_len=cfg.data.max_prompt_len,
                prompt_overflow=cfg.data.prompt_overflow,
                group_timeout=cfg.rollout.group_timeout,
                **agent,
            )
            await w.setup()
            return w

        self.rollout_workers = list(await asyncio.gather(*(one(p) for p in self.cluster.rollout)))

    async def _start_train_workers(self, model_path: str) -> None:
        cfg = self.cfg
        rank0 = self.cluster.train[0].handle
        host = rendezvous_host(self.cluster)
        port = await rank0.call("free_port", {"host": host})
        actor = attrs.asdict(cfg.actor)
        actor["path"] = model_path
        world = len(self.cluster.train)
        self.train_workers = list(
            await asyncio.gather(
                *(
                    p.handle.create(
                        "arl.node.train:TrainWorker",
                        actor,
                        name="train",
                        rank=p.spec.rank,
                        world_size=world,
                        init_method=f"tcp://{host}:{port}",
                        device=p.device,
                        seed=cfg.experiment.seed,
                        ref_path=cfg.ref_path or None,
                        total_steps=cfg.experiment.total_train_steps * cfg.actor.ppo_n_minibatches,
                    )
                    for p in self.cluster.train
                )
            )
        )

    def _make_weight_sync(self) -> WeightSync:
        """The configured weight-sync plug-in (``auto``: chosen by the placement plan)."""
        ctx = SyncContext(
            cluster=self.cluster,
            train=self.train_workers,
            rollout_workers=self.rollout_workers,
            rollout=self.rollout,
            config=self.cfg.weight_sync,
            run_path=self.cfg.run_path,
            free=self.free,
        )
        plan = [p.spec for p in self.cluster.nodes]
        return make_weight_sync(self.cfg.weight_sync.mode, plan, ctx)

    # ---- the loop ---------------------------------------------------------------------------
    async def train(self) -> None:
        """Run training steps until ``experiment.total_train_steps``."""
        cfg = self.cfg
        total = cfg.experiment.total_train_steps
        self.rollout.start()
        self._open_progress(total)
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
            await self.save_hf()

    async def _await_lost_node(self, err: RemoteError) -> None:
        """Raise the loss of the node ``err``'s pull found gone, once the controller declares it.

        The pull fails as soon as the owner's connection closes; the controller declares the
        node lost only after ``cluster.heartbeat_timeout``, with what its event loop was blocked
        in (which decides whether a restart helps). Returns if no verdict comes by then."""
        hb = self.cfg.cluster
        deadline = time.monotonic() + hb.heartbeat_timeout + 2 * hb.heartbeat_interval + 1.0
        while time.monotonic() < deadline:
            self.rollout.check()
            for node in self.cluster.nodes:
                h = node.handle
                if h.lost:
                    doing = f"{err.method} on node {err.node}"
                    raise NodeLost(h.node_id, doing, h.lost, h.blocked_in) from err
            await asyncio.sleep(0.05)

    async def _loop(self, total: int, warm: asyncio.Future) -> None:
        cfg = self.cfg
        if self.stop is not None:
            self.stop.arm()
        self._last_save = time.monotonic()
        while self.step < total and not (self.stop is not None and self.stop.requested):
            t0 = time.monotonic()
            got = await self._unless_stopped(
                self.rollout.prepare_batch(cfg.data.batch_size, self.version)
            )
            if got is None:  # stopped while waiting for the batch: nothing of it was trained
                return
            batch, infos = got
            await warm  # done after the first step
            t_rollout = time.monotonic() - t0
            try:
                async with self._gpu_turn():
                    metrics = await self.train_step(batch)
                    t1 = time.monotonic()
                    metrics.update(await self.weight_sync.sync(self.version + 1))
            except RemoteError as err:
                # A rank that failed because a node it pulled from is gone: that node's loss is
                # the cause the run reports and the supervisor judges (rollout's error first).
                if err.kind is ErrorKind.PEER_LOST:
                    await self._await_lost_node(err)
                self.rollout.check()
                raise
            self.version += 1
            if cfg.weight_sync.verify:
                metrics.update(await self.verify_weights())
            self.step += 1
            t2 = time.monotonic()
            await self.free(list(batch.refs))
            metrics.update(self._rollout_metrics(infos))
            metrics.update(
                {
                    "time/wait_rollout_s": t_rollout,
                    "time/train_s": t1 - t0 - t_rollout,
                    "time/sync_s": t2 - t1,
                    "time/step_s": time.monotonic() - t0,
                    "version": self.version,
                }
            )
            metrics.update(await self._node_gauges())
            if self._save_s is not None:  # the recovery checkpoint written after the last row
                metrics["ckpt/save_s"], self._save_s = self._save_s, None
            self._step_state = self.rollout.state_dict()
            self._trace_step(t0, t0 + t_rollout, t1, t2)
            if cfg.evaluator.due(self.step, total):
                self.last_eval = (self.step, await self.evaluate())
                metrics.update(self.last_eval[1])
            self.last_metrics = metrics
            # Logged before the checkpoint: a crash in between repeats this step's line after
            # recovery rather than losing it.
            self.stats.log(self.step, metrics)
            self._update_progress(metrics)
            if cfg.saver.due(self.step):
                await self.save_hf()
            since = time.monotonic() - self._last_save
            rc = cfg.recover
            due = checkpoint_due(self.step, since, rc.freq_steps, rc.freq_secs)
            if rc.mode == "auto" and (due or self.step == total):  # the last: to train further
                await self.save_recovery()

    async def _unless_stopped(self, aw: Any) -> Any:
        """``aw``'s result, or None when a stop is asked for first (``aw`` is cancelled)."""
        task = asyncio.ensure_future(aw)
        if self.stop is None:
            return await task
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not task.done():
                task.cancel()
            await asyncio.gather(task, stopped, return_exceptions=True)
        return None if task.cancelled() else task.result()

    async def _stop(self) -> None:
        """Write the stop's recovery checkpoint (unless the step already has one) and raise
        `RunStopped` saying where and how long it took."""
        stop = self.stop
        how = signal_name(stop.signum)
        latest = self.saver.latest()
        path, seconds = None, 0.0
        if self.step == 0:
            note = f"stopped by {how} before the first step finished: there was nothing to save"
        elif latest is not None and latest.step == self.step:
            path = latest.path
            note = f"stopped by {how} after step {self.step}; its checkpoint is {path}"
        else:
            print(
                f"stopping ({how}): writing the recovery checkpoint of step {self.step} "
                f"(within recover.stop_grace_s={self.cfg.recover.stop_grace_s:g}s; a second "
                "signal ends the run without it)",
                flush=True,
            )
            path, seconds = await self.save_recovery(stopped=True)
            note = (
                f"stopped by {how} after step {self.step}: the recovery checkpoint was written "
                f"to {path} in {seconds:.1f} s"
            )
        stop.done()
        raise RunStopped(stop.signum, self.step, path, seconds, note)

    def _gpu_turn(self) -> contextlib.AbstractAsyncContextManager:
        """The engines on a train rank's GPU while it trains and syncs: ``alternate`` pauses
        them in place; ``sleep`` aborts their requests (resubmitted, waiting) and puts them to
        sleep (KV cache freed; the weights too for a full fine-tune, whose sync rewrites them
        all; with LoRA the base stays), and the sync wakes them before its transfer
        (`RolloutController.held`); else nothing."""
        sharing = self.cfg.rollout.gpu_sharing
        if sharing not in ("alternate", "sleep") or not self._sharing:
            return contextlib.nullcontext()
        if sharing == "sleep":
            full = self.cfg.actor.lora.rank == 0
            return self.rollout.held(self._sharing, sleep=True, drop_weights=full)
        return self.rollout.held(self._sharing)

    async def train_step(self, batch: RTensor) -> dict:
        """One PPO update over ``batch`` on every train rank; returns averaged statistics."""
        cfg = self.cfg
        t0 = time.monotonic()
        parts, _ = dispatch(batch, len(self.train_workers))
        loaded = await self.ranks.load_batch(parts)
        t1 = time.monotonic()
        if cfg.actor.use_decoupled_loss and not cfg.actor.prox_in_update():
            await self.ranks.compute_logp()
        if cfg.actor.kl_ctl > 0:
            await self.ranks.compute_ref_logp()
        t2 = time.monotonic()
        await self.ranks.compute_advantages()
        per_rank = await self.ranks.ppo_update()
        await self.ranks.end_step()
        n = len(per_rank)
        out = {f"train/{k}": sum(r[k] for r in per_rank) / n for k in per_rank[0].values}
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

    async def verify_weights(self) -> dict:
        """After a sync, check that every engine holds the trainer's weights.

        Engines that checksum their weights (hf) must match the trainer's checksum exactly.
        Server engines cannot, so they score a fixed probe sequence and the trainer scores it
        too; `probe_gap` gives the per-token difference's mean (shift) and mean absolute value
        (spread). Both are compared with their values before the first sync (`_probe_floor`:
        the same weights on both sides, so numerics only, measured in this run): the shift
        and the spread may each move by at most ``weight_sync.verify_tolerance``. Raises
        `WeightSyncError` naming the engine that fails.
        """
        out: dict = {}
        pairs = list(zip(self.cluster.rollout, self.rollout.workers, strict=True))
        local = [w for p, w in pairs if p.spec.engine not in SERVER_ENGINES]
        servers = [(p, w) for p, w in pairs if p.spec.engine in SERVER_ENGINES]
        if local:
            want = (await self.ranks.weights_checksum())[0]
            got = await asyncio.gather(*(w.weights_checksum() for w in local))
            out.update({"sync/checksum_match": all(g == want for g in got), "sync/checksum": want})
        if servers:
            gaps = await self._probe_gaps(servers)
            shift0, spread0 = self._probe_floor or (0.0, 0.0)
            tol = self.cfg.weight_sync.verify_tolerance
            for (p, _), (shift, spread) in zip(servers, gaps, strict=True):
                if abs(shift - shift0) > tol or spread - spread0 > tol:
                    raise WeightSyncError(
                        f"after the sync to version {self.version}, the {p.spec.engine} engine "
                        f"of node {p.handle.node_id} scores the probe sequence away from the "
                        f"trainer: mean log-prob difference per token {shift:+.3f} (before any "
                        f"sync {shift0:+.3f}), mean |difference| {spread:.3f} (before any sync "
                        f"{spread0:.3f}), weight_sync.verify_tolerance={tol}: it does not "
                        "generate with the weights it was sent"
                    )
            out["sync/probe_mean_abs_diff"] = max(spread for _, spread in gaps)
            out["sync/probe_shift_change"] = max(abs(shift - shift0) for shift, _ in gaps)
            out["sync/probe_spread_change"] = max(spread - spread0 for _, spread in gaps)
            out["sync/probe_floor"] = spread0
        return out

    async def _probe_gaps(self, servers: list) -> list[tuple[float, float]]:
        """`probe_gap` of each server engine's probe log-probs against the trainer's."""
        probe = await self._probe_tokens()
        # Scored with the weights in the servers' dtype: a sync in fp32 reaches a bf16 server
        # rounded, and rounding can undo an update smaller than bf16's spacing. With "auto"
        # the server picks its dtype from the model, unknown here: the weights stay unrounded.
        dtype = None if self.cfg.rollout.dtype == "auto" else self.cfg.rollout.dtype
        want = (await self.ranks.score(probe, dtype))[0]
        got = await asyncio.gather(*(w.score(probe) for _, w in servers))
        return [probe_gap(g, want) for g in got]

    async def _measure_probe_floor(self) -> None:
        """Before the first sync of this run (trainer and servers hold the same weights): the
        probe's shift (averaged) and spread (largest) over the servers, numerics only."""
        pairs = zip(self.cluster.rollout, self.rollout.workers, strict=True)
        servers = [(p, w) for p, w in pairs if p.spec.engine in SERVER_ENGINES]
        if servers:
            gaps = await self._probe_gaps(servers)
            self._probe_floor = (
                sum(shift for shift, _ in gaps) / len(gaps),
                max(spread for _, spread in gaps),
            )

    async def _probe_tokens(self) -> list[int]:
        """A fixed chat exchange in the policy's own template, as token ids (built once)."""
        if self._probe is None:
            from transformers import AutoTokenizer

            def build() -> list[int]:
                tok = AutoTokenizer.from_pretrained(self.model_path)
                text = tok.apply_chat_template(PROBE_MESSAGES, tokenize=False)
                return list(tok(text, add_special_tokens=False)["input_ids"])

            self._probe = await asyncio.get_running_loop().run_in_executor(None, build)
        return self._probe

    @property
    def ranks(self) -> TrainRanks:
        """Every train rank at once, through the typed `TrainWorkerAPI` calls."""
        return TrainRanks(self._all, len(self.train_workers))

    async def _all(self, method: str, args: list[list] | None = None) -> list:
        """Call ``method`` on every train rank at once (they run collectives together), within
        ``actor.call_timeout``."""
        return await call_all(
            self.train_workers,
            method,
            args,
            self.cfg.actor.call_timeout,
            wrap=lambda w, call: self.tracer.timed(w.node.node_id, method, call, lane="main"),
        )

    async def free(self, refs: list[ShardRef]) -> None:
        """Free shards on their owners and every node holding a pulled copy, in one fan-out."""
        keys = sorted({r.key for r in refs})
        if keys:
            await asyncio.gather(
                *(
                    p.handle.call("free", {"keys": keys})
                    for p in self.cluster.nodes
                    if not p.handle.lost
                )
            )

    # ---- evaluation, checkpoints, metrics ---------------------------------------------------
    async def evaluate(self) -> dict:
        """Mean reward (accuracy for 0/1 rewards) on the held-out rows."""
        cfg = self.cfg.evaluator
        n = len(self.rollout.workers)
        chunks = [self.eval_rows[i::n] for i in range(n)]
        scores = await asyncio.gather(
            *(
                w.evaluate(chunk, cfg.n_samples, cfg.temperature)
                for w, chunk in zip(self.rollout.workers, chunks, strict=True)
                if chunk
            )
        )
        flat = [s for part in scores for s in part]
        return {"eval/accuracy": sum(flat) / max(1, len(flat)), "eval/n": len(flat)}

    async def save_hf(self) -> Path:
        """Export the policy as an HF folder loadable by from_pretrained."""
        path = self.cfg.run_path / "checkpoints" / f"step{self.step}"
        path.parent.mkdir(parents=True, exist_ok=True)
        await self.ranks.save_hf(str(path), self.cfg.saver.lora_merged)
        return path

    async def save_recovery(self, stopped: bool = False) -> tuple[Path, float]:
        """The train ranks' state (data only: `arl.ckpt.rank_state`) plus the loop state at the
        end of the last step, written atomically; returns (its folder, seconds it took)."""
        t0 = time.monotonic()
        rollout = self._step_state if self._step_state is not None else self.rollout.state_dict()
        state = RecoveryState(
            step=self.step,
            version=self.version,
            rollout=rollout,
            stopped=stopped,
            carry=self._carry,
        )
        async with self.saver.write(state) as path:
            nbytes = sum(await self.ranks.save_state(str(path / "model")))
        seconds = time.monotonic() - t0
        self._last_save, self._save_s = time.monotonic(), seconds
        final = self.saver.root / f"step{self.step}"
        log.info(
            "recovery checkpoint of step %d: %.1f MiB in %.1f s -> %s",
            self.step,
            nbytes / 2**20,
            seconds,
            final,
        )
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
        if self.cfg.weight_sync.verify:
            await self.verify_weights()

    def _filter(self) -> Any:
        """The ``rollout.filter`` accept function, or None to accept every group."""
        if not self.cfg.rollout.filter:
            return None
        prefixes = tuple(self.cfg.cluster.allowed_import_prefixes)
        return resolve_import(self.cfg.rollout.filter, prefixes)

    def _rollout_metrics(self, infos: list[GroupReport]) -> dict:
        rewards = [r for i in infos for r in i.episode_rewards]
        staleness = [self.version - 1 - i.min_version for i in infos]
        s = self.rollout.stats
        return {
            "rollout/reward_mean": sum(rewards) / max(1, len(rewards)),
            "rollout/accuracy": sum(r > 0 for r in rewards) / max(1, len(rewards)),
            "rollout/gen_tokens": sum(i.n_gen_tokens for i in infos),
            "rollout/staleness": staleness,
            "rollout/staleness_max": max(staleness, default=0),
            # Groups whose tokens come from more than one policy version (a sync interrupted
            # them and they went on under the new weights).
            "rollout/version_switches": sum(i.max_version > i.min_version for i in infos),
            "rollout/submitted": s.submitted,
            "rollout/accepted": s.accepted,
            "rollout/failed": s.failed,
            "rollout/rejected": s.rejected,
            "rollout/rejected_samples": s.rejected_samples,
            "rollout/stale_dropped": s.stale_dropped,
            "rollout/stale_kept": s.stale_kept,
            "rollout/timed_out": s.timed_out,
            "batch/data_ids": [i.data_id for i in infos],
        }

    def _trace_step(self, t0: float, t_batch: float, t_train: float, t_sync: float) -> None:
        """The step's phases on the trainer's row, and the weight sync on every train rank's."""
        tr = self.tracer
        tr.add("trainer", "wait_rollout", t0, t_batch, cat="wait", step=self.step)
        tr.add("trainer", "train", t_batch, t_train, cat="train", step=self.step)
        tr.add("trainer", "weight_sync", t_train, t_sync, cat="sync", version=self.version)
        for p in self.cluster.train:
            tr.add(p.handle.node_id, "weight_sync", t_train, t_sync, cat="sync")
        tr.flush()

    async def _node_gauges(self) -> dict:
        """Each node's shard-store gauges, asked for now (after this step's shards were freed)
        rather than taken from its last heartbeat, which may date from the middle of a sync."""
        nodes = [p.handle for p in self.cluster.nodes]
        stats = await asyncio.gather(*(n.call("ping") for n in nodes))
        return {
            f"node/{n.node_id}/{key}": s.get(key, 0)
            for n, s in zip(nodes, stats, strict=True)
            for key in ("bytes_held", "n_shards")
        }

    def _open_progress(self, total: int) -> None:
        if self.cfg.stats.progress_bar:
            from tqdm import tqdm

            self.progress = tqdm(
                total=total, initial=self.step, desc="train", unit="step", dynamic_ncols=True
            )

    def _update_progress(self, m: dict) -> None:
        if self.progress is not None:
            post = {
                "reward": f"{m['rollout/reward_mean']:.3f}",
                "acc": f"{m['rollout/accuracy']:.2f}",
                "v": self.version,
            }
            if "eval/accuracy" in m:
                post["eval"] = f"{m['eval/accuracy']:.2f}"
            self.progress.set_postfix(post)
            self.progress.update(1)

    def summary(self, wall_s: float) -> str:
        """The run's last lines: steps, wall time, final reward and accuracy, and its files."""
        m, run = self.last_metrics, self.cfg.run_path
        minutes, seconds = divmod(round(wall_s), 60)
        steps = f"{self.step} step{'s' if self.step != 1 else ''}"
        if self.resumed_from is not None:  # the wall time is this attempt's
            done_here = self.step - self.resumed_from
            steps += f" ({done_here} in this attempt, resumed from step {self.resumed_from})"
        lines = [f"done: {steps} in {minutes} min {seconds:02d} s"]
        if m:
            lines[0] += (
                f"; last step: reward {m['rollout/reward_mean']:.3f}, "
                f"accuracy {m['rollout/accuracy']:.2f}"
            )
        if self.last_eval is not None:
            step, e = self.last_eval
            acc, n = e["eval/accuracy"], e["eval/n"]
            lines[0] += f"; held-out accuracy {acc:.2f} ({n} questions, step {step})"
        files = [
            ("metrics", self.stats.jsonl_path),
            ("TensorBoard", run / "tensorboard"),  # tensorboard --logdir DIR
            ("trace", self.tracer.path),
            ("checkpoints", run / "checkpoints"),
            ("recovery", run / "recover"),
        ]
        lines += [f"  {name:<12} {path}" for name, path in files if path and Path(path).exists()]
        if self.stats.jsonl_path is not None:
            lines.append(
                f"plot: python -m arl.stats.plot {self.stats.jsonl_path} -o {run / 'curve.png'}"
                "  (pip install -e '.[plot]')"
            )
        return "\n".join(lines)

    async def close(self) -> None:
        """Stop rollout, end the weight sync's node halves, close the loggers (the cluster
        ends the processes)."""
        if self.rollout is not None:
            await self.rollout.stop()
        if self.weight_sync is not None:
            await self.weight_sync.close()
        if self.progress is not None:
            self.progress.close()
        self.stats.close()
        self.tracer.close()
