"""Bring up a run's processes from its config: controller, nodes, roles (DESIGN §1, §8).

``async with start_cluster(cfg, plan) as cluster`` binds the controller, starts the nodes the
way ``cluster.launcher`` says (local subprocesses, one ``srun`` step, Ray actors, or none for
attach), waits for them to say hello, and pairs each with its place in the plan. Leaving the
block ends every process it started, whatever the reason. Each mode is a `Launcher` in
`arl.control.launchers.LAUNCHERS`; a new mode is one more class and its entry there.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Protocol

import attrs

from arl.config import Config, ConfigError
from arl.control.controller import BindError, Controller, NodeHandle
from arl.control.launcher import LocalNodes, SlurmNodes
from arl.control.launchers import launcher_class
from arl.control.mps import MpsDaemon, mps_node_env, start_daemon
from arl.control.mps import wanted as mps_wanted
from arl.control.placement import check_node_count, shares_gpu
from arl.control.ray_launcher import RayNodes
from arl.protocol.node_config import NodeConfig
from arl.protocol.plan import NodeSpec, Plan
from arl.wire.addresses import is_loopback
from arl.wire.sockets import (
    SECRET_ENV,
    AuthError,
    Security,
    new_secret,
    read_secret_file,
    routable_host,
)

log = logging.getLogger("arl.cluster")


@attrs.define
class PlacedNode:
    """A live node and the plan entry it fills; ``device`` is as the node itself sees it."""

    handle: NodeHandle
    spec: NodeSpec

    @property
    def device(self) -> str:
        """The torch device for engines on this node (GPUs are renumbered from 0 per node)."""
        return "cuda:0" if self.spec.gpu_ids else "cpu"


@attrs.define
class Cluster:
    """The controller plus the run's nodes by role, and the plan they were started from."""

    controller: Controller
    rollout: list[PlacedNode]
    train: list[PlacedNode]
    plan: Plan

    @property
    def nodes(self) -> list[PlacedNode]:
        """Every node, rollout first."""
        return [*self.rollout, *self.train]


def run_security(cfg: Config) -> Security:
    """The run secret: transport.secret_file, else $ARL_SECRET, else a fresh one (not for
    attach: its nodes could not know it); a secret file that cannot be used is a `ConfigError`
    naming it."""
    if cfg.transport.secret_file:
        try:
            secret = read_secret_file(cfg.transport.secret_file)
        except (AuthError, OSError) as e:
            raise ConfigError(f"transport.secret_file={cfg.transport.secret_file}: {e}") from None
    elif os.environ.get(SECRET_ENV):
        secret = os.environ[SECRET_ENV]
    elif cfg.cluster.launcher == "attach":
        raise ConfigError(
            "cluster.launcher=attach: the nodes started elsewhere must know the run secret, and "
            "none is set; put one in a 0600 file F, set transport.secret_file=F and start the "
            f"nodes with `arl-node ... --secret-file F` (or export ${SECRET_ENV} for both sides)"
        )
    else:
        secret = new_secret()
    return Security(secret, curve=cfg.transport.curve)


def node_config(cfg: Config) -> NodeConfig:
    """What every node applies from the run's config, sent in the controller's hello reply:
    also a node a job script started with default flags (``cluster.launcher=attach``)."""
    c, t = cfg.cluster, cfg.transport
    return NodeConfig(
        heartbeat_interval=c.heartbeat_interval,
        heartbeat_timeout=c.heartbeat_timeout,
        allowed_import_prefixes=tuple(c.allowed_import_prefixes),
        max_message_bytes=t.max_message_bytes,
        pull_chunk_bytes=t.pull_chunk_bytes,
        shared_memory=t.shared_memory,
    )


