"""Training hosting on a train node: one FSDP2 rank and the batch it is working on.

The controller creates one `TrainWorker` per rank and drives a step as a few calls that every
rank runs together (they share collectives, so the node runs them on its engine thread in call
order): ``load_batch(rtensor)`` (the node pulls this rank's shards first), ``compute_logp``,
``compute_ref_logp``, ``compute_advantages``, ``ppo_update``. Between calls the batch stays
here; only small statistics travel back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from arl.algo.packing import concat_shards
from arl.engines.fsdp import FSDPEngine
from arl.engines.hf import checksum_named_tensors
from arl.engines.weight_transfer import (
    BroadcastGroup,
    BucketLayout,
    CudaIpcSender,
    broadcast_buckets,
    plan_buckets,
)
from arl.wire.codec import parse_dtype


def _actor_config(actor: dict) -> Any:
    from arl.config import ActorConfig, converter

    return converter.structure(actor, ActorConfig)


class TrainWorker:
    """One data-parallel rank: the FSDP engine plus the current step's batch."""

    def __init__(
        self,
        actor: dict,
        *,
        rank: int,
        world_size: int,
        init_method: str,
        device: str = "cpu",
        seed: int = 1,
        ref_path: str | None = None,
        total_steps: int | None = None,
    ):
        if device == "cpu" and os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self.rank = rank
        self.engine = FSDPEngine(
            _actor_config(actor),
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            device=device,
            seed=seed,
            ref_path=ref_path or None,
            total_steps=total_steps,
        )
        self.batch: dict[str, torch.Tensor] | None = None
        self.node: Any = None
        self.n_steps = 0  # load_batch calls: the steps this rank has started
        self._profile: tuple[int, Path] | None = None
        self._profiler: Any = None
        self._recorded: tuple[Any, float, Path] | None = None
        # Weight sync state (DESIGN §6): the engines' dtype, the bucket plan, the nccl/gloo
        # group and the ipc sender of the sync in progress.
        self.sync_dtype: torch.dtype | None = None
        self.layouts: list[BucketLayout] = []
        self.weight_group: BroadcastGroup | None = None
        self.ipc_sender: CudaIpcSender | None = None

    def info(self) -> dict:
        """The layout this rank resolved and its warm-up seconds (compilation included)."""
        e = self.engine
        return {"layout": e.layout, "warm_up_s": e.warm_up_s, "device": str(e.device)}

    def warm_up(self) -> float:
        """Pay the first training passes' one-time costs now (see `FSDPEngine.warm_up`)."""
        return self.engine.warm_up()

    def attach_node(self, node: Any) -> None:
        """Called by the node after construction: gives access to its shard store."""
        self.node = node

    # ---- one step ---------------------------------------------------------------------------
    def load_batch(self, shards: list[dict[str, torch.Tensor]]) -> dict:
        """Concatenate this rank's pulled shards (prompt groups) into one padded batch."""
        if not shards:
            raise ValueError(
                f"rank {self.rank} got no shards; data.batch_size must be >= the "
                "number of train ranks"
            )
        self.n_steps += 1
        self._profile_tick()
        self.batch = concat_shards(shards)
        mask = self.batch["loss_mask"]
        return {"n_seqs": int(mask.shape[0]), "n_tokens": int(self.batch["attention_mask"].sum())}

    def compute_logp(self) -> None:
        """Proximal log-probs: the current policy on the batch (before the update)."""
        self.batch["prox_logp"] = self.engine.compute_logp(self._need_batch())

    def compute_ref_logp(self) -> None:
        """Reference-model log-probs (only with actor.kl_ctl > 0)."""
        self.batch["ref_logp"] = self.engine.compute_ref_logp(self._need_batch())

    def compute_advantages(self) -> dict:
        """Advantages on the batch; returns reward statistics of this rank."""
        self.batch = self.engine.compute_advantages(self._need_batch())
        r = self.batch["rewards"]
        return {"reward_sum": float(r.sum()), "n_seqs": int(r.numel())}

    def ppo_update(self) -> dict:
        """The PPO update over the batch; returns this rank's statistics."""
        b = self._need_batch()
        stats = self.engine.ppo_update(b)
        mask = b["loss_mask"]
        stats["gen_len_mean"] = float(mask.sum(1).float().mean())
        return {k: float(v) if not math.isnan(float(v)) else "nan" for k, v in stats.items()}

    def arm_profile(self, step: int, path: str) -> None:
        """Record one whole step cycle with torch.profiler: from the ``step``-th `load_batch`
        (1-based) to the next one, weight sync and idle time included. The files are written
        by `write_profile`, called after the run, so that writing them costs no step time."""
        if step < 1:
            raise ValueError(f"the profiled step must be >= 1, got {step}")
        self._profile = (step, Path(path))

    def _profile_tick(self) -> None:
        if self._profile is None:
            return
        step, path = self._profile
        if self._profiler is not None and self.n_steps == step + 1:
            prof, self._profiler, self._profile = self._profiler, None, None
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)
            window = time.perf_counter() - self._profile_t0
            prof.stop()
            self._recorded = (prof, window, path)
        elif self._profiler is None and self.n_steps == step:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.engine.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=acts)
            self._profiler.start()
            self._profile_t0 = time.perf_counter()

    def write_profile(self) -> bool:
        """Write the recorded step cycle, if any (False if none was recorded): ``top_ops``
        (by self device time, or CPU time without a GPU), a Chrome ``trace`` and ``profile``
        (the window's wall seconds, device-busy seconds, kernels, host syncs, device
        allocations, op counts), each suffixed with this rank."""
        if self._recorded is None:
            return False
        prof, window, path = self._recorded
        self._recorded = None
        path.mkdir(parents=True, exist_ok=True)
        on_gpu = self.engine.device.type == "cuda"
        sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (path / f"top_ops_rank{self.rank}.txt").write_text(table)
        prof.export_chrome_trace(str(path / f"trace_rank{self.rank}.json"))
        summary = profile_summary(prof, window)
        (path / f"profile_rank{self.rank}.json").write_text(json.dumps(summary, indent=1))
        return True

    def end_step(self) -> None:
        """Drop the step's batch (the pulled shards are freed by the controller's fan-out)."""
        self.batch = None

    def _need_batch(self) -> dict[str, torch.Tensor]:
        if self.batch is None:
            raise RuntimeError("no batch loaded: call load_batch first")
        return self.batch

    # ---- weights ----------------------------------------------------------------------------
    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) named weights; every rank must iterate (collective gathers)."""
        return self.engine.state_dict_for_sync(self.sync_dtype)

    def set_sync_dtype(self, dtype: str | None) -> None:
        """Send and checksum weights in the engines' dtype (e.g. bfloat16); None: as trained."""
        self.sync_dtype = None if dtype is None else parse_dtype(dtype)

    def publish_weights(self, key_prefix: str, bucket_bytes: int) -> list[dict]:
        """Put the full weights into this node's store as buckets (rank 0); returns their metas.

        Every rank calls it (the gathers are collective); only rank 0 keeps the buckets.
        """
        metas, bucket, size, n = [], {}, 0, 0
        for name, t in self.full_state():
            if self.rank != 0:
                continue
            bucket[name] = t.detach().to("cpu").contiguous()
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                metas.append(self.node.store.put(f"{key_prefix}/{n}", bucket).to_wire())
                bucket, size, n = {}, 0, n + 1
        if bucket:
            metas.append(self.node.store.put(f"{key_prefix}/{n}", bucket).to_wire())
        return metas

    def weight_plan(self, bucket_bytes: int) -> list[dict]:
        """Plan the bucket layouts of the full weights (in the sync dtype); metadata only: the
        global shapes come from the sharded state dict, no gathers. Kept for the syncs."""
        dtype = self.sync_dtype
        specs = [
            (name, tuple(t.shape), dtype or t.dtype)
            for name, t in self.engine.model.state_dict().items()
        ]
        self.layouts = plan_buckets(specs, bucket_bytes)
        return [b.to_wire() for b in self.layouts]

    def open_weight_group(self, host: str, port: int, world_size: int, backend: str) -> None:
        """Rank 0: join the weight broadcast group as its rank 0 (blocks until all joined)."""
        self._need_rank0("open_weight_group")
        self.weight_group = BroadcastGroup(host, port, 0, world_size, backend)

    def broadcast_weights(self) -> int:
        """Rank 0: broadcast the full weights bucket by bucket (nccl mode); returns bytes sent.

        The other ranks call `join_weight_gathers` at the same time.
        """
        self._need_rank0("broadcast_weights")
        if self.weight_group is None or not self.layouts:
            raise RuntimeError("broadcast_weights before weight_plan and open_weight_group")
        return broadcast_buckets(
            self.weight_group, self.full_state(), self.layouts, self.engine.device
        )

    def join_weight_gathers(self) -> None:
        """Ranks > 0: take part in the all-gathers of rank 0's streamed pass over the weights."""
        for _ in self.full_state():
            pass

    def share_weight_bucket(self, index: int) -> dict:
        """Rank 0 (ipc mode): fill the CUDA bucket buffer with bucket ``index`` (0, 1, ... in
        order) and return its IPC handle as plain fields."""
        self._need_rank0("share_weight_bucket")
        if index == 0:
            if self.ipc_sender is not None:  # left behind by a sync that failed midway
                self.ipc_sender.release()
            self.ipc_sender = CudaIpcSender(self.full_state(), self.layouts, self.engine.device)
        if self.ipc_sender is None:
            raise RuntimeError(f"share_weight_bucket({index}) before bucket 0")
        return self.ipc_sender.share(index)

    def end_weight_share(self) -> None:
        """Rank 0 (ipc mode): check every bucket was shared and release the bucket buffer."""
        sender, self.ipc_sender = self.ipc_sender, None
        if sender is not None:
            sender.finish()

    def _need_rank0(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{what} runs on train rank 0 only, this is rank {self.rank}")

    def save_hf(self, path: str) -> None:
        """Write the weights as an HF folder (every rank calls; rank 0 writes), atomically."""
        tmp = f"{path}.tmp"
        self.engine.save_hf(tmp)
        if self.rank == 0:
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)

    def weights_checksum(self) -> str:
        """Checksum of the full weights, comparable with an inference engine's."""
        return checksum_named_tensors(self.full_state())

    # ---- recovery ---------------------------------------------------------------------------
    def save_state(self, path: str) -> None:
        """Model and optimizer state through torch.distributed.checkpoint (sharded)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.engine.model, self.engine.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        Path(path, f"rng-{self.rank}.pt").write_bytes(_rng_bytes())

    def load_state(self, path: str, step: int) -> None:
        """Restore what `save_state` wrote and the optimizer step counter."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.engine.model, self.engine.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.engine.model,
            self.engine.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.engine.set_step(step)
        rng = Path(path, f"rng-{self.rank}.pt")
        if rng.exists():
            torch.set_rng_state(torch.frombuffer(bytearray(rng.read_bytes()), dtype=torch.uint8))

    def get_step(self) -> int:
        """Optimizer steps taken."""
        return self.engine.get_step()

    def close(self) -> None:
        """Destroy the weight group and the process group."""
        if self.weight_group is not None:
            self.weight_group.close()
            self.weight_group = None
        self.engine.destroy()


# Host-side calls that wait for the device (a .item(), .cpu() or .tolist() of a device tensor
# ends in one of these).
_HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_summary(prof: Any, window_s: float) -> dict:
    """Figures of one profiled window: device-busy seconds (kernel and copy time), kernels,
    host syncs, device allocations (cudaMalloc: the caching allocator grew), op counts."""
    from torch.autograd import DeviceType

    busy_us, kernels = 0.0, 0
    counts: dict[str, int] = {}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            busy_us += evt.time_range.elapsed_us()
            kernels += 1
        else:
            counts[evt.name] = counts.get(evt.name, 0) + 1
    return {
        "window_s": window_s,
        "device_busy_s": busy_us / 1e6,
        "kernels": kernels,
        "host_syncs": sum(counts.get(n, 0) for n in _HOST_SYNCS),
        "item_calls": counts.get("aten::_local_scalar_dense", 0),
        "device_mallocs": counts.get("cudaMalloc", 0),
        "top_counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])[:25]),
    }


def _rng_bytes() -> bytes:
    return torch.get_rng_state().numpy().tobytes()
