"""Nodes placed by Ray: each ``arl-node`` runs under a Ray actor (``cluster.launcher=ray``).

Ray only places and supervises processes; everything between the nodes and the controller still
goes over arl's own ZeroMQ sockets, exactly as in the local and Slurm modes.

- One placement group reserves the whole plan at once, one bundle per node: ``{"CPU": c}`` plus
  ``{"GPU": g}`` for a node with ``g`` GPUs. A bundle never spans hosts, so the GPUs of one
  tensor-parallel inference replica stay together; ``cluster.ray_placement_strategy`` says how
  the bundles spread (PACK by default). The group is removed when the run ends.
- Each node's actor (`NodeProcess`) starts the same ``python -m arl.node`` program as
  the other launchers, as a subprocess, rather than running the daemon inside the actor: the
  daemon keeps its own event loop, signal handlers and ``os._exit``, and Ray's worker keeps its.
  Ray sets the subprocess's CUDA_VISIBLE_DEVICES to the GPUs it granted the actor.
- The daemon dies with its actor: Ray ends the children of a worker that exits (``ray.kill``),
  and for a worker that crashes the daemon was forked with PR_SET_PDEATHSIG from a thread that
  lives as long as the daemon. The controller then sees the node go silent and, after
  ``cluster.heartbeat_timeout``, fails its in-flight calls with `NodeLost` naming it, as when
  a local node is killed; the launcher logs which actor died.
- Leaving the block (normally, on an exception or Ctrl-C) stops every daemon (SIGTERM, SIGKILL
  after the grace period), kills every actor, removes the placement group, and disconnects
  from Ray (ending Ray too when ``ray_address=local`` started it). The actors belong to this
  driver, so Ray also ends them if the launcher dies without cleaning up.
- The run secret travels in the actor's constructor arguments (kept by Ray, never on a command
  line or in a log) into the daemon's environment. Anyone who may run code on the Ray cluster
  can read it there, as anyone on a Slurm node could: trust the cluster's users.

``ray`` is imported here, lazily, and nowhere else: arl's core runs without it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from arl.config import ConfigError
from arl.control.launcher import node_command
from arl.process import OwnedProcess, spawn
from arl.protocol.plan import NodeSpec
from arl.wire.addresses import is_loopback
from arl.wire.sockets import SECRET_ENV, Security

log = logging.getLogger("arl.ray")


def import_ray() -> Any:
    """``import ray``, or an error that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ConfigError(
            f"cluster.launcher=ray needs the ray package ({e}); install it with "
            "`pip install 'arl[ray]'` on this host and on every Ray node"
        ) from None
    return ray