def node_env(spec: NodeSpec, cfg: Config, plan: Sequence[NodeSpec] = ()) -> dict[str, str]:
    """Environment of a locally spawned node of ``plan``: its GPUs and, without one, its CPU
    threads (`cpu_threads`).

    The plan numbers GPUs as this process sees them; under a ``CUDA_VISIBLE_DEVICES`` of the
    launcher's own (``3,5``) plan GPU 0 is device 3, so the node is given that one.
    """
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    visible = [d for d in visible if d]
    gpus = [visible[i] if i < len(visible) else str(i) for i in spec.gpu_ids]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
    threads = cfg.cluster.cpu_threads_per_node
    if not spec.gpu_ids:
        if threads is None:
            threads = cpu_threads(spec, plan or [spec])
        if "OMP_WAIT_POLICY" not in os.environ:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def cpu_threads(spec: NodeSpec, plan: Sequence[NodeSpec], cores: int | None = None) -> int:
    """Torch threads of a GPU-less node of ``plan`` on a host of ``cores`` (this one's).

    Rollout runs ahead of training and then waits on the staleness bound, so on a CPU host the
    train step is the long phase: each train node takes the host's cores (shared among the
    train nodes), each rollout node its share of them among all the nodes. The two then
    overlap on some cores, which costs little because `node_env` makes OpenMP's idle threads
    sleep (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning on a core the other process needs.
    Measured on 2 cores (docs/results.md): the quick start in 71.5 s against 81.4 s with the
    cores split one each; the same threads with spinning waits took 85.1 s.
    """
    cores = cores or os.cpu_count() or 1
    if spec.role == "train":
        share = sum(1 for s in plan if s.role == "train" and not s.gpu_ids)
    else:
        share = len(plan)
    return max(1, cores // max(1, share))


def _bind_problem(e: BindError) -> str:
    """What to change when the controller cannot bind ``cluster.controller_host:port``."""
    where = f"tcp://{e.host}:{e.port}"
    if e.errno == errno.EADDRINUSE:
        return (
            f"cluster.controller_port={e.port}: {where} is already in use (another run or "
            "program listens there); choose another port, or cluster.controller_port=0 to "
            "pick a free one"
        )
    if e.errno == errno.EADDRNOTAVAIL:
        return (
            f"cluster.controller_host={e.host}: not an address of this machine ({e.reason}); "
            "use 127.0.0.1 for a run on one machine, or this host's own name or address"
        )
    return (
        f"the controller cannot listen at {where} ({e.reason}); check "
        "cluster.controller_host and cluster.controller_port"
    )


class Launcher(Protocol):
    """How one launch mode starts the nodes of a plan; `start_cluster` drives every mode alike.

    `prepare` runs before the controller binds (Ray connects and reserves there, since Ray
    decides where the nodes run); `controller_host` is the address nodes can reach the
    controller at; `start` starts the nodes, which then connect to ``controller``; while the
    run waits for them, `exited` names a started process that has ended (no node of it will
    come) and `hint` says what to check when they do not come in time; `close` ends
    whatever `prepare` and `start` set up. `close` must be safe to call more than once: it runs
    while the controller is still up (the nodes end first) and again at the very end, which
    also covers a failed `prepare` or a controller that could not bind.
    """

    async def prepare(self) -> None: ...

    def controller_host(self, host: str) -> str: ...

    async def start(self, controller: str) -> None: ...

    def exited(self) -> str | None: ...

    def hint(self, controller: str) -> str: ...

    async def close(self) -> None: ...


@attrs.frozen
class LaunchRequest:
    """What every launcher is built from: the run's config, the plan's nodes, the secret and
    the node names."""

    cfg: Config
    plan: Sequence[NodeSpec]
    security: Security
    names: list[str]

    @property
    def command_kw(self) -> dict:
        """The `node_command` settings every node gets: what the hello reply's `node_config`
        replaces, given here too so the node has them from its start (the heartbeat timeout
        bounds its wait for the controller) and its data socket binds with the run's cap."""
        c = self.cfg.cluster
        return dict(
            allowed_prefixes=c.allowed_import_prefixes,
            heartbeat_interval=c.heartbeat_interval,
            heartbeat_timeout=c.heartbeat_timeout,
            max_message_bytes=self.cfg.transport.max_message_bytes,
        )


class _LocalLauncher:
    """``local``: one ``arl-node`` subprocess per plan entry on this machine; with
    ``rollout.gpu_sharing=mps`` (or auto, where it can) and an engine on a train rank's GPU,
    a private MPS daemon (`arl.control.mps`) started before the nodes and ended after them."""

    def __init__(self, req: LaunchRequest) -> None:
        self.req, self.nodes = req, None
        self.mps: MpsDaemon | None = None
        rollout = [s for s in req.plan if s.role == "rollout"]
        train = [s for s in req.plan if s.role == "train"]
        self.shared = {s.node_id for s in rollout if shares_gpu(s, train)}
        # mps without its daemon is a config error, before anything starts; auto goes without
        self.use_mps = mps_wanted(req.cfg.rollout.gpu_sharing, bool(self.shared))
        if req.cfg.rollout.gpu_sharing == "auto" and self.shared and not self.use_mps:
            log.info(
                "rollout.gpu_sharing=auto: no nvidia-cuda-mps-control on PATH; the engines "
                "time-slice the GPU with the train ranks (as concurrent)"
            )

    async def prepare(self) -> None:
        pass

    def controller_host(self, host: str) -> str:
        return host

    async def start(self, controller: str) -> None:
        r = self.req
        envs = [node_env(s, r.cfg, r.plan) for s in r.plan]
        if self.use_mps:
            self.mps = await start_daemon(r.cfg.run_path / "mps", r.cfg.rollout.gpu_sharing)
        if self.mps is not None:
            pct = r.cfg.rollout.mps_engine_percent
            for spec, env in zip(r.plan, envs, strict=True):
                shared = spec.node_id in self.shared
                env.update(mps_node_env(spec.role, spec.gpu_ids, shared, self.mps.client_env, pct))
        self.nodes = LocalNodes(controller, r.security, envs, node_ids=r.names, **r.command_kw)
        await self.nodes.__aenter__()

    def exited(self) -> str | None:
        return self.nodes.exited() if self.nodes is not None else None

    def hint(self, controller: str) -> str:
        return _SLOW_START

    async def close(self) -> None:
        if self.nodes is not None:
            await self.nodes.close()
            self.nodes = None
        if self.mps is not None:  # after its clients, the nodes, have ended
            await self.mps.stop()
            self.mps = None


class _SlurmLauncher:
    """``slurm``: one ``srun arl-node`` step inside the current allocation."""

    def __init__(self, req: LaunchRequest) -> None:
        self.req, self.nodes = req, None

    async def prepare(self) -> None:
        pass

    def controller_host(self, host: str) -> str:
        several_hosts = os.environ.get("SLURM_JOB_NUM_NODES", "1") != "1"
        if is_loopback(host) and several_hosts:
            return routable_host()  # nodes on other hosts must reach the controller
        return host

    async def start(self, controller: str) -> None:
        r = self.req
        srun_args = r.cfg.cluster.srun_args
        self.nodes = SlurmNodes(
            controller, r.security, len(r.plan), srun_args=srun_args, **r.command_kw
        )
        await self.nodes.__aenter__()

    def exited(self) -> str | None:
        return self.nodes.exited() if self.nodes is not None else None

    def hint(self, controller: str) -> str:
        return (
            "srun may still wait for resources (`squeue --me`), or the nodes cannot reach "
            f"{controller} (set cluster.controller_host to an address they can reach); "
            + _SLOW_START
        )

    async def close(self) -> None:
        if self.nodes is not None:
            await self.nodes.__aexit__(None, None, None)
            self.nodes = None


class _RayLauncher:
    """``ray``: one Ray actor per node, in one placement group, starts and supervises it."""

    def __init__(self, req: LaunchRequest) -> None:
        c = req.cfg.cluster
        self.nodes = RayNodes(
            req.security,
            req.plan,
            node_ids=req.names,
            address=c.ray_address,
            namespace=c.ray_namespace,
            cpus={"rollout": c.ray_rollout_cpus, "train": c.ray_train_cpus},
            strategy=c.ray_placement_strategy,
            placement_timeout=c.ray_placement_timeout,
            cpu_threads=c.cpu_threads_per_node,
            **req.command_kw,
        )

    async def prepare(self) -> None:
        await self.nodes.__aenter__()

    def controller_host(self, host: str) -> str:
        return self.nodes.controller_host(host)

    async def start(self, controller: str) -> None:
        await self.nodes.start(controller)

    def exited(self) -> str | None:
        return self.nodes.ended  # the driver shows the daemon's own output (log_to_driver)

    def hint(self, controller: str) -> str:
        return f"the Ray hosts may not reach {controller}; " + _SLOW_START

    async def close(self) -> None:
        await self.nodes.close()


class _AttachLauncher:
    """``attach``: starts nothing; a job script runs ``arl-node --controller ...`` itself."""

    def __init__(self, req: LaunchRequest) -> None:
        self.n_nodes = len(req.plan)
        self.secret_file = req.cfg.transport.secret_file
        self.fixed_port = req.cfg.cluster.controller_port != 0

    async def prepare(self) -> None:
        pass

    def controller_host(self, host: str) -> str:
        return host

    async def start(self, controller: str) -> None:
        log.warning("waiting for %d nodes to attach to %s", self.n_nodes, controller)

    def exited(self) -> str | None:
        return None  # nothing was started here

    def hint(self, controller: str) -> str:
        secret = (
            f" --secret-file {self.secret_file}`" if self.secret_file else f"` with ${SECRET_ENV}"
        )
        how = (
            f"start {self.n_nodes} with `arl-node --controller {controller}{secret} "
            "(launch/arl.sbatch does it all)"
        )
        if not self.fixed_port:
            how += "; cluster.controller_port=0 picks a new port each run: set a fixed one"
        return how

    async def close(self) -> None:
        pass


_SLOW_START = "on a loaded machine, raise cluster.node_start_timeout"


@asynccontextmanager
async def start_cluster(
    cfg: Config, plan: Plan, security: Security | None = None
) -> AsyncIterator[Cluster]:
    """Start (or attach to) the nodes of ``plan`` and yield them by role."""
    check_node_count(cfg, plan)  # a plan made elsewhere (an embedding program) is checked too
    security = security or run_security(cfg)
    c = cfg.cluster
    names = [f"{s.role}{s.rank}" for s in plan.nodes]
    launcher = launcher_class(c.launcher)(LaunchRequest(cfg, plan.nodes, security, names))
    async with AsyncExitStack() as stack:
        stack.push_async_callback(launcher.close)  # last out: also after a failed prepare
        await launcher.prepare()
        host = launcher.controller_host(c.controller_host)
        controller = Controller(
            security,
            host=host,
            port=c.controller_port,
            heartbeat_interval=c.heartbeat_interval,
            heartbeat_timeout=c.heartbeat_timeout,
            max_message_bytes=cfg.transport.max_message_bytes,
            inline_threshold=cfg.transport.inline_threshold_bytes,
            node_config=node_config(cfg),
        )
        try:
            ctl = await stack.enter_async_context(controller)
        except BindError as e:
            raise ConfigError(_bind_problem(e)) from None
        stack.push_async_callback(launcher.close)  # the nodes end while the controller is up
        await launcher.start(ctl.address)
        # The launcher starts the nodes before importing torch (`arl.launch`); the controller
        # imports it now, while they start, in a thread: in the event loop the import would
        # hold the loop for a second or more as the nodes say hello.
        torch_imported = asyncio.get_running_loop().run_in_executor(
            None, importlib.import_module, "torch"
        )
        # Unwound before the launchers end the nodes: their exits then are expected, not losses.
        stack.callback(ctl.expect_exits)
        handles = await ctl.wait_for_nodes(
            len(plan.nodes),
            timeout=c.node_start_timeout,
            stop_if=launcher.exited,
            hint=launcher.hint(ctl.address),
        )
        await torch_imported
        by_name = {h.node_id: h for h in handles}
        if set(names) <= set(by_name):
            placed = [
                PlacedNode(by_name[name], s) for name, s in zip(names, plan.nodes, strict=True)
            ]
        else:  # nodes named themselves (srun, attach): fill the plan in a stable order
            ordered = sorted(handles, key=lambda h: (h.info.get("host", ""), h.node_id))
            placed = [PlacedNode(h, s) for h, s in zip(ordered, plan.nodes, strict=True)]
        yield Cluster(
            ctl,
            [p for p in placed if p.spec.role == "rollout"],
            [p for p in placed if p.spec.role == "train"],
            plan,
        )