class NodeProcess:
    """The body of one node's Ray actor: starts the ``arl-node`` daemon and supervises it.

    Constructed by Ray on the host it placed the actor on; ``args`` is the daemon's command
    line after the interpreter (the actor's own interpreter runs it).
    """

    def __init__(self, args: list[str], env: dict[str, str], cwd: str):
        self.owned: OwnedProcess | None = None
        self.proc: subprocess.Popen | None = None  # self.owned's leader
        self._started, self._done = threading.Event(), threading.Event()
        self._error: BaseException | None = None
        # PDEATHSIG fires when the *thread* that forked the child ends, so fork from a thread
        # that lives exactly as long as the daemon (it waits on it), not from Ray's task threads.
        threading.Thread(
            target=self._supervise, args=(args, env, cwd), name="arl-node", daemon=True
        ).start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _supervise(self, args: list[str], env: dict[str, str], cwd: str) -> None:
        try:
            self.owned = spawn(
                [sys.executable, *args],
                env={**os.environ, **env},
                cwd=cwd if os.path.isdir(cwd) else None,  # the launcher's directory, if shared
            )
            self.proc = self.owned.popen
        except BaseException as e:
            self._error = e
            return
        finally:
            self._started.set()
        self.proc.wait()
        self._done.set()

    def info(self) -> dict:
        """Where the daemon runs: host, address, pid and the GPUs Ray granted."""
        import ray

        assert self.proc is not None
        return {
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "pid": self.proc.pid,
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def wait(self) -> int:
        """Block until the daemon exits; its exit status."""
        self._done.wait()
        assert self.proc is not None
        return self.proc.returncode

    def stop(self, grace: float) -> int:
        """End the daemon's process group: SIGTERM, then SIGKILL after ``grace`` seconds."""
        assert self.owned is not None and self.proc is not None
        self.owned.stop_sync(grace)
        self._done.wait()
        return self.proc.returncode


class _HideThreadWarning(logging.Filter):
    """Drops Ray's note that it installs no SIGTERM handler off the main thread (wanted here:
    the launcher, not Ray, decides what SIGTERM does)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class RayNodes:
    """Place the nodes of a plan on a Ray cluster; an async context manager that ends them.

    ``async with RayNodes(...) as nodes`` connects to Ray and reserves the plan's resources;
    `controller_host` then says which address the nodes can reach the controller at, and
    ``await nodes.start(controller)`` starts one actor (and daemon) per node.
    """

    def __init__(
        self,
        security: Security,
        specs: Sequence[NodeSpec],
        *,
        node_ids: Sequence[str],
        address: str = "auto",
        namespace: str = "arl",
        cpus: Mapping[str, float] | None = None,
        strategy: str = "PACK",
        placement_timeout: float = 300.0,
        cpu_threads: int | None = None,
        grace: float = 10.0,
        **command_kw: Any,
    ):
        colocated = [n for n in specs if n.colocated and n.gpu_ids]
        if colocated:
            raise ConfigError(
                "cluster.launcher=ray gives every node GPUs of its own, but this plan shares GPUs "
                f"between rollout and training ({len(colocated)} colocated nodes); give the run "
                "enough GPUs for both (cluster.n_gpus), or use cluster.launcher=local"
            )
        self.security, self.specs = security, list(specs)
        self.node_ids = list(node_ids)
        if len(self.node_ids) != len(self.specs):
            raise ValueError(f"{len(self.node_ids)} node ids for {len(self.specs)} nodes")
        self.address, self.namespace = address, namespace
        self.cpus = {"rollout": 1.0, "train": 1.0, **(cpus or {})}
        self.strategy, self.placement_timeout = strategy, placement_timeout
        self.cpu_threads, self.grace, self.command_kw = cpu_threads, grace, command_kw
        self.tag = f"{os.getpid()}-{secrets.token_hex(3)}"  # names of this run's actors
        self.actors: dict[str, Any] = {}
        self.infos: dict[str, dict] = {}
        self._ray: Any = None
        self._owns_connection = False
        self._pg: Any = None
        self._watchers: list[asyncio.Task] = []
        self._closing = False
        self.ended: str | None = None  # the first node that ended while the run needed it

    def bundles(self) -> list[dict[str, float]]:
        """One resource bundle per node, in plan order."""
        out = []
        for spec in self.specs:
            bundle = {"CPU": float(self.cpus[spec.role])}
            if spec.gpu_ids:
                bundle["GPU"] = float(len(spec.gpu_ids))
            out.append(bundle)
        return out

    def actor_name(self, node_id: str) -> str:
        """The Ray actor name of a node (in ``namespace``)."""
        return f"arl-{self.tag}-{node_id}"

    async def __aenter__(self) -> RayNodes:
        try:
            await self._connect()
            await self._reserve()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _connect(self) -> None:
        ray = self._ray = import_ray()
        if ray.is_initialized():  # an embedding program already holds the connection
            return
        need = self.bundles()
        kw: dict[str, Any] = {"namespace": self.namespace, "log_to_driver": True}
        if self.address == "local":
            # A private Ray for this run: logical CPUs enough for the plan even on a small host.
            kw["num_cpus"] = max(os.cpu_count() or 1, math.ceil(sum(b["CPU"] for b in need)))
            kw["include_dashboard"] = False
        else:
            kw["address"] = self.address
            await asyncio.to_thread(_probe, self.address)
        hide = _HideThreadWarning()
        ray_log = logging.getLogger("ray")
        for h in [*ray_log.handlers, *logging.getLogger().handlers]:
            h.addFilter(hide)
        try:
            await asyncio.to_thread(ray.init, **kw)  # connecting blocks for a second or more
        except ConnectionError as e:
            raise ConfigError(
                f"cluster.ray_address={self.address!r}: cannot reach a Ray cluster ({e}); start "
                "one with `ray start --head`, point ray_address at its head (HOST:PORT or "
                "ray://HOST:10001), or use ray_address=local"
            ) from None
        finally:
            for h in [*ray_log.handlers, *logging.getLogger().handlers]:
                h.removeFilter(hide)
        self._owns_connection = True
        log.info("connected to Ray at %s (namespace %s)", self.address, self.namespace)

    async def _reserve(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group, remove_placement_group

        need = self.bundles()
        gpus = sum(b.get("GPU", 0.0) for b in need)
        have = ray.cluster_resources()
        if gpus > have.get("GPU", 0.0):
            raise ConfigError(
                f"the placement plan needs {gpus:g} GPUs but the Ray cluster has "
                f"{have.get('GPU', 0.0):g}; lower cluster.n_gpus (or d/t in the backend strings), "
                "or add GPU nodes to the Ray cluster"
            )
        self._pg = placement_group(need, strategy=self.strategy, name=f"arl-{self.tag}")
        try:
            await asyncio.wait_for(self._pg.ready(), self.placement_timeout)
        except TimeoutError:
            pg, self._pg = self._pg, None
            remove_placement_group(pg)
            raise RuntimeError(
                f"Ray did not reserve the nodes' resources within {self.placement_timeout:g}s "
                f"({len(need)} bundles {need}, strategy {self.strategy}); the cluster has "
                f"{_fmt(have)}, free now {_fmt(ray.available_resources())}. Free or add "
                "resources, lower cluster.ray_rollout_cpus/ray_train_cpus, or wait longer "
                "(cluster.ray_placement_timeout)"
            ) from None
        log.info("Ray reserved %d bundles (%s): %s", len(need), self.strategy, need)

    def controller_host(self, host: str) -> str:
        """The address nodes can reach the controller at: ``host``, unless that is loopback and
        some Ray node is on another host; then this host's address as Ray knows it."""
        if not is_loopback(host):
            return host
        here = self._ray.util.get_node_ip_address()
        hosts = {n["NodeManagerAddress"] for n in self._ray.nodes() if n.get("Alive")}
        if all(h == here or is_loopback(h) for h in hosts):
            return host
        log.info("Ray nodes on other hosts (%s): the controller binds %s", sorted(hosts), here)
        return here

    async def start(self, controller: str) -> None:
        """Start one actor (and so one ``arl-node``) per node of the plan."""
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = ray.remote(NodeProcess)
        for i, (spec, node_id) in enumerate(zip(self.specs, self.node_ids, strict=True)):
            args = node_command(
                controller, node_id=node_id, curve=self.security.curve, **self.command_kw
            )[1:]
            cpus = self.cpus[spec.role]
            threads = self.cpu_threads or max(1, int(cpus))
            env = {SECRET_ENV: self.security.secret, "OMP_NUM_THREADS": str(threads)}
            self.actors[node_id] = actor_class.options(
                name=self.actor_name(node_id),
                namespace=self.namespace,
                num_cpus=cpus,
                num_gpus=len(spec.gpu_ids),
                max_concurrency=2,  # wait() blocks one thread; stop() and info() use the other
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i
                ),
            ).remote(args, env, os.getcwd())
        infos = await asyncio.wait_for(
            asyncio.gather(*(a.info.remote() for a in self.actors.values())),
            self.placement_timeout,
        )
        for (node_id, actor), info in zip(self.actors.items(), infos, strict=True):
            self.infos[node_id] = info
            log.info(
                "node %s: Ray actor on %s (%s), daemon pid %d, GPUs %s",
                node_id,
                info["host"],
                info["ip"],
                info["pid"],
                ",".join(info["gpus"]) or "none",
            )
            self._watchers.append(asyncio.create_task(self._watch(node_id, actor)))

    async def _watch(self, node_id: str, actor: Any) -> None:
        try:
            rc = await actor.wait.remote()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the actor died (ray.kill, a crashed worker, a lost Ray node)
            if not self._closing:
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.error("node %s: its Ray actor died (%s); its daemon dies with it", node_id, why)
                self.ended = self.ended or f"the Ray actor of node {node_id} died ({why})"
            return
        if not self._closing:
            log.warning("node %s: its daemon exited with status %s", node_id, rc)
            self.ended = self.ended or f"node {node_id}'s daemon exited with status {rc}"

    async def close(self) -> None:
        """Stop every daemon, kill every actor, remove the placement group, leave Ray."""
        self._closing = True
        ray = self._ray
        if ray is None:
            return
        stops = [a.stop.remote(self.grace) for a in self.actors.values()]
        if stops:
            done, _ = await asyncio.wait(
                [asyncio.ensure_future(s) for s in stops], timeout=self.grace + 30
            )
            for fut in done:
                if not fut.cancelled():
                    fut.exception()  # an actor that already died has nothing left to stop
        for node_id, actor in self.actors.items():
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # Ray itself is gone: nothing of it is left to end
                log.warning("could not kill the Ray actor of node %s: %s", node_id, e)
        for w in self._watchers:
            w.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await self._until_gone(list(self.actors))
        self.actors.clear()
        self._watchers.clear()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_connection:
            self._owns_connection = False
            await asyncio.to_thread(ray.shutdown)

    async def _until_gone(self, node_ids: list[str], timeout: float = 30.0) -> None:
        """Wait until Ray has processed the kills (``ray.kill`` only asks), so that nothing of
        the run is registered when `close` returns."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        left = node_ids
        while left:
            left = [n for n in left if self._registered(self.actor_name(n))]
            if not left or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
        if left:
            log.warning("Ray still lists the actors of nodes %s after %gs", left, timeout)

    def _registered(self, name: str) -> bool:
        try:
            self._ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return False
        return True


def _probe(address: str, timeout: float = 10.0) -> None:
    """Fail fast on a Ray head that is not there: ``ray.init`` would retry it for minutes."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "")  # else Ray finds the local one, or says so
    if not address or address.startswith("ray://") or address in ("auto", "local"):
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(
            f"cluster.ray_address={address!r} is not HOST:PORT, ray://HOST:PORT, auto or local"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConfigError(
            f"cluster.ray_address={address!r}: no Ray head answers there ({e}); start one with "
            "`ray start --head --port=PORT`, or use ray_address=local to start one for this run"
        ) from None


def _fmt(resources: Mapping[str, float]) -> str:
    keys = ("CPU", "GPU")
    return ", ".join(f"{k} {resources.get(k, 0.0):g}" for k in keys)
